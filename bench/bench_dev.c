/* See bench_dev.h. The driver comes from magpie's one loader
 * (src/device/cuda_driver.h), the table magpie's backend calls; the runtime
 * (libcudart, for the reference allocators) is loaded here, with dlopen. */
#include "bench/bench_dev.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/cuda_driver.h"
#include "magpie_sim.h"

#ifdef MAGPIE_BENCH_PTX
#include "bench/bench_kernels_ptx.h"
#endif

/* Runtime values used here (driver_types.h); the driver's are cuda_driver.h's. */
enum {
  BENCH_POOL_RELEASE_THRESHOLD = 4, /* cudaMemPoolAttrReleaseThreshold */
  BENCH_POOL_RESERVED_CURRENT = 5,  /* cudaMemPoolAttrReservedMemCurrent */
  BENCH_POOL_RESERVED_HIGH = 6,     /* cudaMemPoolAttrReservedMemHigh */
};

static struct {
  int cuda;
  cudrv_context ctx;
  cudrv_device device;
  cudrv_function function; /* the touch kernel */
  /* runtime */
  void *cudart;
  char cudart_path[256];
  void *pool;
  int (*cudaSetDevice)(int);
  int (*cudaMalloc)(void **, size_t);
  int (*cudaFree)(void *);
  int (*cudaMallocAsync)(void **, size_t, cudaStream_t);
  int (*cudaFreeAsync)(void *, cudaStream_t);
  int (*cudaDeviceGetDefaultMemPool)(void **, int);
  int (*cudaMemPoolSetAttribute)(void *, int, void *);
  int (*cudaMemPoolGetAttribute)(void *, int, void *);
  int (*cudaMemPoolTrimTo)(void *, size_t);
  const char *(*cudaGetErrorName)(int);
  char name[128];
} dev;

static atomic_ulong dev_errors;

uint64_t bench_dev_errors(void) { return atomic_load(&dev_errors); }

void bench_dev_fail(const char *what, int code) {
  /* Print the first few: a broken device repeats the same failure. */
  if (atomic_fetch_add(&dev_errors, 1) < 20) fprintf(stderr, "bench: %s failed: %d\n", what, code);
}

static int cu_check(int rc, const char *what) {
  if (rc == 0) return 0;
  const char *name = NULL;
  if (cudrv.get_error_name) cudrv.get_error_name(rc, &name);
  if (atomic_fetch_add(&dev_errors, 1) < 20)
    fprintf(stderr, "bench: %s failed: %s (%d)\n", what, name ? name : "?", rc);
  return rc;
}

static int rt_check(int rc, const char *what) {
  if (rc == 0) return 0;
  const char *name = dev.cudaGetErrorName ? dev.cudaGetErrorName(rc) : "?";
  if (atomic_fetch_add(&dev_errors, 1) < 20) fprintf(stderr, "bench: %s failed: %s (%d)\n", what, name, rc);
  return rc;
}

static int load_sym(void *h, void **slot, const char *sym) {
  *slot = dlsym(h, sym);
  if (*slot == NULL) fprintf(stderr, "bench: %s missing\n", sym);
  return *slot != NULL;
}

#define LOAD(h, field, sym) ok &= load_sym(h, (void **)&dev.field, sym)

/* The runtime of the process if one is loaded already (PyTorch brings its
 * own), else the toolkit's. */
static void load_cudart(void) {
  static const char *const names[] = {
      "libcudart.so.13",
      "libcudart.so.12",
      "libcudart.so",
      "/usr/local/cuda/lib64/libcudart.so.13",
      "/usr/local/cuda/lib64/libcudart.so.12",
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0] && dev.cudart == NULL; i++) {
    dev.cudart = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (dev.cudart) snprintf(dev.cudart_path, sizeof dev.cudart_path, "%s", names[i]);
  }
  const char *home = getenv("CUDA_HOME");
  if (dev.cudart == NULL && home) {
    snprintf(dev.cudart_path, sizeof dev.cudart_path, "%s/lib64/libcudart.so", home);
    dev.cudart = dlopen(dev.cudart_path, RTLD_NOW | RTLD_LOCAL);
  }
  if (dev.cudart == NULL) {
    fprintf(stderr,
            "bench: libcudart not found (LD_LIBRARY_PATH, /usr/local/cuda/lib64, $CUDA_HOME/lib64): "
            "cudaMalloc and cudaMallocAsync are skipped\n");
    return;
  }
  void *h = dev.cudart;
  int ok = 1;
  LOAD(h, cudaSetDevice, "cudaSetDevice");
  LOAD(h, cudaMalloc, "cudaMalloc");
  LOAD(h, cudaFree, "cudaFree");
  LOAD(h, cudaMallocAsync, "cudaMallocAsync");
  LOAD(h, cudaFreeAsync, "cudaFreeAsync");
  LOAD(h, cudaDeviceGetDefaultMemPool, "cudaDeviceGetDefaultMemPool");
  LOAD(h, cudaMemPoolSetAttribute, "cudaMemPoolSetAttribute");
  LOAD(h, cudaMemPoolGetAttribute, "cudaMemPoolGetAttribute");
  LOAD(h, cudaMemPoolTrimTo, "cudaMemPoolTrimTo");
  LOAD(h, cudaGetErrorName, "cudaGetErrorName");
  if (!ok || rt_check(dev.cudaSetDevice(dev.device), "cudaSetDevice")) {
    dev.cudart = NULL;
    return;
  }
}

int bench_dev_init(void) {
  int kind = magpie_active_backend();
  if (kind < 0) {
    fprintf(stderr, "magpie failed to start: %s\n", magpie_last_error_message());
    return -1;
  }
  dev.cuda = kind == MAGPIE_BACKEND_CUDA;
  if (!dev.cuda) {
    snprintf(dev.name, sizeof dev.name, "simulated device");
    return 0;
  }
  /* Every entry point used here, workload 3's completion probe included
   * (cuEventQuery, cuMemHostAlloc, cuMemHostGetDevicePointer,
   * cuStreamWriteValue64, cuMemFreeHost), is in the loader's table. */
  const char *why = NULL;
  if (cudrv_load(CUDRV_LOAD_ALL, &why) != 0) {
    fprintf(stderr, "bench: %s\n", why);
    return -1;
  }
  if (cu_check(cudrv.init(0), "cuInit") || cu_check(cudrv.device_get(&dev.device, 0), "cuDeviceGet") ||
      cu_check(cudrv.primary_ctx_retain(&dev.ctx, dev.device), "cuDevicePrimaryCtxRetain") ||
      cu_check(cudrv.ctx_set_current(dev.ctx), "cuCtxSetCurrent"))
    return -1;
  if (cu_check(cudrv.device_get_name(dev.name, (int)sizeof dev.name, dev.device), "cuDeviceGetName"))
    snprintf(dev.name, sizeof dev.name, "CUDA device %d", dev.device);
#ifdef MAGPIE_BENCH_PTX
  cudrv_module module = NULL;
  if (cu_check(cudrv.module_load_data(&module, bench_kernels_ptx), "cuModuleLoadData") ||
      cu_check(cudrv.module_get_function(&dev.function, module, "bench_touch"), "cuModuleGetFunction"))
    return -1;
#endif
  load_cudart();
  return 0;
}

int bench_dev_is_cuda(void) { return dev.cuda; }
const char *bench_dev_name(void) { return dev.name; }

int bench_dev_thread_init(void) {
  if (!dev.cuda) return 0;
  return cu_check(cudrv.ctx_set_current(dev.ctx), "cuCtxSetCurrent");
}

cudaStream_t bench_stream_create(void) {
  if (!dev.cuda) {
    cudaStream_t s = magpie_sim_stream_create();
    if (s == NULL) bench_dev_fail("magpie_sim_stream_create", magpie_sim_last_error());
    return s;
  }
  cudaStream_t s = NULL;
  return cu_check(cudrv.stream_create(&s, CUDRV_STREAM_NON_BLOCKING), "cuStreamCreate") ? NULL : s;
}

static int sim_check(int rc, const char *what) {
  if (rc != 0) bench_dev_fail(what, rc);
  return rc;
}

int bench_stream_destroy(cudaStream_t s) {
  if (!dev.cuda) return sim_check(magpie_sim_stream_destroy(s), "magpie_sim_stream_destroy");
  return cu_check(cudrv.stream_destroy(s), "cuStreamDestroy");
}

int bench_stream_sync(cudaStream_t s) {
  if (!dev.cuda) return sim_check(magpie_sim_stream_synchronize(s), "magpie_sim_stream_synchronize");
  return cu_check(cudrv.stream_synchronize(s), "cuStreamSynchronize");
}

int bench_device_sync(void) {
  if (!dev.cuda) return sim_check(magpie_sim_device_synchronize(), "magpie_sim_device_synchronize");
  return cu_check(cudrv.ctx_synchronize(), "cuCtxSynchronize");
}

bench_event bench_event_create(void) {
  if (!dev.cuda) {
    magpie_sim_event e = magpie_sim_event_create();
    if (e == NULL) bench_dev_fail("magpie_sim_event_create", magpie_sim_last_error());
    return (bench_event)e;
  }
  cudrv_event e = NULL;
  return cu_check(cudrv.event_create(&e, CUDRV_EVENT_DISABLE_TIMING), "cuEventCreate") ? NULL : (bench_event)e;
}

int bench_event_destroy(bench_event e) {
  if (!dev.cuda) return sim_check(magpie_sim_event_destroy((magpie_sim_event)e), "magpie_sim_event_destroy");
  return cu_check(cudrv.event_destroy((cudrv_event)e), "cuEventDestroy");
}

int bench_event_record(bench_event e, cudaStream_t s) {
  if (!dev.cuda) return sim_check(magpie_sim_event_record((magpie_sim_event)e, s), "magpie_sim_event_record");
  return cu_check(cudrv.event_record((cudrv_event)e, s), "cuEventRecord");
}

int bench_event_sync(bench_event e) {
  if (!dev.cuda) return sim_check(magpie_sim_event_synchronize((magpie_sim_event)e), "magpie_sim_event_synchronize");
  return cu_check(cudrv.event_synchronize((cudrv_event)e), "cuEventSynchronize");
}

int bench_stream_wait_event(cudaStream_t s, bench_event e) {
  if (!dev.cuda) return sim_check(magpie_sim_stream_wait_event(s, (magpie_sim_event)e), "magpie_sim_stream_wait_event");
  return cu_check(cudrv.stream_wait_event(s, (cudrv_event)e, 0), "cuStreamWaitEvent");
}

int bench_event_query(bench_event e) {
  if (!dev.cuda) return -1;
  return cudrv.event_query((cudrv_event)e);
}

int bench_host_word(volatile uint64_t **host, uint64_t *devaddr) {
  if (!dev.cuda) return -1;
  void *p = NULL;
  cudrv_deviceptr d = 0;
  if (cu_check(cudrv.mem_host_alloc(&p, 64, CUDRV_MEMHOSTALLOC_PORTABLE | CUDRV_MEMHOSTALLOC_DEVICEMAP),
               "cuMemHostAlloc"))
    return -1;
  if (cu_check(cudrv.mem_host_get_device_pointer(&d, p, 0), "cuMemHostGetDevicePointer")) {
    cu_check(cudrv.mem_free_host(p), "cuMemFreeHost");
    return -1;
  }
  *devaddr = d;
  *host = p;
  **host = 0;
  return 0;
}

int bench_host_word_free(volatile uint64_t *host) {
  return host == NULL ? 0 : cu_check(cudrv.mem_free_host((void *)(uintptr_t)host), "cuMemFreeHost");
}

int bench_stream_write_value(cudaStream_t s, uint64_t devaddr, uint64_t value) {
  return cu_check(cudrv.stream_write_value64(s, devaddr, value, 0), "cuStreamWriteValue64");
}

int bench_have_kernel(void) { return dev.cuda ? dev.function != NULL : 1; }

typedef struct touch_arg {
  uint32_t *p[4];
  size_t words[4];
  int n;
  uint32_t tag;
} touch_arg;

/* What the kernel does, as a simulated stream's host function: the first
 * 128 words of each block. */
static void sim_touch(void *a) {
  touch_arg *t = a;
  for (int i = 0; i < t->n; i++)
    for (size_t w = 0; w < t->words[i] && w < 128; w++) t->p[i][w] = t->tag;
  free(t);
}

int bench_stream_get_id(cudaStream_t s, unsigned long long *id) {
  if (!dev.cuda) return -1;
  return cudrv.stream_get_id(s, id);
}

int bench_touch(cudaStream_t s, void *const *p, const size_t *bytes, int n, uint32_t tag) {
  if (n < 1 || n > 4) return -1;
  if (!dev.cuda) {
    touch_arg *t = calloc(1, sizeof *t);
    if (t == NULL) return -1;
    for (int i = 0; i < n; i++) {
      t->p[i] = p[i];
      t->words[i] = bytes[i] / 4;
    }
    t->n = n;
    t->tag = tag;
    int rc = magpie_sim_launch(s, sim_touch, t);
    if (rc != 0) {
      free(t);
      bench_dev_fail("magpie_sim_launch", rc);
    }
    return rc;
  }
  if (dev.function == NULL) return -1;
  /* Unused slots repeat block 0 with 0 words. */
  uint64_t ptr[4];
  unsigned long long words[4];
  for (int i = 0; i < 4; i++) {
    ptr[i] = (uint64_t)(uintptr_t)p[i < n ? i : 0];
    words[i] = i < n ? bytes[i] / 4 : 0;
  }
  void *args[] = {&ptr[0], &words[0], &ptr[1], &words[1], &ptr[2], &words[2], &ptr[3], &words[3], &tag};
  return cu_check(cudrv.launch_kernel(dev.function, 1, 1, 1, 128, 1, 1, 0, s, args, NULL), "cuLaunchKernel");
}

int bench_cudart_ok(void) { return dev.cuda && dev.cudart != NULL; }
const char *bench_cudart_path(void) { return dev.cudart_path; }

int bench_cuda_malloc(void **p, size_t size) { return rt_check(dev.cudaMalloc(p, size), "cudaMalloc"); }
int bench_cuda_free(void *p) { return rt_check(dev.cudaFree(p), "cudaFree"); }

int bench_pool_prepare(void) {
  if (!bench_cudart_ok()) return -1;
  if (rt_check(dev.cudaDeviceGetDefaultMemPool(&dev.pool, dev.device), "cudaDeviceGetDefaultMemPool")) return -1;
  uint64_t max = UINT64_MAX;
  return rt_check(dev.cudaMemPoolSetAttribute(dev.pool, BENCH_POOL_RELEASE_THRESHOLD, &max),
                  "cudaMemPoolSetAttribute(ReleaseThreshold)");
}

int bench_cuda_malloc_async(void **p, size_t size, cudaStream_t s) {
  return rt_check(dev.cudaMallocAsync(p, size, s), "cudaMallocAsync");
}

int bench_cuda_free_async(void *p, cudaStream_t s) { return rt_check(dev.cudaFreeAsync(p, s), "cudaFreeAsync"); }

int bench_pool_trim(void) { return rt_check(dev.cudaMemPoolTrimTo(dev.pool, 0), "cudaMemPoolTrimTo"); }

int bench_pool_reserved_high(uint64_t *out) {
  return rt_check(dev.cudaMemPoolGetAttribute(dev.pool, BENCH_POOL_RESERVED_HIGH, out),
                  "cudaMemPoolGetAttribute(ReservedMemHigh)");
}

int bench_pool_reset_high(void) {
  uint64_t zero = 0; /* the only value the attribute accepts: resets to current */
  return rt_check(dev.cudaMemPoolSetAttribute(dev.pool, BENCH_POOL_RESERVED_HIGH, &zero),
                  "cudaMemPoolSetAttribute(ReservedMemHigh)");
}

int bench_mem_alloc(void **p, size_t size) {
  cudrv_deviceptr d = 0;
  int rc = cu_check(cudrv.mem_alloc(&d, size), "cuMemAlloc");
  *p = rc ? NULL : (void *)(uintptr_t)d;
  return rc;
}

int bench_mem_free(void *p) { return cu_check(cudrv.mem_free((cudrv_deviceptr)(uintptr_t)p), "cuMemFree"); }
