#!/usr/bin/env bash
# Generates the data notebooks/whatif.ipynb reads: GPT 3.9B (pd2bw-gpt-3.9b) on 8 x p3.16xlarge
# (64 V100-16GB), w=8 d=8 b=1, with PipeDream-2BW, PipeDream-Flush (1f1b) and GPipe.
#   sweep_batch.csv      samples/s against the global batch B (m = B/8)
#   sweep_bandwidth.csv  samples/s against the inter-node bandwidth, B = 512
#   report_<schedule>.json, estimate_<schedule>.json  simulated and closed-form run reports, B = 512
#   timeline_2bw.json    a simulated timeline (Chrome trace) of the 2bw plan
# Usage: make_whatif_data.sh PATH/TO/pipewright OUT_DIR   (about 15 s on 2 cores)
set -euo pipefail
PW=$1
OUT=$2
mkdir -p "$OUT"

SCENARIO=(--model pd2bw-gpt-3.9b --cluster p3.16xlarge:8 -w 8 -d 8 -b 1)
# GPipe stashes all m microbatches: it needs recomputation to fit in 16 GB; 2bw and 1f1b do not.
recompute_for() { [ "$1" = gpipe ] && echo --recompute || true; }

for s in 2bw 1f1b gpipe; do
  "$PW" sweep "${SCENARIO[@]}" --schedule "$s" $(recompute_for "$s") --steps 2 \
    --vary B=256,512,1024 --out "$OUT/sweep_batch_$s.csv" --json "$OUT/sweep_batch_$s.json" >/dev/null
  "$PW" sweep "${SCENARIO[@]}" --schedule "$s" $(recompute_for "$s") --steps 2 --batch 512 \
    --vary network.bandwidth_bytes_per_s=1.25e9,3.125e9,6.25e9,1.25e10 \
    --out "$OUT/sweep_bandwidth_$s.csv" >/dev/null
  "$PW" estimate "${SCENARIO[@]}" --schedule "$s" $(recompute_for "$s") -m 64 \
    --out "$OUT/estimate_$s.json" >/dev/null
  timeline=()
  [ "$s" = 2bw ] && timeline=(--timeline "$OUT/timeline_2bw.json")
  "$PW" simulate "${SCENARIO[@]}" --schedule "$s" $(recompute_for "$s") -m 64 --steps 2 \
    --out "$OUT/report_$s.json" "${timeline[@]}" >/dev/null
done
echo "wrote $(ls "$OUT" | wc -l) files to $OUT"
