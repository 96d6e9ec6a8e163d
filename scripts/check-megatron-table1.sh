#!/usr/bin/env bash
# Predicts the runs of Megatron-LM's weak-scaling table (Narayanan et al., "Efficient Large-Scale
# Language Model Training on GPU Clusters Using Megatron-LM", SC'21, Table 1: GPT 1.7B to 1T on 32
# to 3,072 A100-80GB GPUs) with `pipewright estimate` and prints each row's step-time error against
# the published achieved TFLOP/s per GPU. Nothing is fitted to these runs.
# Assumptions (the table states neither): 1F1B, microbatch size B_MB (default 1), m = B / (w b),
# tied embeddings, dropout, full recomputation (the paper's FLOP count includes it).
# Ends with the mean and max |error|; with --check (first argument) exits 1 when the mean exceeds
# 5% or the max 13% (a regression guard around today's 3.6% / 12.3%, not the issue's target of
# 5% / 12%, which the 18.4B row misses).
# Usage: scripts/check-megatron-table1.sh [--check] [PIPEWRIGHT] [DEVICE] [B_MB]
set -euo pipefail
CHECK=0
if [ "${1:-}" = --check ]; then
  CHECK=1
  shift
fi
PW=${1:-./build/pipewright}
DEV=${2:-A100-80GB-cal}
B_MB=${3:-1}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# name hidden heads layers t p GPUs batch published-TFLOP/s-per-GPU
ROWS="1.7B 2304 24 24 1 1 32 512 137
3.6B 3072 32 30 2 1 64 512 138
7.5B 4096 32 36 4 1 128 512 142
18.4B 6144 48 40 8 1 256 1024 135
39.1B 8192 64 48 8 2 512 1536 138
76.1B 10240 80 60 8 4 1024 1792 140
145.6B 12288 96 80 8 8 1536 2304 148
310.1B 16384 128 96 8 16 1920 2160 155
529.6B 20480 128 105 8 35 2520 2520 163
1T 25600 160 128 8 64 3072 3072 163"
printf '%-7s %5s %4s %3s %3s %5s %11s %11s %9s %8s\n' model GPUs t p w B predicted measured TF/GPU error
while read -r name h nh L t p n B tf; do
  cat >"$TMP/m.json" <<J
{"format": "pipewright.model/1", "name": "megatron-$name", "arch": "gpt", "layers": $L,
 "hidden": $h, "heads": $nh, "ffn": $((4 * h)), "seq_len": 2048, "vocab": 51200,
 "max_positions": 2048, "tied_embeddings": true, "bias": true, "mlp": "gelu",
 "norm": "layernorm", "positions": "learned", "dtype": "fp16", "dropout": true}
J
  w=$((n / (t * p)))
  m=$((B / (w * B_MB)))
  "$PW" estimate --model "$TMP/m.json" --cluster "dgx-a100:$(((n + 7) / 8))" --set "device=$DEV" \
    --tp "$t" -d "$p" -w "$w" -b "$B_MB" -m "$m" --recompute full --schedule 1f1b \
    --out "$TMP/r.json" >/dev/null
  python3 - "$name" "$h" "$L" "$B" "$n" "$tf" "$t" "$p" "$w" "$TMP/r.json" <<'P'
import json, sys
name, h, L, B, n, tf, t, p, w, path = sys.argv[1:]
h, L, B, n, tf = map(float, (h, L, B, n, tf))
s, V = 2048, 51200
flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))  # the paper's count
measured = flops / (n * tf * 1e12)
predicted = json.load(open(path))["iteration_time_s"]
open(path + ".err", "a").write(f"{predicted / measured - 1}\n")
print(f"{name:<7} {int(n):>5} {t:>4} {p:>3} {w:>3} {int(B):>5} {predicted:>10.2f}s "
      f"{measured:>10.2f}s {flops / (n * predicted) / 1e12:>9.1f} {predicted / measured - 1:>+8.1%}")
P
done <<<"$ROWS"
python3 - "$TMP/r.json.err" "$CHECK" <<'P'
import sys
errors = [abs(float(x)) for x in open(sys.argv[1])]
mean, worst = sum(errors) / len(errors), max(errors)
print(f"mean |error| {mean:.1%}, max {worst:.1%} over {len(errors)} runs")
sys.exit(1 if sys.argv[2] == "1" and (mean > 0.05 or worst > 0.13) else 0)
P
