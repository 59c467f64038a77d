#!/usr/bin/env bash
# Runs magpie's whole test suite (no GPU needed; GPU tests are tagged and
# run by tools/gpu_suite.sh on a GPU machine). Ends with one line
# "N passed, N failed" counting the cmocka test cases of every test binary.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh || exit 1
bazel test //... "$@"
rc=$?
passed=0
failed=0
while IFS= read -r log; do
  p=$(grep -Eo '^\[  PASSED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
  f=$(grep -Eo '^\[  FAILED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
  passed=$((passed + p))
  failed=$((failed + f))
done < <(find -L bazel-testlogs/ -name test.log 2>/dev/null)
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "${passed} passed, ${failed} failed"
exit "$rc"
