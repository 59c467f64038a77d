#!/usr/bin/env bash
# Runs magpie's whole test suite (no GPU needed; GPU tests are tagged and
# run by tools/gpu_suite.sh on a GPU machine): the sources' formatting
# (tools/format.sh --check), the plain build, then again with the checked
# invariants compiled in (--config=debug: MAGPIE_ASSERT), under
# ThreadSanitizer and under AddressSanitizer + UndefinedBehaviorSanitizer
# (clang; configs in .bazelrc), then the libFuzzer target for a bounded time
# (MAGPIE_FUZZ_SECONDS, default 60; 0 skips it). Extra arguments go to every
# `bazel test`. The model checker (tests/model) runs in the plain build only:
# Relacy's fibers and own instrumentation do not mix with the sanitizers.
# Ends with one line "N passed, N failed" counting the cmocka test cases of
# every test binary in every run, plus one each for the format check and
# the fuzzing run.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh || exit 1

passed=0
failed=0
status=0

echo "=== tools/format.sh --check"
if tools/format.sh --check; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  status=1
fi

count_logs() {
  local log p f
  while IFS= read -r log; do
    p=$(grep -Eo '^\[  PASSED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
    f=$(grep -Eo '^\[  FAILED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
    passed=$((passed + p))
    failed=$((failed + f))
  done < <(find -L bazel-testlogs/ -name test.log 2>/dev/null)
}

for config in "" debug tsan asan; do
  echo "=== bazel test //... ${config:+--config=$config}"
  p0=$passed
  f0=$failed
  if [ -z "$config" ] || [ "$config" = debug ]; then
    bazel test ${config:+--config=$config} //... "$@"
  else
    # Not the tests tagged gcc_only (the sanitizer builds use clang; the
    # RMM resource's test needs gcc, tests/defs.bzl), nor under TSan those
    # tagged no_tsan (tests/BUILD says why).
    filter=(--build_tag_filters=-gcc_only --test_tag_filters=-gcc_only)
    [ "$config" = tsan ] && filter=(--build_tag_filters=-gcc_only --test_tag_filters=-no_tsan,-gcc_only)
    bazel test --config="$config" "${filter[@]}" "$@" -- //... -//tests/model:all
  fi
  rc=$?
  if [ "$rc" -ne 0 ]; then
    status=$rc
    before=$failed
    count_logs
    [ "$failed" -eq "$before" ] && failed=$((failed + 1))
  else
    count_logs
  fi
  echo "--- ${config:-plain}: $((passed - p0)) passed, $((failed - f0)) failed"
done

fuzz_seconds=${MAGPIE_FUZZ_SECONDS:-60}
if [ "$fuzz_seconds" -gt 0 ]; then
  echo "=== fuzzing //tests/fuzz:alloc_fuzz for ${fuzz_seconds} s"
  work=$(mktemp -d)
  # New inputs go to a scratch directory; the seed corpus stays as committed.
  # Leak checking is off for the reason given in .bazelrc (asan config).
  if bazel build --config=fuzz //tests/fuzz:alloc_fuzz &&
    ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0:quarantine_size_mb=16 \
      bazel-bin/tests/fuzz/alloc_fuzz -max_total_time="$fuzz_seconds" -print_final_stats=1 \
      -rss_limit_mb=3072 -artifact_prefix="$work/" "$work" tests/fuzz/corpus 2>"$work/log"; then
    grep -E '^(Done|stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb)' "$work/log"
    passed=$((passed + 1))
  else
    tail -n 60 "$work/log"
    echo "fuzzing found a failure; reproducer(s): $(ls "$work" | grep -E '^(crash|leak|oom|timeout)-' || true)"
    failed=$((failed + 1))
    status=1
  fi
  rm -rf "$work"
fi
echo "${passed} passed, ${failed} failed"
exit "$status"
