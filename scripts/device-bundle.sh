#!/usr/bin/env bash
# Packs what a GPU machine without this project's Debian packages (SimGrid, OpenBLAS, fmt, ...;
# no network) needs to run pipewright's GPU checks into one compressed file small enough to carry
# there (the device tool carries at most 64 MiB): a CUDA build without MPI, stripped, with the
# shared libraries it loads except the big CUDA ones (cuBLASLt, NCCL) that such a machine has.
#
#   bash scripts/device-bundle.sh            # -> .device/bundle.tar.xz (git-ignored)
#   bash scripts/device-bundle.sh --no-build --build-dir build   # pack a CUDA build as it is
#   # on the GPU machine, in a copy of this repository:
#   mkdir -p /tmp/pw && tar -xJf .device/bundle.tar.xz -C /tmp/pw
#   bash scripts/gpu-check.sh --no-build --build-dir /tmp/pw/build --quick
#
# The bundle's build/pipewright and build/tests/test_cuda_* are small wrappers around bin/: they
# put build/lib first on LD_LIBRARY_PATH, then the CUDA library folders of that machine (the
# toolkit's, and the nvidia-* Python packages' where PyTorch is installed), and if the machine's C
# library is older than the one the binaries were built against, they run them through the
# bundled loader and C library (build/glibc).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  echo "Usage: bash scripts/device-bundle.sh [--build-dir DIR] [--out FILE] [--no-build]"
}
BUILD=build-device
OUT_FILE=.device/bundle.tar.xz
BUILD_IT=1
while (($#)); do
  case $1 in
    --no-build) BUILD_IT=0 ;;
    --build-dir) BUILD=$2; shift ;;
    --out) OUT_FILE=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "device-bundle: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
LIMIT=$((60 * 1024 * 1024))  # leaves room under the 64 MiB carry limit for the tree itself

command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] ||
  { echo "device-bundle: no nvcc: the bundle is a CUDA build" >&2; exit 1; }

tests=()
for src in tests/test_cuda_*.cpp; do tests+=("$(basename "$src" .cpp)"); done
if ((BUILD_IT)); then
  echo "== configure and build $BUILD (CUDA on, MPI off: single-process GPU runs) =="
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DPW_ENABLE_CUDA=ON -DPW_ENABLE_MPI=OFF \
    -DPW_BUILD_BENCH=OFF -DPW_BUILD_TESTS=ON >/dev/null
  cmake --build "$BUILD" -j "$(nproc 2>/dev/null || echo 2)" --target pipewright "${tests[@]}"
fi
grep -q '^PW_ENABLE_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" ||
  { echo "device-bundle: $BUILD is not a CUDA build (PW_ENABLE_CUDA)" >&2; exit 1; }
for t in pipewright "tests/${tests[0]}"; do
  [ -x "$BUILD/$t" ] || { echo "device-bundle: $BUILD/$t is missing: build it first" >&2; exit 1; }
done

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
B=$STAGE/build
mkdir -p "$B/bin" "$B/lib" "$B/glibc" "$B/tests"
cp "$BUILD/pipewright" "$B/bin/"
for t in "${tests[@]}"; do cp "$BUILD/tests/$t" "$B/bin/"; done
strip --strip-unneeded "$B"/bin/*

# Shared libraries: the CUDA driver, cuBLAS(Lt) and NCCL come from the GPU machine (hundreds of
# MB); the C library family goes to glibc/ (used only through the bundled loader); the rest to lib/.
declare -A seen=()
for exe in "$B"/bin/*; do
  while read -r name path; do
    [ -n "$path" ] && [ -e "$path" ] || continue
    [ -n "${seen[$name]:-}" ] && continue
    seen[$name]=1
    case $name in
      libcuda.so* | libcublas* | libnccl* | linux-vdso*) ;;
      ld-linux* | libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | libresolv.so*)
        cp -L "$path" "$B/glibc/$name" ;;
      *) cp -L "$path" "$B/lib/$name" ;;
    esac
  done < <(ldd "$exe" | awk '/=>/ {print $1, $3} /ld-linux/ && !/=>/ {n=$1; sub(".*/", "", n); print n, $1}')
done

cat >"$B/run" <<'EOF'
#!/usr/bin/env bash
# Runs bin/NAME with the bundle's libraries (see scripts/device-bundle.sh).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
name=$1; shift
paths="$here/lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && paths="$paths:$d"
done
if [ -z "${PW_BUNDLE_PY_LIBS+x}" ] && command -v python3 >/dev/null 2>&1; then
  PW_BUNDLE_PY_LIBS=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = set()
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(os.path.join(base, "nvidia", "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
  export PW_BUNDLE_PY_LIBS
fi
[ -n "${PW_BUNDLE_PY_LIBS:-}" ] && paths="$paths:$PW_BUNDLE_PY_LIBS"
export LD_LIBRARY_PATH="$paths${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exe="$here/bin/$name"
# An older C library than the build's: use the bundled loader and C library.
if "$here/bin/pipewright" --version 2>&1 | grep -q 'GLIBC'; then
  exec "$here/glibc/ld-linux-x86-64.so.2" --library-path "$here/glibc:$LD_LIBRARY_PATH" "$exe" "$@"
fi
exec "$exe" "$@"
EOF
chmod +x "$B/run"
printf '#!/bin/sh\nexec "$(dirname "$0")/run" pipewright "$@"\n' >"$B/pipewright"
chmod +x "$B/pipewright"
for t in "${tests[@]}"; do
  printf '#!/bin/sh\nexec "$(dirname "$0")/../run" %s "$@"\n' "$t" >"$B/tests/$t"
  chmod +x "$B/tests/$t"
done

mkdir -p "$(dirname "$OUT_FILE")"
echo "== pack $OUT_FILE =="
tar -C "$STAGE" -cJf "$OUT_FILE.tmp" build
mv "$OUT_FILE.tmp" "$OUT_FILE"
size=$(stat -c %s "$OUT_FILE")
du -sh "$B/bin" "$B/lib" "$B/glibc" | sed 's/^/  /'
echo "$OUT_FILE: $((size / 1024 / 1024)) MiB compressed (limit $((LIMIT / 1024 / 1024)) MiB)"
if ((size > LIMIT)); then
  echo "device-bundle: $OUT_FILE is over the limit" >&2
  exit 1
fi
