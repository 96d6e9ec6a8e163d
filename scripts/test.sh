#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh) and runs the whole test suite; ends with ctest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cd build
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
