#!/usr/bin/env bash
# Generates the data notebooks/calibration.ipynb reads: the device model fitted by
# `pipewright calibrate` to vTrain's 1,440 measured single-node A100 runs (5-fold CV).
#   device.json     the calibrated device (pipewright.device/1)
#   residuals.csv   each row's measured, fitted and cross-validated iteration times
#   calibrate.txt   the command's printed summary
#   preset.json     the shipped preset clusters/devices/A100-80GB-cal.json, for comparison
# The measurements live beside the repository, in ../shared/data/calibration (PW_MEASUREMENTS
# names another file).
# Usage: make_calibration_data.sh PATH/TO/pipewright OUT_DIR   (about 90 s on one core)
set -euo pipefail
PW=$1
OUT=$2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MEAS=${PW_MEASUREMENTS:-$ROOT/../shared/data/calibration/vtrain-a100-single-node.csv}
[ -f "$MEAS" ] || { echo "$MEAS: no measurements (expected ../shared beside the repository)" >&2; exit 1; }
mkdir -p "$OUT"

"$PW" calibrate --measurements "$MEAS" --out "$OUT/device.json" --residuals "$OUT/residuals.csv" \
  >"$OUT/calibrate.txt"
cp "$ROOT/clusters/devices/A100-80GB-cal.json" "$OUT/preset.json"
echo "wrote $(ls "$OUT" | wc -l) files to $OUT"
