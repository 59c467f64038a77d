// The kernels and host helpers shared by the standalone CUDA programs run
// under LD_PRELOAD (preload_prog.cu, preload_static.cu, preload_ipc.cu), so
// that they all write and check one pattern. Each program is a single
// translation unit that includes this once; the definitions are inline
// (not static) so that a program that leaves one unused gets no nvcc warning.
#ifndef MAGPIE_TESTS_GPU_PRELOAD_KERNELS_CUH
#define MAGPIE_TESTS_GPU_PRELOAD_KERNELS_CUH

#include <cuda_runtime.h>
#include <stddef.h>

#include "cuda_check.h"

// Word i of seed's pattern. Host and device alike, so the host can check
// what a kernel wrote.
__host__ __device__ inline unsigned mix(unsigned seed, unsigned long long i) {
  unsigned long long x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return (unsigned)(x ^ (x >> 32));
}

__global__ void fill(unsigned *p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = mix(seed, i);
}

// Waits spin_ns first (so a premature reuse has time to overwrite), then
// counts words that are not the pattern.
__global__ void slow_check(const unsigned *p, size_t n, unsigned seed, unsigned long long spin_ns,
                           unsigned long long *bad) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= spin_ns) break;
    __nanosleep(1000);
  }
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    mine += ((volatile const unsigned *)p)[i] != mix(seed, i);
  if (mine) atomicAdd(bad, mine);
}

__global__ void copy_words(unsigned *dst, const unsigned *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

// The checks' tally, read by main: bad_counter must be allocated (managed
// memory) before the first use_then_check.
inline unsigned long long *bad_counter; // device: mismatches seen by checks
inline unsigned long long checks;       // host: checks launched (atomic add)

// Fills p's bytes with seed's pattern on s and queues a slow check of it
// behind, so that a block reused before s reaches the check shows.
inline void use_then_check(void *p, size_t bytes, unsigned seed, cudaStream_t s, unsigned long long spin_ns) {
  size_t n = bytes / 4;
  fill<<<64, 256, 0, s>>>((unsigned *)p, n, seed);
  slow_check<<<64, 256, 0, s>>>((const unsigned *)p, n, seed, spin_ns, bad_counter);
  CHECK(cudaGetLastError());
  __atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED);
}

inline size_t pick_size(unsigned *state) {
  static const size_t sizes[] = {256, 4096, 65536, 1 << 20, 3 << 20};
  *state = *state * 1103515245u + 12345u;
  return sizes[(*state >> 16) % 5];
}

// The graph case's neighbour thread: allocates, checks and frees through
// cudaMallocAsync on its own streams while the graph replays, until
// graph_stop is set.
inline volatile int graph_stop;

inline void *graph_neighbour(void *arg) {
  (void)arg;
  CHECK(cudaSetDevice(0));
  cudaStream_t s[2];
  for (auto &x : s) CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  unsigned rng = 99u;
  for (int it = 0; !graph_stop; it++) {
    size_t n = pick_size(&rng);
    void *p = nullptr;
    CHECK(cudaMallocAsync(&p, n, s[it % 2]));
    use_then_check(p, n, 5000u + it, s[it % 2], 0);
    CHECK(cudaFreeAsync(p, s[it % 2]));
  }
  for (auto &x : s) {
    CHECK(cudaStreamSynchronize(x));
    CHECK(cudaStreamDestroy(x));
  }
  return nullptr;
}

#endif // MAGPIE_TESTS_GPU_PRELOAD_KERNELS_CUH
