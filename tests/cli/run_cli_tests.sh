#!/usr/bin/env bash
# Command-line tests of the real binary: every command's --help, the main outputs, and every
# bad-input path (one line on stderr, non-zero exit, no output file left behind).
# Usage: run_cli_tests.sh PATH/TO/pipewright SOURCE_DIR
set -u
source "$(dirname "$0")/harness.sh"

# expect_error NAME PATTERN OUTFILE CMD...: any non-zero exit, one stderr line matching PATTERN,
# OUTFILE (if not -) absent afterwards (harness.sh's expect_fail).
expect_error() { local name=$1; shift; expect_fail "$name" any "$@"; }

# --backend cuda: without a GPU (CI) one line saying there is none (or no CUDA in this build); with
# a GPU, that the fp32 gpt-tiny these lines use is not a bf16 model.
CUDA_ERR="no CUDA"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then CUDA_ERR="bf16"; fi

# --help everywhere.
for cmd in "" models clusters trace schedule estimate simulate plan sweep train profile; do
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
expect_error "simulate too many ranks" "w\*d" "$O" $PW simulate --model gpt-tiny --cluster dgx-a100 -w 5 -d 2 --out "$O"
expect_ok "simulate on fewer GPUs than the cluster has" $PW simulate --model gpt-tiny --cluster dgx-a100 -w 1 -d 2 -m 4
expect_error "simulate unknown preset" "unknown cluster" "$O" $PW simulate --model gpt-tiny --cluster dgx-b200 --out "$O"
expect_error "simulate bad steps" "steps" "$O" $PW simulate --model gpt-tiny --cluster h100-x1 --steps 0 --out "$O"

# sweep: a 2x2 what-if in cross-product order, byte-identical twice; --plan-best; a point that
# fails becomes a row with an error; a bad key or value is one line and leaves no file.
SW=(--model gpt-tiny --cluster dgx-a100:2 -d 2 -b 1 --schedule 1f1b --steps 2)
expect_ok "help sweep" $PW sweep --help
expect_ok "sweep 2x2" $PW sweep "${SW[@]}" --vary network.bandwidth_bytes_per_s=1.25e9,1.25e10 --vary m=2,4 --out "$TMP/sw1.csv" --json "$TMP/sw1.json"
[ "$(wc -l <"$TMP/sw1.csv")" -eq 5 ] && ok || bad "sweep 2x2: 4 rows + header"
python3 -c "
import csv, json
rows = list(csv.DictReader(open('$TMP/sw1.csv')))
assert [(r['network.bandwidth_bytes_per_s'], r['m']) for r in rows] == [('1250000000.0', '2'), ('1250000000.0', '4'), ('12500000000.0', '2'), ('12500000000.0', '4')], rows
assert all(r['fits'] == 'true' and r['error'] == '' and float(r['samples_per_s']) > 0 for r in rows)
assert all(r['schedule'] == '1f1b' and r['w'] == '8' and r['d'] == '2' for r in rows)
assert int(rows[0]['peak_memory_bytes']) == max(int(rows[0]['peak_memory_bytes_stage0']), int(rows[0]['peak_memory_bytes_stage1']))
j = json.load(open('$TMP/sw1.json'))
assert j['format'] == 'pipewright.sweep/1' and list(j['vary']) == ['network.bandwidth_bytes_per_s', 'm']
assert len(j['rows']) == 4 and len(j['rows'][0]['peak_memory_bytes_per_device']) == 16
assert abs(j['rows'][3]['samples_per_s'] - float(rows[3]['samples_per_s'])) < 1e-9
" && ok || bad "sweep 2x2 rows"
expect_ok "sweep 2x2 again" $PW sweep "${SW[@]}" --vary network.bandwidth_bytes_per_s=1.25e9,1.25e10 --vary m=2,4 --out "$TMP/sw2.csv" --json "$TMP/sw2.json" --parallel 1
cmp -s "$TMP/sw1.csv" "$TMP/sw2.csv" && cmp -s "$TMP/sw1.json" "$TMP/sw2.json" && ok || bad "sweep is deterministic"
expect_ok "sweep plan-best" $PW sweep --model gpt2-124m --cluster dgx-a100 --plan-best --vary B=16,32 --steps 2 --out "$TMP/sw3.csv"
python3 -c "
import csv
rows = list(csv.DictReader(open('$TMP/sw3.csv')))
assert [r['B'] for r in rows] == ['16', '32'] and all(r['fits'] == 'true' and r['error'] == '' for r in rows), rows
assert all(int(r['w']) * int(r['d']) == 8 and r['global_batch'] == r['B'] for r in rows), rows
" && ok || bad "sweep --plan-best rows"
expect_ok "sweep invalid point" $PW sweep "${SW[@]}" --vary w=8,9 --out "$TMP/sw4.csv"
grep -q "1 failed" "$TMP/out" && ok || bad "sweep says how many failed"
python3 -c "
import csv
rows = list(csv.DictReader(open('$TMP/sw4.csv')))
assert rows[0]['error'] == '' and rows[0]['fits'] == 'true'
assert 'w*d' in rows[1]['error'] and rows[1]['samples_per_s'] == '' and rows[1]['fits'] == '', rows[1]
" && ok || bad "sweep invalid point carries an error"
expect_error "sweep bad key" "sweep: --vary netwrk.bandwidth_bytes_per_s: unknown key" "$O" $PW sweep "${SW[@]}" --vary netwrk.bandwidth_bytes_per_s=1.25e9,2e9 --out "$O" --json "$O"
expect_error "sweep bad value" "sweep: --vary m=x" "$O" $PW sweep "${SW[@]}" --vary m=2,x --out "$O"
expect_error "sweep bad cluster value" "--vary network.bandwidth_bytes_per_s=fast" "$O" $PW sweep "${SW[@]}" --vary network.bandwidth_bytes_per_s=fast --out "$O"
expect_error "sweep unknown device" "V100-64GB" "$O" $PW sweep "${SW[@]}" --vary device=H100-SXM,V100-64GB --out "$O"
expect_error "sweep plan-best without B" "needs --batch" "$O" $PW sweep --model gpt-tiny --cluster dgx-a100 --plan-best --vary d=1,2 --out "$O"

# plan: the winner is a plan file every command accepts; the ranked list is JSON.
expect_ok "plan" $PW plan --model gpt2-124m --cluster dgx-a100 --batch 32 --top 4 --out "$TMP/best.json" --ranked "$TMP/ranked.json"
python3 -c "
import json
r = json.load(open('$TMP/ranked.json'))
assert r['format'] == 'pipewright.ranked/1' and r['candidates_fitting'] == len(r['rows']) > 4
k = r['simulated']  # --top 4, and those within --within (10%) of the best closed form
assert 4 <= k <= 16 and r['simulated_top'] == 4 and r['simulated_within_percent'] == 10
assert [x['simulated'] for x in r['rows'][:k]] == [True] * k and not r['rows'][k]['simulated']
best = max(x['estimated_samples_per_s'] for x in r['rows'])
assert all(x['estimated_samples_per_s'] < 0.9 * best for x in r['rows'][k:]) or k == 16
s = [x['simulated_samples_per_s'] for x in r['rows'][:k]]
assert s == sorted(s, reverse=True)
assert json.load(open('$TMP/best.json')) == r['rows'][0]['plan']
" && ok || bad "plan ranked list"
expect_ok "simulate the planned plan" $PW simulate --model gpt2-124m --cluster dgx-a100 --plan "$TMP/best.json"
expect_ok "plan 2bw only" $PW plan --model gpt2-124m --cluster dgx-a100 --batch 64 --schedules 2bw --depth 2 --top 2
grep -q "best: 2bw.* d=2 " "$TMP/out" && ok || bad "plan --schedules/--depth restrict the search"
expect_error "plan nothing fits" "nothing fits in memory" "$O" $PW plan --model gpt3-175b --cluster h100-x1 --batch 8 --out "$O"
expect_error "plan bad batch" "no valid plan" "$O" $PW plan --model gpt-tiny --cluster dgx-a100 --batch 3 --tp 1 --out "$O"
expect_error "plan bad schedule" "unknown schedule" "$O" $PW plan --model gpt-tiny --cluster dgx-a100 --batch 8 --schedules 2bw,pipedream --out "$O"
expect_error "plan bad headroom" "memory-headroom" "$O" $PW plan --model gpt-tiny --cluster dgx-a100 --batch 8 --memory-headroom 1.5 --out "$O"

# train on the CPU backend: one line per step, a measured report with every step's loss.
expect_ok "train" $PW train --model gpt-tiny --schedule 2bw -d 2 -m 2 -b 2 --steps 3 --out "$TMP/measured.json" --timeline "$TMP/measured-tl.json"
[ "$(grep -c '^step ' "$TMP/out")" -eq 3 ] && ok || bad "train prints one line per step"
grep '^step ' "$TMP/out" | cut -d'|' -f1,2 > "$TMP/train-losses"
expect_ok "train --pin-cores" $PW train --model gpt-tiny --schedule 2bw -d 2 -m 2 -b 2 --steps 3 --pin-cores
grep '^step ' "$TMP/out" | cut -d'|' -f1,2 | cmp -s - "$TMP/train-losses" \
  && ok || bad "train --pin-cores gives the same losses"
python3 -c "
import json
d = json.load(open('$TMP/measured.json'))
assert d['source'] == 'measured' and len(d['losses']) == 3 and len(d['devices']) == 2
assert all(x['peak_memory_bytes'] > 0 for x in d['devices'])
t = json.load(open(d['timeline']))
x = [e for e in t['traceEvents'] if e['ph'] == 'X']
assert {e['cat'] for e in x} >= {'compute', 'recv', 'send'} and any(e['ph'] == 'C' for e in t['traceEvents'])
assert sum(1 for e in x if e['name'].startswith('F') and e['pid'] == 0) == 6
" && ok || bad "train measured report and timeline"
expect_error "train --backend cuda" "$CUDA_ERR" "$O" $PW train --model gpt-tiny --backend cuda --steps 1 --out "$O"
expect_error "train fp16 model on cpu" "fp32" "$O" $PW train --model gpt2-124m --steps 1 --out "$O"
expect_error "train bad token file" "cannot open token file" "$O" $PW train --model gpt-tiny --data "$TMP/none.bin" --steps 1 --out "$O"
# Under mpirun (builds that link MPI): MPI_Init must be OpenMPI's, not the SMPI one libsimgrid also
# exports, and a job whose process count is not the plan's ranks ends non-zero saying so
# (tests/mpi/run_mpi_tests.sh runs the real mpirun jobs).
if command -v mpirun >/dev/null 2>&1 && ldd "$PW" 2>/dev/null | grep -q libmpi; then
  mpirun --allow-run-as-root --oversubscribe -np 2 $PW train --model gpt-tiny --steps 1 --out "$O" \
    >"$TMP/out" 2>"$TMP/err"
  rc=$?
  if [ "$rc" -ne 0 ] && grep -q "run mpirun -np 1" "$TMP/err" && ! grep -q smpirun "$TMP/err" \
    && [ ! -e "$O" ]; then ok; else bad "mpirun --backend cpu: rc $rc: $(head -5 "$TMP/err")"; fi
fi

# Token file data (uint16 little-endian) and its errors.
python3 -c "
import struct
t = b'the quick brown fox jumps over the lazy dog. ' * 40
open('$TMP/text.bin', 'wb').write(struct.pack('<%dH' % len(t), *t))
open('$TMP/badtok.bin', 'wb').write(struct.pack('<4H', 1, 2, 900, 3))
"
expect_ok "train from a token file" $PW train --model gpt-tiny -d 2 -m 2 -b 2 --steps 2 --data "$TMP/text.bin"
expect_error "token above the vocabulary" "token 900 at offset 4" "$O" $PW train --model gpt-tiny --data "$TMP/badtok.bin" --steps 1 --out "$O"

# Checkpoints: stop, or kill at any point, then --resume: the last checkpoint is bit-identical to
# an unbroken run's (every shard compared byte for byte).
CK="$TMP/ck"
TRAIN_CK="$PW train --model gpt-tiny --schedule 2bw -d 2 -m 4 --steps 6 --checkpoint-every 1"
expect_ok "train with checkpoints" $TRAIN_CK --checkpoint-dir "$CK/ref"
same_as_ref() { for f in "$CK/ref/step-00000006"/*.bin; do cmp -s "$f" "$1/step-00000006/$(basename "$f")" || return 1; done; }
expect_ok "train stopped after 3 steps" $PW train --model gpt-tiny --schedule 2bw -d 2 -m 4 --steps 3 --checkpoint-every 1 --checkpoint-dir "$CK/stop"
expect_ok "resume" $TRAIN_CK --checkpoint-dir "$CK/stop" --resume
grep -q "resuming from .*step-00000003" "$TMP/out" && [ "$(grep -c '^step ' "$TMP/out")" -eq 3 ] && ok || bad "resume says where it starts and runs steps 3-5"
same_as_ref "$CK/stop" && ok || bad "resumed run is bit-identical"
{ PIPEWRIGHT_TEST_KILL_IN_CHECKPOINT=4 $TRAIN_CK --checkpoint-dir "$CK/kill" >/dev/null 2>&1; } 2>/dev/null
[ $? -eq 137 ] && [ ! -e "$CK/kill/step-00000004/manifest.json" ] && ok || bad "killed while writing step 4's checkpoint"
expect_ok "resume after a kill in a checkpoint" $TRAIN_CK --checkpoint-dir "$CK/kill" --resume
grep -q "step-00000003" "$TMP/out" && same_as_ref "$CK/kill" && ok || bad "resume after a kill in a checkpoint is bit-identical"
for delay in 0.05 0.15 0.3; do  # killed wherever it happens to be
  $TRAIN_CK --checkpoint-dir "$CK/k$delay" >/dev/null 2>&1 &
  sleep $delay; kill -9 $! 2>/dev/null; wait $! 2>/dev/null
  if $TRAIN_CK --checkpoint-dir "$CK/k$delay" --resume >"$TMP/out" 2>"$TMP/err" || grep -q "nothing to run" "$TMP/err"; then
    same_as_ref "$CK/k$delay" && ok || bad "kill -9 after ${delay}s: not bit-identical"
  else bad "kill -9 after ${delay}s: resume failed: $(cat "$TMP/err")"; fi
done
expect_error "fresh run into a used checkpoint dir" "pass --resume" "$O" $TRAIN_CK --checkpoint-dir "$CK/ref" --out "$O"
expect_error "resume with another plan" "field run.plan.m" "$O" $PW train --model gpt-tiny --schedule 2bw -d 2 -m 2 --steps 8 --checkpoint-dir "$CK/stop" --resume --out "$O"
expect_error "resume past the end" "nothing to run" "$O" $PW train --model gpt-tiny --schedule 2bw -d 2 -m 4 --steps 5 --checkpoint-every 1 --checkpoint-dir "$CK/ref" --resume --out "$O"
expect_error "resume without a dir" "checkpoint-dir" "$O" $PW train --model gpt-tiny --steps 1 --resume --out "$O"

# profile: a measured trace that estimate and simulate accept.
expect_ok "profile" $PW profile --model gpt-tiny --microbatch 1,2 --repeats 1 --out "$TMP/cpu-trace.json"
python3 -c "
import json
t = json.load(open('$TMP/cpu-trace.json'))
assert t['format'] == 'pipewright.trace/1' and t['source']['kind'] == 'measured'
assert [e['microbatch_size'] for e in t['entries']] == [1, 2]
assert all(e['layers']['block']['forward_s'] > 0 for e in t['entries'])
" && ok || bad "profile trace"
expect_ok "simulate with the measured trace" $PW simulate --model gpt-tiny --cluster h100-x1 --trace "$TMP/cpu-trace.json" -d 2 --ranks-per-gpu 2 -m 2 -b 2 --schedule 1f1b
expect_error "profile --backend cuda" "$CUDA_ERR" "$O" $PW profile --model gpt-tiny --backend cuda --out "$O"
expect_error "profile fp16 model" "fp32" "$O" $PW profile --model gpt2-124m --out "$O"

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
expect_error "w*d > devices" "w\*d" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 -w 5 -d 2 --out "$O"
# 3D parallelism (issue 12): flags, their errors, the executors' refusal.
expect_ok "estimate --tp --sp --recompute selective --distributed-optimizer" $PW estimate --model llama2-7b --cluster dgx-a100:2 --tp 4 --sp -d 2 -w 2 -b 1 -m 8 --recompute selective --distributed-optimizer --out "$TMP/tp.json"
grep -q "1f1b t=4 sp w=2 d=2 b=1 m=8 distributed-optimizer" "$TMP/out" && ok || bad "estimate prints the 3D plan"
python3 -c "
import json; r = json.load(open('$TMP/tp.json'))
p = r['plan']; assert p['t'] == 4 and p['sp'] and p['distributed_optimizer'] and p['recompute'] == ['selective', 'selective'], p
assert [d['gpu'] for d in r['devices']] == [0, 0, 4, 4] and [d['node'] for d in r['devices']] == [0, 1, 0, 1], r['devices']
assert all(s['tp_s'] > 0 for s in r['estimate']['stages'])
" && ok || bad "estimate report of a TP plan"
expect_ok "simulate a TP plan" $PW simulate --model llama2-7b --cluster dgx-a100:2 --tp 4 --sp -d 2 -w 2 -b 1 -m 8 --recompute selective --timeline "$TMP/tp-tl.json"
grep -q '"tensor_parallel"' "$TMP/tp-tl.json" && ok || bad "TP timeline has a tensor_parallel stream"
expect_ok "bare --recompute is full" $PW estimate --model gpt-tiny --cluster dgx-a100 -w 1 -d 2 --recompute --out "$TMP/rc.json"
python3 -c "import json; assert json.load(open('$TMP/rc.json'))['plan']['recompute'] == ['full', 'full']" && ok || bad "bare --recompute means full"
expect_error "--tp not dividing the node" "t = 3 must divide" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 --tp 3 -w 1 -d 1 --out "$O"
expect_error "--tp not dividing the heads" "/heads" "$O" $PW estimate --model gpt2-124m --cluster dgx-a100 --tp 8 -w 1 -d 1 --out "$O"
expect_error "--sp without --tp" "sp:" "$O" $PW estimate --model gpt2-124m --cluster dgx-a100 --sp -d 2 --out "$O"
expect_error "--recompute unknown mode" "partial" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 --recompute partial -d 2 --out "$O"
expect_error "--seq-len beyond max_positions" "max_positions" "$O" $PW estimate --model gpt2-124m --cluster dgx-a100 --seq-len 2048 -d 2 --out "$O"
expect_ok "--seq-len with rotary positions" $PW estimate --model llama2-7b --cluster dgx-a100 --seq-len 8192 --tp 8 -w 1 -d 1
expect_ok "train --tp 2 (cpu, a thread per device)" $PW train --model gpt-tiny --tp 2 -d 2 -w 1 --steps 2 --out "$TMP/train-tp.json" --timeline "$TMP/train-tp-tl.json"
python3 -c "import json; r = json.load(open('$TMP/train-tp.json')); assert len(r['devices']) == 4 and r['plan']['t'] == 2, r['devices']" && ok || bad "train --tp 2 reports every device"
expect_ok "train --tp 2 --sp (cpu)" $PW train --model gpt-tiny --tp 2 --sp -d 2 -w 1 --steps 2
expect_error "train --tp not dividing the heads" "/heads" "$O" $PW train --model gpt-tiny --tp 3 -d 1 -w 1 --steps 1 --out "$O"
expect_ok "validate --tp 2 (a thread per GPU)" $PW validate --model gpt-tiny --tp 2 -d 1 -w 1 --steps 3 --repeats 2 --round-trips 20 --out "$TMP/val-tp.json"
grep -q "^  rank stage" "$TMP/out" && grep -q "^   0.1     0 " "$TMP/out" && ok || bad "validate --tp 2 prints a row per GPU (rank.tp)"
python3 -c "
import json
v = json.load(open('$TMP/val-tp.json'))
assert v['plan']['t'] == 2 and [(d['rank'], d['tp']) for d in v['devices']] == [(0, 0), (0, 1)], v['devices']
assert v['max_abs_memory_error'] == 0, v['max_abs_memory_error']  # each GPU's peak: its rank's prediction
assert v['iteration_time_s']['predicted'] > 0 and v['iteration_time_s']['measured'] > 0
" && ok || bad "validate --tp 2 compares each GPU with its rank's prediction"
expect_error "validate --tp not dividing the heads" "/heads" "$O" $PW validate --model gpt-tiny --tp 3 --steps 2 --out "$O"
! grep -q "^profiling" "$TMP/out" && ok || bad "validate --tp 3 is refused before it profiles"
expect_error "validate --tp with more threads than cores" "each on a core of its own" "$O" $PW validate --model gpt-tiny --tp 2 -w 4096 -m 1 --steps 2 --out "$O"
expect_ok "profile --tp 2 --sp" $PW profile --model gpt-tiny --tp 2 --sp --microbatch 1 --repeats 2 -o "$TMP/prof-tp.json"
python3 -c "
import json
t = json.load(open('$TMP/prof-tp.json'))
assert t['tensor_parallel'] == 2 and t['sequence_parallel'] is True, (t.get('tensor_parallel'), t.get('sequence_parallel'))
" && ok || bad "profile --tp 2 --sp writes a trace of one GPU of the TP group"
expect_ok "estimate from a profiled TP trace" $PW estimate --model gpt-tiny --cluster dgx-a100 --tp 2 --sp -w 1 -d 1 --trace "$TMP/prof-tp.json"
expect_error "profile --sp without --tp" "needs --tp 2 or more" "$O" $PW profile --model gpt-tiny --sp -o "$O"
expect_ok "trace --tp --sp" $PW trace --model llama2-7b --device A100-80GB --tp 4 --sp --microbatch 1 --out "$TMP/t4.json"
expect_ok "estimate from a TP trace" $PW estimate --model llama2-7b --cluster dgx-a100 --tp 4 --sp -d 2 -w 1 --trace "$TMP/t4.json"
expect_error "a TP trace for another t" "/tensor_parallel: trace is for t = 4 with SP" "$O" $PW estimate --model llama2-7b --cluster dgx-a100 --tp 2 -d 2 -w 1 --trace "$TMP/t4.json" --out "$O"
expect_ok "sweep over t" $PW sweep --model llama2-7b --cluster dgx-a100:2 -d 2 -b 1 --schedule 1f1b --vary t=1,4 --vary B=32 --steps 2 --out "$TMP/swt.csv"
python3 -c "
import csv; rows = list(csv.DictReader(open('$TMP/swt.csv')))
assert [(r['t'], r['w']) for r in rows] == [('1', '8'), ('4', '2')] and all(r['error'] == '' for r in rows), rows
" && ok || bad "sweep --vary t sets t and the default w"
expect_error "trace --sp without --tp" "needs --tp > 1" "$O" $PW trace --model llama2-7b --device A100-80GB --sp --out "$O"
expect_ok "train --recompute selective (cpu)" $PW train --model gpt-tiny -d 2 -w 1 -m 2 --recompute selective --steps 2 --out "$TMP/sel.json"
expect_ok "train without recompute (cpu)" $PW train --model gpt-tiny -d 2 -w 1 -m 2 --steps 2 --out "$TMP/nosel.json"
python3 -c "
import json
a, b = json.load(open('$TMP/nosel.json')), json.load(open('$TMP/sel.json'))
assert b['plan']['recompute'] == ['selective', 'selective'], b['plan']
assert a['losses'] == b['losses'], (a['losses'], b['losses'])
for x, y in zip(a['devices'], b['devices']):
    assert y['memory_breakdown_bytes']['activations'] < x['memory_breakdown_bytes']['activations'], (x, y)
" && ok || bad "train --recompute selective: the same losses, fewer activation bytes"
expect_ok "train --offload chunks --recompute selective (cpu)" $PW train --model gpt-tiny -d 2 -w 1 -m 2 --recompute selective --offload chunks --device-memory 4000000 --steps 2 --out "$TMP/selch.json"
python3 -c "
import json
a, b = json.load(open('$TMP/sel.json')), json.load(open('$TMP/selch.json'))
assert b['plan']['recompute'] == ['selective', 'selective'] and b['plan']['offload'] == 'chunks', b['plan']
assert a['losses'] == b['losses'], (a['losses'], b['losses'])
assert all(0 < d['peak_memory_bytes'] <= 4000000 for d in b['devices']), b['devices']
assert b['offload']['copy_in_bytes_per_step'] > 0, b['offload']
" && ok || bad "train --offload chunks --recompute selective: the losses without chunks, inside the device"
expect_ok "validate --offload chunks --recompute selective (cpu)" $PW validate --model gpt-tiny -d 2 -m 2 --recompute selective --offload chunks --device-memory 4000000 --steps 2 --out "$TMP/valselch.json"
python3 -c "
import json; r = json.load(open('$TMP/valselch.json'))
assert r['plan']['offload'] == 'chunks' and r['max_abs_memory_error'] == 0, r['max_abs_memory_error']
" && ok || bad "validate --offload chunks --recompute selective: the predicted peaks are the measured ones"
expect_ok "validate --recompute selective (cpu)" $PW validate --model gpt-tiny -d 2 -m 2 --recompute selective --steps 2 --out "$TMP/valsel.json"
python3 -c "
import json; r = json.load(open('$TMP/valsel.json'))
assert r['plan']['recompute'] == ['selective', 'selective'] and r['max_abs_memory_error'] == 0, r['max_abs_memory_error']
" && ok || bad "validate --recompute selective: the predicted peaks are the measured ones"
expect_error "train refuses --overlap-param-gather" "overlap_param_gather: the cpu executor" "$O" $PW train --model gpt-tiny -d 2 -w 2 -m 2 --distributed-optimizer --overlap-param-gather --steps 2 --out "$O"
expect_error "--overlap-param-gather needs the distributed optimizer" "overlap_param_gather" "$O" $PW estimate --model gpt-tiny --cluster dgx-a100 -d 2 -w 2 --overlap-param-gather --out "$O"
expect_ok "simulate --overlap-param-gather" $PW simulate --model gpt-tiny --cluster dgx-a100 -d 2 -w 2 -m 4 --distributed-optimizer --overlap-param-gather --out "$TMP/opg.json"
grep -q '"overlap_param_gather": true' "$TMP/opg.json" && ok || bad "simulate --overlap-param-gather: the plan in the report says so"
expect_ok "train --distributed-optimizer (cpu)" $PW train --model gpt-tiny -d 2 -w 2 -m 2 --distributed-optimizer --steps 2 --out "$TMP/dopt.json"
python3 -c "
import json; r = json.load(open('$TMP/dopt.json')); assert r['plan']['distributed_optimizer'], r['plan']
o = [d['memory_breakdown_bytes']['optimizer'] for d in r['devices']]; w = [d['memory_breakdown_bytes']['weights'] for d in r['devices']]
assert all(x == 2 * ((y // 4 + 1) // 2) * 4 for x, y in zip(o, w)), (o, w)
" && ok || bad "train --distributed-optimizer: each replica holds half the optimizer state"
expect_ok "plan over --tp and -d lists" $PW plan --model gpt3-1.3b --cluster dgx-a100 --batch 64 --tp 1,2,4 -d 1,2 --top 2 --out "$TMP/plan3d.json"
python3 -c "import json; p = json.load(open('$TMP/plan3d.json')); assert p['t'] in (1, 2, 4) and p['d'] in (1, 2), p" && ok || bad "plan honours --tp and -d lists"
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

# ---- validate (begin) ----------------------------------------------------------------------
# validate: profile, simulate on a cluster description of this machine, train, compare; then the
# same comparison from the report files. Timing accuracy is never asserted (docs/performance.md
# records what this machine gives); only that every figure is there and the errors add up.
expect_ok "help validate" $PW validate --help
expect_ok "validate" $PW validate --model gpt-tiny --schedule 1f1b -d 2 -m 2 -b 2 --steps 3 --repeats 2 --round-trips 20 --blocks 2 \
  --out "$TMP/val.json" --simulated-out "$TMP/val-sim.json" --measured-out "$TMP/val-meas.json" \
  --cluster-out "$TMP/cpu-host.json" --trace-out "$TMP/val-trace.json"
grep -q "^  step time " "$TMP/out" && grep -q "busy pred" "$TMP/out" && [ "$(grep -c '^step ' "$TMP/out")" -eq 6 ] \
  && [ "$(grep -c '^profiling gpt-tiny at b=2 (mean of 2 round-robin runs, block [12] of 2)' "$TMP/out")" -eq 2 ] \
  && grep -q "^  the mean of the 2 profiles: block forward" "$TMP/out" \
  && grep -Eq "^  machine: other processes used ([0-9]+%|unknown)" "$TMP/out" \
  && grep -q "^training 3 steps on 2 ranks (threads on cores [0-9]*,[0-9]*)" "$TMP/out" \
  && ok || bad "validate prints the step lines and the error table"
python3 -c "
import json, math
v = json.load(open('$TMP/val.json'))
assert v['format'] == 'pipewright.validation/1' and v['model'] == 'gpt-tiny'
assert v['plan']['d'] == 2 and v['plan']['schedule'] == '1f1b' and len(v['plan']['placement']) == 2
assert v['predicted']['source'] == 'simulated' and v['measured']['source'] == 'measured'
# Two blocks of 3 steps: the first block's steps, then the second's after its first (a warm-up).
assert len(v['measured']['step_times_s']) == 5
assert len(json.load(open('$TMP/val-meas.json'))['warm_up_step_times_s']) == 1
assert v['machine']['blocks'] == 2 and v['machine']['trace']['blocks'] == 2
t = v['iteration_time_s']
assert t['predicted'] > 0 and t['measured'] > 0
assert math.isclose(t['error'], (t['predicted'] - t['measured']) / t['measured'], rel_tol=1e-9)
assert v['median_step_time_s']['measured'] > 0
m = v['machine']
assert m['cores'] >= 1 and m['gemm_flops_per_s'] > 0
assert m['transport']['latency_s'] >= 0 and m['transport']['bandwidth_bytes_per_s'] > 0
assert len(m['transport']['samples']) == 4 and m['cluster']['name'] == 'cpu-host'
assert m['cluster']['intra_node']['bandwidth_bytes_per_s'] == m['transport']['bandwidth_bytes_per_s']
assert [d['rank'] for d in v['devices']] == [0, 1]
for phase in ('profile', 'train'):
  l = m['other_load'][phase]
  assert l is None or (0 <= l['others'] <= 1 and 0 <= l['steal'] <= 1 and l['wall_s'] > 0), l
for d in v['devices']:
  for k in ('busy_s', 'peak_memory_bytes', 'bubble_fraction'):
    assert set(d[k]) == {'predicted', 'measured', 'error'}
  assert d['peak_memory_bytes']['predicted'] > 0 and d['peak_memory_bytes']['measured'] > 0
  assert abs(d['peak_memory_bytes']['error']) < 0.1  # memory: exact, or the planner one message above
assert v['files']['predicted'] == '$TMP/val-sim.json' and v['files']['cluster'] == '$TMP/cpu-host.json'
assert json.load(open('$TMP/val-sim.json'))['source'] == 'simulated'
assert json.load(open('$TMP/val-meas.json'))['source'] == 'measured'
" && ok || bad "validate writes the validation report"
expect_ok "simulate on the cpu-host cluster" $PW simulate --model gpt-tiny --cluster "$TMP/cpu-host.json" --trace "$TMP/val-trace.json" --schedule 1f1b -d 2 -m 2 -b 2
# Offload: the host side measured (copies, CPU Adam) into the cpu-host cluster, the devices the
# executor's --device-memory; bytes moved and peaks exact, the step time's error as it comes.
expect_ok "validate --offload chunks" $PW validate --model gpt-tiny --schedule 1f1b -d 2 -m 2 -b 2 --steps 3 --repeats 2 --round-trips 10 --blocks 1 \
  --offload chunks --chunk-size 65536 --device-memory 2600000 --out "$TMP/val-ck.json" --cluster-out "$TMP/cpu-host-ck.json"
grep -q "^probing the host side of offload" "$TMP/out" && grep -q "^  copied per step " "$TMP/out" && ok || bad "validate --offload chunks prints the host probe and the bytes moved"
python3 -c "
import json
v = json.load(open('$TMP/val-ck.json'))
c = v['copy_bytes_per_step']
assert c['predicted'] > 0 and c['predicted'] == c['measured'] and c['error'] == 0, c
assert v['max_abs_memory_error'] == 0, v['max_abs_memory_error']
h = v['machine']['host']
assert h['copy_bandwidth_bytes_per_s'] > 0 and h['optimizer_params_per_s'] > 0, h
k = json.load(open('$TMP/cpu-host-ck.json'))
assert k['device']['memory_bytes'] == 2600000 and k['host']['cpu_adam_params_per_s_per_core'] > 0, k['host']
" && ok || bad "validate --offload chunks: bytes and peaks exact, the host measured"
expect_error "validate --offload chunks without --device-memory" "needs --device-memory" "$O" $PW validate --model gpt-tiny --offload chunks --steps 2 --out "$O"
! grep -q "^profiling" "$TMP/out" && ok || bad "validate --offload chunks without a device is refused before it profiles"
expect_error "validate: an offload the executor refuses" "needs the tied embedding and LM head on different stages" "$O" $PW validate --model gpt-tiny --offload optimizer -d 1 --steps 2 --out "$O"
! grep -q "^profiling" "$TMP/out" && ok || bad "validate --offload optimizer at d = 1 (tied) is refused before it profiles"
expect_ok "validate with a given trace" $PW validate --model gpt-tiny --trace "$TMP/val-trace.json" --schedule 2bw -d 2 -m 2 -b 2 --steps 2 --round-trips 10
! grep -q "^profiling" "$TMP/out" && ok || bad "validate --trace does not profile"
expect_ok "validate files" $PW validate --predicted "$TMP/val-sim.json" --measured "$TMP/val-meas.json" --out "$TMP/val-files.json"
grep -q "^  step time " "$TMP/out" && ok || bad "validate files prints the table"
python3 -c "
import json
a, b = json.load(open('$TMP/val.json')), json.load(open('$TMP/val-files.json'))
assert a['iteration_time_s'] == b['iteration_time_s'] and a['devices'] == b['devices']
assert b['machine'] is None and b['files'] == {'predicted': '$TMP/val-sim.json', 'measured': '$TMP/val-meas.json'}
d = json.load(open('$TMP/val-meas.json')); d['plan']['m'] = 4; json.dump(d, open('$TMP/val-meas-m4.json', 'w'))
" && ok || bad "validate files gives the same comparison"
echo '{"format": "pipewright.report/1", "source": ' >"$TMP/val-garbage.json"
expect_error "validate mismatched plans" "/plan/m: 2 in" "$O" $PW validate --predicted "$TMP/val-sim.json" --measured "$TMP/val-meas-m4.json" --out "$O"
expect_error "validate swapped files" "/source" "$O" $PW validate --predicted "$TMP/val-meas.json" --measured "$TMP/val-sim.json" --out "$O"
expect_error "validate missing predicted file" "cannot open" "$O" $PW validate --predicted "$TMP/none.json" --measured "$TMP/val-meas.json" --out "$O"
expect_error "validate garbage predicted file" "val-garbage.json" "$O" $PW validate --predicted "$TMP/val-garbage.json" --measured "$TMP/val-meas.json" --out "$O"
expect_error "validate predicted alone" "requires --measured" "$O" $PW validate --predicted "$TMP/val-sim.json" --out "$O"
expect_error "validate files with plan flags" "runs nothing" "$O" $PW validate --predicted "$TMP/val-sim.json" --measured "$TMP/val-meas.json" -d 2 --out "$O"
expect_error "validate --backend cuda" "$CUDA_ERR" "$O" $PW validate --backend cuda --out "$O"
expect_error "validate unknown backend" "--backend: unknown" "$O" $PW validate --backend tpu --out "$O"
expect_error "validate fp16 model" "fp32" "$O" $PW validate --model gpt2-124m --out "$O"
expect_error "validate ranks per gpu" "places the ranks" "$O" $PW validate -d 2 --ranks-per-gpu 2 --out "$O"
expect_error "validate trace lacks b" "microbatch size 8" "$O" $PW validate --trace "$TMP/val-trace.json" -d 2 -m 2 -b 8 --out "$O"
expect_error "validate bad plan" "m >= d" "$O" $PW validate --schedule 2bw -d 2 -m 1 --out "$O"
expect_error "validate --blocks 0" "--blocks: Value 0 not in range 1 to 100" "$O" $PW validate --blocks 0 --out "$O"
expect_error "validate files with --blocks" "--blocks: comparing --predicted" "$O" $PW validate --predicted "$TMP/val-sim.json" --measured "$TMP/val-meas.json" --blocks 2 --out "$O"
# ---- validate (end) ------------------------------------------------------------------------

# ---- calibrate -----------------------------------------------------------------------------
# vTrain's measurements live in ../shared beside the repository (as CI has it); without them
# these checks cannot run, and say so rather than fail one after another.
CAL_DATA="$SRC/../shared/data/calibration"
if [ -f "$CAL_DATA/vtrain-a100-single-node.csv" ]; then
CAL_HEADER='# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)'
# The first 60 t = 1 rows of vTrain's data: fast enough for a CLI test (also under ASan).
{ echo "$CAL_HEADER"; awk -F, 'NR > 1 && $8 == 1' "$SRC/../shared/data/calibration/vtrain-a100-single-node.csv" | head -60; } >"$TMP/cal.csv"
expect_ok "help calibrate" $PW calibrate --help
expect_ok "calibrate a" $PW calibrate --measurements "$TMP/cal.csv" --cluster vtrain-a100 --folds 3 --out "$TMP/cal-a.json" --residuals "$TMP/cal-a.csv"
grep -q "3-fold cross-validation: mean |error|" "$TMP/out" && ok || bad "calibrate prints the CV error"
expect_ok "calibrate b" $PW calibrate --measurements "$TMP/cal.csv" --cluster vtrain-a100 --folds 3 --out "$TMP/cal-b.json"
cmp -s "$TMP/cal-a.json" "$TMP/cal-b.json" && ok || bad "calibrate output is deterministic"
python3 -c "import json; d=json.load(open('$TMP/cal-a.json')); assert d['format']=='pipewright.device/1' and d['name']=='A100-80GB-cal' and 0<d['efficiency']['gemm_max']<=1" && ok || bad "calibrate writes a device"
[ "$(wc -l <"$TMP/cal-a.csv")" -eq 61 ] && ok || bad "calibrate residuals: one line per row"
python3 -c "import json; d=json.load(open('$TMP/cal-a.json')); assert d['efficiency']['overhead_exponent']==0" && ok || bad "calibrate keeps the hard floor by default"
expect_ok "calibrate --blend-floor" $PW calibrate --measurements "$TMP/cal.csv" --cluster vtrain-a100 --folds 2 --blend-floor --out "$TMP/cal-blend.json"
python3 -c "import json; d=json.load(open('$TMP/cal-blend.json')); assert d['efficiency']['overhead_exponent']>1" && ok || bad "calibrate --blend-floor fits the exponent"
expect_ok "estimate with the calibrated device" $PW estimate --model gpt2-124m --cluster vtrain-a100 --set "device=$TMP/cal-a.json" -w 8 -b 1 -m 4
{ echo "$CAL_HEADER"; echo "8,32,4,1536,12,24,1024,8,1,1,219.7"; } >"$TMP/cal-tp.csv"
expect_error "calibrate unsupported row" "row 1 (line 2): cannot predict" "$O" $PW calibrate --measurements "$TMP/cal-tp.csv" --out "$O"
cat "$TMP/cal.csv" "$TMP/cal-tp.csv" | grep -v "^# GPUs,global batch" | { echo "$CAL_HEADER"; cat; } >"$TMP/cal-mixed.csv"
expect_ok "calibrate --skip-unsupported" $PW calibrate --measurements "$TMP/cal-mixed.csv" --skip-unsupported --folds 2 --out "$TMP/cal-c.json"
grep -q "skipped 1 row" "$TMP/out" && ok || bad "calibrate counts skipped rows"
: >"$TMP/cal-empty.csv"
expect_error "calibrate empty file" "cal-empty.csv: empty file" "$O" $PW calibrate --measurements "$TMP/cal-empty.csv" --out "$O"
{ echo "# GPUs,global batch"; echo "2,16"; } >"$TMP/cal-cols.csv"
expect_error "calibrate missing column" 'missing column "micro batch"' "$O" $PW calibrate --measurements "$TMP/cal-cols.csv" --out "$O"
{ echo "$CAL_HEADER"; echo "2,16,8,1024,16,24,1024,1,1,2,-1"; } >"$TMP/cal-neg.csv"
expect_error "calibrate negative time" 'column "iteration time (ms)": must be a positive' "$O" $PW calibrate --measurements "$TMP/cal-neg.csv" --out "$O"
{ echo "$CAL_HEADER"; echo "2,16,8,1024,16,24,1024,1,1,2,nan"; } >"$TMP/cal-nan.csv"
expect_error "calibrate non-finite time" 'must be a positive finite time' "$O" $PW calibrate --measurements "$TMP/cal-nan.csv" --out "$O"
{ echo "$CAL_HEADER"; echo "two,16,8,1024,16,24,1024,1,1,2,300"; } >"$TMP/cal-int.csv"
expect_error "calibrate non-integer GPUs" 'column "# GPUs": "two" is not an integer' "$O" $PW calibrate --measurements "$TMP/cal-int.csv" --out "$O"
{ echo "$CAL_HEADER"; echo "8,16,8,1024,16,24,1024,1,1,2,300"; } >"$TMP/cal-prod.csv"
expect_error "calibrate t*w*d != GPUs" '= 2, not 8' "$O" $PW calibrate --measurements "$TMP/cal-prod.csv" --out "$O"
{ echo "$CAL_HEADER"; } >"$TMP/cal-huge.csv"; truncate -s 65M "$TMP/cal-huge.csv"
expect_error "calibrate huge file" "over the 64 MiB limit" "$O" $PW calibrate --measurements "$TMP/cal-huge.csv" --out "$O"
rm -f "$TMP/cal-huge.csv"
expect_error "calibrate without --out" "--out DEVICE.json is required" - $PW calibrate --measurements "$TMP/cal.csv"
expect_ok "calibrate --allreduce" $PW calibrate --allreduce "$SRC"/../shared/data/calibration/vtrain-a100-allreduce/allreduce_{2,8}gpu.csv --cluster-out "$TMP/cal-cluster.json"
python3 -c "import json; d=json.load(open('$TMP/cal-cluster.json')); assert 0<d['intra_node']['efficiency']<1" && ok || bad "calibrate --allreduce writes the cluster"
else
  echo "skipped: calibrate tests ($CAL_DATA not found beside the repository)"
fi
# ---- calibrate (end) -----------------------------------------------------------------------

# ---- offload (issue 15) ---------------------------------------------------------------------
expect_ok "simulate --offload optimizer" $PW simulate --model gpt2-124m --cluster p3.16xlarge -w 1 -d 2 -m 4 --offload optimizer --timeline "$TMP/off-tl.json" --out "$TMP/off-sim.json"
grep -q "moved per step" "$TMP/out" && ok || bad "simulate --offload prints the bytes moved"
python3 -c "
import json
t = json.load(open('$TMP/off-tl.json'))['traceEvents']
names = {e['args']['name'] for e in t if e.get('name') == 'thread_name'}
cats = {e.get('cat') for e in t if e.get('ph') == 'X'}
assert {'copy_d2h', 'copy_h2d', 'host_cpu'} <= names and {'copy_d2h', 'copy_h2d', 'host_cpu'} <= cats, (names, cats)
r = json.load(open('$TMP/off-sim.json'))
assert r['hosts'][0]['fits'] and r['offload']['copy_out_bytes_per_step'] > 0
assert any(l['kind'] == 'uplink' for l in r['simulation']['links']), r['simulation']['links']" && ok || bad "offload timeline tracks, hosts and uplink traffic"
expect_ok "train --offload optimizer,activations" $PW train --model gpt-tiny --schedule 1f1b -d 2 -m 4 -b 2 --steps 2 --offload optimizer,activations --device-memory 3000000 --timeline "$TMP/off-train-tl.json" --out "$TMP/off-train.json"
python3 -c "
import json
r = json.load(open('$TMP/off-train.json'))
o = r['offload']
assert o['mode'] == 'optimizer,activations' and o['copy_out_bytes_per_step'] > 0 and o['copy_in_bytes_per_step'] > 0, o
assert all(d['peak_memory_bytes'] <= 3000000 and d['memory_breakdown_bytes']['optimizer'] == 0 for d in r['devices']), r['devices']
t = json.load(open('$TMP/off-train-tl.json'))
names = {e['args']['name'] for e in t['traceEvents'] if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
assert {'copy_d2h', 'copy_h2d', 'host_cpu'} <= names, names" && ok || bad "train --offload: report's offload bytes, device peaks inside --device-memory, copy tracks"
expect_ok "schedule --offload optimizer" $PW schedule -d 2 -m 2 --offload optimizer
grep -q "D2H1" "$TMP/out" && grep -q "hostopt0(v1) H2D0(v1)" "$TMP/out" && ok || bad "schedule prints the offload ops"
expect_ok "plan falls back to offload" $PW plan --model gpt-10b --cluster v100-32gb-ws -B 8 --top 2 --out "$TMP/off-plan.json"
grep -q "without offload nothing fits" "$TMP/out" && grep -q "so the search tried --offload activations" "$TMP/out" && ok || bad "plan says why it offloads: $(head -c 400 "$TMP/out")"
python3 -c "import json; assert json.load(open('$TMP/off-plan.json'))['offload'] == 'optimizer'" && ok || bad "plan writes the offload plan"
expect_ok "sweep host memory with offload" $PW sweep --model gpt2-124m --cluster v100-32gb-ws -b 1 -m 2 --offload optimizer --vary host.memory_bytes=1e9,1e11 --out "$TMP/off-sweep.csv"
grep -q "does not fit: the host memory of node 0" "$TMP/out" && grep -q "m=2 offload" "$TMP/out" && ok || bad "sweep names the host that runs out: $(head -c 600 "$TMP/out")"
# Activation offload (KARMA): the rule's choice printed per stage; a plan file's choices simulated
# with copy tracks in the timeline and the swapped bytes in the report.
expect_ok "estimate --offload activations" $PW estimate --model gpt2-124m --cluster p3.16xlarge -w 1 -d 4 -m 8 --schedule 1f1b --offload activations
grep -q "activations stage 0: 0 layers swap, 3 recompute" "$TMP/out" && grep -q "activations stage 3: 3 layers swap, 0 recompute (nothing can swap here: keeps its stash)" "$TMP/out" && ok || bad "estimate prints each stage's activation choice: $(head -c 600 "$TMP/out")"
python3 -c "
import json
json.dump({'format': 'pipewright.plan/1', 'schedule': 'gpipe', 'w': 1, 'd': 2, 'b': 1, 'm': 8,
           'offload': 'activations', 'activations': ['swap', 'recompute']}, open('$TMP/swap-plan.json', 'w'))"
expect_ok "simulate a plan that swaps" $PW simulate --model gpt2-124m --cluster p3.16xlarge --plan "$TMP/swap-plan.json" --timeline "$TMP/swap-tl.json" --out "$TMP/swap-sim.json"
grep -q "swapped activations" "$TMP/out" && ok || bad "simulate prints the swapped bytes: $(head -c 600 "$TMP/out")"
python3 -c "
import json
t = json.load(open('$TMP/swap-tl.json'))['traceEvents']
names = {e['args']['name'] for e in t if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
assert 'copy_d2h' in names and 'copy_h2d' in names, names
assert any(e.get('name', '').startswith('A2H') for e in t) and any(e.get('name', '').startswith('A2D') for e in t)
r = json.load(open('$TMP/swap-sim.json'))
assert r['offload']['activation_bytes_per_step'] > 0 and r['plan']['activations'] == ['swap', 'recompute']" && ok || bad "swap timeline tracks and report"
# Per-layer choices (activation_layers): a stage mixing swapped and recomputed blocks, estimated
# and simulated; the choice printed per stage and written back in the report's plan.
python3 -c "
import json
json.dump({'format': 'pipewright.plan/1', 'schedule': 'gpipe', 'w': 1, 'd': 2, 'b': 1, 'm': 8,
           'offload': 'activations', 'activation_layers': [['swap'] * 4 + ['recompute'] * 2, ['recompute'] * 6]},
          open('$TMP/mixed-plan.json', 'w'))"
expect_ok "estimate a plan mixing swap and recompute" $PW estimate --model gpt2-124m --cluster p3.16xlarge --plan "$TMP/mixed-plan.json"
grep -q "activations stage 0: 4 layers swap, 2 recompute" "$TMP/out" && grep -q "activations stage 1: 0 layers swap, 6 recompute" "$TMP/out" && ok || bad "estimate prints per-layer choices: $(head -c 600 "$TMP/out")"
expect_ok "simulate a plan mixing swap and recompute" $PW simulate --model gpt2-124m --cluster p3.16xlarge --plan "$TMP/mixed-plan.json" --out "$TMP/mixed-sim.json"
python3 -c "
import json
r = json.load(open('$TMP/mixed-sim.json'))
a = r['offload']['ranks'][0]['activations']
assert a['swapped_layers'] == 4 and a['recomputed_layers'] == 2 and a['swapped_bytes_per_step'] > 0, a
assert r['plan']['activation_layers'][0] == ['swap'] * 4 + ['recompute'] * 2, r['plan']" && ok || bad "mixed plan's report"

finish
