// PyTorch's CUDA caching allocator behind a C interface, for the benchmark
// suite (bench/allocators.c loads it with dlopen). Built on the GPU machine
// by bench/run_gpu.sh against the installed torch package:
//
//   g++ -std=c++17 -O2 -shared -fPIC torch_shim.cpp -I$TORCH/include \
//       -I$CUDA_HOME/include -L$TORCH/lib -lc10_cuda -lc10 -Wl,-rpath,$TORCH/lib
//
// It calls the same entry points as torch.cuda's raw allocations
// (c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete) and
// reads the allocator's own reserved-bytes statistics. No exception crosses
// the C boundary: a failed allocation returns NULL.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdint>
#include <cstdio>
#include <exception>

namespace alloc = c10::cuda::CUDACachingAllocator;

extern "C" {

int bench_torch_init(char *err, size_t n) {
  try {
    int count = c10::cuda::device_count();
    if (count < 1) {
      std::snprintf(err, n, "no CUDA device visible to PyTorch");
      return -1;
    }
    alloc::init(count);
    return 0;
  } catch (const std::exception &e) {
    std::snprintf(err, n, "%s", e.what());
    return -1;
  }
}

void *bench_torch_alloc(size_t size, cudaStream_t stream) {
  try {
    return alloc::raw_alloc_with_stream(size, stream);
  } catch (const std::exception &e) {
    static int told;
    if (!told++) std::fprintf(stderr, "pytorch: raw_alloc_with_stream(%zu): %s\n", size, e.what());
    return nullptr;
  }
}

void bench_torch_free(void *p) {
  try {
    alloc::raw_delete(p);
  } catch (const std::exception &e) {
    std::fprintf(stderr, "pytorch: raw_delete: %s\n", e.what());
  }
}

int bench_torch_empty_cache(void) {
  try {
    alloc::emptyCache();
    return 0;
  } catch (const std::exception &) {
    return -1;
  }
}

int bench_torch_reset_peak(void) {
  try {
    alloc::resetPeakStats(0);
    return 0;
  } catch (const std::exception &) {
    return -1;
  }
}

// Reserved bytes (segments obtained from cudaMalloc) now and at the peak,
// over all pools (StatType::AGGREGATE).
int bench_torch_reserved(uint64_t *current, uint64_t *peak) {
  try {
    auto st = alloc::getDeviceStats(0);
    const auto &r = st.reserved_bytes[0];
    *current = (uint64_t)r.current;
    *peak = (uint64_t)r.peak;
    return 0;
  } catch (const std::exception &) {
    return -1;
  }
}
}
