#!/usr/bin/env bash
# The simulated device's honesty under ThreadSanitizer (tests/sim_race_demo.c):
# a race reported exactly where CUDA would not order two accesses. Each mode
# runs in a process of its own; ThreadSanitizer exits 66 when it reported a
# race. In a build without ThreadSanitizer there is nothing to observe.
set -u
demo=$1
if ! "$demo" tsan; then
  echo "sim_race_demo_test: not a ThreadSanitizer build, nothing to check (bazel test --config=tsan)"
  exit 0
fi
export TSAN_OPTIONS="halt_on_error=0:exitcode=66:report_signal_unsafe=0"
fail=0
for pair in nowait:66 wait:0 event:0 rerecord:66 host-nosync:66 host-record:66 host-sync:0 destroyed:66 devsync:0; do
  mode=${pair%%:*} want=${pair##*:}
  "$demo" "$mode" > /dev/null 2> "${TEST_TMPDIR:-/tmp}/race_$mode.txt"
  got=$?
  if [[ $got == "$want" ]]; then
    echo "ok   $mode: exit $got"
  else
    echo "FAIL $mode: exit $got, expected $want ($([[ $want == 66 ]] && echo 'a race' || echo 'no race'))"
    tail -30 "${TEST_TMPDIR:-/tmp}/race_$mode.txt"
    fail=1
  fi
done
exit $fail
