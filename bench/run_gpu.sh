#!/usr/bin/env bash
# Runs the benchmark suite on a GPU machine, from the bundle that
# bench/gpu_bench.sh makes (no Bazel there):
#
#   bash .gpu_bench/run_gpu.sh OUTDIR [magpie_bench options...]
#
# Builds bench/torch_shim.cpp against the installed PyTorch when python3
# can import torch (else PyTorch's allocator is skipped, with the reason in
# OUTDIR/torch_shim.log), then runs each workload in its own process (the
# fragmentation trace first), every allocator inside that process. Writes
# OUTDIR/bench.log (the tables), OUTDIR/results.csv (all figures) and
# OUTDIR/machine.txt. MAGPIE_BENCH_MEMCHECK=1 also runs the bundled GPU
# tests under compute-sanitizer (OUTDIR/gpu_tests_memcheck.log).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: run_gpu.sh OUTDIR [magpie_bench options]}
shift
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cuda_home=${CUDA_HOME:-/usr/local/cuda}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  sed 's/^/bundle /' "$here/MANIFEST" 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  echo "cpu: $(nproc) x $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
  echo "g++: $(g++ --version 2>/dev/null | head -1)"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1 | tail -1)"
} > "$out/machine.txt"
cat "$out/machine.txt"

# PyTorch's allocator: a C shim compiled against this machine's torch.
shim=""
tdir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
if [[ -n $tdir && -d $tdir/include ]]; then
  abi=$(python3 -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
  so=$(mktemp -d)/bench_torch_shim.so
  start=$(date +%s)
  if g++ -std=c++17 -O2 -shared -fPIC -D_GLIBCXX_USE_CXX11_ABI="$abi" "$here/torch_shim.cpp" -o "$so" \
      -I"$tdir/include" -I"$tdir/include/torch/csrc/api/include" -I"$cuda_home/include" \
      -L"$tdir/lib" -lc10_cuda -lc10 -Wl,-rpath,"$tdir/lib" > "$out/torch_shim.log" 2>&1; then
    shim=$so
    echo "torch shim: built against $tdir in $(($(date +%s) - start)) s" | tee -a "$out/torch_shim.log"
  else
    echo "torch shim: build failed (see torch_shim.log); PyTorch's allocator is skipped"
    tail -20 "$out/torch_shim.log"
  fi
else
  echo "PyTorch not found (python3 -c 'import torch'): its allocator is skipped" | tee "$out/torch_shim.log"
fi

rc=0
: > "$out/bench.log"
echo "workload,allocator,x,metric,value" > "$out/results.csv"
for w in 5 7 1 2 3 4 6; do
  echo "+ magpie_bench -w $w ${shim:+--torch $shim} $*" | tee -a "$out/bench.log"
  timeout 300 "$here/bin/magpie_bench" -w "$w" --csv "$out/w$w.csv" ${shim:+--torch "$shim"} "$@" 2>&1 |
    tee -a "$out/bench.log"
  r=${PIPESTATUS[0]}
  ((r != 0)) && { echo "workload $w: exit $r" | tee -a "$out/bench.log"; rc=1; }
  [[ -f $out/w$w.csv ]] && tail -n +2 "$out/w$w.csv" >> "$out/results.csv" && rm -f "$out/w$w.csv"
done

if [[ ${MAGPIE_BENCH_MEMCHECK:-0} == 1 && -d $here/tests ]]; then
  bash "$here/run.sh" --sanitize > "$out/gpu_tests_memcheck.log" 2>&1 || rc=1
  tail -1 "$out/gpu_tests_memcheck.log"
fi
exit $rc
