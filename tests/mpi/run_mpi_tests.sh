#!/usr/bin/env bash
# `mpirun -np N pipewright train --backend cpu`: one rank per process over MPI.
# Usage:
#   run_mpi_tests.sh PIPEWRIGHT SOURCE_DIR identity NP PLAN-ARGS...
#       the mpirun job's losses equal the threaded run's of the same plan, bit for bit (the JSON
#       numbers of both reports compared as text), so do the final checkpoint's shards (byte for
#       byte), and rank 0's report and timeline hold every rank
#   run_mpi_tests.sh PIPEWRIGHT SOURCE_DIR fault kill|hang
#       rank 1 dies (SIGKILL) or stops answering mid-run: the job ends non-zero within the timeout;
#       a killed rank is named by mpirun ("process rank 1 ... exited on signal 9") and the others
#       say in one line that mpirun ended them and what they waited for; a hung one is named by
#       pipewright's one-line error ("rank R: OP timed out after 5s (--comm-timeout): rank P is
#       dead or hung") on each rank that gave up before rank 0's MPI_Abort ended the job
#   run_mpi_tests.sh PIPEWRIGHT SOURCE_DIR validate
#       `mpirun -np 2 pipewright validate` runs and writes a report with the MPI link as network
#   run_mpi_tests.sh PIPEWRIGHT SOURCE_DIR progress CHECK on|off
#       tests/mpi/progress_check.cpp under mpirun -np 2 over TCP: with the progress thread a large
#       message moves while its sender makes no MPI call; without it, it does not
# Exit 77 (ctest SKIP_RETURN_CODE) with the reason where mpirun or an MPI build is missing.
set -u
PW=$1
SRC=$2
MODE=$3
shift 3
MODEL="$SRC/tests/data/gpt-micro-4l.json"

if ! command -v mpirun >/dev/null 2>&1; then
  echo "SKIP: mpirun not found (Debian: apt-get install openmpi-bin libopenmpi-dev)"
  exit 77
fi
if ! ldd "$PW" 2>/dev/null | grep -q libmpi; then
  echo "SKIP: $PW was built without MPI (libopenmpi-dev missing at configure time)"
  exit 77
fi
# Open MPI refuses to start as root without these (containers, CI); harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# This machine may have fewer cores than ranks; no InfiniBand/shared-memory probing noise.
# In the sanitized tree (scripts/sanitize.sh): Open MPI 4.1 leaks at exit in components it
# dlopens and unloads at MPI_Finalize, which LeakSanitizer cannot attribute or suppress by name;
# leak checking is off for these processes (ASan's memory checks and UBSan stay on).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
MPIRUN=(mpirun --oversubscribe --mca btl self,vader,tcp -x ASAN_OPTIONS)

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

case "$MODE" in
  identity)
    NP=$1
    shift
    "$PW" train --model "$MODEL" "$@" --out "$TMP/threads.json" \
      --checkpoint-dir "$TMP/ckpt-threads" >"$TMP/threads.out" 2>&1 ||
      { echo "FAIL: threaded run: $(tail -3 "$TMP/threads.out")"; exit 1; }
    "${MPIRUN[@]}" -np "$NP" "$PW" train --model "$MODEL" "$@" --out "$TMP/mpi.json" \
      --timeline "$TMP/mpi-tl.json" --checkpoint-dir "$TMP/ckpt-mpi" >"$TMP/mpi.out" \
      2>"$TMP/mpi.err" || { echo "FAIL: mpirun -np $NP: $(tail -5 "$TMP/mpi.err")"; exit 1; }
    cat "$TMP/mpi.out"
    # The final checkpoint's shards (every rank's weights and optimizer state, the distributed
    # optimizer's shards included) equal the threaded run's byte for byte.
    final=$(cd "$TMP/ckpt-threads" && ls -d step-* | sort | tail -1)
    for shard in "$TMP/ckpt-threads/$final"/rank-*.bin; do
      cmp -s "$shard" "$TMP/ckpt-mpi/$final/$(basename "$shard")" ||
        { echo "FAIL: $final/$(basename "$shard") differs between the threaded and mpirun runs"; exit 1; }
    done
    echo "ok: the shards of $final are byte-identical to the threaded run's"
    python3 - "$TMP/threads.json" "$TMP/mpi.json" "$TMP/mpi-tl.json" "$NP" <<'EOF' || exit 1
import json, re, sys
threads, mpi, timeline, np = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def losses(path):
    # The numbers as written (shortest round-trip text of the double): equal text, equal bits.
    text = open(path).read()
    return re.search(r'"losses":\s*\[([^\]]*)\]', text).group(1).split(',')
a, b = losses(threads), losses(mpi)
if [x.strip() for x in a] != [x.strip() for x in b]:
    sys.exit(f"FAIL: losses differ: threads {a} vs mpirun {b}")
d = json.load(open(mpi))
assert len(d['devices']) == np, d['devices']
assert all(x['peak_memory_bytes'] > 0 and x['busy_s'] > 0 for x in d['devices'])
if 'offload' in d:  # the copy engines moved the threaded run's bytes
    o = json.load(open(threads))['offload']
    for key in ('copy_out_bytes_per_step', 'copy_in_bytes_per_step', 'activation_bytes_per_step'):
        assert d['offload'][key] == o[key], (key, d['offload'][key], o[key])
    print(f"ok: offload moved {o['copy_out_bytes_per_step']} B out and "
          f"{o['copy_in_bytes_per_step']} B in per step in both runs")
t = json.load(open(timeline))
pids = {e['pid'] for e in t['traceEvents'] if e['ph'] == 'X'}
assert pids == set(range(np)), f"timeline ranks {pids}"
print(f"ok: {len(a)} losses bit-identical to the threaded run: {[x.strip() for x in b]}")
EOF
    ;;
  fault)
    ACTION=$1
    TIMEOUT=5
    start=$(date +%s.%N)
    # Rank 1 fails before op 12 of its program (mid-way through the first step).
    PW_TEST_FAULT="1:12:$ACTION" timeout 120 "${MPIRUN[@]}" -x PW_TEST_FAULT -np 4 "$PW" train \
      --model "$MODEL" --schedule 1f1b -w 2 -d 2 -m 4 --steps 3 --comm-timeout $TIMEOUT \
      >"$TMP/out" 2>"$TMP/err"
    rc=$?
    elapsed=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
    echo "mpirun exit $rc after ${elapsed}s; stderr:"
    cat "$TMP/err"
    [ "$rc" -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
    [ "$rc" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout 120)"; exit 1; }
    python3 -c "import sys; sys.exit(0 if $elapsed < $TIMEOUT + 25 else 1)" ||
      { echo "FAIL: the job took ${elapsed}s, more than the ${TIMEOUT}s timeout + 25s"; exit 1; }
    # pipewright's own errors are one line each.
    errors=$(grep -c "^pipewright: error: " "$TMP/err")
    if [ "$ACTION" = kill ]; then
      # mpirun notices the death first (before any --comm-timeout) and says which rank it was.
      grep -q "process rank 1 .*exited on signal 9" "$TMP/err" ||
        { echo "FAIL: mpirun did not name the killed rank 1"; exit 1; }
      # The ranks mpirun ends (SIGTERM) say so in one line each, with what they waited for.
      grep -Eq "^pipewright: error: rank [023]: ended by mpirun \(SIGTERM\)( while waiting to .+)?: another rank of the job died, failed or was interrupted first$" "$TMP/err" ||
        { echo "FAIL: no one-line 'ended by mpirun' error from a surviving rank"; exit 1; }
    fi
    if [ "$ACTION" = hang ]; then
      # The first rank to give up names the op and the peer it waited for (rank 1, or a rank
      # waiting for rank 1 in turn); its MPI_Abort ends the others.
      grep -Eq "^pipewright: error: rank [0-9]+: .+ timed out after ${TIMEOUT}s \(--comm-timeout\): rank [0-9]+ is dead or hung$" "$TMP/err" ||
        { echo "FAIL: no one-line timeout error naming the rank and op"; exit 1; }
    fi
    echo "ok: ended in ${elapsed}s with $errors pipewright error line(s)"
    ;;
  progress)
    # The MPI transport's progress thread (exec/mpi/transport.hpp, "Progress"): over TCP only (the
    # shared-memory BTL's single copy needs no sender progress), 4 MiB reaches rank 1 while rank 0
    # makes no MPI call (on), and does not without the thread (off: the check can fail).
    CHECK=$1 SWITCH=$2
    "${MPIRUN[@]/vader,/}" -np 2 "$CHECK" "$TMP" "$SWITCH" >"$TMP/out" 2>"$TMP/err"
    rc=$?
    cat "$TMP/out"
    ((rc == 0)) || { echo "FAIL: mpirun exited $rc: $(tail -3 "$TMP/err")"; exit 1; }
    grep -q "^ok: progress $SWITCH" "$TMP/out" || { echo "FAIL: no ok line"; exit 1; }
    ;;
  validate)
    # validate under mpirun: rank 0 profiles, ranks 0 and 1 ping-pong over MPI, rank 0 simulates
    # on N one-core nodes joined by that link, every rank trains, rank 0 compares and writes.
    "${MPIRUN[@]}" -np 2 "$PW" validate --model "$MODEL" --schedule 1f1b -d 2 -m 4 -b 2 --steps 3 \
      --repeats 3 --round-trips 20 --blocks 2 --out "$TMP/v.json" >"$TMP/out" 2>"$TMP/err" ||
      { echo "FAIL: mpirun validate: $(tail -5 "$TMP/err")"; exit 1; }
    cat "$TMP/out"
    python3 - "$TMP/v.json" <<'EOF' || exit 1
import json, sys
v = json.load(open(sys.argv[1]))
m = v['machine']
assert m['transport']['kind'] == 'MPI (ranks 0 and 1)' and m['processes'] == 2, m
c = m['cluster']
assert c['nodes'] == 2 and c['gpus_per_node'] == 1 and c['network']['bandwidth_bytes_per_s'] > 0, c
# Rank 0's send calls, one median per probed size, and their fit as the network's send overhead
# (written when not zero; a send always holds its rank a little).
t = m['transport']
assert [s['bytes'] for s in t['send_samples']] == [s['bytes'] for s in t['samples']], t
assert all(s['send_s'] > 0 for s in t['send_samples']), t
assert t['send_overhead_s'] >= 0 and t['send_overhead_bytes_per_s'] >= 0, t
assert t['send_overhead_s'] > 0 or t['send_overhead_bytes_per_s'] > 0, t
assert c['network']['send_overhead_s'] == t['send_overhead_s'], c
assert c['network']['send_overhead_bytes_per_s'] == t['send_overhead_bytes_per_s'], c
assert len(v['devices']) == 2
# Two blocks of 3 steps, every rank taking part in both: 3 steps, then 2 after the second's first.
assert m['blocks'] == 2 and len(v['measured']['step_times_s']) == 5, v['measured']
# Both ranks' CPU time is the job's: what is left of the host's busy time is others'.
for phase in ('profile', 'train'):
    l = m['other_load'][phase]
    assert l is None or (0 <= l['others'] <= 1 and l['host'] and l['wall_s'] > 0), l
print("ok: validate over 2 processes")
EOF
    # Tensor parallelism: one process per TP rank, the TP group a node of t one-core devices
    # whose own link is the MPI link (the TP collectives take it).
    "${MPIRUN[@]}" -np 2 "$PW" validate --model "$MODEL" --tp 2 -d 1 -m 2 -b 2 --steps 3 \
      --repeats 3 --round-trips 20 --out "$TMP/tp.json" >"$TMP/out" 2>"$TMP/err" ||
      { echo "FAIL: mpirun validate --tp 2: $(tail -5 "$TMP/err")"; exit 1; }
    python3 - "$TMP/tp.json" <<'EOF' || exit 1
import json, sys
v = json.load(open(sys.argv[1]))
c = v['machine']['cluster']
t = v['machine']['transport']
assert v['plan']['t'] == 2 and c['nodes'] == 1 and c['gpus_per_node'] == 2, c
assert c['intra_node']['bandwidth_bytes_per_s'] == t['bandwidth_bytes_per_s'], c
assert len(v['devices']) == 2 and v['measured']['step_times_s'], v['measured']
print("ok: validate --tp 2 over 2 processes")
EOF
    # A world that is not t*w*d processes: one line, exit 1, no report.
    if "${MPIRUN[@]}" -np 3 "$PW" validate --model "$MODEL" --tp 2 --steps 2 --out "$TMP/tp3.json" \
      >"$TMP/out" 2>"$TMP/err"; then
      echo "FAIL: mpirun -np 3 validate --tp 2 succeeded"; exit 1
    fi
    grep -q "3 processes" "$TMP/err" || grep -q "world" "$TMP/err" ||
      { echo "FAIL: mpirun -np 3 validate --tp 2: $(tail -3 "$TMP/err")"; exit 1; }
    [ ! -e "$TMP/tp3.json" ] || { echo "FAIL: mpirun -np 3 validate --tp 2 wrote a report"; exit 1; }
    echo "ok: validate --tp 2 on 3 processes is refused"
    ;;
  *)
    echo "unknown mode $MODE"
    exit 2
    ;;
esac
