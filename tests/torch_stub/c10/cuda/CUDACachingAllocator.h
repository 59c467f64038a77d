// The part of PyTorch's c10 that python/magpie/torch_pools.h uses, for
// torch_pools_test.cpp: the test builds where PyTorch is not installed.
// Names and types as PyTorch 2.11 declares them; an allocator here has
// only the two calls the pools make.
#ifndef MAGPIE_TEST_TORCH_STUB_CUDA_CACHING_ALLOCATOR_H
#define MAGPIE_TEST_TORCH_STUB_CUDA_CACHING_ALLOCATOR_H

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace c10 {
using DeviceIndex = int8_t;
namespace cuda {
using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
namespace CUDACachingAllocator {
struct CUDAAllocator {
  virtual ~CUDAAllocator() = default;
  virtual void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) = 0;
  virtual void raw_delete(void *ptr) = 0;
};
} // namespace CUDACachingAllocator
} // namespace cuda
} // namespace c10

namespace magpie_test {
inline void check_message(std::ostringstream &) {}
template <typename T, typename... R>
void check_message(std::ostringstream &o, const T &v, const R &...r) {
  o << v;
  check_message(o, r...);
}
} // namespace magpie_test

// PyTorch's TORCH_CHECK throws c10::Error; a runtime_error stands in.
#define TORCH_CHECK(cond, ...)                                   \
  do {                                                           \
    if (!(cond)) {                                               \
      std::ostringstream magpie_check_out;                       \
      magpie_test::check_message(magpie_check_out, __VA_ARGS__); \
      throw std::runtime_error(magpie_check_out.str());          \
    }                                                            \
  } while (0)

#endif
