#!/usr/bin/env bash
# Runs the RMM test binaries that build.sh put in OUTDIR, one after another,
# and prints each one's gtest summary and a total.
#
# Usage: integrations/rmm/run_tests.sh OUTDIR [GTEST_ARG...]
#   GTEST_ARG...           passed to every binary (e.g. --gtest_filter=...)
#   MAGPIE_RMM_BASELINE=1  run the same tests on RMM's own resources
#                          (magpie_test_main.cpp), for comparison
#   LOG_DIR                where each binary's full output goes (default
#                          OUTDIR/logs, or OUTDIR/logs-baseline)
#   TEST_TIMEOUT           seconds one binary may run (default 1800)
# Exit status: 0 when every binary ran and no test failed.
set -euo pipefail

[[ $# -ge 1 ]] || {
  echo "usage: $0 OUTDIR [GTEST_ARG...]" >&2
  exit 2
}
OUT="$(cd "$1" && pwd)"
shift
mode=magpie
if [[ "${MAGPIE_RMM_BASELINE:-}" == 1 ]]; then mode=baseline; fi
LOG_DIR="${LOG_DIR:-$OUT/logs$(if [[ $mode == baseline ]]; then echo -baseline; fi)}"
TEST_TIMEOUT="${TEST_TIMEOUT:-1800}"
mkdir -p "$LOG_DIR"

# The binaries build.sh made, in its order; any rmm_* test binary else.
tests=()
if [[ -f "$OUT/BUILD_INFO" ]]; then
  read -r -a tests <<< "$(awk '$1 == "tests" { $1 = ""; print }' "$OUT/BUILD_INFO")"
  echo "run_tests: RMM tests from RMM commit $(awk '$1 == "rmm_source_commit" { print $2 }' "$OUT/BUILD_INFO")" \
    "against librmm $(awk '$1 == "librmm_wheel_version" { print $2 }' "$OUT/BUILD_INFO"), mode $mode"
else
  for f in "$OUT"/rmm_*; do
    if [[ -x "$f" && "$(basename "$f")" != rmm_random_allocations ]]; then tests+=("$(basename "$f")"); fi
  done
fi
[[ ${#tests[@]} -gt 0 ]] || {
  echo "run_tests: no test binaries in $OUT" >&2
  exit 1
}

# A gtest summary line's count: "[  PASSED  ] 12 tests." -> 12.
count() { # LOG TAG
  grep -m1 -E "^\[ *$2 *\] [0-9]+ test" "$1" | sed -E 's/^\[[^]]*\] ([0-9]+).*/\1/' || true
}

total_run=0 total_passed=0 total_failed=0 total_skipped=0 broken=()
printf '%-40s %6s %6s %6s %6s  %s\n' binary ran passed failed skipped status
for t in "${tests[@]}"; do
  log="$LOG_DIR/$t.log"
  rc=0
  # A binary's failures must not stop the others (set -e).
  timeout "$TEST_TIMEOUT" "$OUT/$t" "$@" > "$log" 2>&1 || rc=$?
  ran="$(grep -m1 -E '^\[==========\] [0-9]+ tests? from .* ran' "$log" | sed -E 's/^\[=+\] ([0-9]+).*/\1/' || true)"
  passed="$(count "$log" PASSED)"
  failed="$(count "$log" FAILED)"
  skipped="$(count "$log" SKIPPED)"
  status=ok
  if [[ -z "$ran" ]]; then
    # No summary: the binary crashed, hung, or refused to start (no GPU).
    status="no summary (exit status $rc): $(tail -n 1 "$log")"
    if [[ $rc == 124 ]]; then status="timed out after ${TEST_TIMEOUT}s"; fi
    broken+=("$t")
  elif [[ $rc != 0 ]]; then
    status="exit status $rc"
    if [[ -z "$failed" ]]; then broken+=("$t"); fi # a crash at exit, after the summary
  fi
  printf '%-40s %6s %6s %6s %6s  %s\n' "$t" "${ran:--}" "${passed:--}" "${failed:-0}" "${skipped:-0}" "$status"
  # Failed tests by name, as gtest lists them after its summary (the lines
  # with a time are the same tests as they ended).
  if [[ -n "$failed" ]]; then
    grep -E '^\[  FAILED  \] [^0-9]' "$log" | grep -v ' ms)$' | sed 's/^/    /' || true
  fi
  total_run=$((total_run + ${ran:-0}))
  total_passed=$((total_passed + ${passed:-0}))
  total_failed=$((total_failed + ${failed:-0}))
  total_skipped=$((total_skipped + ${skipped:-0}))
done

verdict=ok
if [[ $total_failed -gt 0 ]]; then verdict=FAILED; fi
if [[ ${#broken[@]} -gt 0 ]]; then verdict="FAILED (${#broken[@]} binaries without a summary)"; fi
printf '%-40s %6s %6s %6s %6s  %s\n' "TOTAL (${#tests[@]} binaries, $mode)" "$total_run" "$total_passed" \
  "$total_failed" "$total_skipped" "$verdict"
echo "run_tests: logs in $LOG_DIR"
[[ $total_failed -eq 0 && ${#broken[@]} -eq 0 ]]
