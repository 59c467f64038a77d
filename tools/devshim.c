/* See devshim.h. */
#include "tools/devshim.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "magpie_sim.h"

static struct {
  int cuda;
  void *ctx;
  int device;
  int (*cuInit)(unsigned);
  int (*cuDeviceGet)(int *, int);
  int (*cuDevicePrimaryCtxRetain)(void **, int);
  int (*cuCtxSetCurrent)(void *);
  int (*cuStreamCreate)(cudaStream_t *, unsigned);
  int (*cuStreamDestroy)(cudaStream_t);
  int (*cuStreamSynchronize)(cudaStream_t);
  int (*cuMemsetD32Async)(uint64_t, unsigned, size_t, cudaStream_t);
  int (*cuEventCreate)(void **, unsigned);
  int (*cuEventRecord)(void *, cudaStream_t);
  int (*cuEventDestroy)(void *);
  int (*cuStreamWaitEvent)(cudaStream_t, void *, unsigned);
  int (*cuCtxSynchronize)(void);
  int (*cuMemAllocAsync)(uint64_t *, size_t, cudaStream_t);
  int (*cuMemFreeAsync)(uint64_t, cudaStream_t);
  int (*cuDeviceGetDefaultMemPool)(void **, int);
  int (*cuMemPoolSetAttribute)(void *, int, void *);
} dev;

static int devshim_load(void *h, void **slot, const char *sym) {
  *slot = dlsym(h, sym);
  if (*slot == NULL) fprintf(stderr, "devshim: %s missing in libcuda\n", sym);
  return *slot != NULL;
}

#define LOAD(name, sym) ok &= devshim_load(h, (void **)&dev.name, sym)

int devshim_init(void) {
  int kind = magpie_active_backend();
  if (kind < 0) {
    fprintf(stderr, "magpie failed to start: %s\n", magpie_last_error_message());
    return -1;
  }
  dev.cuda = kind == MAGPIE_BACKEND_CUDA;
  if (!dev.cuda) return 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) return -1;
  int ok = 1;
  LOAD(cuInit, "cuInit");
  LOAD(cuDeviceGet, "cuDeviceGet");
  LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  LOAD(cuCtxSetCurrent, "cuCtxSetCurrent");
  LOAD(cuStreamCreate, "cuStreamCreate");
  LOAD(cuStreamDestroy, "cuStreamDestroy_v2");
  LOAD(cuStreamSynchronize, "cuStreamSynchronize");
  LOAD(cuMemsetD32Async, "cuMemsetD32Async");
  LOAD(cuEventCreate, "cuEventCreate");
  LOAD(cuEventRecord, "cuEventRecord");
  LOAD(cuEventDestroy, "cuEventDestroy_v2");
  LOAD(cuStreamWaitEvent, "cuStreamWaitEvent");
  LOAD(cuCtxSynchronize, "cuCtxSynchronize");
  LOAD(cuMemAllocAsync, "cuMemAllocAsync");
  LOAD(cuMemFreeAsync, "cuMemFreeAsync");
  LOAD(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool");
  LOAD(cuMemPoolSetAttribute, "cuMemPoolSetAttribute");
  if (!ok) return -1;
  if (dev.cuInit(0) || dev.cuDeviceGet(&dev.device, 0) || dev.cuDevicePrimaryCtxRetain(&dev.ctx, dev.device))
    return -1;
  dev.cuCtxSetCurrent(dev.ctx);
  return 0;
}

int devshim_is_cuda(void) { return dev.cuda; }

void devshim_thread_init(void) {
  if (dev.cuda) dev.cuCtxSetCurrent(dev.ctx);
}

cudaStream_t devshim_stream_create(void) {
  if (!dev.cuda) return magpie_sim_stream_create();
  cudaStream_t s = NULL;
  return dev.cuStreamCreate(&s, 1 /* CU_STREAM_NON_BLOCKING */) == 0 ? s : NULL;
}

void devshim_stream_destroy(cudaStream_t s) {
  if (dev.cuda) dev.cuStreamDestroy(s);
  else magpie_sim_stream_destroy(s);
}

typedef struct fill_arg {
  uint32_t *p;
  size_t words;
  uint32_t value;
} fill_arg;

static void devshim_sim_fill(void *a) {
  fill_arg *f = a;
  for (size_t i = 0; i < f->words; i += 64) f->p[i] = f->value; /* one word per 256 B */
  free(f);
}

int devshim_fill(void *p, size_t bytes, uint32_t value, cudaStream_t s) {
  if (dev.cuda) return dev.cuMemsetD32Async((uint64_t)(uintptr_t)p, value, bytes / 4, s);
  fill_arg *f = malloc(sizeof *f);
  if (f == NULL) return -1;
  *f = (fill_arg){p, bytes / 4, value};
  int rc = magpie_sim_launch(s, devshim_sim_fill, f);
  if (rc != 0) free(f);
  return rc;
}

int devshim_order(cudaStream_t to, cudaStream_t from) {
  if (!dev.cuda) return magpie_sim_stream_wait(to, from);
  void *ev = NULL;
  int rc = dev.cuEventCreate(&ev, 2 /* CU_EVENT_DISABLE_TIMING */);
  if (rc == 0) rc = dev.cuEventRecord(ev, from);
  if (rc == 0) rc = dev.cuStreamWaitEvent(to, ev, 0);
  if (ev) dev.cuEventDestroy(ev);
  return rc;
}

void devshim_stream_synchronize(cudaStream_t s) {
  if (dev.cuda) dev.cuStreamSynchronize(s);
  else magpie_sim_stream_synchronize(s);
}

void devshim_synchronize(void) {
  if (dev.cuda) dev.cuCtxSynchronize();
  else magpie_sim_device_synchronize();
}

int devshim_pool_prepare(void) {
  if (!dev.cuda) return -1;
  void *pool = NULL;
  if (dev.cuDeviceGetDefaultMemPool(&pool, dev.device) != 0) return -1;
  uint64_t max = UINT64_MAX;
  return dev.cuMemPoolSetAttribute(pool, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &max);
}

void *devshim_pool_alloc(size_t size, cudaStream_t s) {
  uint64_t p = 0;
  return dev.cuMemAllocAsync(&p, size, s) == 0 ? (void *)(uintptr_t)p : NULL;
}

int devshim_pool_free(void *p, cudaStream_t s) { return dev.cuMemFreeAsync((uint64_t)(uintptr_t)p, s); }
