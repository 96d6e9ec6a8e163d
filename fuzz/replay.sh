#!/usr/bin/env bash
# Runs a fuzz target once over every file of the given directories (no fuzzing): the seed corpus
# and the regression inputs. Usage: replay.sh FUZZ_TARGET DIR... (missing directories are skipped)
set -euo pipefail
target=$1
shift
files=()
for dir in "$@"; do
  [ -d "$dir" ] || continue
  while IFS= read -r -d '' f; do files+=("$f"); done < <(find "$dir" -type f ! -name '.*' -print0 | sort -z)
done
if ((${#files[@]} == 0)); then
  echo "replay: no inputs in $*" >&2
  exit 1
fi
echo "replay: $(basename "$target") over ${#files[@]} inputs"
exec "$target" "${files[@]}"
