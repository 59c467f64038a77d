#!/usr/bin/env bash
# Runs magpie's whole test suite (no GPU needed; GPU tests are tagged and
# run by tools/gpu_suite.sh on a GPU machine): the plain build, then again
# under ThreadSanitizer and under AddressSanitizer + UndefinedBehaviorSanitizer
# (clang; configs in .bazelrc). Extra arguments go to every `bazel test`.
# Ends with one line "N passed, N failed" counting the cmocka test cases of
# every test binary in every run.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh || exit 1

passed=0
failed=0
status=0

count_logs() {
  local log p f
  while IFS= read -r log; do
    p=$(grep -Eo '^\[  PASSED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
    f=$(grep -Eo '^\[  FAILED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
    passed=$((passed + p))
    failed=$((failed + f))
  done < <(find -L bazel-testlogs/ -name test.log 2>/dev/null)
}

for config in "" tsan asan; do
  echo "=== bazel test //... ${config:+--config=$config}"
  bazel test ${config:+--config=$config} //... "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    status=$rc
    before=$failed
    count_logs
    [ "$failed" -eq "$before" ] && failed=$((failed + 1))
  else
    count_logs
  fi
done
echo "${passed} passed, ${failed} failed"
exit "$status"
