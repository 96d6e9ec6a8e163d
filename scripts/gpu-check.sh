#!/usr/bin/env bash
# One command for a GPU machine: build pipewright with CUDA, run the GPU tests, profile GPT-2
# 124M/355M/774M, measure single-GPU training (pipewright against plain PyTorch of the same shape
# and batch), validate 1-, 2- and 4-stage plans on one GPU, and print a summary table.
# Every step logs the command it runs; a failing step is reported and the next one runs; the exit
# status is non-zero when any step failed. Run `bash scripts/gpu-check.sh --help` for the options.
set -uo pipefail
CALLER_DIR=$(pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd) || exit 2

usage() {
  cat <<'EOF'
Usage: bash scripts/gpu-check.sh [--quick] [--out DIR] [--no-build] [--build-dir DIR]
                                 [--python PY] [--timeout S] [--only LIST] [--help]

Runs on a machine with an NVIDIA GPU, from the repository root, each step logged:
  1. build       cmake with CUDA (nvcc from PATH or /usr/local/cuda/bin), targets pipewright and
                 the GPU test programs (tests/test_cuda_*.cpp); benchmarks off, MPI off when
                 there is no mpicxx. Needs the Debian packages of scripts/bootstrap.sh (SimGrid,
                 OpenBLAS, nlohmann-json, CLI11, fmt, GoogleTest); without them and without
                 internet, build elsewhere (same x86-64, CUDA 13) and use --no-build.
  2. GPU tests   ctest on the suites of tests/test_cuda_*.cpp (with --no-build: the test
                 programs in BUILD/tests/ run directly, as ctest's files hold the build
                 machine's paths).
  3. profile     pipewright profile --backend cuda for gpt2-124m, gpt2-355m, gpt2-774m at
                 microbatch 1,2,4,8,16 into OUT/<model>-<device>-<dtype>.json (the trace's own
                 device and dtype fields; traces/data/README.md's naming).
  4. train       per model: pipewright train --backend cuda -s 1f1b -d 1 -m 1 -b B (one GPU, no
                 pipeline) and scripts/torch_reference.py of the same model JSON and batch
                 (matmul attention, then SDPA for reference); B = 16, 8, 8 for 124M, 355M, 774M.
  5. validate    pipewright validate --backend cuda on gpt2-124m, b=4 m=8, for gpipe, 1f1b and
                 2bw at d = 1, 2 and 4 (all ranks on the one GPU).
  6. executor    CUDA paths beyond one rank, gpt2-124m: 2bw w=2 d=2 (tied-embedding gathers) run
                 6 steps straight and 3 + --resume to 6 (the losses must be equal, bit for bit),
                 the same global batch on one rank (losses within 1e-3 relative: bf16 sums in
                 another order), interleaved d=2 v=2, 1f1b w=2 d=2 with 3 buckets, 1f1b d=2 at
                 t=2 against t=1 (losses within 2e-2 relative; tensor parallelism's first GPU
                 run); and the profiler's spread: the same shape (b=4) profiled 5 times
  7. dopt        the distributed optimizer (ZeRO-1) in the CUDA executor, gpt2-124m w=2 d=2 b=2
                 m=4, 6 steps, 1f1b and 2bw (3 buckets), with and without
                 --distributed-optimizer: losses equal bit for bit, each rank's optimizer
                 state about 1/w; 2bw stopped after 3 steps and --resumed to 6: the same losses
  8. offload     the CUDA executor's offload (first run on an H100 on 2026-11-27):
                 tests/test_cuda_offload (when built; its sharded w = 2 case, ZeRO-Offload's
                 shards, and its offload chunks case, ChunksTrainAsWithoutChunks, have never
                 run), then gpt2-124m gpipe d=2 b=4 m=4 (stage 0
                 swaps) trained 6 steps with --offload none, optimizer, activations and
                 optimizer,activations, and simulate of the same plans on dgx-h100 for 6 steps:
                 activations' losses equal to none's bit for bit, optimizer's within 1e-2
                 relative, bytes moved per step equal to the simulator's, step times printed;
                 then validate --backend cuda of the optimizer plan (its host side measured:
                 never run)
  9. summary     tables read from the JSON files with python3; also in OUT/gpu-check/summary.txt.

Options:
  --quick          gpt2-124m only, fewer steps and repeats, b=8 training, validate at b=4 m=4,
                   no SDPA run (a smoke test of every step, in a few minutes)
  --out DIR        where the traces go (default: $OUT if set, else traces/data); reports,
                   validation files, torch results and logs go to DIR/gpu-check/
  --no-build       use the pipewright already in the build directory (built elsewhere); its
                   shared libraries may sit in BUILD/lib (added to LD_LIBRARY_PATH)
  --build-dir DIR  build directory (default: build in the repository)
  --python PY      interpreter with PyTorch for scripts/torch_reference.py and the summary
                   (default: python3)
  --timeout S      limit for each step in seconds (default 1800; the build: 3600)
  --only LIST      run only these of tests,profile,train,validate,executor,dopt,offload
                   (comma-separated; the machine, build and summary steps always run), e.g. to
                   split the full check over two sessions of a time-limited machine
  --help           this text

Paths given on the command line or in $OUT are taken from the current directory; the
commands run in the repository root. Exit status: 0 when every step passed, 1 when any
failed, 2 for bad arguments.
EOF
}

QUICK=0
NO_BUILD=0
BUILD=$ROOT/build
PY=python3
STEP_TIMEOUT=1800
OUT_DIR=${OUT:-$ROOT/traces/data}
ONLY=tests,profile,train,validate,executor,dopt,offload
while (($#)); do
  case $1 in
    --quick) QUICK=1 ;;
    --no-build) NO_BUILD=1 ;;
    --out | --build-dir | --python | --timeout | --only)
      if (($# < 2)); then
        echo "gpu-check: $1 needs a value" >&2
        exit 2
      fi
      case $1 in
        --out) OUT_DIR=$2 ;;
        --build-dir) BUILD=$2 ;;
        --python) PY=$2 ;;
        --timeout) STEP_TIMEOUT=$2 ;;
        --only) ONLY=$2 ;;
      esac
      shift
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      echo "gpu-check: unknown option $1 (see --help)" >&2
      exit 2
      ;;
  esac
  shift
done
if ! [[ $STEP_TIMEOUT =~ ^[0-9]+$ ]] || ((STEP_TIMEOUT < 1)); then
  echo "gpu-check: --timeout: a positive number of seconds is needed, found '$STEP_TIMEOUT'" >&2
  exit 2
fi
for part in ${ONLY//,/ }; do
  case $part in
    tests | profile | train | validate | executor | dopt | offload) ;;
    *)
      echo "gpu-check: --only: unknown step '$part' (tests, profile, train, validate, executor, dopt or offload)" >&2
      exit 2
      ;;
  esac
done
# wants PART: whether --only lets the step PART run.
wants() { [[ ",$ONLY," == *",$1,"* ]]; }
[[ $OUT_DIR == /* ]] || OUT_DIR=$CALLER_DIR/$OUT_DIR
[[ $BUILD == /* ]] || BUILD=$CALLER_DIR/$BUILD
[[ $PY == */* && $PY != /* ]] && PY=$CALLER_DIR/$PY
cd "$ROOT" || exit 2

# --- What runs, per mode ---
if ((QUICK)); then
  MODELS=(gpt2-124m)
  declare -A BATCH=([gpt2-124m]=8)
  PROFILE_SIZES=1,2,4,8
  PROFILE_REPEATS=3
  TRAIN_STEPS=6  # pipewright leaves the first step out of its mean
  TORCH_WARMUP=2
  TORCH_STEPS=5
  TORCH_ATTENTION=()
  VAL_B=4 VAL_M=4 VAL_STEPS=4
else
  MODELS=(gpt2-124m gpt2-355m gpt2-774m)
  declare -A BATCH=([gpt2-124m]=16 [gpt2-355m]=8 [gpt2-774m]=8)
  PROFILE_SIZES=1,2,4,8,16
  PROFILE_REPEATS=10
  TRAIN_STEPS=21
  TORCH_WARMUP=3
  TORCH_STEPS=20
  TORCH_ATTENTION=(--both)
  VAL_B=4 VAL_M=8 VAL_STEPS=10
fi
MODELS_PROFILED=("${MODELS[@]}")
MODELS_TRAINED=("${MODELS[@]}")
VAL_MODEL=gpt2-124m
VAL_SCHEDULES=(gpipe 1f1b 2bw)
VAL_DEPTHS=(1 2 4)

RUN_DIR=$OUT_DIR/gpu-check
LOG_DIR=$RUN_DIR/logs
mkdir -p "$OUT_DIR" "$RUN_DIR" "$LOG_DIR" || exit 2
MANIFEST=$RUN_DIR/manifest.tsv  # what the summary reads: kind, name, files
STEPS_TSV=$RUN_DIR/steps.tsv    # every step: name, status, seconds, log, note
: >"$MANIFEST"
: >"$STEPS_TSV"
FAILURES=0

say() { printf '%s gpu-check: %s\n' "$(date +%H:%M:%S)" "$*"; }

# record NAME STATUS SECONDS LOG NOTE: one line of the steps table (STATUS ok, FAIL or SKIP).
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >>"$STEPS_TSV"
  if [ "$2" = FAIL ]; then FAILURES=$((FAILURES + 1)); fi
  say "[$1] $2${5:+: $5}"
}

# amend_ok NOTE: gives the step just recorded as ok a note (what ran, how many passed).
amend_ok() {
  local last
  last=$(tail -n 1 "$STEPS_TSV")
  sed -i '$d' "$STEPS_TSV"
  printf '%s\t%s\n' "${last%$'\t'*}" "$1" >>"$STEPS_TSV"
  say "[${last%%$'\t'*}] $1"
}

# run_step NAME TIMEOUT CMD...: logs the command, runs it under `timeout` with its output on the
# terminal and in LOG_DIR/<name>.log (STEP_LOG), records the result; returns the command's status.
STEP_LOG=
run_step() {
  local name=$1 limit=$2
  shift 2
  local log
  log=$LOG_DIR/$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_').log
  STEP_LOG=$log
  local cmd="" arg
  for arg in "$@"; do  # as typed: plain words bare, the rest quoted
    if [[ $arg =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then cmd+=" $arg"; else cmd+=" $(printf '%q' "$arg")"; fi
  done
  say "[$name] running:${cmd}"
  printf '+%s\n' "$cmd" >"$log"
  local start=$SECONDS
  timeout -k 30 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if ((rc == 0)); then
    record "$name" ok "$took" "$log" ""
  elif ((rc == 124 || rc == 137)); then
    record "$name" FAIL "$took" "$log" "timed out after ${limit}s"
  else
    local last
    last=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c 1-160)
    record "$name" FAIL "$took" "$log" "exit $rc: $last"
  fi
  return "$rc"
}

skip() { record "$1" SKIP 0 "" "$2"; }

# --- 0. The machine ---
say "repository $ROOT, traces to $OUT_DIR, reports and logs to $RUN_DIR$( ((QUICK)) && echo ', quick')"
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
run_step machine 60 nvidia-smi
if [ -z "$GPU_NAME" ]; then
  GPU_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)
fi
GPU_NAME=${GPU_NAME:-unknown GPU}
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
say "GPU: $GPU_NAME; nvcc: ${NVCC:-none}; python: $(command -v "$PY" || echo "$PY: not found")"

# --- 1. Build ---
PW=$BUILD/pipewright
BUILT_HERE=0
TESTS_NOT_BUILT=
mapfile -t CUDA_TEST_SOURCES < <(ls tests/test_cuda_*.cpp 2>/dev/null)
CUDA_TEST_TARGETS=()
for src in "${CUDA_TEST_SOURCES[@]}"; do
  CUDA_TEST_TARGETS+=("$(basename "$src" .cpp)")
done
if ((NO_BUILD)); then
  skip build "--no-build: using $PW"
elif [ -z "$NVCC" ]; then
  record build FAIL 0 "" "no nvcc on PATH or in /usr/local/cuda/bin (a CUDA toolkit is needed)"
else
  missing=()  # what CMakeLists.txt requires, checked first so a failure names it
  pkg-config --exists simgrid 2>/dev/null || missing+=("SimGrid (libsimgrid-dev)")
  pkg-config --exists openblas 2>/dev/null || missing+=("OpenBLAS (libopenblas-dev)")
  [ -e /usr/include/nlohmann/json.hpp ] || missing+=("nlohmann-json (nlohmann-json3-dev)")
  [ -e /usr/include/CLI/CLI.hpp ] || missing+=("CLI11 (libcli11-dev)")
  [ -e /usr/include/fmt/format.h ] || missing+=("fmt (libfmt-dev)")
  tests_flag=-DPW_BUILD_TESTS=ON
  if [ ! -e /usr/include/gtest/gtest.h ]; then
    tests_flag=-DPW_BUILD_TESTS=OFF
    CUDA_TEST_TARGETS=()
    TESTS_NOT_BUILT="no GoogleTest headers (libgtest-dev): the build leaves the tests out"
    say "$TESTS_NOT_BUILT"
  fi
  missing_text=${missing[*]:-}
  [ -n "$missing_text" ] && say "may be missing (headers or pkg-config files not in /usr): $missing_text"
  mpi_flag=()
  command -v mpicxx >/dev/null 2>&1 || mpi_flag=(-DPW_ENABLE_MPI=OFF)
  if run_step configure "$STEP_TIMEOUT" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPW_ENABLE_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" -DPW_BUILD_BENCH=OFF "$tests_flag" \
    "${mpi_flag[@]}"; then
    if ! grep -q "pipewright: CUDA parts ON" "$LOG_DIR/configure.log"; then
      record cuda-configured FAIL 0 "$LOG_DIR/configure.log" \
        "CMake did not enable the CUDA parts (see the log): --backend cuda will not work"
    fi
    run_step build $((STEP_TIMEOUT * 2)) cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 4)" \
      --target pipewright "${CUDA_TEST_TARGETS[@]}" && BUILT_HERE=1
  else
    skip build "configure failed${missing_text:+ (missing: $missing_text)}; build elsewhere and use --no-build"
  fi
fi

# The binary: present, its libraries found (BUILD/lib first, for a copied binary), --version.
HAVE_PW=0
if [ -x "$PW" ]; then
  if [ -d "$BUILD/lib" ]; then
    LD_LIBRARY_PATH="$(cd "$BUILD/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
  fi
  not_found=$(ldd "$PW" 2>/dev/null | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
  if [ -n "$not_found" ]; then
    record binary FAIL 0 "" "$PW: shared libraries not found: $not_found(put them in $BUILD/lib)"
  elif run_step binary 60 "$PW" --version; then
    HAVE_PW=1
  fi
else
  record binary FAIL 0 "" "no executable $PW"
fi
PW_VERSION=$( ((HAVE_PW)) && "$PW" --version 2>/dev/null || echo "pipewright ?")
GIT_REV=$(git rev-parse --short HEAD 2>/dev/null || echo "no git")

# --- 2. GPU tests ---
if ! wants tests; then
  skip gpu-tests "--only $ONLY"
elif ((${#CUDA_TEST_SOURCES[@]} == 0)); then
  record gpu-tests FAIL 0 "" "no tests/test_cuda_*.cpp in this tree"
elif ((!NO_BUILD)) && [ -n "$TESTS_NOT_BUILT" ]; then
  record gpu-tests FAIL 0 "" "$TESTS_NOT_BUILT"
elif ((!NO_BUILD && !BUILT_HERE)); then
  skip gpu-tests "the build failed"
elif ((BUILT_HERE)); then
  # The suites of tests/test_cuda_*.cpp (gtest_discover_tests names tests Suite.Test; the suites
  # are CudaKernels, LocalTransport, NcclHost, ...: a plain `ctest -R cuda` would match none).
  suites=$(grep -ho '^TEST[_FP]*([A-Za-z0-9_]*' "${CUDA_TEST_SOURCES[@]}" | sed 's/.*(//' | sort -u |
    paste -sd '|' -)
  if run_step gpu-tests "$STEP_TIMEOUT" ctest --test-dir "$BUILD" -R "^(${suites})\\." \
    --output-on-failure --no-tests=error; then
    amend_ok "$(grep -E 'tests passed' "$STEP_LOG" | tail -n 1); $(grep -c '(Skipped)' "$STEP_LOG") skipped"
  fi
else
  progs=()
  for t in "${CUDA_TEST_SOURCES[@]}"; do
    exe=$BUILD/tests/$(basename "$t" .cpp)
    if [ -x "$exe" ]; then progs+=("$exe"); else record "gpu-tests $(basename "$exe")" FAIL 0 "" "not built: $exe"; fi
  done
  for exe in "${progs[@]}"; do
    if run_step "gpu-tests $(basename "$exe")" "$STEP_TIMEOUT" "$exe"; then
      n_pass=$(grep -Eo '\[  PASSED  \] [0-9]+' "$STEP_LOG" | grep -Eo '[0-9]+$')
      n_skip=$(grep -Eo '\[  SKIPPED \] [0-9]+' "$STEP_LOG" | grep -Eo '[0-9]+$')
      amend_ok "${n_pass:-0} passed, ${n_skip:-0} skipped"
    fi
  done
fi

# A step that needs the binary: run it, or record it skipped.
pw_step() {
  local name=$1
  shift
  if ((HAVE_PW)); then run_step "$name" "$STEP_TIMEOUT" "$@"; else
    skip "$name" "no usable pipewright binary"
    return 1
  fi
}

# --- 3. Profile ---
wants profile || MODELS_PROFILED=()
for model in "${MODELS_PROFILED[@]}"; do
  tmp=$RUN_DIR/profile-$model.json
  rm -f "$tmp"
  if pw_step "profile $model" "$PW" profile --backend cuda --model "$model" \
    --microbatch "$PROFILE_SIZES" --repeats "$PROFILE_REPEATS" -o "$tmp"; then
    # Named by the trace's own device and dtype fields (traces/data/README.md).
    dest=$("$PY" - "$tmp" "$model" "$GPU_NAME" <<'EOF'
import json, re, sys
t = json.load(open(sys.argv[1]))
clean = lambda s: re.sub(r"[^A-Za-z0-9._-]+", "-", str(s)).strip("-")
print(f"{clean(t.get('model') or sys.argv[2])}-{clean(t.get('device') or sys.argv[3])}-"
      f"{clean(t.get('dtype') or 'bf16')}.json")
EOF
    )
    if [ -n "$dest" ] && mv -f "$tmp" "$OUT_DIR/$dest"; then
      say "[profile $model] wrote $OUT_DIR/$dest"
      printf 'profile\t%s\t%s\n' "$model" "$OUT_DIR/$dest" >>"$MANIFEST"
    else
      record "profile $model" FAIL 0 "" "could not read or move $tmp"
    fi
  fi
done

# --- 4. Single-GPU training: pipewright, then PyTorch of the same shape and batch ---
wants train || MODELS_TRAINED=()
for model in "${MODELS_TRAINED[@]}"; do
  b=${BATCH[$model]}
  report=$RUN_DIR/train-$model-b$b.json
  torch_json=$RUN_DIR/torch-$model-b$b.json
  rm -f "$report" "$torch_json"
  pw_step "train $model b=$b" "$PW" train --backend cuda --model "$model" -s 1f1b -d 1 -m 1 \
    -b "$b" --steps "$TRAIN_STEPS" -o "$report"
  # The same peak as pipewright's MFU when its report has one (model FLOP/s / MFU).
  peak=()
  if [ -s "$report" ]; then
    p=$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1]))
print(r["model_flops_per_s"] / r["mfu"] if r.get("mfu") else "")' "$report" 2>/dev/null)
    [ -n "$p" ] && peak=(--peak-flops "$p")
  fi
  run_step "torch $model b=$b" "$STEP_TIMEOUT" "$PY" scripts/torch_reference.py \
    --model "models/presets/$model.json" --batch "$b" --warmup "$TORCH_WARMUP" \
    --steps "$TORCH_STEPS" "${TORCH_ATTENTION[@]}" "${peak[@]}" --json "$torch_json"
  printf 'train\t%s\t%s\t%s\t%s\n' "$model" "$b" "$report" "$torch_json" >>"$MANIFEST"
done

# --- 5. validate: 1-, 2- and 4-stage plans on the one GPU ---
wants validate || VAL_SCHEDULES=()
for s in "${VAL_SCHEDULES[@]}"; do
  for d in "${VAL_DEPTHS[@]}"; do
    v=$RUN_DIR/validate-$VAL_MODEL-$s-d$d-b$VAL_B-m$VAL_M.json
    rm -f "$v"
    pw_step "validate $s d=$d" "$PW" validate --backend cuda --model "$VAL_MODEL" -s "$s" \
      -d "$d" -m "$VAL_M" -b "$VAL_B" --steps "$VAL_STEPS" --out "$v"
    printf 'validate\t%s\t%s\t%s\n' "$s" "$d" "$v" >>"$MANIFEST"
  done
done

# --- 6. Executor paths beyond one rank, and the profiler's spread ---
EXE_DIR=$RUN_DIR/executor
if wants executor; then
  mkdir -p "$EXE_DIR"
  c=(--backend cuda --model gpt2-124m -s 2bw -d 2 -w 2 -b 2 -m 4)
  rm -rf "$EXE_DIR/ckpt" "$EXE_DIR"/*.json
  pw_step "executor 2bw w=2 d=2, 6 steps" "$PW" train "${c[@]}" --steps 6 -o "$EXE_DIR/straight.json"
  pw_step "executor 2bw w=2 d=2, 3 steps + checkpoint" "$PW" train "${c[@]}" --steps 3 \
    --checkpoint-dir "$EXE_DIR/ckpt" -o "$EXE_DIR/part1.json"
  pw_step "executor 2bw w=2 d=2, --resume to 6" "$PW" train "${c[@]}" --steps 6 \
    --checkpoint-dir "$EXE_DIR/ckpt" --resume -o "$EXE_DIR/part2.json"
  pw_step "executor 2bw one rank, same batch" "$PW" train --backend cuda --model gpt2-124m -s 2bw \
    -d 1 -w 1 -b 2 -m 8 --steps 6 -o "$EXE_DIR/single.json"
  pw_step "executor interleaved d=2 v=2" "$PW" train --backend cuda --model gpt2-124m \
    -s interleaved -d 2 -v 2 -b 2 -m 8 --steps 6 -o "$EXE_DIR/interleaved.json"
  pw_step "executor 1f1b w=2 d=2, 3 buckets" "$PW" train --backend cuda --model gpt2-124m -s 1f1b \
    -d 2 -w 2 -b 2 -m 4 --buckets 3 --steps 6 -o "$EXE_DIR/buckets.json"
  if [ -s "$EXE_DIR/straight.json" ] && [ -s "$EXE_DIR/part2.json" ]; then
    run_step "executor: resume bit-identical, one rank close" 60 "$PY" - "$EXE_DIR" <<'EOF'
import json, sys
d = sys.argv[1]
load = lambda n: json.load(open(f"{d}/{n}.json"))["losses"]
straight, part1, part2 = load("straight"), load("part1"), load("part2")
resumed = part1 + part2[len(part2) - (len(straight) - len(part1)):]
print("straight:", straight)
print("3 + resumed:", resumed)
ok = resumed == straight
print("resume bit-identical:", ok)
try:
    single = load("single")
    rel = max(abs(a - b) / abs(b) for a, b in zip(single, straight))
    print(f"one rank, same global batch: max relative loss difference {rel:.2e} (limit 1e-3)")
    ok = ok and rel <= 1e-3
except (OSError, KeyError, ValueError) as e:
    print("one rank: no report:", e)
    ok = False
sys.exit(0 if ok else 1)
EOF
  fi
  rm -rf "$EXE_DIR/ckpt"  # gigabytes of checkpoints: compared above, not kept
  # Tensor parallelism (never run on a GPU before): t = 2 against t = 1, every device on this GPU.
  for tp in 1 2; do
    pw_step "executor 1f1b d=2 t=$tp" "$PW" train --backend cuda --model gpt2-124m -s 1f1b \
      -d 2 --tp "$tp" -b 2 -m 4 --steps 6 -o "$EXE_DIR/tp$tp.json"
  done
  if [ -s "$EXE_DIR/tp1.json" ] && [ -s "$EXE_DIR/tp2.json" ]; then
    run_step "executor: t=2 follows t=1" 60 "$PY" - "$EXE_DIR" <<'EOF'
import json, sys
d = sys.argv[1]
one, two = (json.load(open(f"{d}/tp{t}.json"))["losses"] for t in (1, 2))
rel = max(abs(a - b) / abs(b) for a, b in zip(two, one))
print("t=1:", one)
print("t=2:", two)
print(f"max relative loss difference {rel:.2e} (limit 2e-2)")
sys.exit(0 if len(one) == len(two) and rel <= 2e-2 else 1)
EOF
  fi
  for i in 1 2 3 4 5; do
    pw_step "executor profile spread $i/5" "$PW" profile --backend cuda --model gpt2-124m \
      --microbatch 4 --repeats 10 -o "$EXE_DIR/spread-$i.json"
  done
  run_step "executor: profile spread" 60 "$PY" - "$EXE_DIR" <<'EOF'
import glob, json, sys
f = []
for p in sorted(glob.glob(sys.argv[1] + "/spread-*.json")):
    e = json.load(open(p))["entries"][0]
    f.append(e["layers"]["block"]["forward_s"] * 1e6)
if not f:
    sys.exit("no profile to compare")
print("block forward at b=4, 5 profiles (us):", ", ".join(f"{x:.1f}" for x in f))
print(f"spread (max - min) / min: {100 * (max(f) - min(f)) / min(f):.1f}%")
EOF
else
  skip executor "--only $ONLY"
fi

# --- 7. The distributed optimizer in the CUDA executor ---
DOPT_DIR=$RUN_DIR/dopt
if wants dopt; then
  mkdir -p "$DOPT_DIR"
  rm -rf "$DOPT_DIR/ckpt" "$DOPT_DIR"/*.json
  for s in 1f1b 2bw; do
    c=(--backend cuda --model gpt2-124m -s "$s" -d 2 -w 2 -b 2 -m 4 --buckets 3 --steps 6)
    pw_step "dopt $s w=2 d=2, plain" "$PW" train "${c[@]}" -o "$DOPT_DIR/$s-plain.json"
    pw_step "dopt $s w=2 d=2, --distributed-optimizer" "$PW" train "${c[@]}" \
      --distributed-optimizer -o "$DOPT_DIR/$s-dopt.json"
  done
  c=(--backend cuda --model gpt2-124m -s 2bw -d 2 -w 2 -b 2 -m 4 --buckets 3 --distributed-optimizer)
  pw_step "dopt 2bw, 3 steps + checkpoint" "$PW" train "${c[@]}" --steps 3 \
    --checkpoint-dir "$DOPT_DIR/ckpt" -o "$DOPT_DIR/part1.json"
  pw_step "dopt 2bw, --resume to 6" "$PW" train "${c[@]}" --steps 6 --checkpoint-dir "$DOPT_DIR/ckpt" \
    --resume -o "$DOPT_DIR/part2.json"
  run_step "dopt: losses bit-identical, optimizer state sharded" 60 "$PY" - "$DOPT_DIR" <<'EOF'
import json, sys
d = sys.argv[1]
ok = True
def load(n):
    return json.load(open(f"{d}/{n}.json"))
for s in ("1f1b", "2bw"):
    try:
        plain, dopt = load(f"{s}-plain"), load(f"{s}-dopt")
    except (OSError, ValueError) as e:
        print(s, "no report:", e); ok = False; continue
    same = plain["losses"] == dopt["losses"]
    print(f"{s}: losses plain {plain['losses']}")
    print(f"{s}: losses dopt  {dopt['losses']}  bit-identical: {same}")
    print(f"{s}: tokens/s plain {plain['tokens_per_s']:.0f}, dopt {dopt['tokens_per_s']:.0f}")
    for a, b in zip(plain["devices"], dopt["devices"]):
        oa = a["memory_breakdown_bytes"]["optimizer"]; ob = b["memory_breakdown_bytes"]["optimizer"]
        print(f"  rank {a['rank']}: optimizer {oa / 2**20:.1f} -> {ob / 2**20:.1f} MiB, "
              f"peak {a['peak_memory_bytes'] / 2**30:.2f} -> {b['peak_memory_bytes'] / 2**30:.2f} GiB")
        ok = ok and ob < 0.6 * oa
    ok = ok and same
try:
    straight = load("2bw-dopt")["losses"]
    part1, part2 = load("part1")["losses"], load("part2")["losses"]
    resumed = part1 + part2[len(part2) - (len(straight) - len(part1)):]
    print("2bw dopt 3 + resumed:", resumed, "equal:", resumed == straight)
    ok = ok and resumed == straight
except (OSError, KeyError, ValueError) as e:
    print("resume: no report:", e); ok = False
sys.exit(0 if ok else 1)
EOF
  rm -rf "$DOPT_DIR/ckpt"  # gigabytes (every rank's fp32 shard per step): not worth keeping
else
  skip dopt "--only $ONLY"
fi

# --- 8. Offload in the CUDA executor (docs/formats.md, offload in the CUDA executor) ---
OFF_DIR=$RUN_DIR/offload
if wants offload; then
  mkdir -p "$OFF_DIR"
  rm -f "$OFF_DIR"/*.json
  exe=$BUILD/tests/test_cuda_offload
  if [ -x "$exe" ]; then
    run_step "offload tests" "$STEP_TIMEOUT" "$exe"
  else
    record "offload tests" FAIL 0 "" "not built: $exe"
  fi
  # Plan files with the swap choice on both stages (train's default; simulate's rule would pick
  # recompute where the copies do not hide, and move other bytes).
  for mode in none optimizer activations optimizer,activations; do
    name=${mode//,/+}
    choices=
    [[ $mode == *activations* ]] && choices=', "activations": ["swap", "swap"]'
    printf '{"format": "pipewright.plan/1", "schedule": "gpipe", "w": 1, "d": 2, "b": 4, "m": 4, "offload": "%s"%s}\n' \
      "$mode" "$choices" >"$OFF_DIR/plan-$name.json"
    pw_step "offload train $mode" "$PW" train --backend cuda --model gpt2-124m \
      --plan "$OFF_DIR/plan-$name.json" --steps 6 -o "$OFF_DIR/train-$name.json"
    [ "$mode" = none ] && continue
    pw_step "offload simulate $mode" "$PW" simulate --cluster dgx-h100 --model gpt2-124m \
      --plan "$OFF_DIR/plan-$name.json" --steps 6 -o "$OFF_DIR/sim-$name.json"
  done
  run_step "offload: losses, bytes, times" 60 "$PY" - "$OFF_DIR" <<'EOF'
import json, os, sys
d = sys.argv[1]
def load(name):
    p = f"{d}/{name}.json"
    return json.load(open(p)) if os.path.exists(p) else None
def median_step(run):
    t = sorted(run["step_times_s"][1:] or run["step_times_s"])
    return t[len(t) // 2]
base = load("train-none")
if base is None:
    sys.exit("no run without offload")
ok = True
t0 = median_step(base)
print(f"none: losses {base['losses']}, median step {1e3 * t0:.1f} ms")
for mode in ["optimizer", "activations", "optimizer+activations"]:
    run, sim = load("train-" + mode), load("sim-" + mode)
    if run is None:
        print(mode, ": no run")
        ok = False
        continue
    rel = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], base["losses"]))
    same = run["losses"] == base["losses"]
    good = same if mode == "activations" else rel <= 1e-2
    t = median_step(run)
    print(f"{mode}: max relative loss difference {rel:.2e} "
          f"({'bit-identical' if same else 'differs'}), median step {1e3 * t:.1f} ms "
          f"({t / t0:.2f}x none)")
    o = run.get("offload", {})
    if sim is None or "offload" not in sim:
        print("  no simulation to compare bytes with")
        ok = False
    else:
        for r, s in zip(o.get("ranks", []), sim["offload"]["ranks"]):
            for k in ["copy_out_bytes_per_step", "copy_in_bytes_per_step"]:
                match = r[k] == s[k]
                print(f"  rank {r['rank']} {k}: run {r[k]}, simulator {s[k]}"
                      f"{'' if match else '  MISMATCH'}")
                ok = ok and match
            print(f"  rank {r['rank']} host bytes {r['host_bytes']}")
    ok = ok and good
sys.exit(0 if ok else 1)
EOF
  # validate with optimizer offload: the host side (pinned copies, CPU Adam) measured into the
  # gpu-host cluster (exec::cuda::measure_host; never run on a GPU before).
  pw_step "offload validate optimizer" "$PW" validate --backend cuda --model gpt2-124m \
    --plan "$OFF_DIR/plan-optimizer.json" --steps 6 --out "$OFF_DIR/validate-optimizer.json"
else
  skip offload "--only $ONLY"
fi

# --- 9. Summary ---
SUMMARY=$RUN_DIR/summary.txt
summary_py() {
  "$PY" - "$MANIFEST" "$STEPS_TSV" "$GPU_NAME" "$PW_VERSION" "$GIT_REV" "$VAL_MODEL" <<'EOF'
import json, os, sys

manifest, steps_tsv, gpu, version, rev, val_model = sys.argv[1:7]


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def num(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def pct(x):
    return f"{100 * x:+.1f}%" if isinstance(x, (int, float)) else "n/a"


def gib(x):
    return f"{x / 2**30:.1f} GiB" if isinstance(x, (int, float)) else "-"


def frac(x):
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "n/a"


def ms(x):
    return f"{1e3 * x:.1f} ms" if isinstance(x, (int, float)) else "-"


rows = [line.rstrip("\n").split("\t") for line in open(manifest) if line.strip()]
print(f"pipewright gpu-check on {gpu}: {version}, commit {rev}")

train = [r for r in rows if r[0] == "train"]
if train:
    print("\nSingle-GPU training, bf16 (pipewright: train -s 1f1b -d 1 -m 1 -b B, mean step after "
          "the first;\ntorch: scripts/torch_reference.py, eager, matmul attention, mean of the "
          "timed steps; ratio = pipewright / torch tokens/s)")
    head = (f"{'model':<11} {'batch':>5} {'pw tok/s':>10} {'pw MFU':>7} {'pw peak':>9} "
            f"{'torch tok/s':>11} {'torch MFU':>9} {'torch peak':>10} {'ratio':>6} "
            f"{'sdpa tok/s':>10}")
    print(head)
    for _, model, batch, report, torch_json in train:
        r, t = load(report), load(torch_json)
        runs = {x["attention"]: x for x in (t or {}).get("runs", [])}
        tm, ts = runs.get("matmul") or {}, runs.get("sdpa") or {}
        pw_tok = r.get("tokens_per_s") if r else None
        pw_peak = max((d.get("peak_memory_bytes", 0) for d in r.get("devices", [])),
                      default=None) if r else None
        t_tok = tm.get("tokens_per_s")
        ratio = f"{pw_tok / t_tok:.2f}x" if pw_tok and t_tok else "-"
        print(f"{model:<11} {batch:>5} {num(pw_tok, '.0f') if r else 'FAILED':>10} "
              f"{num(100 * r['mfu'], '.1f') + '%' if r and r.get('mfu') else '-':>7} "
              f"{gib(pw_peak):>9} {num(t_tok, '.0f') if tm and not tm.get('error') else 'FAILED':>11} "
              f"{num(100 * tm['mfu'], '.1f') + '%' if tm.get('mfu') else '-':>9} "
              f"{gib(tm.get('peak_memory_bytes')):>10} {ratio:>6} "
              f"{num(ts.get('tokens_per_s'), '.0f') if ts else '':>10}")
        if r and t and r.get("tokens_per_s") and t.get("flops_per_token"):
            pw_fpt = r["model_flops_per_s"] / r["tokens_per_s"]
            if abs(pw_fpt / t["flops_per_token"] - 1) > 1e-6:
                print(f"  note: FLOPs per token differ: pipewright {pw_fpt:.6g}, "
                      f"torch_reference {t['flops_per_token']:.6g}")

val = [r for r in rows if r[0] == "validate"]
if val:
    v0 = next((load(r[3]) for r in val if load(r[3])), None)
    plan = (v0 or {}).get("plan", {})
    print(f"\nvalidate {val_model} on one GPU (b={plan.get('b', '?')} m={plan.get('m', '?')}; "
          "error = (predicted - measured) / measured; 'median' against the median measured step)")
    print(f"{'schedule':<8} {'d':>2} {'step pred':>10} {'step meas':>10} {'error':>7} "
          f"{'median':>7} {'max|busy err|':>13} {'max|peak mem err|':>17} {'peak meas':>10}")
    for _, sched, d, path in val:
        v = load(path)
        if not v:
            print(f"{sched:<8} {d:>2} {'FAILED':>10}")
            continue
        it = v.get("iteration_time_s", {})
        med = v.get("median_step_time_s") or {}
        peak = max((x["peak_memory_bytes"]["measured"] for x in v.get("devices", [])),
                   default=None)
        print(f"{sched:<8} {d:>2} {ms(it.get('predicted')):>10} {ms(it.get('measured')):>10} "
              f"{pct(it.get('error')):>7} {pct(med.get('error')):>7} "
              f"{frac(v.get('max_abs_busy_error')):>13} {frac(v.get('max_abs_memory_error')):>17} "
              f"{gib(peak):>10}")

profiles = [r for r in rows if r[0] == "profile"]
if profiles:
    print("\nProfiled traces")
    for _, model, path in profiles:
        t = load(path) or {}
        sizes = [e.get("microbatch_size") for e in t.get("entries", [])]
        print(f"  {model:<11} {path}: device {t.get('device', '?')}, dtype {t.get('dtype', '?')}, "
              f"b = {','.join(map(str, sizes)) or '?'}")

steps = [line.rstrip("\n").split("\t") for line in open(steps_tsv) if line.strip()]
print("\nSteps")
for name, status, secs, log, note in steps:
    where = f" [{log}]" if status == "FAIL" and log else ""
    print(f"  {status:<4} {name:<28} {secs:>5}s  {note}{where}")
n = {s: sum(1 for x in steps if x[1] == s) for s in ("ok", "FAIL", "SKIP")}
print(f"{len(steps)} steps: {n['ok']} ok, {n['FAIL']} failed, {n['SKIP']} skipped")
EOF
}
say "summary (also in $SUMMARY)"
echo
if ! summary_py | tee "$SUMMARY"; then
  echo "gpu-check: the summary could not be made with $PY; the steps:" | tee -a "$SUMMARY"
  tee -a "$SUMMARY" <"$STEPS_TSV"
  FAILURES=$((FAILURES + 1))
fi
((FAILURES == 0))
