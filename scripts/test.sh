#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh) and runs the whole test suite in ./build; then (issue 13) the same
# suite built with ASan + UBSan in ./build-asan and every fuzz target for 20 s on its seed corpus
# (scripts/sanitize.sh; PW_TEST_SANITIZE=0 skips that part, PW_FUZZ_SECONDS sets the time per
# target). Ends with ctest's summary lines; fails when any part fails.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/bootstrap.sh
status=0
(cd build && ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)") | tee build/ctest.log ||
  status=1
summary=$(grep -E 'tests passed|tests failed|Total Test time' build/ctest.log | tail -n 2)
if [ "${PW_TEST_SANITIZE:-1}" != 0 ]; then
  bash scripts/sanitize.sh | tee build/sanitize.log || status=1
  echo
  echo "== sanitizers and fuzzing (scripts/sanitize.sh) =="
  sed -n '/^== sanitized ctest/,$p' build/sanitize.log | grep -v '^== sanitized ctest'
  grep 'sanitize: FAILED' build/sanitize.log || true
fi
echo
echo "scripts/test.sh: $((SECONDS - start)) s in all"
echo "== ctest summary (build) =="
echo "$summary"
exit "$status"
