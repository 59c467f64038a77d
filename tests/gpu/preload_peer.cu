// preload_peer: peer and pool access in an ordinary two-GPU CUDA program,
// run as is and under LD_PRELOAD=libmagpie_preload.so (tests/gpu/README.md),
// as NVIDIA's simpleP2P and streamOrderedAllocationP2P samples use them:
//   1. cudaMalloc on device 0; device 1 enables peer access to device 0
//      (cudaDeviceEnablePeerAccess); a device-1 kernel reads device 0's
//      block and writes its own; cudaMemcpy between the devices
//      (cudaMemcpyDefault);
//   2. device 1's default pool opened to device 0 (cudaMemPoolSetAccess,
//      read-write; no peer access enabled in that direction); a
//      cudaMallocAsync block of device 1 written by a device-0 kernel;
//      cudaMemPoolGetAccess answers read-write.
// Every word is checked on the host. With PRELOAD_EXPECT=1 it also requires
// that magpie served the blocks of both devices (magpie_stats_get found in
// the process, reserved > 0). With fewer than two GPUs, or without peer
// access between 0 and 1, it says so and exits 0.
//
// Built with nvcc -cudart shared (a statically linked runtime cannot be
// interposed).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_check.h"

static const size_t N = (size_t)1 << 20; // words per block (4 MiB)

__global__ void fill(unsigned *p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = seed ^ (unsigned)(i * 2654435761u);
}

// dst[i] = src[i] + 1, src possibly another device's memory.
__global__ void copy_plus_one(unsigned *dst, const unsigned *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i] + 1;
}

static size_t wrong(const unsigned *h, size_t n, unsigned seed, unsigned add) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += h[i] != ((seed ^ (unsigned)(i * 2654435761u)) + add);
  return bad;
}

// Reserved bytes magpie reports for device d, or -1 if magpie is not in the
// process.
static long long magpie_reserved(int d) {
  typedef int (*stats_fn)(int, void *);
  stats_fn f = (stats_fn)dlsym(RTLD_DEFAULT, "magpie_stats_get");
  if (f == NULL) return -1;
  size_t st[256] = {0}; // larger than magpie_stats; reserved_bytes is its second field
  if (f(d, st) != 0) return -1;
  return (long long)st[1];
}

int main(void) {
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  int can10 = 0, can01 = 0;
  if (n >= 2) {
    CHECK(cudaDeviceCanAccessPeer(&can10, 1, 0));
    CHECK(cudaDeviceCanAccessPeer(&can01, 0, 1));
  }
  if (n < 2 || !can10 || !can01) {
    printf("preload_peer: skipped (%d GPU(s), peer access 1->0 %d, 0->1 %d)\n", n, can10, can01);
    return 0;
  }
  unsigned *h = (unsigned *)malloc(N * sizeof *h);
  int failed = 0;

  // 1. Peer access: device 1 reads device 0's cudaMalloc block.
  unsigned *a0 = NULL, *b1 = NULL, *c1 = NULL;
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&a0, N * sizeof *a0));
  fill<<<256, 256>>>(a0, N, 0xA0u);
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaSetDevice(1));
  CHECK(cudaDeviceEnablePeerAccess(0, 0));
  CHECK(cudaMalloc(&b1, N * sizeof *b1));
  CHECK(cudaMalloc(&c1, N * sizeof *c1));
  copy_plus_one<<<256, 256>>>(b1, a0, N);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(h, b1, N * sizeof *h, cudaMemcpyDefault));
  size_t bad = wrong(h, N, 0xA0u, 1);
  printf("%s peer access: device 1's kernel read device 0's cudaMalloc block (%zu wrong words)\n",
         bad ? "FAIL" : "PASS", bad);
  failed |= bad != 0;
  CHECK(cudaMemcpy(c1, a0, N * sizeof *c1, cudaMemcpyDefault));
  CHECK(cudaMemcpy(h, c1, N * sizeof *h, cudaMemcpyDefault));
  bad = wrong(h, N, 0xA0u, 0);
  printf("%s peer copy: cudaMemcpy device 0 -> device 1, cudaMemcpyDefault (%zu wrong words)\n", bad ? "FAIL" : "PASS",
         bad);
  failed |= bad != 0;

  // 2. Pool access: device 0 writes device 1's pool block (no peer access
  // enabled from device 0).
  cudaMemPool_t pool1;
  CHECK(cudaDeviceGetDefaultMemPool(&pool1, 1));
  cudaMemAccessDesc desc = {};
  desc.location.type = cudaMemLocationTypeDevice;
  desc.location.id = 0;
  desc.flags = cudaMemAccessFlagsProtReadWrite;
  CHECK(cudaMemPoolSetAccess(pool1, &desc, 1));
  cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
  cudaMemLocation loc = {};
  loc.type = cudaMemLocationTypeDevice;
  loc.id = 0;
  CHECK(cudaMemPoolGetAccess(&flags, pool1, &loc));
  printf("%s pool access: cudaMemPoolGetAccess answers %d (read-write is %d)\n",
         flags == cudaMemAccessFlagsProtReadWrite ? "PASS" : "FAIL", (int)flags, (int)cudaMemAccessFlagsProtReadWrite);
  failed |= flags != cudaMemAccessFlagsProtReadWrite;
  cudaStream_t s1, s0;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  unsigned *p1 = NULL;
  CHECK(cudaMallocAsync(&p1, N * sizeof *p1, s1));
  fill<<<256, 256, 0, s1>>>(p1, N, 0xB1u);
  CHECK(cudaStreamSynchronize(s1));
  CHECK(cudaSetDevice(0));
  CHECK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  copy_plus_one<<<256, 256, 0, s0>>>(p1, p1, N); // device 0 reads and writes device 1's pool block
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(s0));
  CHECK(cudaMemcpy(h, p1, N * sizeof *h, cudaMemcpyDefault));
  bad = wrong(h, N, 0xB1u, 1);
  printf("%s pool access: device 0's kernel wrote device 1's cudaMallocAsync block (%zu wrong words)\n",
         bad ? "FAIL" : "PASS", bad);
  failed |= bad != 0;
  CHECK(cudaSetDevice(1));
  CHECK(cudaFreeAsync(p1, s1));
  CHECK(cudaStreamSynchronize(s1));

  long long r0 = magpie_reserved(0), r1 = magpie_reserved(1);
  if (getenv("PRELOAD_EXPECT") != NULL) {
    int served = r0 > 0 && r1 > 0;
    printf("%s magpie served both devices (reserved %lld and %lld bytes)\n", served ? "PASS" : "FAIL", r0, r1);
    failed |= !served;
  }
  CHECK(cudaFree(c1));
  CHECK(cudaFree(b1));
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(a0));
  free(h);
  printf("preload_peer: %s\n", failed ? "FAILED" : "passed");
  return failed ? 1 : 0;
}
