#!/usr/bin/env bash
# The drop-in checks on a GPU machine: the GPU tests, the LD_PRELOAD program,
# PyTorch (tests/gpu/torch_test.py, tests/gpu/torch_memory_api.py,
# tests/gpu/torch_graph_test.py, tests/gpu/torch_ipc_test.py,
# tests/gpu/torch_multi_gpu_test.py) and CuPy (tests/gpu/cupy_test.py),
# plus what the installed PyTorch does with record_stream.
#
#   tools/gpu_dropin.sh build        here: builds the bundle (.gpu_bundle/, or
#                                    $MAGPIE_GPU_BUNDLE) with libmagpie.so,
#                                    libmagpie_preload.so, preload_prog,
#                                    preload_peer, preload_ipc, preload_static,
#                                    the Python package and the Python tests
#   bash .gpu_bundle/dropin.sh [ARGS]  there: runs everything, prints verdicts
#                                    (ARGS go to run.sh, e.g. --only NAME)
set -uo pipefail

if [[ ${1:-} == build ]]; then
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  bundle="$root/${MAGPIE_GPU_BUNDLE:-.gpu_bundle}"
  "$root/tools/gpu_suite.sh" build //:libmagpie.so //:libmagpie_preload.so //tests:preload_prog //tests:preload_peer \
    //tests:preload_ipc //tests:preload_static || exit 1
  cp "$root/tests/gpu/torch_test.py" "$root/tests/gpu/torch_memory_api.py" "$root/tests/gpu/cupy_test.py" "$root/tests/gpu/cupy_checks.py" \
    "$root/tests/gpu/torch_graph_test.py" "$root/tests/gpu/torch_ipc_test.py" \
    "$root/tests/gpu/torch_multi_gpu_test.py" "$root/tests/gpu/verdicts.py" "$root/tests/gpu/torch_mempool_test.py" \
    "$root/tests/gpu/torch_compile_test.py" \
    "$bundle/"
  gcc -shared -fPIC -O2 -Wall "$root/tests/gpu/mempool_alloc.c" -o "$bundle/bin/libmempool_alloc.so" -ldl || exit 1
  mkdir -p "$bundle/python"
  cp -r "$root/python/magpie" "$bundle/python/"
  # Beside the package, as the installed wheel has it: magpie.torch's native
  # allocator compiles against it on first use.
  cp "$root/include/magpie.h" "$bundle/python/magpie/"
  rm -rf "$bundle/python/magpie/__pycache__"
  cp "${BASH_SOURCE[0]}" "$bundle/dropin.sh"
  echo "run there: bash $(basename "$bundle")/dropin.sh"
  exit 0
fi

B=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MAGPIE_LIB=$B/bin/libmagpie.so MAGPIE_PRELOAD_LIB=$B/bin/libmagpie_preload.so
echo "### torch: $(python3 -c 'import torch;print(torch.__version__, torch.version.cuda)' 2>&1)"
TP=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
echo "### CUDAPluggableAllocator.h (record_stream)"
grep -n "record_stream\|recordStream" "$TP/include/torch/csrc/cuda/CUDAPluggableAllocator.h"
echo "### torch/cuda/memory.py CUDAPluggableAllocator"
awk '/^class CUDAPluggableAllocator/,/^def change_current_allocator/' "$TP/cuda/memory.py" |
  grep -n "def \|_cuda_customAllocator\|record"
echo "### torch._C names"
python3 -c "import torch; print([n for n in dir(torch._C) if 'ustomAllocator' in n or 'record' in n.lower()])"
echo "### libtorch_cuda cudart: $(ldd "$TP/lib/libtorch_cuda.so" | grep -i cudart)"
echo "### cupy: $(python3 -c 'import cupy;print(cupy.__version__)' 2>&1 | tail -1)"
status=0
echo "### GPU tests"
timeout 300 bash "$B/run.sh" "$@" || status=1
# One LD_PRELOAD program plainly, then under the preload: NAME SECONDS [NOTE].
preload_pair() {
  echo "### $1 (plain${3:+; $3})"
  timeout "$2" "$B/bin/$1" || status=1
  echo "### $1 (LD_PRELOAD)"
  PRELOAD_EXPECT=1 LD_PRELOAD=$MAGPIE_PRELOAD_LIB timeout "$2" "$B/bin/$1" || status=1
}
preload_pair preload_prog 60
preload_pair preload_peer 60
preload_pair preload_static 60 "nvcc's default -cudart static"
preload_pair preload_ipc 120
echo "### torch_test"
timeout 200 python3 "$B/torch_test.py" || status=1
echo "### torch_memory_api"
timeout 300 python3 "$B/torch_memory_api.py" || status=1
echo "### torch_mempool_test"
MEMPOOL_ALLOC_LIB=$B/bin/libmempool_alloc.so timeout 300 python3 "$B/torch_mempool_test.py" "${OUT:-$B}" || status=1
echo "### torch_compile_test"
timeout 600 python3 "$B/torch_compile_test.py" || status=1
echo "### torch_graph_test"
timeout 400 python3 "$B/torch_graph_test.py" --variants pytorch,magpie || status=1
echo "### torch_ipc_test"
timeout 300 python3 "$B/torch_ipc_test.py" || status=1
echo "### torch_multi_gpu_test (two GPUs; skipped on one)"
timeout 400 python3 "$B/torch_multi_gpu_test.py" || status=1
echo "### cupy_test"
timeout 120 python3 "$B/cupy_test.py" || status=1
echo "### dropin: $([[ $status == 0 ]] && echo PASS || echo FAIL)"
exit $status
