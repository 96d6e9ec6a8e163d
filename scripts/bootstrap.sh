#!/usr/bin/env bash
# Installs every Debian package pipewright needs (as root, idempotent, quick when all is there),
# then configures and builds it in ./build. Usage: bash scripts/bootstrap.sh [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake pkg-config git python3
  nlohmann-json3-dev libcli11-dev libfmt-dev libsimgrid-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  # MPI (issues 6, 16): `mpirun -np N pipewright train` runs one rank per process (CPU ranks talk
  # over MPI, CUDA ranks broadcast the NCCL id over it); exec/mpi/ links it; the build leaves MPI
  # out when this is missing. openmpi-bin: mpirun, for the mpirun tests (skipped without it).
  libopenmpi-dev openmpi-bin
  # iproute2 (ip netns, tc): scripts/netns-cluster.sh's emulated multi-node cluster (its test skips
  # where namespaces cannot be made); util-linux: unshare, a host name per emulated node.
  iproute2 util-linux
  # GSL (issue 12): `pipewright calibrate` fits the device model with gsl_multifit_nlinear
  # (Levenberg-Marquardt nonlinear least squares).
  libgsl-dev
  # zlib (issue 13): crc32 checksums of every checkpoint tensor, shard header and manifest, checked
  # on load (exec/checkpoint.cpp; CMake's FindZLIB).
  zlib1g-dev
  jupyter-nbconvert python3-nbconvert python3-ipykernel python3-matplotlib python3-pandas
  # Sanitizers and fuzzing (issue 13, scripts/sanitize.sh): clang 14 with its runtimes (ASan,
  # UBSan, libFuzzer's -fsanitize=fuzzer are in libclang-rt-14-dev), llvm-symbolizer-14 (llvm-14)
  # for readable sanitizer stacks, ccache so the second tree rebuilds only what changed.
  clang-14 libclang-rt-14-dev llvm-14 ccache
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

JOBS=$(nproc 2>/dev/null || echo 2)
# Through ccache when it is there (paths relative to CCACHE_BASEDIR, so copies of the tree share it).
launcher=()
if command -v ccache >/dev/null 2>&1; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
fi
mkdir -p build
if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" "$@" >build/configure.log 2>&1; then
  cat build/configure.log
  exit 1
fi
grep "pipewright:" build/configure.log || true
cmake --build build -j "$JOBS"
