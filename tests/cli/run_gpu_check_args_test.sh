#!/usr/bin/env bash
# scripts/gpu-check.sh without a GPU: its arguments are checked before anything runs (bad ones exit
# 2 with one line), --help documents every step, and --only with no usable GPU step reports the
# failures and exits 1 instead of hanging. Usage: run_gpu_check_args_test.sh PIPEWRIGHT SOURCE_DIR
set -uo pipefail
PW=$1
SRC=$2
GC=$SRC/scripts/gpu-check.sh
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
out=$(bash "$GC" --help) || fail "--help exited $?"
for word in --only executor validate profile; do
  grep -q -- "$word" <<<"$out" || fail "--help does not mention $word"
done
err=$(bash "$GC" --only bogus 2>&1)
[ $? -eq 2 ] || fail "--only bogus: exit status not 2"
grep -q "unknown step 'bogus'" <<<"$err" || fail "--only bogus: message: $err"
[ "$(wc -l <<<"$err")" -eq 1 ] || fail "--only bogus: more than one line: $err"
bash "$GC" --timeout x >/dev/null 2>&1
[ $? -eq 2 ] || fail "--timeout x: exit status not 2"
# Without a GPU the CUDA steps fail (a CUDA-less build refuses --backend cuda): reported, exit 1.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/build" && cp "$PW" "$tmp/build/pipewright"
timeout 120 bash "$GC" --no-build --build-dir "$tmp/build" --only executor --out "$tmp/out" \
  >"$tmp/log" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "--only executor without a GPU: exit $rc (want 1); $(tail -n 5 "$tmp/log")"
grep -q "FAIL executor 2bw w=2 d=2, 6 steps" "$tmp/out/gpu-check/summary.txt" ||
  fail "the summary does not list the failed executor step"
echo "gpu-check arguments: ok"
