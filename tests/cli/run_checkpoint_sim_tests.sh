#!/usr/bin/env bash
# Command-line tests of issue 13's checkpoint and simulator-child parts, on the real binary:
# damaged checkpoints found and skipped with one warning line, a finished run's report written
# again from its final checkpoint, wrong JSON types named, old checkpoints refused; inputs that
# would make SimGrid abort refused before it starts, in one line.
# Usage: run_checkpoint_sim_tests.sh PATH/TO/pipewright SOURCE_DIR
set -u
source "$(dirname "$0")/harness.sh"

# expect_error NAME PATTERN OUTFILE CMD...: exit 1, one stderr line matching PATTERN, OUTFILE (if
# not -) absent afterwards (harness.sh's expect_fail).
expect_error() { local name=$1; shift; expect_fail "$name" 1 "$@"; }

# flip FILE OFFSET (negative: from the end): flips bit 3 of that byte.
flip() {
  python3 - "$1" "$2" <<'EOF'
import sys
path, at = sys.argv[1], int(sys.argv[2])
b = bytearray(open(path, 'rb').read())
b[at] ^= 8
open(path, 'wb').write(bytes(b))
EOF
}

# ---- checkpoints ------------------------------------------------------------------------------
CK="$TMP/ck"
TRAIN="$PW train --model gpt-tiny --schedule 2bw -d 2 -m 4 --checkpoint-every 2"
expect_ok "reference run" $TRAIN --steps 6 --checkpoint-dir "$CK/ref"
same_as_ref() { for f in "$CK/ref/step-00000006"/*.bin; do cmp -s "$f" "$1/step-00000006/$(basename "$f")" || return 1; done; }

# A finished run's report, written again from its final checkpoint: equal to the one it wrote.
expect_ok "finished run with a report" $TRAIN --steps 4 --checkpoint-dir "$CK/done" --out "$TMP/r1.json"
expect_ok "resume a finished run" $TRAIN --steps 4 --checkpoint-dir "$CK/done" --resume --out "$TMP/r2.json"
grep -q "final checkpoint of a finished run" "$TMP/out" && ! grep -q "^step " "$TMP/out" && ok || bad "resume of a finished run says so and runs nothing: $(cat "$TMP/out")"
cmp -s "$TMP/r1.json" "$TMP/r2.json" && ok || bad "the report written again equals the run's"
# Killed after the last checkpoint, before --out: the same as a run without --out.
expect_ok "finished run, report lost" $TRAIN --steps 4 --checkpoint-dir "$CK/lost"
expect_ok "report written from the final checkpoint" $TRAIN --steps 4 --checkpoint-dir "$CK/lost" --resume --out "$TMP/r3.json"
python3 -c "
import json; d = json.load(open('$TMP/r3.json'))
assert d['source'] == 'measured' and len(d['losses']) == 4 and d['iteration_time_s'] > 0
" && ok || bad "report from the final checkpoint"
expect_ok "--timeline of a finished run" $TRAIN --steps 4 --checkpoint-dir "$CK/lost" --resume --timeline "$TMP/t.json"
[ ! -e "$TMP/t.json" ] && grep -q "keeps no timeline" "$TMP/err" && [ "$(wc -l <"$TMP/err")" -eq 1 ] && ok || bad "--timeline of a finished run: one warning, no file"
expect_error "resume past a mid-run checkpoint" "nothing to run" "$O" $TRAIN --steps 2 --checkpoint-dir "$CK/done" --resume --out "$O"

# The newest checkpoint damaged: one warning line, the older one used, bit-identical at the end.
for victim in rank-00001.bin:-100 rank-00000.bin:30 manifest.json:-60; do
  file=${victim%%:*} at=${victim##*:}
  dir="$CK/dmg-$file"
  expect_ok "run to step 4 ($file)" $TRAIN --steps 4 --checkpoint-dir "$dir"
  flip "$dir/step-00000004/$file" "$at"
  expect_ok "resume past a damaged $file" $TRAIN --steps 6 --checkpoint-dir "$dir" --resume --out "$TMP/r4.json"
  [ "$(wc -l <"$TMP/err")" -eq 1 ] && grep -q "^warning: .*step-00000004/$file: damaged: .*resuming from .*step-00000002$" "$TMP/err" && ok || bad "damaged $file: one warning line: $(cat "$TMP/err")"
  grep -q "resuming from .*step-00000002 (step 2)" "$TMP/out" && [ -d "$dir/step-00000004.damaged" ] && ok || bad "damaged $file: resumed from step 2, kept the damaged one"
  same_as_ref "$dir" && ok || bad "damaged $file: resumed run is bit-identical"
done

# Wrong JSON types under an intact checksum (an edited, re-summed manifest): named, then skipped.
expect_ok "run to step 2" $TRAIN --steps 2 --checkpoint-dir "$CK/types"
python3 - "$CK/types/step-00000002/manifest.json" <<'EOF'
import sys, zlib
path = sys.argv[1]
text = open(path).read()
body = text[:text.rindex(',\n  "crc32"')].replace('"ranks": 2', '"ranks": "two"', 1)
open(path, 'w').write(body + ',\n  "crc32": "%08x"\n}\n' % zlib.crc32(body.encode()))
EOF
expect_ok "resume past a manifest of wrong types" $TRAIN --steps 4 --checkpoint-dir "$CK/types" --resume
grep -q "manifest.json: /ranks: expected a number, found string" "$TMP/err" && [ "$(wc -l <"$TMP/err")" -eq 1 ] && ok || bad "wrong type named: $(cat "$TMP/err")"

# A format-1 checkpoint (no checksums): refused in one line.
mkdir -p "$CK/old/step-00000002"
echo '{"format": "pipewright.checkpoint/1", "step": 2, "ranks": 2, "run": {}}' >"$CK/old/step-00000002/manifest.json"
expect_error "format-1 checkpoint" "older format (pipewright.checkpoint/1" "$O" $TRAIN --steps 4 --checkpoint-dir "$CK/old" --resume --out "$O"

# ---- the simulator child ----------------------------------------------------------------------
python3 - "$TMP" <<'EOF'
import json, sys
tmp = sys.argv[1]
model = {"format": "pipewright.model/1", "name": "gpt-huge", "arch": "gpt", "layers": 4,
         "hidden": 1000000000, "heads": 8, "seq_len": 64, "vocab": 256, "dtype": "fp16"}
json.dump(model, open(tmp + "/huge.json", "w"))
EOF
SIM="$PW simulate --model gpt-tiny --cluster dgx-a100:2 -w 8 -d 2 -m 2 -b 2 --schedule 1f1b"
expect_error "hidden 1e9" "huge.json: /hidden" "$O" $PW simulate --model "$TMP/huge.json" --cluster dgx-a100:2 -w 8 -d 2 -m 2 -b 2 --out "$O"
expect_error "network latency 1e308" "network.latency_s = 1e+308" "$O" $SIM --set network.latency_s=1e308 --out "$O"
expect_error "intra-node latency 1e308" "intra_node.latency_s = 1e+308" "$O" $SIM --set intra_node.latency_s=1e308 --out "$O"
expect_error "device peak flops 1e-300" "outside 0 to 1e+09 s" "$O" $SIM --set device.peak_fp32_flops_per_s=1e-300 --out "$O"
expect_error "bandwidth 1e-300" "network.bandwidth_bytes_per_s" "$O" $SIM --set network.bandwidth_bytes_per_s=1e-300 --out "$O"
expect_error "plan: latency 1e308" "network.latency_s = 1e+308" "$O" $PW plan --model gpt-tiny --cluster dgx-a100:2 -B 32 --set network.latency_s=1e308 --out "$O"

finish
