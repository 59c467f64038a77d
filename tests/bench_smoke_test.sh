#!/usr/bin/env bash
# The benchmarks still run: every workload of magpie_bench, peak_probe,
# pair_bench and scaling_bench on the simulated device, each with tiny
# parameters (they measure nothing here; the figures are not checked). A
# workload that crashes, hangs, reports a failed device call or a failed
# magpie allocation, or stops printing its table fails the test; under the
# sanitizer builds, so does any report from its code.
set -euo pipefail
bench=$1
probe=$2
pair=$3
scaling=$4
export MAGPIE_BACKEND=sim
out=$(mktemp)
trap 'rm -f "$out"' EXIT
failed=0

check() { # name, then patterns the output must hold
  local name=$1
  shift
  for p in "$@"; do
    if ! grep -qE -- "$p" "$out"; then
      echo "FAIL: $name: no line matching '$p'"
      failed=1
    fi
  done
}

run() { # name, then the command
  local name=$1
  shift
  if ! timeout 300 "$@" > "$out" 2>&1; then
    echo "FAIL: $name exited with an error:"
    tail -20 "$out"
    failed=1
  fi
}

run magpie_bench "$bench" -w 1,2,3,4,5,6,7 --seed 7 --allocs magpie,bestfit --lat-sizes 256,4m --lat-pairs 2000 \
  --threads 1,2 --seconds 0.05 --mix 256,2m --spread --pipe 2,4 --pipe-seconds 0.05 --pipe-rounds 1 \
  --cross-pairs 2 --cross-seconds 0.05 --trace 2,2,4 --trace-hidden 256 --trace-layers 2 \
  --rot-streams 1,33 --rot-rounds 2 --rot-blocks 2 --demo 2,2,200
check magpie_bench '^== 1 latency' '^== 2 scaling' '^== 3 pipeline' '^== 4 ' '^== 5 trace' '^== 6 streams' \
  '^== 7 demo' '^magpie +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +0$' '^bestfit ' \
  'failed CUDA calls: 0; magpie failed allocations: 0;'
run peak_probe "$probe" 3 20000
check peak_probe 'bestfit' 'magpie'
run peak_probe_mixed "$probe" 3 20000 2097152 - mixed
check peak_probe_mixed 'powers of two' 'bestfit' 'magpie'
run pair_bench "$pair" 20000 1
check pair_bench 'magpie'
run scaling_bench "$scaling" 2 0.05 16
check scaling_bench 'magpie'
if ((failed)); then exit 1; fi
echo "PASS: magpie_bench (workloads 1-7), peak_probe, pair_bench and scaling_bench ran"
echo "[  PASSED  ] 1 test(s)." # counted by tools/test.sh with the cmocka tests
