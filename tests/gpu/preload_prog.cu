// preload_prog: an ordinary CUDA program (shared runtime, driver API too)
// that checks its device memory stays correct, run as is and under
// LD_PRELOAD=libmagpie_preload.so (tests/gpu/README.md).
//
// Every block is filled by a kernel with a pattern and checked by a later,
// deliberately slow kernel on the stream of its last use, after which the
// block is freed; the next allocation (another stream, another thread) is
// immediately overwritten with another pattern. A block handed out while
// the slow check still runs shows as a mismatch.
//   1. cudaMallocAsync / cudaFreeAsync on 4 streams in each of 8 threads;
//   2. cudaMalloc / cudaFree, used on one stream, reallocated on another;
//   3. the driver's cuMemAlloc / cuMemFree and cuMemAllocAsync /
//      cuMemFreeAsync;
//   4. pointers from functions that are not interposed (managed memory,
//      pitched memory, an explicit pool) freed with cudaFree / cudaFreeAsync
//      (they must reach the real functions);
//   5. the default pool's usage attributes, reset and trim;
//   6. a CUDA graph capturing cudaMallocAsync / cudaFreeAsync (graph memory
//      nodes, which stay CUDA's under the preload library) and a kernel
//      copying through the temporary into a block allocated before the
//      capture; replayed 200 times while another thread allocates, fills
//      and frees through cudaMallocAsync on its own streams; every replay's
//      output is checked.
// With PRELOAD_EXPECT=1 it also requires that magpie served the
// allocations (magpie_stats_get found in the process and reserved > 0).
//
// Built with nvcc -cudart shared (a statically linked runtime cannot be
// interposed).
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "preload_kernels.cuh"

#define CHECK_DRV(call)                                                                \
  do {                                                                                 \
    CUresult r_ = (call);                                                              \
    if (r_ != CUDA_SUCCESS) {                                                          \
      fprintf(stderr, "%s:%d: %s: CUresult %d\n", __FILE__, __LINE__, #call, (int)r_); \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

struct worker_arg {
  int id;
};

static void *async_worker(void *arg) {
  int id = ((worker_arg *)arg)->id;
  CHECK(cudaSetDevice(0));
  cudaStream_t s[4];
  for (auto &x : s) CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  unsigned rng = 17u + (unsigned)id;
  for (int it = 0; it < 200; it++) {
    cudaStream_t a = s[it % 4], b = s[(it + 1) % 4];
    size_t n = pick_size(&rng);
    void *p = nullptr, *q = nullptr;
    CHECK(cudaMallocAsync(&p, n, a));
    use_then_check(p, n, 1000u * id + it, a, it % 8 == 0 ? 200000 : 0);
    CHECK(cudaFreeAsync(p, a));
    CHECK(cudaMallocAsync(&q, n, b)); // another stream: must not be p until a's check ran
    fill<<<64, 256, 0, b>>>((unsigned *)q, n / 4, 0xdeadu);
    CHECK(cudaGetLastError());
    CHECK(cudaFreeAsync(q, b));
  }
  for (auto &x : s) {
    CHECK(cudaStreamSynchronize(x));
    CHECK(cudaStreamDestroy(x));
  }
  return nullptr;
}

static void sync_alloc_case(void) {
  cudaStream_t a, b;
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  for (int it = 0; it < 50; it++) {
    size_t n = (size_t)(it % 5 + 1) << 16;
    void *p = nullptr, *q = nullptr;
    CHECK(cudaMalloc(&p, n));
    use_then_check(p, n, 7u + it, a, 100000);
    CHECK(cudaFree(p)); // used on a, freed with no stream
    CHECK(cudaMalloc(&q, n));
    fill<<<64, 256, 0, b>>>((unsigned *)q, n / 4, 0xbeefu);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(b));
    CHECK(cudaFree(q));
  }
  CHECK(cudaStreamDestroy(a));
  CHECK(cudaStreamDestroy(b));
}

static void driver_case(void) {
  CUstream a, b;
  CHECK_DRV(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
  CHECK_DRV(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
  for (int it = 0; it < 50; it++) {
    size_t n = (size_t)(it % 3 + 1) << 18;
    CUdeviceptr p, q;
    CHECK_DRV(cuMemAlloc(&p, n));
    use_then_check((void *)p, n, 99u + it, (cudaStream_t)a, 50000);
    CHECK_DRV(cuMemFree(p));
    CHECK_DRV(cuMemAllocAsync(&p, n, a));
    use_then_check((void *)p, n, 199u + it, (cudaStream_t)a, it % 5 == 0 ? 200000 : 0);
    CHECK_DRV(cuMemFreeAsync(p, a));
    CHECK_DRV(cuMemAllocAsync(&q, n, b));
    fill<<<64, 256, 0, (cudaStream_t)b>>>((unsigned *)q, n / 4, 0xfeedu);
    CHECK(cudaGetLastError());
    CHECK_DRV(cuMemFreeAsync(q, b));
  }
  CHECK_DRV(cuStreamSynchronize(a));
  CHECK_DRV(cuStreamSynchronize(b));
  CHECK_DRV(cuStreamDestroy(a));
  CHECK_DRV(cuStreamDestroy(b));
}

static void passthrough_case(void) {
  void *m = nullptr, *pitched = nullptr;
  size_t pitch = 0;
  CHECK(cudaMallocManaged(&m, 1 << 20));
  memset(m, 1, 1 << 20);
  CHECK(cudaFree(m));
  CHECK(cudaMallocPitch(&pitched, &pitch, 1000, 100));
  CHECK(cudaFree(pitched));
  cudaMemPool_t pool;
  cudaMemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  CHECK(cudaMemPoolCreate(&pool, &props));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *fp = nullptr;
  CHECK(cudaMallocFromPoolAsync(&fp, 1 << 20, pool, s));
  CHECK(cudaFreeAsync(fp, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaStreamDestroy(s));
  CHECK(cudaMemPoolDestroy(pool));
  CHECK(cudaFree(nullptr)); // a no-op, as always
}

// 6. (see the top). Returns 1 if every replay's output was right.
static int graph_case(void) {
  const size_t n = 1 << 18, bytes = n * 4;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *out = nullptr;
  CHECK(cudaMallocAsync((void **)&out, bytes, s));
  CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  unsigned *tmp = nullptr;
  cudaError_t e = cudaMallocAsync((void **)&tmp, bytes, s);
  if (e != cudaSuccess) {
    typedef const char *(*msg_fn)(void);
    msg_fn msg = (msg_fn)dlsym(RTLD_DEFAULT, "magpie_last_error_message");
    printf("preload_prog: cudaMallocAsync in a capture: %s (magpie: %s)\n", cudaGetErrorString(e),
           msg != nullptr ? msg() : "not loaded");
    return 0;
  }
  fill<<<64, 256, 0, s>>>(tmp, n, 0x6a09u);
  copy_words<<<64, 256, 0, s>>>(out, tmp, n);
  CHECK(cudaFreeAsync(tmp, s));
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  pthread_t t;
  graph_stop = 0;
  pthread_create(&t, nullptr, graph_neighbour, nullptr);
  unsigned *host = (unsigned *)malloc(bytes), *want = (unsigned *)malloc(bytes), *ref = nullptr;
  CHECK(cudaMalloc((void **)&ref, bytes));
  fill<<<64, 256, 0, s>>>(ref, n, 0x6a09u);
  CHECK(cudaMemcpyAsync(want, ref, bytes, cudaMemcpyDeviceToHost, s));
  int wrong = 0;
  for (int r = 0; r < 200; r++) {
    CHECK(cudaMemsetAsync(out, 0, bytes, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaMemcpyAsync(host, out, bytes, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    wrong += memcmp(host, want, bytes) != 0;
  }
  graph_stop = 1;
  pthread_join(t, nullptr);
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaFree(ref));
  CHECK(cudaFreeAsync(out, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaStreamDestroy(s));
  free(host);
  free(want);
  printf("preload_prog: graph with cudaMallocAsync captured, 200 replays, %d wrong: %s\n", wrong,
         wrong == 0 ? "ok" : "WRONG");
  return wrong == 0;
}

// 5. The default pool's usage attributes, which PyTorch's cudaMallocAsync
// backend reads for torch.cuda.memory_allocated (served by magpie under
// LD_PRELOAD, by the pool otherwise): a 64 MiB cudaMallocAsync shows in
// UsedMemCurrent and ReservedMemCurrent, leaves UsedMemCurrent once freed
// and trimmed, and resetting UsedMemHigh brings the mark below it.
static int pool_case(void) {
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const cuuint64_t n = 64ull << 20;
  cuuint64_t used0 = 0, used1 = 0, res1 = 0, used2 = 0, high = 0, zero = 0;
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used0));
  void *p = nullptr;
  CHECK(cudaMallocAsync(&p, n, s));
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used1));
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &res1));
  CHECK(cudaFreeAsync(p, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaMemPoolTrimTo(pool, 0));
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used2));
  CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  CHECK(cudaStreamDestroy(s));
  int ok = used1 >= used0 + n && res1 >= used1 && used2 + n <= used1 && high < used1;
  printf(
      "preload_prog: default pool: used %llu -> %llu (reserved %llu) -> %llu after free and trim; "
      "used high after reset %llu: %s\n",
      (unsigned long long)used0, (unsigned long long)used1, (unsigned long long)res1, (unsigned long long)used2,
      (unsigned long long)high, ok ? "ok" : "WRONG");
  return ok;
}

int main(void) {
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));
  CHECK(cudaMallocManaged(&bad_counter, sizeof *bad_counter));
  *bad_counter = 0;
  CHECK(cudaDeviceSynchronize());

  pthread_t t[8];
  worker_arg args[8];
  for (int i = 0; i < 8; i++) {
    args[i].id = i;
    pthread_create(&t[i], nullptr, async_worker, &args[i]);
  }
  for (auto &x : t) pthread_join(x, nullptr);
  sync_alloc_case();
  driver_case();
  passthrough_case();
  CHECK(cudaDeviceSynchronize());

  unsigned long long bad = *bad_counter;
  typedef int (*stats_fn)(int, void *);
  stats_fn stats = (stats_fn)dlsym(RTLD_DEFAULT, "magpie_stats_get");
  int magpie = 0;
  if (stats != nullptr) {
    size_t st[64]; // magpie_stats starts with in_use_bytes, reserved_bytes
    static unsigned char buf[8192];
    if (stats(0, buf) == 0) {
      memcpy(st, buf, 2 * sizeof(size_t));
      printf("preload_prog: magpie in use %zu B, reserved %zu B\n", st[0], st[1]);
      magpie = st[1] > 0;
    }
  }
  printf("preload_prog: %llu checks, %llu bad words, served by %s\n", checks, bad,
         magpie ? "magpie (LD_PRELOAD)" : "the CUDA runtime");
  int graph_ok = graph_case();
  bad = *bad_counter;
  int pool_ok = pool_case() && graph_ok; // after the figures above: its trim gives magpie's memory back
  const char *expect = getenv("PRELOAD_EXPECT");
  if (expect != nullptr && strcmp(expect, "1") == 0 && !magpie) {
    printf("preload_prog: FAIL: magpie was expected to serve the allocations\n");
    return 1;
  }
  CHECK(cudaFree(bad_counter));
  printf("preload_prog: %s\n", bad == 0 && pool_ok ? "PASS" : "FAIL");
  return bad == 0 && pool_ok ? 0 : 1;
}
