/* magpie's resource for RMM's benchmarks: integrations/rmm/build.sh
 * includes this in random_allocations.cpp and
 * multi_stream_allocations_bench.cu, whose factories of RMM's own
 * resources it stands beside (make_cuda, make_pool, ...). */
#ifndef MAGPIE_RMM_BENCH_HPP
#define MAGPIE_RMM_BENCH_HPP

#include <cuda/memory_resource>
#include <magpie_rmm.hpp>

#include <stdexcept>

/* Not on magpie's simulated device, which magpie picks by itself where it
 * finds no GPU: the figures would not be a GPU's. */
inline cuda::mr::any_resource<cuda::mr::device_accessible> make_magpie() {
  if (magpie_active_backend() != MAGPIE_BACKEND_CUDA) {
    throw std::runtime_error("magpie is not on its CUDA backend (no GPU, or MAGPIE_BACKEND=sim)");
  }
  return magpie::rmm_memory_resource{};
}

#endif /* MAGPIE_RMM_BENCH_HPP */
