#!/usr/bin/env bash
# scripts/netns-cluster.sh: an emulated 2-node cluster (network namespaces, tc-shaped veth links);
# an mpirun job across it gives the threaded run's losses, the cluster JSON it writes loads, and
# every namespace it made is gone afterwards, also when the command fails.
# Usage: run_netns_test.sh PIPEWRIGHT SOURCE_DIR. Exit 77 (skipped, with the reason) where the
# kernel or the user cannot make namespaces, or mpirun / MPI is missing.
set -u
PW=$(realpath "$1")
SRC=$2
MODEL="$SRC/tests/data/gpt-micro-4l.json"
SCRIPT="$SRC/scripts/netns-cluster.sh"
command -v mpirun >/dev/null 2>&1 || { echo "SKIP: mpirun not found"; exit 77; }
ldd "$PW" 2>/dev/null | grep -q libmpi || { echo "SKIP: $PW was built without MPI"; exit 77; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
count_ns() { ip netns list 2>/dev/null | grep -c '^pw[0-9]' ; }
before=$(count_ns)

# Leak checking off in the sanitized tree: Open MPI leaks at exit (see run_mpi_tests.sh).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
PLAN=(--model "$MODEL" --schedule 1f1b -d 2 -m 4 -b 2 --steps 2)
"$PW" train "${PLAN[@]}" --out "$TMP/threads.json" >/dev/null 2>&1 || { echo "FAIL: threaded run"; exit 1; }
bash "$SCRIPT" --nodes 2 --rate 50mbit --cluster-out "$TMP/cluster.json" -- \
  bash -c "\$PW_MPIRUN -x ASAN_OPTIONS -np 2 $PW train ${PLAN[*]} --out $TMP/netns.json" >"$TMP/out" 2>&1
rc=$?
cat "$TMP/out"
[ "$rc" -eq 77 ] && exit 77
[ "$rc" -eq 0 ] || { echo "FAIL: the run across the namespaces exited $rc"; exit 1; }
python3 - "$TMP/threads.json" "$TMP/netns.json" <<'PY' || exit 1
import re, sys
l = [re.search(r'"losses":\s*\[([^\]]*)\]', open(p).read()).group(1).split(',') for p in sys.argv[1:]]
if [x.strip() for x in l[0]] != [x.strip() for x in l[1]]: sys.exit(f"FAIL: losses differ {l}")
print("ok: losses across the namespaces bit-identical to the threaded run")
PY
"$PW" simulate --model "$MODEL" --cluster "$TMP/cluster.json" --schedule 1f1b -d 2 -m 4 -b 2 \
  >/dev/null 2>"$TMP/err" || { echo "FAIL: the cluster JSON: $(cat "$TMP/err")"; exit 1; }
[ "$(count_ns)" -eq "$before" ] || { echo "FAIL: namespaces left behind: $(ip netns list)"; exit 1; }

# A failing command: its exit status comes back and the namespaces still go.
bash "$SCRIPT" --nodes 3 --rate 10mbit -- bash -c 'exit 3' >/dev/null 2>&1
rc=$?
[ "$rc" -eq 3 ] || { echo "FAIL: a failing command's status: $rc, not 3"; exit 1; }
[ "$(count_ns)" -eq "$before" ] || { echo "FAIL: namespaces left after a failure: $(ip netns list)"; exit 1; }
echo "ok: namespaces cleaned up after success and failure"
