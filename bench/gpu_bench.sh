#!/usr/bin/env bash
# Builds the benchmark suite here for a GPU machine and bundles it:
#
#   bench/gpu_bench.sh
#
# Uses tools/gpu_suite.sh (-c opt; the GPU tests come along) into the folder
# named by MAGPIE_GPU_BUNDLE (default .gpu_bench), adds the run script, the
# PyTorch shim's source and the plot script, and prints the commands: the
# one to run on the GPU machine and the one that draws the plots here from
# the CSV that comes back.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MAGPIE_GPU_BUNDLE=${MAGPIE_GPU_BUNDLE:-.gpu_bench}
"$root/tools/gpu_suite.sh" build //bench:magpie_bench
cp "$root/bench/run_gpu.sh" "$root/bench/torch_shim.cpp" "$root/bench/plot.py" "$root/$MAGPIE_GPU_BUNDLE/"
cat <<MSG
bundle ready: $root/$MAGPIE_GPU_BUNDLE
on the GPU machine (from the folder holding $MAGPIE_GPU_BUNDLE):
  bash $MAGPIE_GPU_BUNDLE/run_gpu.sh OUTDIR            # all workloads; options go to magpie_bench
  MAGPIE_BENCH_MEMCHECK=1 bash $MAGPIE_GPU_BUNDLE/run_gpu.sh OUTDIR   # and the GPU tests under memcheck
then here: python3 bench/plot.py OUTDIR/results.csv bench/results/<machine>-<YYYY-MM-DD>-<commit>
MSG
