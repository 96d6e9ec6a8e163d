#!/usr/bin/env bash
# Executes notebooks/NAME.ipynb (whatif, calibration or offload) headless on freshly generated data
# (notebooks/make_NAME_data.sh); fails if a cell fails or a figure is missing.
# Uses Debian's Jupyter and Python (/usr/bin): the python3 first on PATH may be another interpreter
# without nbconvert, matplotlib and pandas. The kernel spec is written into a private folder so a
# user's own "python3" kernel cannot take its place.
# Usage: run_notebook_test.sh PATH/TO/pipewright SOURCE_DIR [NAME]   (NAME defaults to whatif)
set -euo pipefail
PW=$1
SRC=$2
NB=${3:-whatif}
case "$NB" in
  whatif) FIGS="whatif_batch whatif_bandwidth whatif_memory whatif_timeline" ;;
  calibration) FIGS="calibration_scatter calibration_residuals calibration_gemm" ;;
  offload) FIGS="offload_capacity offload_bandwidth offload_memory" ;;
  *) echo "unknown notebook $NB" >&2; exit 2 ;;
esac
if ! /usr/bin/python3 -c "import nbconvert, ipykernel, matplotlib, pandas" 2>/dev/null; then
  echo "notebook test needs Debian's jupyter-nbconvert python3-ipykernel python3-matplotlib" \
    "python3-pandas (scripts/bootstrap.sh installs them)" >&2
  exit 1
fi
# The calibration notebook needs vTrain's measurements from ../shared beside the repository
# (CI has them): without them the test is reported skipped (exit 77), not failed.
if [ "$NB" = calibration ] && [ -z "${PW_MEASUREMENTS:-}" ] &&
  [ ! -f "$SRC/../shared/data/calibration/vtrain-a100-single-node.csv" ]; then
  echo "skipped: $SRC/../shared/data/calibration not found beside the repository"
  exit 77
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

[ -n "${PW_KEEP_FIGURES:-}" ] && trap 'cp -r "$TMP/figures" "$PW_KEEP_FIGURES"; rm -rf "$TMP"' EXIT
start=$(date +%s.%N)
bash "$SRC/notebooks/make_${NB}_data.sh" "$PW" "$TMP/data"
generated=$(date +%s.%N)

mkdir -p "$TMP/jupyter/kernels/python3"
cat >"$TMP/jupyter/kernels/python3/kernel.json" <<'JSON'
{"argv": ["/usr/bin/python3", "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
 "display_name": "Python 3 (Debian)", "language": "python"}
JSON
export JUPYTER_PATH="$TMP/jupyter" JUPYTER_RUNTIME_DIR="$TMP/runtime" IPYTHONDIR="$TMP/ipython"
export MPLCONFIGDIR="$TMP/matplotlib" PYTHONNOUSERSITE=1 PYDEVD_DISABLE_FILE_VALIDATION=1
unset PYTHONPATH PYTHONHOME
export PW_DATA="$TMP/data" PW_FIGURES="$TMP/figures"
/usr/bin/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.kernel_name=python3 \
  --ExecutePreprocessor.timeout=120 --output-dir "$TMP/out" "$SRC/notebooks/$NB.ipynb"
for f in $FIGS; do
  [ -s "$TMP/figures/$f.png" ] || { echo "missing figure $f.png" >&2; exit 1; }
done
end=$(date +%s.%N)
awk -v nb="$NB" -v a="$start" -v b="$generated" -v c="$end" \
  'BEGIN { printf "notebook " nb ": ok (data %.1f s, notebook %.1f s)\n", b - a, c - b }'
