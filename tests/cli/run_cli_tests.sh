#!/usr/bin/env bash
# Command-line tests of the real binary: every command's --help, the main outputs, and every
# bad-input path (one line on stderr, non-zero exit, no output file left behind).
# Usage: run_cli_tests.sh PATH/TO/pipewright SOURCE_DIR
set -u
PW=$1
SRC=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0
O="$TMP/never.json"  # an output that bad input must never create

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# expect_ok NAME CMD...: exits 0.
expect_ok() {
  local name=$1; shift
  if "$@" >"$TMP/out" 2>"$TMP/err"; then ok; else bad "$name (exit $?): $(head -c 300 "$TMP/err")"; fi
}

# expect_error NAME PATTERN OUTFILE CMD...: non-zero exit, exactly one stderr line matching
# PATTERN, and OUTFILE (if not -) does not exist afterwards.
expect_error() {
  local name=$1 pattern=$2 outfile=$3; shift 3
  "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$TMP/err")
  if [ "$rc" -eq 0 ]; then bad "$name: exit 0"; return; fi
  if [ "$lines" -ne 1 ]; then bad "$name: $lines stderr lines: $(cat "$TMP/err")"; return; fi
  if ! grep -q -- "$pattern" "$TMP/err"; then bad "$name: stderr lacks '$pattern': $(cat "$TMP/err")"; return; fi
  if [ "$outfile" != - ] && [ -e "$outfile" ]; then bad "$name: left $outfile behind"; return; fi
  if ls "$TMP"/.*.tmp.* >/dev/null 2>&1; then bad "$name: left a temporary file"; return; fi
  ok
}

# --help everywhere.
for cmd in "" models clusters trace schedule estimate simulate; do
  expect_ok "help $cmd" $PW $cmd --help
done
expect_ok "version" $PW --version

# Listings and shows.
expect_ok "models" $PW models
grep -q "gpt2-124m" "$TMP/out" && ok || bad "models lists gpt2-124m"
expect_ok "models gpt2-124m" $PW models gpt2-124m
grep -q "124439808" "$TMP/out" && ok || bad "gpt2-124m shows 124439808 parameters"
expect_ok "models --json" $PW models gpt-tiny --json
python3 -c "import json,sys; d=json.load(open('$TMP/out')); assert d['derived_per_sample']['total_parameters']>0" && ok || bad "models --json parses"
expect_ok "models hf config" $PW models "$SRC/tests/data/hf-gpt2-config.json"
expect_ok "clusters" $PW clusters
expect_ok "clusters show" $PW clusters p3.16xlarge:8
expect_ok "clusters json" $PW clusters dgx-a100 --nodes 2 --set network.bandwidth_bytes_per_s=1.25e10 --json
python3 -c "import json; d=json.load(open('$TMP/out')); assert d['nodes']==2 and d['network']['bandwidth_bytes_per_s']==1.25e10" && ok || bad "clusters --set applied"

# trace -> estimate --trace.
expect_ok "trace" $PW trace --model gpt-tiny --device H100-SXM --microbatch 1,2,4 --out "$TMP/trace.json"
expect_ok "estimate with trace" $PW estimate --model gpt-tiny --cluster h100-x1 -d 2 --ranks-per-gpu 2 -m 4 -b 2 --schedule 2bw --trace "$TMP/trace.json" --out "$TMP/r1.json"
python3 -c "import json; d=json.load(open('$TMP/r1.json')); assert d['format']=='pipewright.report/1' and d['source']=='analytic' and len(d['devices'])==2" && ok || bad "estimate report fields"

# Determinism: byte-identical reports.
expect_ok "estimate a" $PW estimate --model pd2bw-gpt-1.3b --cluster p3.16xlarge:2 -d 4 -m 8 -b 2 --schedule 2bw --out "$TMP/a.json"
expect_ok "estimate b" $PW estimate --model pd2bw-gpt-1.3b --cluster p3.16xlarge:2 -d 4 -m 8 -b 2 --schedule 2bw --out "$TMP/b.json"
cmp -s "$TMP/a.json" "$TMP/b.json" && ok || bad "estimate is deterministic"

# Default scenario and every schedule through `schedule`.
expect_ok "estimate defaults" $PW estimate
for s in "gpipe -d 4 -m 6" "1f1b -d 4 -m 6" "2bw -d 4 -m 6 --steps 3" "interleaved -d 2 -m 4 -v 2" "dp -m 3 -w 2"; do
  expect_ok "schedule $s" $PW schedule --schedule $s
  grep -q "checker: ok" "$TMP/out" && ok || bad "schedule $s: checker line"
done
expect_ok "estimate plan file" $PW estimate --model gpt-tiny --cluster h100-x1 --plan "$SRC/tests/data/plan-tiny-2bw.json" --ranks-per-gpu 2

# simulate: report, timeline, platform XML; byte-identical reports.
expect_ok "simulate" $PW simulate --model pd2bw-gpt-1.3b --cluster p3.16xlarge:2 -d 4 -m 8 -b 2 --schedule 2bw --out "$TMP/s1.json" --timeline "$TMP/tl.json" --export-platform "$TMP/platform.xml"
python3 -c "
import json
d = json.load(open('$TMP/s1.json'))
assert d['source'] == 'simulated' and len(d['devices']) == 16 and d['iteration_time_s'] > 0
assert d['timeline'] == '$TMP/tl.json' and len(d['simulation']['links']) > 0
t = json.load(open('$TMP/tl.json'))
names = {e['args']['name'] for e in t['traceEvents'] if e['ph'] == 'M' and e['name'] == 'thread_name'}
assert {'compute', 'send', 'recv', 'collective'} <= names
assert any(e['ph'] == 'C' for e in t['traceEvents']) and any(e['ph'] == 'X' for e in t['traceEvents'])
" && ok || bad "simulate report and timeline"
grep -q "<platform" "$TMP/platform.xml" && grep -q "n1g7" "$TMP/platform.xml" && ok || bad "exported platform XML"
expect_ok "simulate again" $PW simulate --model pd2bw-gpt-1.3b --cluster p3.16xlarge:2 -d 4 -m 8 -b 2 --schedule 2bw --out "$TMP/s2.json"
python3 -c "
import json
a = json.load(open('$TMP/s1.json')); b = json.load(open('$TMP/s2.json'))
a.pop('timeline'); assert a == b" && ok || bad "simulate is deterministic"
expect_ok "simulate defaults" $PW simulate
expect_ok "simulate one gpu" $PW simulate --model gpt2-124m --cluster h100-x1 -d 4 --ranks-per-gpu 4 -m 8 -b 2 --schedule 1f1b
expect_error "simulate oom" "does not fit: rank 0" "$O" $PW simulate --model gpt3-175b --cluster h100-x1 --schedule dp --out "$O"
expect_error "simulate trace lacks b" "microbatch size 8" "$O" $PW simulate --model gpt-tiny --cluster h100-x1 -b 8 --trace "$TMP/trace.json" --out "$O"
expect_error "simulate wrong device count" "w\*d" "$O" $PW simulate --model gpt-tiny --cluster dgx-a100 -w 3 -d 2 --out "$O"
expect_error "simulate unknown preset" "unknown cluster" "$O" $PW simulate --model gpt-tiny --cluster dgx-b200 --out "$O"
expect_error "simulate bad steps" "steps" "$O" $PW simulate --model gpt-tiny --cluster h100-x1 --steps 0 --out "$O"

# Bad inputs.
echo '{ "format": "pipewright.model/1", "name": "x", ' >"$TMP/broken.json"
echo '{"format":"pipewright.plan/1","schedule":"2bw","w":1,"d":4,"b":1,"m":2}' >"$TMP/plan-m.json"
echo '{"format":"pipewright.plan/1","schedule":"1f1b","w":1,"d":"2","b":1,"m":2}' >"$TMP/plan-type.json"
expect_error "unknown model" "unknown model" "$O" $PW estimate --model gpt9 --out "$O"
expect_error "malformed model file" "broken.json" "$O" $PW estimate --model "$TMP/broken.json" --out "$O"
expect_error "missing model file" "cannot open" "$O" $PW estimate --model "$TMP/none.json" --out "$O"
expect_error "unknown cluster" "unknown cluster" "$O" $PW estimate --model gpt-tiny --cluster dgx-z --out "$O"
expect_error "bad --set key" "network.bandwith_bytes_per_s" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 -d 2 --set network.bandwith_bytes_per_s=1 --out "$O"
expect_error "2bw m < d" "m >= d" "$O" $PW estimate --model gpt-tiny --cluster h100-x1 --ranks-per-gpu 2 -d 2 -m 1 --schedule 2bw --out "$O"
expect_error "plan file m < d" "plan-m.json" "$O" $PW estimate --model gpt3-125m --cluster dgx-a100 --plan "$TMP/plan-m.json" --out "$O"
expect_error "plan file wrong type" "/d" "$O" $PW estimate --model gpt3-125m --cluster dgx-a100 --plan "$TMP/plan-type.json" --out "$O"
expect_error "w*d != devices" "w\*d" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 -w 3 -d 2 --out "$O"
expect_error "more stages than blocks" "blocks" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 -w 1 -d 8 --out "$O"
expect_error "interleaved m % d" "multiple of d" "$O" $PW estimate --model gpt2-124m --cluster dgx-a100 -w 2 -d 4 -m 6 -v 2 --schedule interleaved --out "$O"
expect_error "unknown schedule" "unknown schedule" "$O" $PW estimate --model gpt-tiny --cluster h100-x1 --schedule zb --out "$O"
expect_error "trace lacks b" "microbatch size 8" "$O" $PW estimate --model gpt-tiny --cluster h100-x1 -b 8 --trace "$TMP/trace.json" --out "$O"
expect_error "trace for another model" "trace is for model" "$O" $PW estimate --model gpt2-124m --cluster h100-x1 --trace "$TMP/trace.json" --out "$O"
expect_error "bad microbatch list" "--microbatch" "$O" $PW trace --model gpt-tiny --device H100-SXM --microbatch 1,x --out "$O"
expect_error "unknown device" "V100-64GB" "$O" $PW trace --model gpt-tiny --device V100-64GB --out "$O"
expect_error "does not fit" "does not fit: rank 0" "$O" $PW estimate --model gpt3-175b --cluster h100-x1 --schedule dp --out "$O"
expect_ok "allow oom" $PW estimate --model gpt3-175b --cluster h100-x1 --schedule dp --allow-oom --out "$TMP/oom.json"
python3 -c "import json; d=json.load(open('$TMP/oom.json')); assert d['fits'] is False and d['devices'][0]['fits'] is False" && ok || bad "--allow-oom report says fits false"
expect_error "unknown option" "--frobnicate" - $PW estimate --frobnicate
expect_error "no subcommand" "subcommand" - $PW
expect_error "schedule bad plan" "m >= d" - $PW schedule --schedule 2bw -d 4 -m 2
expect_error "unwritable output" "cannot write" - $PW estimate --model gpt-tiny --cluster h100-x1 --out "$TMP/no/such/dir/r.json"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
