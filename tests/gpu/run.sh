#!/usr/bin/env bash
# Runs the GPU tests of a bundle made by tools/gpu_suite.sh (this file is
# copied into .gpu_bundle/). On the GPU machine:
#
#   bash .gpu_bundle/run.sh [--sanitize] [--only NAME]...
#       runs every bundled test (or only those named), prints each one's
#       output, ends with "N passed, N failed", exits nonzero on a failure.
#       --sanitize runs each under compute-sanitizer --tool memcheck.
#   bash .gpu_bundle/run.sh --bin NAME [ARGS...]
#       runs a bundled non-test binary (benchmark, demo) with the bundle's
#       libraries.
#
# MAGPIE_GPU_TEST_TIMEOUT (seconds, default 600) bounds each test.
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

sanitize=0
only=()
while (($#)); do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --only) only+=("${2:?--only needs a test name}"); shift ;;
    --bin)
      name=${2:?--bin needs a binary name}
      shift 2
      exec "$here/bin/$name" "$@"
      ;;
    -h | --help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

runner=()
if ((sanitize)); then
  export MAGPIE_GPU_HOLD_SECONDS=${MAGPIE_GPU_HOLD_SECONDS:-120}
  export MAGPIE_GPU_UNDER_SANITIZER=1
  cs=$(command -v compute-sanitizer || true)
  for d in "${CUDA_HOME:-/usr/local/cuda}/bin" /usr/local/cuda/bin; do
    [[ -z $cs && -x $d/compute-sanitizer ]] && cs=$d/compute-sanitizer
  done
  if [[ -z $cs ]]; then
    echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin)" >&2
    exit 2
  fi
  # The tests provoke driver errors on purpose (out of memory, bad ranges):
  # only memory errors count. Child processes (the probe) are checked too.
  runner=("$cs" --tool memcheck --error-exitcode 86 --report-api-errors no
    --target-processes all)
fi

[[ -f $here/MANIFEST ]] && sed 's/^/bundle /' "$here/MANIFEST"
command -v nvidia-smi > /dev/null && nvidia-smi -L

pass=0
fail=0
failed=()
# run_one LABEL TEST [VAR=value...]: one run of a test binary, counted.
run_one() {
  local label=$1 t=$2
  shift 2
  echo "=== $label${runner[0]:+ (memcheck)}"
  local start rc secs why
  start=$(date +%s)
  env "$@" timeout --kill-after=10 "${MAGPIE_GPU_TEST_TIMEOUT:-600}" "${runner[@]}" "$t"
  rc=$?
  secs=$(($(date +%s) - start))
  if ((rc == 0)); then
    pass=$((pass + 1))
    echo "=== $label: PASS (${secs} s)"
  else
    fail=$((fail + 1))
    failed+=("$label")
    why="exit $rc"
    ((rc == 124 || rc == 137)) && why="timed out"
    ((rc == 86)) && why="memcheck errors"
    echo "=== $label: FAIL ($why, ${secs} s)"
  fi
}

gpus=$( (nvidia-smi -L 2> /dev/null || true) | grep -c '^GPU ')
for t in "$here"/tests/*; do
  [[ -x $t ]] || continue
  name=$(basename "$t")
  if ((${#only[@]})); then
    want=0
    for o in "${only[@]}"; do [[ $o == "$name" ]] && want=1; done
    ((want)) || continue
  fi
  run_one "$name" "$t"
  # The allocator again where the device reports no virtual memory
  # management: slabs are cuMemAlloc'd and found through the page map.
  [[ $name == gpu_alloc_test ]] && run_one "$name[no-vmm]" "$t" MAGPIE_CUDA_VMM=0
  # The soak again over two GPUs where there are two: every hand-off
  # crosses the devices (gpu_soak_test.c).
  [[ $name == gpu_soak_test && $gpus -ge 2 ]] && run_one "$name[2 devices]" "$t" MAGPIE_SOAK_DEVICES=2
done

echo "$pass passed, $fail failed${failed[0]:+ (${failed[*]})}"
((fail == 0 && pass > 0))
