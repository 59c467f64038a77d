#!/usr/bin/env bash
# Runs a test binary built with a deliberate bug and passes only if it
# fails (nonzero exit) and its output contains the expected message.
# Usage: expect_failure.sh BINARY PATTERN [ARGS...]
set -u
bin=$1
pattern=$2
shift 2
# Under ThreadSanitizer the bug may also show as a data race: keep running
# so that the checker's own report is made too.
export TSAN_OPTIONS="${TSAN_OPTIONS:-}:halt_on_error=0"
out=$("$bin" "$@" 2>&1)
rc=$?
# The broken binary's own report, indented so that its cmocka summary lines
# are not counted as this test's results.
echo "$out" | tail -n 40 | sed 's/^/  | /'
echo "--- exit status $rc"
if [ "$rc" -eq 0 ]; then
  echo "FAIL: the deliberately broken build passed its tests"
  echo "[  FAILED  ] 1 test(s)."
  exit 1
fi
if ! grep -q -- "$pattern" <<<"$out"; then
  echo "FAIL: it failed, but without \"$pattern\""
  echo "[  FAILED  ] 1 test(s)."
  exit 1
fi
echo "OK: the deliberately broken build fails as expected (\"$pattern\")"
echo "[  PASSED  ] 1 test(s)."
