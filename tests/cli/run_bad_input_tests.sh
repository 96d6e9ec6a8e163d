#!/usr/bin/env bash
# Bad-input regression tests of the real binary (issue 13): every input that once crashed, hung,
# wrapped around silently or ended in "internal error" now gives one line on stderr, the documented
# exit code (1 bad input, 2 usage), no signal, no hang (each command runs under `timeout`) and no
# output file. Usage: run_bad_input_tests.sh PATH/TO/pipewright SOURCE_DIR
set -u
LIMIT=30  # seconds per command (PW_TEST_TIMEOUT overrides): a hang fails instead of blocking
source "$(dirname "$0")/harness.sh"

# expect_code NAME CODE PATTERN CMD...: exits with CODE (1 bad input, 2 usage) within LIMIT
# seconds, one stderr line matching PATTERN, never "internal error", $O not created.
expect_code() { local name=$1 code=$2 pattern=$3; shift 3; expect_fail "$name" "$code" "$pattern" "$O" "$@"; }
# py 'python code' edits JSON: j is the document, written back.
edit_json() {
  local in=$1 out=$2 code=$3
  python3 -c "
import json, sys
j = json.load(open('$in'))
$code
json.dump(j, open('$out', 'w'))"
}

# --- Exit codes: 0 success, 1 bad input, 2 usage. ---
expect_ok "exit 0: --help" $PW --help
expect_ok "exit 0: --version" $PW --version
expect_ok "exit 0: estimate" $PW estimate --model gpt-tiny --cluster h100-x1 -d 2 --ranks-per-gpu 2 -m 4 --out "$TMP/r.json"
expect_code "exit 2: no subcommand" 2 "pipewright:" $PW
expect_code "exit 2: unknown option" 2 "--frobnicate" $PW estimate --frobnicate
expect_code "exit 2: unknown subcommand" 2 "pipewright:" $PW frobnicate
expect_code "exit 2: missing value" 2 "microbatches" $PW estimate -m
expect_code "exit 2: not a number" 2 "microbatches" $PW estimate -m lots
expect_code "exit 2: missing required option" 2 "batch" $PW plan --model gpt-tiny
expect_code "exit 1: unknown model" 1 "unknown model" $PW estimate --model no-such-model --out "$O"

# --- Flags share the files' limits (usage errors: exit 2). ---
expect_code "-m 1000001" 2 "microbatches" $PW simulate --model gpt-tiny -m 1000001 --out "$O"
expect_code "--nodes 2147483647" 2 "nodes" $PW estimate --model gpt-tiny --nodes 2147483647 --out "$O"
expect_code "--nodes 2^32" 2 "nodes" $PW estimate --model gpt-tiny --nodes 4294967296 --out "$O"
expect_code "-w 2^31" 2 "width" $PW estimate --model gpt-tiny -w 2147483648 --out "$O"
expect_code "--chunks 0" 2 "chunks" $PW plan --model gpt-tiny --cluster dgx-a100 -B 8 --chunks 0 --out "$O"
expect_code "--columns 0" 2 "columns" $PW schedule -d 2 -m 2 --columns 0
expect_code "--lr nan" 2 "lr" $PW train --model gpt-tiny --lr nan --steps 1 --out "$O"
expect_code "--lr -1" 2 "lr" $PW train --model gpt-tiny --lr -1 --steps 1 --out "$O"
expect_code "--lr inf" 2 "lr" $PW train --model gpt-tiny --lr inf --steps 1 --out "$O"
expect_code "--lr 1e400" 2 "lr" $PW train --model gpt-tiny --lr 1e400 --steps 1 --out "$O"
expect_code "--weight-decay nan" 2 "weight-decay" $PW train --model gpt-tiny --weight-decay nan --steps 1 --out "$O"
expect_code "--memory-headroom nan" 2 "memory-headroom" $PW plan --model gpt-tiny --cluster dgx-a100 -B 8 --memory-headroom nan --out "$O"
expect_code "--seq-len 2^24+1" 2 "seq-len" $PW estimate --model gpt-tiny --seq-len 16777217 --out "$O"
expect_code "--steps 0" 2 "steps" $PW simulate --model gpt-tiny --cluster h100-x1 --steps 0 --out "$O"

# --- Sizes that hung: refused in one line before anything is built (exit 1). ---
expect_code "simulate -m 1000000" 1 "ops" $PW simulate --model gpt-tiny --cluster h100-x1 -m 1000000 --out "$O"
# A sweep point that fails is a row with its error (the sweep itself succeeds).
expect_ok "sweep -m 1000000" $PW sweep --model gpt-tiny --cluster h100-x1 -m 1000000 --vary network.latency_s=1e-6 --out "$TMP/sw.csv"
python3 -c "
import csv
rows = list(csv.DictReader(open('$TMP/sw.csv')))
assert len(rows) == 1 and 'ops' in rows[0]['error'], rows" && ok || bad "sweep -m 1000000: the row names the ops limit"
expect_code "train -m 1000000" 1 "ops" $PW train --model gpt-tiny -m 1000000 --out "$O"
expect_code "schedule -m 1000000 --steps 100" 1 "ops" $PW schedule -d 4 -m 1000000 --steps 100
expect_code "--nodes 100000" 1 "ranks" $PW simulate --model gpt-tiny --nodes 100000 --out "$O"
expect_code "--set nodes=100000" 1 "ranks" $PW simulate --model gpt-tiny --set nodes=100000 --out "$O"
expect_code "simulate 8192 ranks" 1 "more than the 4096" $PW simulate --model gpt-tiny --cluster dgx-a100:1024 -d 1 --out "$O"
expect_code "simulate on 125,000 x 8 GPUs" 1 "more than the 16384" $PW simulate --model gpt-tiny --cluster dgx-a100:125000 -w 1 -d 1 --out "$O"
expect_code "--nodes 1000000 (8 GPUs each)" 1 "gpus_per_node" $PW estimate --model gpt-tiny --nodes 1000000 --out "$O"
expect_code "estimate dgx-a100:1000000" 1 "GPUs is more than" $PW estimate --model gpt-tiny --cluster dgx-a100:1000000 --out "$O"
expect_code "cluster NAME:10^7" 1 "node count" $PW estimate --model gpt-tiny --cluster dgx-a100:10000000 --out "$O"
$PW clusters dgx-a100 --json >"$TMP/dgx.json"
edit_json "$TMP/dgx.json" "$TMP/c-1m.json" "j['nodes'] = 1; j['gpus_per_node'] = 10**6"
expect_code "plan on 10^6 GPUs per node" 1 "pipeline ranks" $PW plan --model gpt-tiny --cluster "$TMP/c-1m.json" -B 8 --out "$O"
expect_code "simulate on 10^6 GPUs per node" 1 "more than the 16384" $PW simulate --model gpt-tiny --cluster "$TMP/c-1m.json" -w 1 -d 1 --out "$O"
expect_code "estimate on 10^6 GPUs per node" 1 "w\*d" $PW estimate --model gpt-tiny --cluster "$TMP/c-1m.json" --out "$O"
edit_json "$TMP/dgx.json" "$TMP/c-int.json" "j['gpus_per_node'] = 2**31 - 1"
expect_code "plan, gpus_per_node 2^31-1" 1 "/gpus_per_node" $PW plan --model gpt-tiny --cluster "$TMP/c-int.json" -B 8 --out "$O"
edit_json "$TMP/dgx.json" "$TMP/c-3x.json" "j['nodes'] = 3; j['gpus_per_node'] = 1431655766"
expect_code "cluster 3 x 1431655766" 1 "gpus_per_node" $PW estimate --model gpt-tiny --cluster "$TMP/c-3x.json" --out "$O"
edit_json "$TMP/dgx.json" "$TMP/c-prod.json" "j['nodes'] = 1001; j['gpus_per_node'] = 1000"
expect_code "cluster 1001 x 1000" 1 "more than 1000000" $PW estimate --model gpt-tiny --cluster "$TMP/c-prod.json" --out "$O"

# --- Files that are not regular files, or too large. ---
mkdir -p "$TMP/dir"
mkfifo "$TMP/fifo"
truncate -s 300M "$TMP/huge.json"
expect_code "--model /dev/zero" 1 "not a regular file" $PW estimate --model /dev/zero --out "$O"
expect_code "--model a directory" 1 "not a regular file" $PW estimate --model "$TMP/dir/" --out "$O"
expect_code "--model a FIFO" 1 "not a regular file" $PW estimate --model "$TMP/fifo" --out "$O"
expect_code "--model 300 MB" 1 "limit" $PW estimate --model "$TMP/huge.json" --out "$O"
edit_json "$TMP/dgx.json" "$TMP/c-zero.json" "j['device'] = '/dev/zero'"
expect_code "device /dev/zero" 1 "not a regular file" $PW estimate --model gpt-tiny --cluster "$TMP/c-zero.json" --out "$O"
expect_code "--plan a directory" 1 "not a regular file" $PW estimate --model gpt-tiny --plan "$TMP/dir" --out "$O"
expect_code "--data a directory" 1 "not a regular file" $PW train --model gpt-tiny --data "$TMP/dir" --steps 1 --out "$O"
expect_code "--data /dev/zero" 1 "not a regular file" $PW train --model gpt-tiny --data /dev/zero --steps 1 --out "$O"

# --- JSON: any nlohmann error is one line naming the file and the path. ---
$PW models gpt-tiny --json >"$TMP/tiny-full.json"
python3 -c "
import json
j = json.load(open('$TMP/tiny-full.json'))
j = {k: v for k, v in j.items() if k != 'derived_per_sample'}
json.dump(j, open('$TMP/tiny.json', 'w'))"
sed 's/"layers": *[0-9]*/"layers": 1e400/' "$TMP/tiny.json" >"$TMP/m-1e400.json"
expect_code "1e400" 1 "m-1e400.json: /layers: invalid JSON: number overflow" $PW estimate --model "$TMP/m-1e400.json" --out "$O"
sed 's/"layers": *[0-9]*/"layers": -1e400/' "$TMP/tiny.json" >"$TMP/m-neg.json"
expect_code "-1e400" 1 "invalid JSON" $PW estimate --model "$TMP/m-neg.json" --out "$O"
sed 's/"layers": *[0-9]*/"layers": 18446744073709551615/' "$TMP/tiny.json" >"$TMP/m-u64.json"
expect_code "2^64-1 is not -1" 1 "/layers" $PW estimate --model "$TMP/m-u64.json" --out "$O"
sed 's/"layers": *[0-9]*/"layers": 2, "layers": 2/' "$TMP/tiny.json" >"$TMP/m-dup.json"
expect_code "duplicate key" 1 "/layers: invalid JSON: key given twice" $PW estimate --model "$TMP/m-dup.json" --out "$O"
printf '{"format": "pipewright.model/1", "name": "\xff\xfe"}' >"$TMP/m-utf8.json"
expect_code "invalid UTF-8 in a file" 1 "invalid JSON" $PW estimate --model "$TMP/m-utf8.json" --out "$O"
python3 -c "
import json
j = json.load(open('$TMP/tiny.json'))
j['x'] = 'DEEP'
s = json.dumps(j).replace('\"DEEP\"', '[' * 100000 + ']' * 100000)
open('$TMP/m-deep.json', 'w').write(s)"
expect_code "nested 10^5 deep" 1 "nested deeper than" $PW estimate --model "$TMP/m-deep.json" --out "$O"
edit_json "$TMP/tiny.json" "$TMP/m-seq.json" "j['seq_len'] = 10**9; j['max_positions'] = 10**9"
expect_code "seq_len 1e9" 1 "/seq_len" $PW estimate --model "$TMP/m-seq.json" --out "$O"
sed 's/"hidden": *[0-9]*/"hidden": "big"/' "$TMP/tiny.json" >"$TMP/m-type.json"
expect_code "wrong type" 1 "/hidden: expected a number" $PW estimate --model "$TMP/m-type.json" --out "$O"

# --- Reports for validate: an index read as 64-bit, never wrapped; deep unknown fields. ---
$PW estimate --model gpt-tiny --cluster h100-x1 -d 2 --ranks-per-gpu 2 -m 4 --out "$TMP/pred.json" >/dev/null
edit_json "$TMP/pred.json" "$TMP/meas.json" "j['source'] = 'measured'"
expect_ok "validate two good reports" $PW validate --predicted "$TMP/pred.json" --measured "$TMP/meas.json"
edit_json "$TMP/meas.json" "$TMP/meas-2-31.json" "j['devices'][0]['rank'] = 2**31"
expect_code "report rank 2^31" 1 "/devices/0/rank: must be in 0 .. 999999" $PW validate --predicted "$TMP/pred.json" --measured "$TMP/meas-2-31.json" --out "$O"
edit_json "$TMP/meas.json" "$TMP/meas-2-32.json" "j['devices'][1]['rank'] = 2**32 + 1"
expect_code "report rank 2^32+1" 1 "/devices/1/rank" $PW validate --predicted "$TMP/pred.json" --measured "$TMP/meas-2-32.json" --out "$O"
edit_json "$TMP/meas.json" "$TMP/meas-mem.json" "j['devices'][0]['memory_breakdown_bytes']['weights'] = 2**62"
expect_code "report bytes 2^62" 1 "/weights" $PW validate --predicted "$TMP/pred.json" --measured "$TMP/meas-mem.json" --out "$O"
python3 -c "
import json
j = json.load(open('$TMP/meas.json'))
j['unknown'] = 'DEEP'
s = json.dumps(j).replace('\"DEEP\"', '{\"a\":' * 100000 + '1' + '}' * 100000)
open('$TMP/meas-deep.json', 'w').write(s)"
expect_code "report unknown field 10^5 deep" 1 "nested deeper than" $PW validate --predicted "$TMP/pred.json" --measured "$TMP/meas-deep.json" --out "$O"

# --- Plans: placement indices, stage_blocks, counts. ---
PLAN="$SRC/tests/data/plan-tiny-2bw.json"
$PW estimate --model gpt-tiny --cluster h100-x1 --plan "$PLAN" --ranks-per-gpu 2 --out "$TMP/plan-r.json" >/dev/null
python3 -c "
import json
p = json.load(open('$TMP/plan-r.json'))['plan']
for k in ('global_batch',): p.pop(k, None)
json.dump(p, open('$TMP/plan.json', 'w'))"
edit_json "$TMP/plan.json" "$TMP/p-gpu.json" "j['placement'][1]['gpu'] = 2**32 + 1"
expect_code "placement gpu 2^32+1" 1 "/placement/1/gpu" $PW estimate --model gpt-tiny --cluster h100-x1 --plan "$TMP/p-gpu.json" --ranks-per-gpu 2 --out "$O"
edit_json "$TMP/plan.json" "$TMP/p-sb.json" "j['stage_blocks'] = [2**62, 2**62]"
expect_code "stage_blocks 2^62" 1 "/stage_blocks/0" $PW estimate --model gpt-tiny --cluster h100-x1 --plan "$TMP/p-sb.json" --ranks-per-gpu 2 --out "$O"
edit_json "$TMP/plan.json" "$TMP/p-m.json" "j['m'] = 10**6 + 1"
expect_code "plan m 10^6+1" 1 "/m: must be in 1 .. 1000000" $PW estimate --model gpt-tiny --cluster h100-x1 --plan "$TMP/p-m.json" --ranks-per-gpu 2 --out "$O"

# --- Models: HF dtype, absurd sizes (one line, never bad_alloc). ---
edit_json "$SRC/tests/data/hf-gpt2-config.json" "$TMP/hf-int8.json" "j['torch_dtype'] = 'int8'"
expect_code "HF torch_dtype int8" 1 "torch_dtype: unsupported dtype" $PW estimate --model "$TMP/hf-int8.json" --out "$O"
edit_json "$TMP/tiny.json" "$TMP/m-huge.json" "j.update(layers=10**6, hidden=2**14, heads=128, ffn=2**16, vocab=2**24, seq_len=2**16, max_positions=2**16)"
expect_code "absurd model sizes" 1 "too large\|more than" $PW estimate --model "$TMP/m-huge.json" --out "$O"
expect_code "estimate --seq-len 2^24" 1 "" $PW estimate --model gpt2-124m --seq-len 16777216 --cluster dgx-a100 -b 1000000 --out "$O"

# --- Non-UTF-8 names and --set values. ---
expect_code "non-UTF-8 --set value" 1 "not valid UTF-8" $PW estimate --model gpt-tiny --set $'name=\xff' --out "$O"
expect_code "non-UTF-8 --model" 1 "not valid UTF-8" $PW estimate --model $'\xffmodel' --out "$O"
expect_code "--set nan" 1 "network" $PW estimate --model gpt-tiny --set network.latency_s=nan --out "$O"
expect_code "--set 1e400" 1 "latency_s" $PW estimate --model gpt-tiny --set network.latency_s=1e400 --out "$O"
expect_code "--set nodes=2^32+1" 1 "nodes" $PW estimate --model gpt-tiny --set nodes=4294967297 --out "$O"

# --- Offload (issue 15): modes not there yet, host memory, hostile host fields, train. ---
WS="--model gpt2-124m --cluster v100-32gb-ws -b 1 -m 2"
expect_ok "offload optimizer estimate" $PW estimate $WS --offload optimizer --out "$TMP/off.json"
python3 -c "
import json
r = json.load(open('$TMP/off.json'))
assert r['plan']['offload'] == 'optimizer' and r['hosts'][0]['fits'] and r['offload']['copy_in_bytes_per_step'] > 0, r.get('hosts')" && ok || bad "offload report: plan.offload, hosts, offload section"
expect_ok "--offload chunks with d = 2" $PW estimate $WS -d 2 --ranks-per-gpu 2 --offload chunks --out "$TMP/ckd2.json"
python3 -c "
import json
r = json.load(open('$TMP/ckd2.json'))
assert len(r['offload']['ranks']) == 2 and all(x['chunks']['chunks'] > 0 for x in r['offload']['ranks']), r.get('offload')" && ok || bad "chunks d = 2 report: offload.ranks per stage"
expect_ok "--offload chunks with w = 2" $PW estimate $WS -w 2 --ranks-per-gpu 2 --offload chunks --out "$TMP/ckw2.json"
python3 -c "
import json
r = json.load(open('$TMP/ckw2.json'))
c = r['offload']['ranks'][0]['chunks']
assert len(r['offload']['ranks']) == 2 and c['replicas'] == 2 and c['collective_s'] > 0, r.get('offload')" && ok || bad "chunks w = 2 report: offload.ranks per replica, replicas, collective_s"
CK="--model gpt2-124m --cluster v100-32gb-ws -b 1 -m 1 --offload chunks"
expect_ok "offload chunks estimate" $PW estimate $CK --out "$TMP/ck.json"
python3 -c "
import json
r = json.load(open('$TMP/ck.json'))
c = r['offload']['ranks'][0]['chunks']
assert r['plan']['offload'] == 'chunks' and r['hosts'][0]['fits'] and c['chunks'] > 0, r.get('offload')" && ok || bad "chunks report: plan.offload, hosts, offload.ranks[0].chunks"
expect_code "--offload optimizer,chunks" 1 "combines with no other mode" $PW estimate --model gpt2-124m --cluster v100-32gb-ws -b 1 -m 1 --offload optimizer,chunks --out "$O"
expect_code "--chunk-size below a tensor" 1 "is smaller than tensor wte" $PW estimate $CK --chunk-size 1000000 --out "$O"
expect_code "--chunk-size without chunks" 1 "chunk_bytes: a chunk size needs offload chunks" $PW estimate $WS --chunk-size 1000000000 --out "$O"
expect_code "chunks: device below a layer's working set" 1 "is smaller than the working set of the" $PW simulate $CK --set device.memory_bytes=2e8 --out "$O"
expect_code "chunks: host memory too small" 1 "the host memory of node 0" $PW estimate --model gpt3-13b --cluster v100-32gb-ws -b 1 -m 1 --offload chunks --set host.memory_bytes=1e11 --out "$O"
expect_ok "chunks with w = 8" $PW estimate --model gpt2-124m --cluster p3.16xlarge -b 1 -m 1 -d 1 -w 8 --offload chunks --out "$TMP/ckw8.json"
expect_ok "chunks with w > 1, tied embeddings and d > 1" $PW estimate --model gpt2-124m --cluster p3.16xlarge -b 1 -m 2 -d 2 -w 4 --offload chunks --out "$TMP/ckw4d2.json"
python3 -c "
import json
r = json.load(open('$TMP/ckw4d2.json'))
assert r['estimate']['tied_s'] > 0 and r['offload']['ranks'][7]['chunks']['replicas'] == 4, r['estimate']" && ok || bad "chunks w = 4 d = 2 tied: the tied exchange and 4 replicas per stage"
expect_ok "train: chunks with w = 2, tied embeddings and d = 2" $PW train --backend cpu --model gpt-tiny --steps 2 -w 2 -d 2 -b 1 -m 2 --offload chunks --chunk-size 65536 --device-memory 3000000 --out "$TMP/ckw2d2-train.json"
expect_code "chunks with the distributed optimizer" 1 "leave distributed_optimizer off" $PW estimate --model gpt2-124m --cluster p3.16xlarge -b 1 -m 1 -d 1 -w 8 --offload chunks --distributed-optimizer --out "$O"
expect_code "schedule --offload chunks" 1 "programs need the chunk schedule" $PW schedule --offload chunks -d 1 -m 1
echo '{"format": "pipewright.plan/1", "schedule": "gpipe", "w": 1, "d": 2, "b": 1, "m": 4, "offload": "activations", "activations": ["swap"]}' > "$TMP/bad-swap.json"
expect_code "plan file: activations of the wrong length" 1 "plan: activations: has 1 entries but the plan has d = 2 stages" $PW estimate --model gpt2-124m --cluster p3.16xlarge --plan "$TMP/bad-swap.json" --out "$O"
echo '{"format": "pipewright.plan/1", "schedule": "gpipe", "w": 1, "d": 2, "b": 1, "m": 4, "offload": "activations", "activation_layers": [["swap"], ["swap"]]}' > "$TMP/bad-layers.json"
expect_code "plan file: activation_layers of the wrong length" 1 "plan: activation_layers.0.: has 1 entries but stage 0 holds 6 blocks" $PW estimate --model gpt2-124m --cluster p3.16xlarge --plan "$TMP/bad-layers.json" --out "$O"
echo '{"format": "pipewright.plan/1", "schedule": "1f1b", "w": 1, "d": 1, "b": 1, "m": 2, "offload": "activations", "activation_layers": [["swap", "recompute"]]}' > "$TMP/mixed-layers.json"
expect_ok "train: a stage mixing swap and recompute" $PW train --backend cpu --model gpt-tiny --steps 1 --plan "$TMP/mixed-layers.json" --out "$TMP/mixed-train.json"
echo '{"format": "pipewright.plan/1", "schedule": "1f1b", "w": 1, "d": 1, "b": 1, "m": 2, "offload": "activations", "activation_layers": [["swap", "recompute", "swap"]]}' > "$TMP/mixed-bad.json"
expect_code "train: activation_layers longer than the stage" 1 "plan: activation_layers.0.: has 3 entries but stage 0 holds 2 blocks" $PW train --backend cpu --model gpt-tiny --steps 1 --plan "$TMP/mixed-bad.json" --out "$O"
expect_code "--offload activations with --recompute" 1 "with activation offload each stage's recompute follows its swap/recompute choice" $PW estimate $WS --offload activations --recompute full --out "$O"
expect_ok "--offload activations with t > 1" $PW estimate --model gpt2-124m --cluster dgx-a100 --tp 2 -w 1 -d 4 --offload activations --out "$TMP/tp-activations.json"
expect_code "--offload bogus" 1 "unknown offload mode" $PW estimate $WS --offload gpu --out "$O"
echo '{"format": "pipewright.plan/1", "schedule": "1f1b", "w": 2, "d": 4, "b": 1, "m": 4, "offload": "optimizer"}' > "$TMP/offload-w2.json"
expect_code "offload with w > 1 without the distributed optimizer" 1 "plan: offload: optimizer offload with data parallelism (w = 2) shards the host optimizer over the replicas (ZeRO-Offload): it needs the distributed optimizer" $PW estimate --model gpt2-124m --cluster dgx-a100 --plan "$TMP/offload-w2.json" --out "$O"
expect_ok "optimizer offload with t > 1" $PW estimate --model gpt2-124m --cluster dgx-a100 --tp 2 -w 1 -d 4 --offload optimizer --out "$TMP/tp-optimizer.json"
expect_ok "offload chunks with interleaving: estimated" $PW estimate --model gpt2-124m --cluster dgx-a100 --tp 2 -w 2 -d 2 -v 2 --schedule interleaved --offload chunks --out "$TMP/ileave.json"
expect_ok "train --offload chunks with interleaving, tied, d = 1" $PW train --backend cpu --model gpt-tiny --steps 1 --schedule interleaved -d 1 -v 2 -m 2 -b 1 --offload chunks --device-memory 4000000 --out "$TMP/il-tied-d1.json"
expect_ok "offload chunks with t > 1 and w > 1" $PW estimate --model gpt2-124m --cluster dgx-a100 --tp 2 -w 2 -d 2 --offload chunks --out "$TMP/tp-dp-chunks.json"
expect_code "offload: host memory too small" 1 "host memory of node 0: offload needs .*(short by" $PW estimate $WS --offload optimizer --set host.memory_bytes=1e9 --out "$O"
expect_code "offload: simulate, host memory too small" 1 "host memory of node 0" $PW simulate $WS --offload optimizer --set host.memory_bytes=1e9 --out "$O"
expect_code "offload: no CPU Adam rate" 1 "needs the host's CPU Adam rate" $PW estimate --model gpt2-124m --cluster h100-x1 --offload optimizer --out "$O"
expect_code "host memory negative" 1 "/host/memory_bytes" $PW estimate $WS --set host.memory_bytes=-1 --out "$O"
expect_code "host memory 1e300" 1 "/host/memory_bytes" $PW estimate $WS --set host.memory_bytes=1e300 --out "$O"
expect_code "pinned above host memory" 1 "/host/pinned_memory_bytes: .* is more than memory_bytes" $PW estimate $WS --set host.pinned_memory_bytes=1e12 --out "$O"
expect_code "cpu cores -1" 1 "/host/cpu_cores" $PW estimate $WS --set host.cpu_cores=-1 --out "$O"
expect_code "gpus_per_uplink 3 of 8" 1 "/host/gpus_per_uplink: must divide" $PW estimate --model gpt2-124m --cluster dgx-a100 --set host.gpus_per_uplink=3 --out "$O"
expect_code "pcie3 at 64 GB/s" 1 "more than a pcie3 link" $PW estimate $WS --set host.pcie_bandwidth_bytes_per_s=64e9 --out "$O"
expect_code "train --offload optimizer, tied ends on one stage" 1 "needs the tied embedding and LM head on different stages" $PW train --backend cpu --model gpt-tiny --steps 1 -d 1 -m 2 -b 1 --offload optimizer --out "$O"
expect_code "train --offload optimizer, w > 1, tied ends in two chunks of one device" 1 "plan: offload: the executor's sharded optimizer offload (w = 2) needs the tied embedding and LM head on one chunk or on different stages (here d = 1, v = 2)" $PW train --backend cpu --model gpt-tiny --steps 1 --schedule interleaved -w 2 -d 1 -v 2 -m 2 -b 1 --offload optimizer --out "$O"
expect_code "train --device-memory too small" 1 "rank 0: --device-memory 1000 B: weights of .* do not fit .*short by" $PW train --backend cpu --model gpt-tiny --steps 1 -d 2 -m 2 -b 1 --offload optimizer,activations --device-memory 1000 --out "$O"
expect_code "train --device-memory just short" 1 "rank 0: --device-memory .* do not fit .*short by" $PW train --backend cpu --model gpt-tiny --steps 2 -d 2 -m 4 -b 2 --offload optimizer,activations --device-memory 2300000 --out "$O"
expect_code "train --device-memory -5" 2 "device-memory" $PW train --backend cpu --model gpt-tiny --steps 1 -d 2 -m 2 --device-memory -5 --out "$O"
TC="train --backend cpu --model gpt-tiny -d 1 -b 1 --offload chunks"
expect_code "train --offload chunks without --device-memory" 1 "offload chunks needs --device-memory BYTES" $PW $TC -m 1 --steps 1 --chunk-size 65536 --out "$O"
expect_code "train --offload chunks: device below a layer's working set" 1 "offload chunks: the device's 1.43 MiB is smaller than the working set of the forward of block 1 (6 chunks of 128.00 KiB = 768.00 KiB, non-model memory 786.25 KiB) by 89.41 KiB" $PW $TC -m 1 --steps 1 --chunk-size 65536 --device-memory 1500000 --out "$O"
expect_code "train --offload chunks: device below a given chunk, a smaller one offered" 1 "working set of the forward of head (1 chunk of 512.00 MiB = 512.00 MiB, non-model memory 867.25 KiB) by 510.94 MiB; a chunk size of 512.00 KiB (524288 B: --chunk-size, or the plan.s chunk_bytes) lets every working set fit" $PW $TC -m 1 --steps 1 --chunk-size 268435456 --device-memory 2000000 --out "$O"
expect_ok "train --offload chunks: no chunk size, the largest halving of the default that fits" $PW $TC -m 1 --steps 1 --device-memory 2000000 --out "$TMP/ck.json"
chunk=$(python3 -c "import json; print(json.load(open('$TMP/ck.json'))['plan']['chunk_bytes'])")
if [ "$chunk" = 524288 ]; then ok; else bad "the report's plan has chunk_bytes $chunk, not the 524288 the run took"; fi
expect_code "train --offload chunks: chunk below a tensor" 1 "chunk size 65532 B (16383 elements of 4 B) is smaller than tensor wte (16384 elements, 65536 B) by 4 B; use --chunk-size 65536 or more" $PW $TC -m 1 --steps 1 --chunk-size 65532 --device-memory 4000000 --out "$O"
expect_code "train --offload chunks -d 2: a stage's device below a layer's working set" 1 "offload chunks: stage 0: the device's 976.56 KiB is smaller than the working set of the forward of block 0 (7 chunks of 128.00 KiB = 896.00 KiB, non-model memory 802.50 KiB) by 721.94 KiB" $PW train --backend cpu --model gpt-tiny -d 2 -b 1 -m 2 --steps 1 --offload chunks --chunk-size 65536 --device-memory 1000000 --out "$O"
# A refused run prints its one error line and nothing on stdout (not the run's line first).
if [ -s "$TMP/out" ]; then bad "refused train printed on stdout: $(head -c 300 "$TMP/out")"; else ok; fi
expect_code "train --offload chunks --optimizer sgd" 1 "offload chunks runs AdamW" $PW $TC -m 1 --steps 1 --chunk-size 65536 --optimizer sgd --device-memory 4000000 --out "$O"
expect_ok "train --offload chunks" $PW $TC -m 1 --steps 2 --chunk-size 65536 --device-memory 2000000 --out "$TMP/tc.json"
python3 -c "
import json
r = json.load(open('$TMP/tc.json'))
o = r['offload']
assert r['plan']['offload'] == 'chunks' and o['copy_in_bytes_per_step'] > 0 and r['devices'][0]['peak_memory_bytes'] <= 2000000, o" && ok || bad "train chunks report: plan.offload, offload bytes, peak inside the budget"

# Sharded chunks (--chunk-shard): the refusals, and a run that moves less than whole chunks.
expect_code "--chunk-shard with w = 1" 1 "chunk_shard: sharded chunks split each chunk over the w replicas: needs w > 1, found w = 1" $PW $TC -m 1 --steps 1 --chunk-shard --device-memory 2000000 --out "$O"
expect_code "--chunk-shard without offload chunks" 1 "chunk_shard: sharded chunks need offload chunks" $PW estimate $WS -w 2 --ranks-per-gpu 2 --chunk-shard --out "$O"
# Block recompute: the CPU executor runs it (with SP, and with the chunk manager too).
expect_ok "train --recompute block" $PW train --backend cpu --model gpt-tiny -d 2 --steps 2 --recompute block --out "$TMP/block.json"
expect_ok "train --recompute block --sp" $PW train --backend cpu --model gpt-tiny --tp 2 --sp --steps 1 --recompute block --out "$TMP/blocksp.json"
expect_ok "train --offload chunks --recompute block" $PW $TC -m 2 --steps 2 --recompute block --device-memory 1700000 --out "$TMP/tcb.json"
python3 -c "
import json; r = json.load(open('$TMP/tcb.json'))
assert r['plan']['recompute'] == ['block'] and r['offload']['copy_in_bytes_per_step'] > 0 and r['devices'][0]['peak_memory_bytes'] <= 1700000, r['plan']" && ok || bad "train chunks + block report: plan.recompute, offload bytes, peak inside the budget"
expect_code "--recompute blocks" 1 "unknown recompute mode \"blocks\" (expected none, selective, full or block)" $PW estimate $WS --recompute blocks --out "$O"
TW="train --backend cpu --model gpt-tiny -w 2 -d 1 -b 1 -m 2 --steps 2 --offload chunks --chunk-size 65536 --device-memory 1700000"
expect_ok "train --offload chunks -w 2" $PW $TW --out "$TMP/tw.json"
expect_ok "train --offload chunks -w 2 --chunk-shard" $PW $TW --chunk-shard --out "$TMP/tws.json"
python3 -c "
import json
a, b = json.load(open('$TMP/tw.json')), json.load(open('$TMP/tws.json'))
assert b['plan']['chunk_shard'] is True and 'chunk_shard' not in a['plan'], (a['plan'], b['plan'])
assert a['losses'] == b['losses'], (a['losses'], b['losses'])
for k in ('copy_in_bytes_per_step', 'copy_out_bytes_per_step'):
    assert 0 < b['offload'][k] < a['offload'][k], (k, a['offload'][k], b['offload'][k])" && ok || bad "train --chunk-shard: plan.chunk_shard, the same losses, fewer bytes moved than whole chunks"
expect_ok "train --offload chunks -w 2 --schedule 2bw" $PW $TW --schedule 2bw --out "$TMP/tw2.json"
expect_ok "train --offload chunks -w 2 --schedule 2bw --chunk-shard" $PW $TW --schedule 2bw --chunk-shard --out "$TMP/tws2.json"
python3 -c "
import json
a, b = json.load(open('$TMP/tw2.json')), json.load(open('$TMP/tws2.json'))
assert b['plan']['chunk_shard'] is True and b['plan']['schedule'] == '2bw', b['plan']
assert a['losses'] == b['losses'], (a['losses'], b['losses'])
for k in ('copy_in_bytes_per_step', 'copy_out_bytes_per_step'):
    assert 0 < b['offload'][k] < a['offload'][k], (k, a['offload'][k], b['offload'][k])" && ok || bad "train --chunk-shard -s 2bw: the same losses as whole chunks, fewer bytes moved"

finish "bad-input CLI tests"
