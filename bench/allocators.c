/* See allocators.h. */
#include "bench/allocators.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "bench/bench_dev.h"
#include "bench/bestfit.h"

static bench_alloc table[BA_COUNT];
static atomic_ulong failures[BA_COUNT];

bench_alloc *bench_allocs(void) { return table; }
uint64_t bench_alloc_failures(int which) { return atomic_load(&failures[which]); }
void bench_alloc_note_failure(int which) { atomic_fetch_add(&failures[which], 1); }

static void *checked(int which, void *p) {
  if (p == NULL) bench_alloc_note_failure(which);
  return p;
}

/* --- magpie --- */

static void *mp_alloc(size_t size, cudaStream_t s) {
  void *p = magpie_malloc_async(size, s);
  if (p == NULL && atomic_fetch_add(&failures[BA_MAGPIE], 1) < 5)
    fprintf(stderr, "bench: magpie_malloc_async(%zu): %s\n", size, magpie_last_error_message());
  return p;
}

static void mp_free(void *p, size_t size, cudaStream_t s) {
  if (magpie_free_async(p, s) != 0) bench_dev_fail("magpie_free_async", magpie_last_error());
}

static void mp_free_cross(void *p, size_t size, cudaStream_t alloc_stream, cudaStream_t use_stream) {
  mp_free(p, size, use_stream);
}

static void mp_reset(void) {} /* magpie has no call that restarts its peak */

static uint64_t mp_peak(void) {
  magpie_stats st;
  if (magpie_stats_get(0, &st) != 0) return 0;
  return st.peak_reserved_bytes;
}

/* --- cudaMalloc --- */

static void *cm_alloc(size_t size, cudaStream_t s) {
  void *p = NULL;
  return checked(BA_CUDA_MALLOC, bench_cuda_malloc(&p, size) ? NULL : p);
}

static void cm_free(void *p, size_t size, cudaStream_t s) { bench_cuda_free(p); }

static void cm_free_cross(void *p, size_t size, cudaStream_t a, cudaStream_t u) { bench_cuda_free(p); }

static void cm_reset(void) {}
static uint64_t cm_peak(void) { return 0; }

/* --- cudaMallocAsync --- */

static void *ca_alloc(size_t size, cudaStream_t s) {
  void *p = NULL;
  return checked(BA_CUDA_ASYNC, bench_cuda_malloc_async(&p, size, s) ? NULL : p);
}

static void ca_free(void *p, size_t size, cudaStream_t s) { bench_cuda_free_async(p, s); }

static void ca_free_cross(void *p, size_t size, cudaStream_t a, cudaStream_t u) { bench_cuda_free_async(p, u); }

static void ca_reset(void) {
  bench_device_sync();
  bench_pool_trim();
  bench_pool_reset_high();
}

static uint64_t ca_peak(void) {
  uint64_t v = 0;
  return bench_pool_reserved_high(&v) ? 0 : v;
}

/* --- PyTorch, through the shim --- */

static struct {
  int (*init)(char *err, size_t n);
  void *(*alloc)(size_t size, cudaStream_t s);
  void (*free)(void *p);
  int (*empty_cache)(void);
  int (*reset_peak)(void);
  int (*reserved)(uint64_t *current, uint64_t *peak);
} torch;

/* One event per thread hands a use on another stream back to the
 * allocation stream (what Tensor.record_stream arranges in PyTorch). */
static _Thread_local bench_event torch_event;

static void *pt_alloc(size_t size, cudaStream_t s) { return checked(BA_TORCH, torch.alloc(size, s)); }
static void pt_free(void *p, size_t size, cudaStream_t s) { torch.free(p); }

static void pt_free_cross(void *p, size_t size, cudaStream_t alloc_stream, cudaStream_t use_stream) {
  if (torch_event == NULL) torch_event = bench_event_create();
  if (torch_event == NULL || bench_event_record(torch_event, use_stream) ||
      bench_stream_wait_event(alloc_stream, torch_event)) {
    bench_device_sync(); /* the order still holds, expensively */
  }
  torch.free(p);
}

static void pt_reset(void) {
  bench_device_sync();
  if (torch.empty_cache() != 0) bench_dev_fail("CUDACachingAllocator::emptyCache", -1);
  if (torch.reset_peak() != 0) bench_dev_fail("CUDACachingAllocator::resetPeakStats", -1);
}

static uint64_t pt_peak(void) {
  uint64_t cur = 0, peak = 0;
  return torch.reserved(&cur, &peak) ? 0 : peak;
}

static void torch_load(bench_alloc *a, const char *path) {
  if (path == NULL || path[0] == 0) {
    snprintf(a->why_not, sizeof a->why_not, "no PyTorch shim given (--torch PATH; bench/run_gpu.sh builds it)");
    return;
  }
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    snprintf(a->why_not, sizeof a->why_not, "dlopen %s: %s", path, dlerror());
    return;
  }
  torch.init = (int (*)(char *, size_t))dlsym(h, "bench_torch_init");
  torch.alloc = (void *(*)(size_t, cudaStream_t))dlsym(h, "bench_torch_alloc");
  torch.free = (void (*)(void *))dlsym(h, "bench_torch_free");
  torch.empty_cache = (int (*)(void))dlsym(h, "bench_torch_empty_cache");
  torch.reset_peak = (int (*)(void))dlsym(h, "bench_torch_reset_peak");
  torch.reserved = (int (*)(uint64_t *, uint64_t *))dlsym(h, "bench_torch_reserved");
  if (!torch.init || !torch.alloc || !torch.free || !torch.empty_cache || !torch.reset_peak || !torch.reserved) {
    snprintf(a->why_not, sizeof a->why_not, "%s lacks the bench_torch_* entry points", path);
    return;
  }
  char err[128] = "";
  if (torch.init(err, sizeof err) != 0) {
    snprintf(a->why_not, sizeof a->why_not, "PyTorch's allocator did not start: %s", err);
    return;
  }
  a->available = 1;
}

/* --- no-op reference --- */

enum { NOOP_SLICES = 64 };
static struct {
  char *base;
  size_t slice;
  atomic_uint next_slice;
} noop;

static _Thread_local struct {
  char *base;
  size_t off;
} noop_me;

static void *noop_alloc(size_t size, cudaStream_t s) {
  if (noop_me.base == NULL)
    noop_me.base = noop.base + (size_t)(atomic_fetch_add(&noop.next_slice, 1) % NOOP_SLICES) * noop.slice;
  size = (size + 255) & ~(size_t)255;
  if (size > noop.slice) return noop_me.base; /* larger than a slice: aliases */
  if (noop_me.off + size > noop.slice) noop_me.off = 0;
  void *p = noop_me.base + noop_me.off;
  noop_me.off += size;
  return p;
}

static void noop_free(void *p, size_t size, cudaStream_t s) {}
static void noop_free_cross(void *p, size_t size, cudaStream_t a, cudaStream_t u) {}
static void noop_reset(void) {}
static uint64_t noop_peak(void) { return 0; }

static void noop_init(bench_alloc *a, size_t arena) {
  void *p = NULL;
  if (bench_dev_is_cuda()) {
    if (bench_mem_alloc(&p, arena) != 0) p = NULL;
  } else {
    /* Simulated device memory is host memory; untouched pages cost nothing. */
    p = mmap(NULL, arena, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) p = NULL;
  }
  if (p == NULL) {
    snprintf(a->why_not, sizeof a->why_not, "could not allocate its %zu-byte arena", arena);
    return;
  }
  noop.base = p;
  noop.slice = (arena / NOOP_SLICES) & ~(size_t)255;
  a->available = 1;
}

/* --- best-fit reference (bestfit.c) --- */

static void *bf_alloc(size_t size, cudaStream_t s) { return checked(BA_BESTFIT, bestfit_alloc(size)); }
static void bf_free(void *p, size_t size, cudaStream_t s) { bestfit_free(p); }
static void bf_free_cross(void *p, size_t size, cudaStream_t a, cudaStream_t u) { bestfit_free(p); }

void bench_allocs_init(const char *torch_shim, size_t noop_arena) {
  table[BA_MAGPIE] = (bench_alloc){"magpie", 1, "", mp_alloc, mp_free, mp_free_cross, mp_reset, mp_peak};
  table[BA_CUDA_MALLOC] = (bench_alloc){"cudaMalloc", 0, "", cm_alloc, cm_free, cm_free_cross, cm_reset, cm_peak};
  table[BA_CUDA_ASYNC] = (bench_alloc){"cudaMallocAsync", 0, "", ca_alloc, ca_free, ca_free_cross, ca_reset, ca_peak};
  table[BA_TORCH] = (bench_alloc){"pytorch", 0, "", pt_alloc, pt_free, pt_free_cross, pt_reset, pt_peak};
  table[BA_NOOP] = (bench_alloc){"noop", 0, "", noop_alloc, noop_free, noop_free_cross, noop_reset, noop_peak};
  table[BA_BESTFIT] =
      (bench_alloc){"bestfit", 1, "", bf_alloc, bf_free, bf_free_cross, bestfit_reset_peak, bestfit_peak_reserved};
  if (!bench_dev_is_cuda()) {
    for (int i = BA_CUDA_MALLOC; i <= BA_TORCH; i++)
      snprintf(table[i].why_not, sizeof table[i].why_not, "needs a GPU (this run is on the simulated device)");
  } else if (!bench_cudart_ok()) {
    for (int i = BA_CUDA_MALLOC; i <= BA_CUDA_ASYNC; i++)
      snprintf(table[i].why_not, sizeof table[i].why_not, "libcudart not found");
  } else {
    table[BA_CUDA_MALLOC].available = 1;
    if (bench_pool_prepare() == 0) table[BA_CUDA_ASYNC].available = 1;
    else snprintf(table[BA_CUDA_ASYNC].why_not, sizeof table[BA_CUDA_ASYNC].why_not, "default pool unavailable");
  }
  if (bench_dev_is_cuda()) torch_load(&table[BA_TORCH], torch_shim);
  noop_init(&table[BA_NOOP], noop_arena);
}
