#!/usr/bin/env bash
# scripts/validate-rounds.sh: one round of two tiny plans writes a report per run and a table with
# a median error per plan; bad usage is refused.
set -uo pipefail
PW=$1
SRC=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
printf '# a comment\n\nd1\t%s validate --schedule 1f1b -d 1 -m 2 -b 1 --steps 2 --repeats 2 --round-trips 5 --out "$OUT"\nd2\t%s validate --schedule 2bw -d 2 -m 2 -b 1 --steps 2 --repeats 2 --round-trips 5 --out "$OUT"\n' "$PW" "$PW" > "$TMP/plans"
timeout 300 bash "$SRC/scripts/validate-rounds.sh" --rounds 1 --max-wait 0 --dir "$TMP/runs" "$TMP/plans" > "$TMP/out" 2>&1 ||
  { cat "$TMP/out"; echo "FAIL: validate-rounds exited non-zero"; exit 1; }
cat "$TMP/out"
[ -s "$TMP/runs/d1-1.json" ] && [ -s "$TMP/runs/d2-1.json" ] || { echo "FAIL: reports missing"; exit 1; }
grep -Eq '^d1 +[-+][0-9.]+ +[-+][0-9.]+%' "$TMP/out" && grep -Eq '^d2 +[-+][0-9.]+ +[-+][0-9.]+%' "$TMP/out" ||
  { echo "FAIL: no table row per plan"; exit 1; }
bash "$SRC/scripts/validate-rounds.sh" --rounds 0 "$TMP/plans" > /dev/null 2>&1 && { echo "FAIL: --rounds 0 accepted"; exit 1; }
bash "$SRC/scripts/validate-rounds.sh" "$TMP/none" > /dev/null 2>&1 && { echo "FAIL: a missing file accepted"; exit 1; }
echo "ok: validate-rounds"
