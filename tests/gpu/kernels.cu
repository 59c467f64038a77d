// Kernels of the GPU tests. Compiled to PTX (compute_90) by a genrule,
// embedded in the test binaries and loaded with cuModuleLoadData, so the
// tests themselves stay plain C linked against the driver.
//
// Kernels that wait for something bound the wait with the device's global
// timer, so a broken test ends instead of hanging the GPU.

typedef unsigned long long u64;

__device__ static u64 gpu_now_ns(void) {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ static unsigned int gpu_mix(unsigned int seed, u64 i) {
  u64 x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return (unsigned int)(x ^ (x >> 32));
}

// p[i] = mix(seed, i) over n words.
extern "C" __global__ void gpu_fill_u32(unsigned int *p, u64 n, unsigned int seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    p[i] = gpu_mix(seed, i);
}

// Counts the words that are not mix(seed, i).
extern "C" __global__ void gpu_check_u32(const unsigned int *p, u64 n, unsigned int seed, unsigned int *bad) {
  unsigned int mine = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    mine += p[i] != gpu_mix(seed, i);
  if (mine) atomicAdd(bad, mine);
}

// One block. Keeps writing tag over block[0..n) until *flag (host memory,
// read through its device pointer with volatile loads) becomes nonzero or
// timeout_ns passes. *status: 3 once running, then 1 (released) or
// 2 (timed out).
extern "C" __global__ void gpu_hold(const volatile int *flag, u64 *block, u64 n, u64 tag, u64 timeout_ns,
                                    volatile int *status) {
  __shared__ int stop;
  u64 t0 = gpu_now_ns();
  if (threadIdx.x == 0) {
    *status = 3;
    __threadfence_system();
  }
  for (;;) {
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) ((volatile u64 *)block)[i] = tag;
    if (threadIdx.x == 0) stop = *flag ? 1 : (gpu_now_ns() - t0 > timeout_ns ? 2 : 0);
    __syncthreads();
    int s = stop;
    __syncthreads();
    if (s) {
      if (threadIdx.x == 0) {
        __threadfence_system();
        *status = s;
      }
      return;
    }
  }
}

// p[i] = tag over n 64-bit words.
extern "C" __global__ void gpu_stamp(u64 *p, u64 n, u64 tag) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) p[i] = tag;
}

// Counts words that are not expect, then (if restamp) writes tag: the
// check before a block changes hands or is freed.
extern "C" __global__ void gpu_check_stamp(u64 *p, u64 n, u64 expect, u64 tag, int restamp, unsigned int *bad) {
  unsigned int mine = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    mine += p[i] != expect;
    if (restamp) p[i] = tag;
  }
  if (mine) atomicAdd(bad, mine);
}

// Occupies the stream for about ns nanoseconds (a window for races).
extern "C" __global__ void gpu_delay(u64 ns) {
  u64 t0 = gpu_now_ns();
  while (gpu_now_ns() - t0 < ns) {
  }
}

// Batches (the soak test): one thread block per entry of a batch of blocks
// whose pointers, tags and sizes sit in host-mapped pinned memory. Each
// block's probe words (up to 64, spread over the whole block, first and
// last included) get the tag, or are checked against it.
__device__ static u64 gpu_probe(u64 words, unsigned j) {
  u64 step = words > 64 ? (words - 1) / 63 : 1;
  u64 w = (u64)j * step;
  return w < words ? w : words - 1;
}

extern "C" __global__ void gpu_batch_stamp(u64 *const *ptrs, const u64 *tags, const u64 *words, unsigned n) {
  unsigned b = blockIdx.x;
  if (b >= n) return;
  u64 *p = ptrs[b];
  u64 w = words[b];
  if (threadIdx.x < 64 && (u64)threadIdx.x < (w < 64 ? w : 64)) p[gpu_probe(w, threadIdx.x)] = tags[b];
}

extern "C" __global__ void gpu_batch_check(u64 *const *ptrs, const u64 *tags, const u64 *words, unsigned n,
                                           unsigned int *bad) {
  unsigned b = blockIdx.x;
  if (b >= n) return;
  u64 *p = ptrs[b];
  u64 w = words[b];
  if (threadIdx.x < 64 && (u64)threadIdx.x < (w < 64 ? w : 64) && p[gpu_probe(w, threadIdx.x)] != tags[b])
    atomicAdd(bad, 1u);
}
