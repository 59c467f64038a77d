#!/usr/bin/env bash
# Formats magpie's C and C++ sources with .clang-format (clang-format 14):
#
#   tools/format.sh          rewrite the files in place
#   tools/format.sh --check  change nothing; list the files that differ and
#                            exit 1 if any does (tools/test.sh runs this)
#
# Sources: every tracked *.c, *.h, *.cpp, *.hpp, *.cu and *.cuh outside
# third_party/.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cpp' '*.hpp' '*.cu' '*.cuh' | grep -v '^third_party/')
if [ "${1:-}" = "--check" ]; then
  bad=0
  for f in "${files[@]}"; do
    if ! clang-format --style=file "$f" | cmp -s - "$f"; then
      echo "not formatted: $f (tools/format.sh fixes it)"
      bad=1
    fi
  done
  [ "$bad" -eq 0 ] && echo "formatted: ${#files[@]} files"
  exit "$bad"
fi
clang-format --style=file -i "${files[@]}"
