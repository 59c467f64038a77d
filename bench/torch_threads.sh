#!/usr/bin/env bash
# Builds bench/torch_threads.cpp against the installed PyTorch (a machine
# with PyTorch, its C++ headers and a C++ compiler) and runs its modes in
# turn: PyTorch's caching allocator, magpie behind PyTorch's
# CUDAPluggableAllocator, magpie's own PyTorch allocator (built by the
# magpie package found by python3), magpie called directly.
#
#   [MODES="magpie direct"] bash bench/torch_threads.sh LIBMAGPIE [SIZE] [SECONDS]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
lib=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
tp=$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))")
abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
cuda=${CUDA_HOME:-/usr/local/cuda}
out=${TMPDIR:-/tmp}/torch_threads
if [[ ! -x $out || $here/torch_threads.cpp -nt $out ]]; then # built once per folder and source
  "${CXX:-c++}" -O2 -std=c++17 -D_GLIBCXX_USE_CXX11_ABI="$abi" -isystem "$tp/include" \
    -isystem "$tp/include/torch/csrc/api/include" -isystem "$cuda/include" "$here/torch_threads.cpp" -o "$out" \
    -L"$tp/lib" -Wl,-rpath,"$tp/lib" -ltorch_cuda -ltorch_cpu -lc10_cuda -lc10 \
    -L"$cuda/lib64" -Wl,-rpath,"$cuda/lib64" -lcudart -ldl -lpthread
fi
echo "torch $(python3 -c 'import torch; print(torch.__version__)'), $(nvidia-smi -L 2> /dev/null | head -1)"
MAGPIE_TORCH_NATIVE=$(python3 -c "import torch, magpie._shim as s; print(s.build(torch, s._NATIVE))")
export MAGPIE_TORCH_NATIVE
for mode in ${MODES:-native pluggable magpie direct}; do "$out" "$mode" "$lib" "${2:-4096}" "${3:-1}"; done
