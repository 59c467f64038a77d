// preload_static: an ordinary CUDA program linked with nvcc's default,
// static CUDA runtime (-cudart static: cudaMalloc & co. are inside the
// program, and the runtime reaches the driver through cuGetProcAddress),
// run as is and under LD_PRELOAD=libmagpie_preload.so by tools/gpu_dropin.sh
// (docs/preload.md, "Programs with a statically linked CUDA runtime").
//
// Every block is filled by a kernel and checked by a later, deliberately
// slow kernel on the stream of its last use before it is freed; the next
// allocation (another stream) is overwritten at once. A block handed out
// while the slow check still runs shows as a mismatch.
//   0. the runtime is the program's own: no libcudart.so in the process;
//   1. cudaMallocAsync / cudaFreeAsync on 3 streams and cudaStreamPerThread
//      in each of 4 threads, the streams destroyed at the end;
//   2. cudaMalloc / cudaFree, used on one stream, reallocated on another;
//   3. the default pool's UsedMemCurrent shows a 64 MiB cudaMallocAsync
//      and drops once it is freed;
//   4. a CUDA graph capturing cudaMallocAsync / cudaFreeAsync (memory
//      nodes, CUDA's under the preload library too), replayed 50 times
//      while another thread allocates on its own streams;
//   5. cudaGetDriverEntryPointByVersion("cuMemAlloc") answers.
// With PRELOAD_EXPECT=1 it also requires that magpie served it: every block
// of 1 and 2 is magpie's (magpie_block_info), magpie reports reserved
// memory, and the entry point of 5 is the preload library's.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "preload_kernels.cuh"

static unsigned long long blocks;     // host: blocks of 1 and 2
static unsigned long long not_magpie; // host: of those, blocks magpie does not hold

typedef int (*block_info_fn)(const void *, size_t *, int *);
static block_info_fn block_info; // magpie_block_info, if magpie is in the process

// A block of 1 or 2 just allocated: is it magpie's?
static void count_block(const void *p) {
  int dev = -1;
  __atomic_add_fetch(&blocks, 1, __ATOMIC_RELAXED);
  if (block_info == nullptr || block_info(p, nullptr, &dev) != 0) __atomic_add_fetch(&not_magpie, 1, __ATOMIC_RELAXED);
}

// 1. (see the top)
static void *async_worker(void *arg) {
  int id = (int)(intptr_t)arg;
  CHECK(cudaSetDevice(0));
  cudaStream_t s[4];
  for (int i = 0; i < 3; i++) CHECK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
  s[3] = cudaStreamPerThread;
  unsigned rng = 17u + (unsigned)id;
  for (int it = 0; it < 200; it++) {
    cudaStream_t a = s[it % 4], b = s[(it + 1) % 4];
    size_t n = pick_size(&rng);
    void *p = nullptr, *q = nullptr;
    CHECK(cudaMallocAsync(&p, n, a));
    count_block(p);
    use_then_check(p, n, 1000u * id + it, a, it % 8 == 0 ? 200000 : 0);
    CHECK(cudaFreeAsync(p, a));
    CHECK(cudaMallocAsync(&q, n, b)); // another stream: must not be p until a's check ran
    count_block(q);
    fill<<<64, 256, 0, b>>>((unsigned *)q, n / 4, 0xdeadu);
    CHECK(cudaGetLastError());
    CHECK(cudaFreeAsync(q, b));
  }
  for (auto &x : s) CHECK(cudaStreamSynchronize(x));
  for (int i = 0; i < 3; i++) CHECK(cudaStreamDestroy(s[i]));
  return nullptr;
}

// 2.
static void sync_alloc_case(void) {
  cudaStream_t a, b;
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  for (int it = 0; it < 50; it++) {
    size_t n = (size_t)(it % 5 + 1) << 16;
    void *p = nullptr, *q = nullptr;
    CHECK(cudaMalloc(&p, n));
    count_block(p);
    use_then_check(p, n, 7u + it, a, 100000);
    CHECK(cudaFree(p)); // used on a, freed with no stream
    CHECK(cudaMalloc(&q, n));
    count_block(q);
    fill<<<64, 256, 0, b>>>((unsigned *)q, n / 4, 0xbeefu);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(b));
    CHECK(cudaFree(q));
  }
  CHECK(cudaStreamDestroy(a));
  CHECK(cudaStreamDestroy(b));
}

// 3. Returns 1 if the figures are right.
static int pool_case(void) {
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const uint64_t n = 64ull << 20;
  uint64_t used0 = 0, used1 = 0, used2 = 0; // cuuint64_t
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used0));
  void *p = nullptr;
  CHECK(cudaMallocAsync(&p, n, s));
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used1));
  CHECK(cudaFreeAsync(p, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaMemPoolTrimTo(pool, 0));
  CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used2));
  CHECK(cudaStreamDestroy(s));
  int ok = used1 >= used0 + n && used2 + n <= used1;
  printf("preload_static: default pool: used %llu -> %llu -> %llu after free and trim: %s\n", (unsigned long long)used0,
         (unsigned long long)used1, (unsigned long long)used2, ok ? "ok" : "WRONG");
  return ok;
}

// 4. Returns 1 if every replay's output was right.
static int graph_case(void) {
  const size_t n = 1 << 18, bytes = n * 4;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *out = nullptr, *tmp = nullptr, *ref = nullptr;
  CHECK(cudaMallocAsync((void **)&out, bytes, s));
  CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  CHECK(cudaMallocAsync((void **)&tmp, bytes, s));
  fill<<<64, 256, 0, s>>>(tmp, n, 0x6a09u);
  copy_words<<<64, 256, 0, s>>>(out, tmp, n);
  CHECK(cudaFreeAsync(tmp, s));
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  pthread_t t;
  graph_stop = 0;
  pthread_create(&t, nullptr, graph_neighbour, nullptr);
  unsigned *host = (unsigned *)malloc(bytes), *want = (unsigned *)malloc(bytes);
  CHECK(cudaMalloc((void **)&ref, bytes));
  fill<<<64, 256, 0, s>>>(ref, n, 0x6a09u);
  CHECK(cudaMemcpyAsync(want, ref, bytes, cudaMemcpyDeviceToHost, s));
  int wrong = 0;
  for (int r = 0; r < 50; r++) {
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
  printf("preload_static: graph with cudaMallocAsync captured, 50 replays, %d wrong: %s\n", wrong,
         wrong == 0 ? "ok" : "WRONG");
  return wrong == 0;
}

static int find_cudart(struct dl_phdr_info *info, size_t size, void *found) {
  (void)size;
  if (info->dlpi_name != nullptr && strstr(info->dlpi_name, "libcudart.so") != nullptr) *(int *)found = 1;
  return 0;
}

// The file that defines f ("?" if none).
static const char *defined_in(const void *f, const void **base) {
  Dl_info info;
  *base = nullptr;
  if (f == nullptr || dladdr(f, &info) == 0) return "?";
  *base = info.dli_fbase;
  return info.dli_fname != nullptr && info.dli_fname[0] != '\0' ? info.dli_fname : "the program";
}

int main(void) {
  int shared_runtime = 0;
  dl_iterate_phdr(find_cudart, &shared_runtime);
  if (shared_runtime) {
    printf("preload_static: FAIL: libcudart.so is loaded; the program must carry its own runtime\n");
    return 1;
  }
  block_info = (block_info_fn)dlsym(RTLD_DEFAULT, "magpie_block_info");
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(nullptr));
  CHECK(cudaMallocManaged(&bad_counter, sizeof *bad_counter));
  *bad_counter = 0;
  CHECK(cudaDeviceSynchronize());

  // 5. Where the runtime's entry point for cuMemAlloc lies.
  void *entry = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  CHECK(cudaGetDriverEntryPointByVersion("cuMemAlloc", &entry, 3020, cudaEnableDefault, &q));
  const void *entry_base = nullptr, *magpie_base = nullptr;
  const char *entry_file = defined_in(entry, &entry_base);
  defined_in((const void *)block_info, &magpie_base);
  int entry_ok = q == cudaDriverEntryPointSuccess && entry != nullptr;
  printf("preload_static: cuMemAlloc's entry point is in %s\n", entry_file);

  pthread_t t[4];
  for (int i = 0; i < 4; i++) pthread_create(&t[i], nullptr, async_worker, (void *)(intptr_t)i);
  for (auto &x : t) pthread_join(x, nullptr);
  sync_alloc_case();
  CHECK(cudaDeviceSynchronize());
  unsigned long long bad = *bad_counter;

  size_t st[2] = {0, 0}; // magpie_stats starts with in_use_bytes, reserved_bytes
  int magpie = 0;
  typedef int (*stats_fn)(int, void *);
  stats_fn stats = (stats_fn)dlsym(RTLD_DEFAULT, "magpie_stats_get");
  static unsigned char buf[8192];
  if (stats != nullptr && stats(0, buf) == 0) {
    memcpy(st, buf, sizeof st);
    printf("preload_static: magpie in use %zu B, reserved %zu B\n", st[0], st[1]);
    magpie = st[1] > 0;
  }
  printf("preload_static: %llu checks, %llu bad words; %llu blocks, %llu not magpie's; served by %s\n", checks, bad,
         blocks, not_magpie, magpie ? "magpie (LD_PRELOAD)" : "the CUDA runtime");
  int graph_ok = graph_case();
  int pool_ok = pool_case();
  bad = *bad_counter;
  int ok = bad == 0 && graph_ok && pool_ok && entry_ok;
  const char *expect = getenv("PRELOAD_EXPECT");
  if (expect != nullptr && strcmp(expect, "1") == 0) {
    if (!magpie || not_magpie != 0) {
      printf("preload_static: FAIL: magpie was expected to serve every block (%llu of %llu were not its)\n", not_magpie,
             blocks);
      ok = 0;
    }
    if (entry_base == nullptr || entry_base != magpie_base) {
      printf("preload_static: FAIL: cuMemAlloc's entry point was expected in the preload library\n");
      ok = 0;
    }
  }
  CHECK(cudaFree(bad_counter));
  printf("preload_static: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
