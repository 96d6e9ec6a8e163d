#!/usr/bin/env bash
# validate, the protocol of docs/performance.md: several plans, R rounds, the plans taking turns,
# each run started when the machine is quiet (or after --max-wait), then a table of the medians.
#
# Usage: scripts/validate-rounds.sh [--rounds 5] [--quiet-load 0.3] [--max-wait 60] \
#          [--dir DIR] PLANS-FILE
# PLANS-FILE: one plan per line, `NAME<TAB>COMMAND`; COMMAND runs with bash -c and must write its
# validation report to "$OUT" (e.g. `build/pipewright validate -d 2 --out "$OUT"`). Blank lines
# and lines starting with # are skipped. Writes DIR/NAME-ROUND.json (DIR: a new temporary
# directory unless given) and prints, per plan: the error of each run, the median error, the
# measured and predicted step time (medians and ranges) and the median load other processes put
# on the machine while it trained (validate's `machine.other_load`).
set -euo pipefail

ROUNDS=5
QUIET=0.3
MAX_WAIT=60
DIR=""
while (($#)); do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --quiet-load) QUIET=$2; shift 2 ;;
    --max-wait) MAX_WAIT=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "validate-rounds: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
(($# == 1)) || { echo "validate-rounds: one PLANS-FILE expected (see --help)" >&2; exit 2; }
PLANS=$1
[ -r "$PLANS" ] || { echo "validate-rounds: $PLANS: cannot read" >&2; exit 2; }
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "validate-rounds: --rounds $ROUNDS: a count" >&2; exit 2; }
[ -n "$DIR" ] || DIR=$(mktemp -d /tmp/validate-rounds.XXXXXX)
mkdir -p "$DIR"

mapfile -t LINES < <(grep -v '^\s*\(#\|$\)' "$PLANS")
((${#LINES[@]} > 0)) || { echo "validate-rounds: $PLANS: no plans" >&2; exit 2; }

# Waits until the 1-minute load average is below QUIET and the last 2 s were >= 95% idle, or
# MAX_WAIT seconds have passed.
wait_quiet() {
  local start=$SECONDS
  while ((SECONDS - start < MAX_WAIT)); do
    local a b
    a=($(head -1 /proc/stat)); sleep 2; b=($(head -1 /proc/stat))
    local idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) total=0 i
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    local load; load=$(cut -d' ' -f1 /proc/loadavg)
    if ((total > 0 && idle * 100 >= 95 * total)) && awk "BEGIN{exit !($load < $QUIET)}"; then
      return 0
    fi
  done
  echo "  (machine not quiet after ${MAX_WAIT}s: load $(cut -d' ' -f1-3 /proc/loadavg); running anyway)"
}

for ((round = 1; round <= ROUNDS; ++round)); do
  for line in "${LINES[@]}"; do
    name=${line%%$'\t'*}
    cmd=${line#*$'\t'}
    wait_quiet
    echo "round $round/$ROUNDS: $name (load $(cut -d' ' -f1 /proc/loadavg))"
    OUT="$DIR/$name-$round.json" bash -c "$cmd" > "$DIR/$name-$round.log" 2>&1 ||
      { echo "validate-rounds: $name round $round failed: $(tail -1 "$DIR/$name-$round.log")" >&2; exit 1; }
  done
done

python3 - "$DIR" "$ROUNDS" "${LINES[@]}" <<'PY'
import json, statistics, sys
directory, rounds, lines = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print(f"\n{rounds} rounds; files in {directory}")
print(f"{'plan':<28} {'errors per run':<40} {'median':>8} {'predicted (ms)':>20} {'measured (ms)':>20} {'others':>7}")
for line in lines:
    name = line.split("\t", 1)[0]
    runs = [json.load(open(f"{directory}/{name}-{r}.json")) for r in range(1, rounds + 1)]
    err = [100 * v["iteration_time_s"]["error"] for v in runs]
    pred = [1e3 * v["iteration_time_s"]["predicted"] for v in runs]
    meas = [1e3 * v["iteration_time_s"]["measured"] for v in runs]
    loads = [v["machine"].get("other_load", {}).get("train") for v in runs]
    others = [100 * l["others"] for l in loads if l]
    span = lambda x: f"{statistics.median(x):.1f} ({min(x):.1f}-{max(x):.1f})"
    print(f"{name:<28} {', '.join(f'{e:+.1f}' for e in err):<40} {statistics.median(err):>+7.1f}% "
          f"{span(pred):>20} {span(meas):>20} "
          f"{(f'{statistics.median(others):.0f}%' if others else 'n/a'):>7}")
PY
