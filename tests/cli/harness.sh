# Sourced by the command-line test scripts (run_*_tests.sh PATH/TO/pipewright SOURCE_DIR): the
# binary and source dir from the arguments, a scratch TMP removed on exit, pass/fail counts and
# the checks every script makes. Each command runs under `timeout` (PW_TEST_TIMEOUT seconds, or
# the script's LIMIT, default 600) so a hang fails its check instead of blocking the suite.
PW=$1
SRC=${2:-}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0
O="$TMP/never.json"  # an output that bad input must never create
LIMIT=${PW_TEST_TIMEOUT:-${LIMIT:-600}}

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# run CMD...: stdout to $TMP/out, stderr to $TMP/err, killed after LIMIT seconds (exit 124/137).
run() { timeout -k 5 "$LIMIT" "$@" >"$TMP/out" 2>"$TMP/err"; }

# expect_ok NAME CMD...: exits 0.
expect_ok() {
  local name=$1; shift
  run "$@"
  local rc=$?
  if [ "$rc" -eq 0 ]; then ok; else bad "$name (exit $rc): $(head -c 600 "$TMP/err")"; fi
}

# expect_fail NAME CODE PATTERN OUTFILE CMD...: exits with CODE (any: any non-zero) within LIMIT
# seconds and by no signal, exactly one stderr line matching PATTERN, never "internal error";
# OUTFILE (if not -) and temporary files absent afterwards.
expect_fail() {
  local name=$1 code=$2 pattern=$3 outfile=$4; shift 4
  run "$@"
  local rc=$?
  local lines
  lines=$(wc -l <"$TMP/err")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then bad "$name: hung (killed after ${LIMIT}s)"; return; fi
  if [ "$rc" -gt 128 ]; then bad "$name: killed by signal $((rc - 128))"; return; fi
  if [ "$code" = any ] && [ "$rc" -eq 0 ]; then bad "$name: exit 0"; return; fi
  if [ "$code" != any ] && [ "$rc" -ne "$code" ]; then
    bad "$name: exit $rc, expected $code: $(head -c 600 "$TMP/err")"; return
  fi
  if [ "$lines" -ne 1 ]; then bad "$name: $lines stderr lines: $(head -c 2000 "$TMP/err")"; return; fi
  if grep -q "internal error" "$TMP/err"; then bad "$name: internal error: $(cat "$TMP/err")"; return; fi
  if ! grep -q -- "$pattern" "$TMP/err"; then bad "$name: stderr lacks '$pattern': $(cat "$TMP/err")"; return; fi
  if [ "$outfile" != - ] && [ -e "$outfile" ]; then bad "$name: left $outfile behind"; rm -f "$outfile"; return; fi
  if ls "$TMP"/.*.tmp.* >/dev/null 2>&1; then bad "$name: left a temporary file"; return; fi
  ok
}

# finish [LABEL]: the summary line; the script's exit status.
finish() {
  echo "${1:+$1: }$pass passed, $fail failed"
  [ "$fail" -eq 0 ]
}
