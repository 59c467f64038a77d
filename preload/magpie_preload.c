/* libmagpie_preload.so: magpie under unmodified CUDA programs, with
 * LD_PRELOAD.
 *
 * Interposed by name (a program linking the shared runtime, libcudart.so,
 * or calling the driver's exported symbols; a runtime linked into the
 * program or a library, nvcc's default -cudart static, gets the driver
 * functions below from its lookup, dlsym and cuGetProcAddress, which
 * preload_procaddr.c interposes):
 *
 *   runtime  cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync
 *            (+ the _ptsz forms used under --default-stream per-thread),
 *            cudaStreamDestroy, cudaStreamBeginCapture, cudaStreamEndCapture
 *            (+ _ptsz)
 *            cudaMemPoolGetAttribute, cudaMemPoolSetAttribute,
 *            cudaMemPoolTrimTo, cudaDeviceEnablePeerAccess,
 *            cudaMemPoolSetAccess
 *   driver   cuMemAlloc_v2, cuMemFree_v2, cuMemAllocAsync, cuMemFreeAsync
 *            (+ _ptsz), cuStreamDestroy_v2, cuStreamBeginCapture_v2,
 *            cuStreamEndCapture (+ _ptsz), cuMemPoolGetAttribute,
 *            cuMemPoolSetAttribute, cuMemPoolTrimTo, cuCtxEnablePeerAccess,
 *            cuMemPoolSetAccess; cuda.h maps cuMemAlloc,
 *            cuMemFree and cuStreamDestroy to the _v2 names
 *   and, in preload_ipc.c, legacy CUDA IPC (cudaIpcGetMemHandle,
 *   cudaIpcOpenMemHandle, cudaIpcCloseMemHandle, cuIpc*), the disables of
 *   peer access and cudaMemPoolExportPointer / cuMemPoolExportPointer
 *
 * Semantics:
 *   - cudaMallocAsync(p, n, s) / cudaFreeAsync(p, s): magpie_malloc_async /
 *     magpie_free_async on s: the same stream-ordered contract.
 *   - cudaMalloc / cuMemAlloc: memory usable by every stream at once. It
 *     comes from a private stream of the device that no work is ever
 *     enqueued on and no block is freed on except after a device
 *     synchronisation, so every block it hands out is free of pending work
 *     on every stream.
 *   - cudaFree / cuMemFree of a magpie block: the block may have been used
 *     on any stream, and magpie cannot know which. It synchronises the
 *     block's device (as the real cudaFree may), then frees the block on the
 *     private stream: it is reusable at once, by any stream.
 *   - Size 0, NULL, and pointers magpie did not hand out (cudaMallocManaged,
 *     cudaMallocPitch, pools, allocations made before the library was
 *     usable) go to the real functions (dlsym(RTLD_NEXT)). So does a request
 *     magpie cannot serve (the real function then reports the error, or
 *     succeeds where magpie could not).
 *   - cudaStreamDestroy / cuStreamDestroy: magpie_stream_retire first (what
 *     magpie holds under the handle is sealed while it is valid), then the
 *     real function.
 *   - CUDA graphs: a capture begun through cudaStreamBeginCapture /
 *     cuStreamBeginCapture is announced to magpie first
 *     (magpie_capture_begin, with a pool of this library's that stays
 *     empty), until its end, so
 *     that nothing magpie does invalidates it. While one is under way,
 *     cudaMallocAsync / cuMemAllocAsync on a capturing stream go to the
 *     real functions: they become the graph's memory nodes, as without this
 *     library (the driver's pool serves them; cudaFreeAsync of them too);
 *     cudaMalloc / cuMemAlloc go to the real functions, which do what CUDA
 *     does during a capture; cudaFree / cuMemFree of a magpie block, which
 *     would synchronise the device, are refused with
 *     cudaErrorStreamCaptureUnsupported (900) and the block stays
 *     allocated, as CUDA refuses an unsafe call during a capture.
 *   - cudaMemPoolGetAttribute / SetAttribute / TrimTo (and cuMemPool*) on a
 *     device's default pool: the usage figures include magpie's, resets
 *     and trims reach magpie too (see "The default memory pool's figures"
 *     below).
 *   - Peer access: cudaDeviceEnablePeerAccess / cuCtxEnablePeerAccess (the
 *     current device may now access the peer's memory), and
 *     cudaMemPoolSetAccess / cuMemPoolSetAccess on a device's default pool
 *     (read or read-write for another device), grant magpie's mappings of
 *     the memory's device to the accessing device too, present and future
 *     (magpie_device_enable_peer_access). If magpie cannot, the call fails
 *     with cudaErrorPeerAccessUnsupported (217). cudaMemPoolGetAccess is not
 *     interposed: the pool answers what was set. The disables
 *     (cudaDeviceDisablePeerAccess, cuCtxDisablePeerAccess, a pool's access
 *     set to none) take magpie's grant back once neither source of it
 *     stands (preload_ipc.c).
 *
 * Not interposed: the shared runtime's own lookups of driver functions,
 * cudaGetDriverEntryPoint under it included (they stay the driver's, which
 * keeps cudaMalloc from being served twice), a static runtime that
 * preload_procaddr.c cannot reach (not on x86-64, in a program linked
 * statically against libc, with a driver older than 12.0: docs/preload.md),
 * cudaMallocFromPoolAsync, cudaMallocPitch/3D/arrays, managed and host
 * memory. Driver-API programs must allocate in the device's primary context
 * (magpie's events and mappings live there).
 *
 * Lock order: preload_lock (private stream creation, the capture pools)
 * is held across magpie_graph_pool_create only (magpie never calls back). */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <stdatomic.h>

#include "magpie.h"
#include "preload/preload_ipc.h"

#define PRELOAD_API __attribute__((visibility("default")))

typedef int cudaError_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;

/* The codes both APIs share for the failures reported here. */
enum {
  PRELOAD_OK = 0,
  PRELOAD_INVALID_VALUE = 1,
  PRELOAD_OUT_OF_MEMORY = 2,
  PRELOAD_INVALID_HANDLE = 400,
  PRELOAD_UNKNOWN = 999
};
#define PRELOAD_STREAM_NON_BLOCKING 1u
#define PRELOAD_PER_THREAD ((cudaStream_t)0x2)

static struct {
  cudaError_t (*cuda_malloc)(void **, size_t);
  cudaError_t (*cuda_free)(void *);
  cudaError_t (*cuda_malloc_async)(void **, size_t, cudaStream_t);
  cudaError_t (*cuda_free_async)(void *, cudaStream_t);
  cudaError_t (*cuda_malloc_async_ptsz)(void **, size_t, cudaStream_t);
  cudaError_t (*cuda_free_async_ptsz)(void *, cudaStream_t);
  cudaError_t (*cuda_get_device)(int *);
  CUresult (*cu_mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*cu_mem_free)(CUdeviceptr);
  CUresult (*cu_mem_alloc_async)(CUdeviceptr *, size_t, cudaStream_t);
  CUresult (*cu_mem_free_async)(CUdeviceptr, cudaStream_t);
  CUresult (*cu_mem_alloc_async_ptsz)(CUdeviceptr *, size_t, cudaStream_t);
  CUresult (*cu_mem_free_async_ptsz)(CUdeviceptr, cudaStream_t);
  CUresult (*cu_ctx_get_device)(int *);
  CUresult (*cu_primary_retain)(CUcontext *, int);
  CUresult (*cu_ctx_push)(CUcontext);
  CUresult (*cu_ctx_pop)(CUcontext *);
  CUresult (*cu_ctx_synchronize)(void);
  CUresult (*cu_stream_create)(cudaStream_t *, unsigned);
  cudaError_t (*cuda_stream_destroy)(cudaStream_t);
  cudaError_t (*cuda_begin_capture)(cudaStream_t, int);
  cudaError_t (*cuda_begin_capture_ptsz)(cudaStream_t, int);
  cudaError_t (*cuda_end_capture)(cudaStream_t, void **);
  cudaError_t (*cuda_end_capture_ptsz)(cudaStream_t, void **);
  CUresult (*cu_begin_capture)(cudaStream_t, int);
  CUresult (*cu_begin_capture_ptsz)(cudaStream_t, int);
  CUresult (*cu_end_capture)(cudaStream_t, void **);
  CUresult (*cu_end_capture_ptsz)(cudaStream_t, void **);
  CUresult (*cu_is_capturing)(cudaStream_t, int *);
  CUresult (*cu_stream_destroy)(cudaStream_t);
  cudaError_t (*cuda_default_pool)(void **, int);
  cudaError_t (*cuda_pool_get)(void *, int, void *);
  cudaError_t (*cuda_pool_set)(void *, int, void *);
  cudaError_t (*cuda_pool_trim)(void *, size_t);
  CUresult (*cu_default_pool)(void **, int);
  CUresult (*cu_pool_get)(void *, int, void *);
  CUresult (*cu_pool_set)(void *, int, void *);
  CUresult (*cu_pool_trim)(void *, size_t);
  cudaError_t (*cuda_enable_peer)(int, unsigned);
  CUresult (*cu_ctx_enable_peer)(CUcontext, unsigned);
  cudaError_t (*cuda_pool_set_access)(void *, const void *, size_t);
  CUresult (*cu_pool_set_access)(void *, const void *, size_t);
  CUresult (*cu_device_count)(int *);
  int usable; /* magpie initialised on the CUDA backend */
} real;

static pthread_once_t preload_once = PTHREAD_ONCE_INIT;
/* The driver and the loaded runtime, as preload_init found them (written
 * once under preload_once, which orders them before every reader). */
static void *preload_drv, *preload_rt;
static pthread_mutex_t preload_lock = PTHREAD_MUTEX_INITIALIZER;
/* Private stream per device: created once under preload_lock, published
 * with release, read with acquire. */
static _Atomic(cudaStream_t) preload_streams[MAGPIE_MAX_DEVICES];
/* The primary context each private stream was made in (retained once);
 * written under preload_lock before the stream is published. */
static CUcontext preload_ctxs[MAGPIE_MAX_DEVICES];

/* The loaded CUDA runtime, for programs that load it into a local scope
 * (Python extension modules are dlopen'ed RTLD_LOCAL), where RTLD_NEXT does
 * not look. */
static int preload_find_cudart(struct dl_phdr_info *info, size_t size, void *out) {
  (void)size;
  if (info->dlpi_name == NULL || strstr(info->dlpi_name, "libcudart.so") == NULL) return 0;
  *(void **)out = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
  return *(void **)out != NULL;
}

/* The next definition of name after this library: the global scope, else
 * the given library (dlsym on a handle searches that library and its
 * dependencies, never this one). */
static void *preload_sym(void *lib, const char *name) {
  void *f = dlsym(RTLD_NEXT, name);
  if (f == NULL && lib != NULL) f = dlsym(lib, name);
  return f;
}

static void preload_init(void) {
  void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  void *rt = NULL;
  dl_iterate_phdr(preload_find_cudart, &rt);
  preload_drv = drv;
  preload_rt = rt;
  real.cuda_malloc = preload_sym(rt, "cudaMalloc");
  real.cuda_free = preload_sym(rt, "cudaFree");
  real.cuda_malloc_async = preload_sym(rt, "cudaMallocAsync");
  real.cuda_free_async = preload_sym(rt, "cudaFreeAsync");
  real.cuda_malloc_async_ptsz = preload_sym(rt, "cudaMallocAsync_ptsz");
  real.cuda_free_async_ptsz = preload_sym(rt, "cudaFreeAsync_ptsz");
  real.cuda_get_device = preload_sym(rt, "cudaGetDevice");
  real.cu_mem_alloc = preload_sym(drv, "cuMemAlloc_v2");
  real.cu_mem_free = preload_sym(drv, "cuMemFree_v2");
  real.cu_mem_alloc_async = preload_sym(drv, "cuMemAllocAsync");
  real.cu_mem_free_async = preload_sym(drv, "cuMemFreeAsync");
  real.cu_mem_alloc_async_ptsz = preload_sym(drv, "cuMemAllocAsync_ptsz");
  real.cu_mem_free_async_ptsz = preload_sym(drv, "cuMemFreeAsync_ptsz");
  real.cuda_stream_destroy = preload_sym(rt, "cudaStreamDestroy");
  real.cuda_begin_capture = preload_sym(rt, "cudaStreamBeginCapture");
  real.cuda_begin_capture_ptsz = preload_sym(rt, "cudaStreamBeginCapture_ptsz");
  real.cuda_end_capture = preload_sym(rt, "cudaStreamEndCapture");
  real.cuda_end_capture_ptsz = preload_sym(rt, "cudaStreamEndCapture_ptsz");
  real.cu_begin_capture = preload_sym(drv, "cuStreamBeginCapture_v2");
  real.cu_begin_capture_ptsz = preload_sym(drv, "cuStreamBeginCapture_v2_ptsz");
  real.cu_end_capture = preload_sym(drv, "cuStreamEndCapture");
  real.cu_end_capture_ptsz = preload_sym(drv, "cuStreamEndCapture_ptsz");
  real.cu_stream_destroy = preload_sym(drv, "cuStreamDestroy_v2");
  real.cuda_pool_get = preload_sym(rt, "cudaMemPoolGetAttribute");
  real.cuda_pool_set = preload_sym(rt, "cudaMemPoolSetAttribute");
  real.cuda_pool_trim = preload_sym(rt, "cudaMemPoolTrimTo");
  real.cu_pool_get = preload_sym(drv, "cuMemPoolGetAttribute");
  real.cu_pool_set = preload_sym(drv, "cuMemPoolSetAttribute");
  real.cu_pool_trim = preload_sym(drv, "cuMemPoolTrimTo");
  real.cuda_default_pool = preload_sym(rt, "cudaDeviceGetDefaultMemPool");
  real.cuda_enable_peer = preload_sym(rt, "cudaDeviceEnablePeerAccess");
  real.cu_ctx_enable_peer = preload_sym(drv, "cuCtxEnablePeerAccess");
  real.cuda_pool_set_access = preload_sym(rt, "cudaMemPoolSetAccess");
  real.cu_pool_set_access = preload_sym(drv, "cuMemPoolSetAccess");
  /* Not interposed: straight from the driver. */
  if (drv != NULL) {
    real.cu_ctx_get_device = dlsym(drv, "cuCtxGetDevice");
    real.cu_primary_retain = dlsym(drv, "cuDevicePrimaryCtxRetain");
    real.cu_ctx_push = dlsym(drv, "cuCtxPushCurrent_v2");
    real.cu_ctx_pop = dlsym(drv, "cuCtxPopCurrent_v2");
    real.cu_ctx_synchronize = dlsym(drv, "cuCtxSynchronize");
    real.cu_stream_create = dlsym(drv, "cuStreamCreate");
    real.cu_default_pool = dlsym(drv, "cuDeviceGetDefaultMemPool");
    real.cu_is_capturing = dlsym(drv, "cuStreamIsCapturing");
    real.cu_device_count = dlsym(drv, "cuDeviceGetCount");
  }
  real.usable = drv != NULL && real.cu_ctx_get_device && real.cu_primary_retain && real.cu_ctx_push &&
                real.cu_ctx_pop && real.cu_ctx_synchronize && real.cu_stream_create && real.cu_is_capturing &&
                magpie_active_backend() == MAGPIE_BACKEND_CUDA;
}

int preload_usable(void) {
  pthread_once(&preload_once, preload_init);
  return real.usable;
}

void *preload_runtime_sym(const char *name) {
  pthread_once(&preload_once, preload_init);
  return preload_sym(preload_rt, name);
}

void *preload_driver_sym(const char *name) {
  pthread_once(&preload_once, preload_init);
  return preload_sym(preload_drv, name);
}

/* The device's private stream (created in its primary context, never given
 * work); NULL if it cannot be made. */
static cudaStream_t preload_stream(int dev) {
  if (dev < 0 || dev >= MAGPIE_MAX_DEVICES) return NULL;
  cudaStream_t s = atomic_load_explicit(&preload_streams[dev], memory_order_acquire);
  if (s != NULL) return s;
  pthread_mutex_lock(&preload_lock);
  s = atomic_load_explicit(&preload_streams[dev], memory_order_relaxed);
  CUcontext ctx = NULL, popped = NULL;
  if (s == NULL && real.cu_primary_retain(&ctx, dev) == 0 && real.cu_ctx_push(ctx) == 0) {
    if (real.cu_stream_create(&s, PRELOAD_STREAM_NON_BLOCKING) != 0) s = NULL;
    real.cu_ctx_pop(&popped);
    preload_ctxs[dev] = ctx;
    if (s != NULL) atomic_store_explicit(&preload_streams[dev], s, memory_order_release);
  }
  pthread_mutex_unlock(&preload_lock);
  return s;
}

static int preload_code(int magpie_rc) {
  switch (magpie_rc) {
  case MAGPIE_OK: return PRELOAD_OK;
  case MAGPIE_ERR_INVALID_POINTER:
  case MAGPIE_ERR_DOUBLE_FREE:
  case MAGPIE_ERR_INVALID_ARGUMENT:
  case MAGPIE_ERR_SIZE_OVERFLOW: return PRELOAD_INVALID_VALUE;
  case MAGPIE_ERR_OUT_OF_MEMORY:
  case MAGPIE_ERR_TOO_LARGE: return PRELOAD_OUT_OF_MEMORY;
  case MAGPIE_ERR_INVALID_STREAM: return PRELOAD_INVALID_HANDLE;
  default: return PRELOAD_UNKNOWN;
  }
}

/* Does p lie in magpie's memory (a block's start, or anywhere in a large
 * segment)? Sets its device. Such a pointer is magpie's to free or to
 * reject (a double free, an interior pointer); any other goes to CUDA. */
int preload_owned(const void *p, int *dev) {
  if (p == NULL || !preload_usable()) return 0;
  return magpie_block_info(p, NULL, dev) == MAGPIE_OK || *dev >= 0;
}

/* Wait for all work on dev (its primary context, made current for the
 * call); after preload_stream(dev) succeeded. */
static int preload_device_synchronize(int dev) {
  CUcontext popped = NULL;
  if (real.cu_ctx_push(preload_ctxs[dev]) != 0) return MAGPIE_ERR_BACKEND;
  int rc = real.cu_ctx_synchronize() == 0 ? MAGPIE_OK : MAGPIE_ERR_BACKEND;
  real.cu_ctx_pop(&popped);
  return rc;
}

int preload_sync_device(int dev) {
  return preload_usable() && preload_stream(dev) != NULL ? preload_device_synchronize(dev) : MAGPIE_ERR_BACKEND;
}

/* ---- CUDA graphs ----
 * Captures begun through the interposed functions and not yet ended:
 * incremented (relaxed) when magpie is told, before the real begin
 * (magpie.h: announce, then begin; a begin that fails takes it back),
 * decremented at the end; read (relaxed) by the allocation paths, which
 * then ask whether their stream captures. A capture begun elsewhere (a
 * runtime whose lookups stay the driver's: docs/preload.md) is not seen:
 * magpie's own slow-path checks still refuse to record events on its
 * stream. */
static _Atomic int preload_captures;
/* The announcement's pool (empty: capturing streams' requests go to the
 * real functions), one per device, made once under preload_lock. */
static uint64_t preload_capture_pools[MAGPIE_MAX_DEVICES];

#define PRELOAD_CAPTURE_UNSUPPORTED 900 /* cudaErrorStreamCaptureUnsupported, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */

/* The pool for a capture on s, of the current context's device: a
 * capturing stream cannot be asked its device (cuStreamGetDevice there
 * fails and invalidates the capture: src/device/backend.h). */
static uint64_t preload_capture_pool(cudaStream_t s) {
  (void)s;
  int dev = -1;
  if (real.cu_ctx_get_device(&dev) != 0) return 0;
  if (dev < 0 || dev >= MAGPIE_MAX_DEVICES) return 0;
  pthread_mutex_lock(&preload_lock);
  if (preload_capture_pools[dev] == 0) magpie_graph_pool_create(dev, &preload_capture_pools[dev]);
  uint64_t pool = preload_capture_pools[dev];
  pthread_mutex_unlock(&preload_lock);
  return pool;
}

/* Before a begin on s: tell magpie (magpie.h: announce, then begin).
 * Returns the pool announced with, or 0. */
static uint64_t preload_capture_announce(cudaStream_t s) {
  uint64_t pool;
  if (!preload_usable() || (pool = preload_capture_pool(s)) == 0) return 0;
  if (magpie_capture_begin(pool, s) != MAGPIE_OK) return 0;
  atomic_fetch_add_explicit(&preload_captures, 1, memory_order_relaxed);
  return pool;
}

/* Before the end on s (magpie's announcement is matched by handle). */
static void preload_capture_ending(cudaStream_t s) {
  if (atomic_load_explicit(&preload_captures, memory_order_relaxed) == 0) return;
  uint64_t pool = preload_capture_pool(s);
  if (pool != 0 && magpie_capture_end(pool, s) == MAGPIE_OK)
    atomic_fetch_sub_explicit(&preload_captures, 1, memory_order_relaxed);
}

/* Is a capture under way, and is s (0: the caller's question is about the
 * thread, not a stream) capturing? */
static int preload_in_capture(cudaStream_t s) {
  if (atomic_load_explicit(&preload_captures, memory_order_relaxed) == 0) return 0;
  if (s == NULL) return 1;
  int st = 0;
  return real.cu_is_capturing(s, &st) != 0 || st != 0;
}

/* The begin's result; a begin that failed takes magpie's announcement
 * (pool, from preload_capture_announce) back. */
static int preload_begun(int rc, uint64_t pool, cudaStream_t s) {
  if (rc != PRELOAD_OK && pool != 0 && magpie_capture_end(pool, s) == MAGPIE_OK)
    atomic_fetch_sub_explicit(&preload_captures, 1, memory_order_relaxed);
  return rc;
}

/* The handle _ptsz entry points mean by s (0: the thread's own stream). */
static cudaStream_t preload_ptsz(cudaStream_t s) { return s ? s : PRELOAD_PER_THREAD; }

PRELOAD_API cudaError_t cudaStreamBeginCapture(cudaStream_t s, int mode) {
  pthread_once(&preload_once, preload_init);
  uint64_t pool = preload_capture_announce(s);
  return preload_begun(real.cuda_begin_capture ? real.cuda_begin_capture(s, mode) : PRELOAD_UNKNOWN, pool, s);
}

PRELOAD_API cudaError_t cudaStreamBeginCapture_ptsz(cudaStream_t s, int mode) {
  pthread_once(&preload_once, preload_init);
  uint64_t pool = preload_capture_announce(preload_ptsz(s));
  return preload_begun(real.cuda_begin_capture_ptsz ? real.cuda_begin_capture_ptsz(s, mode) : PRELOAD_UNKNOWN, pool,
                       preload_ptsz(s));
}

PRELOAD_API CUresult cuStreamBeginCapture_v2(cudaStream_t s, int mode) {
  pthread_once(&preload_once, preload_init);
  uint64_t pool = preload_capture_announce(s);
  return preload_begun(real.cu_begin_capture ? real.cu_begin_capture(s, mode) : PRELOAD_UNKNOWN, pool, s);
}

PRELOAD_API CUresult cuStreamBeginCapture_v2_ptsz(cudaStream_t s, int mode) {
  pthread_once(&preload_once, preload_init);
  uint64_t pool = preload_capture_announce(preload_ptsz(s));
  return preload_begun(real.cu_begin_capture_ptsz ? real.cu_begin_capture_ptsz(s, mode) : PRELOAD_UNKNOWN, pool,
                       preload_ptsz(s));
}

/* The ends tell magpie first (its announcement is matched by handle). */
PRELOAD_API cudaError_t cudaStreamEndCapture(cudaStream_t s, void **graph) {
  pthread_once(&preload_once, preload_init);
  preload_capture_ending(s);
  return real.cuda_end_capture ? real.cuda_end_capture(s, graph) : PRELOAD_UNKNOWN;
}

PRELOAD_API cudaError_t cudaStreamEndCapture_ptsz(cudaStream_t s, void **graph) {
  pthread_once(&preload_once, preload_init);
  preload_capture_ending(preload_ptsz(s));
  return real.cuda_end_capture_ptsz ? real.cuda_end_capture_ptsz(s, graph) : PRELOAD_UNKNOWN;
}

PRELOAD_API CUresult cuStreamEndCapture(cudaStream_t s, void **graph) {
  pthread_once(&preload_once, preload_init);
  preload_capture_ending(s);
  return real.cu_end_capture ? real.cu_end_capture(s, graph) : PRELOAD_UNKNOWN;
}

PRELOAD_API CUresult cuStreamEndCapture_ptsz(cudaStream_t s, void **graph) {
  pthread_once(&preload_once, preload_init);
  preload_capture_ending(preload_ptsz(s));
  return real.cu_end_capture_ptsz ? real.cu_end_capture_ptsz(s, graph) : PRELOAD_UNKNOWN;
}

/* Memory usable by every stream of dev at once, or NULL. */
static void *preload_alloc_sync(size_t size, int dev) {
  cudaStream_t s = preload_stream(dev);
  return s != NULL ? magpie_malloc_async(size, s) : NULL;
}

/* A block possibly used on any stream: wait for the device, then free it on
 * the private stream (reusable at once by anyone). */
static int preload_free_sync(void *p, int dev) {
  if (preload_in_capture(NULL)) return PRELOAD_CAPTURE_UNSUPPORTED;
  cudaStream_t s = preload_stream(dev);
  if (s == NULL) return PRELOAD_UNKNOWN;
  int rc = preload_device_synchronize(dev);
  if (rc != MAGPIE_OK) return preload_code(rc);
  return preload_code(magpie_free_async(p, s));
}

/* Stream-ordered allocation: NULL with *code set when the real function
 * should not be tried (an invalid stream). A capturing stream's request
 * is the real function's (a graph memory node). */
static void *preload_alloc_async(size_t size, cudaStream_t s, int *code) {
  *code = PRELOAD_OK;
  if (!preload_usable() || preload_in_capture(s)) return NULL;
  void *p = magpie_malloc_async(size, s);
  if (p == NULL && magpie_last_error() == MAGPIE_ERR_INVALID_STREAM) *code = PRELOAD_INVALID_HANDLE;
  return p;
}

/* ---- runtime API ---- */

PRELOAD_API cudaError_t cudaMalloc(void **devPtr, size_t size) {
  pthread_once(&preload_once, preload_init);
  int dev = -1;
  if (devPtr != NULL && size != 0 && preload_usable() && !preload_in_capture(NULL) && real.cuda_get_device != NULL &&
      real.cuda_get_device(&dev) == 0) {
    void *p = preload_alloc_sync(size, dev);
    if (p != NULL) {
      *devPtr = p;
      return PRELOAD_OK;
    }
  }
  return real.cuda_malloc ? real.cuda_malloc(devPtr, size) : PRELOAD_UNKNOWN;
}

PRELOAD_API cudaError_t cudaFree(void *devPtr) {
  pthread_once(&preload_once, preload_init);
  int dev = -1;
  if (preload_owned(devPtr, &dev)) return preload_free_sync(devPtr, dev);
  return real.cuda_free ? real.cuda_free(devPtr) : PRELOAD_UNKNOWN;
}

static cudaError_t preload_cuda_malloc_async(void **devPtr, size_t size, cudaStream_t s,
                                             cudaError_t (*fallback)(void **, size_t, cudaStream_t)) {
  if (devPtr != NULL && size != 0) {
    int code = PRELOAD_OK;
    void *p = preload_alloc_async(size, s, &code);
    if (p != NULL) {
      *devPtr = p;
      return PRELOAD_OK;
    }
    if (code != PRELOAD_OK) return code;
  }
  return fallback ? fallback(devPtr, size, s) : PRELOAD_UNKNOWN;
}

static cudaError_t preload_cuda_free_async(void *devPtr, cudaStream_t s,
                                           cudaError_t (*fallback)(void *, cudaStream_t)) {
  int dev = -1;
  if (preload_owned(devPtr, &dev)) return preload_code(magpie_free_async(devPtr, s));
  return fallback ? fallback(devPtr, s) : PRELOAD_UNKNOWN;
}

PRELOAD_API cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cuda_malloc_async(devPtr, size, s, real.cuda_malloc_async);
}

PRELOAD_API cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cuda_free_async(devPtr, s, real.cuda_free_async);
}

/* --default-stream per-thread: stream 0 means the thread's own stream. */
PRELOAD_API cudaError_t cudaMallocAsync_ptsz(void **devPtr, size_t size, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cuda_malloc_async(devPtr, size, s ? s : PRELOAD_PER_THREAD, real.cuda_malloc_async_ptsz);
}

PRELOAD_API cudaError_t cudaFreeAsync_ptsz(void *devPtr, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cuda_free_async(devPtr, s ? s : PRELOAD_PER_THREAD, real.cuda_free_async_ptsz);
}

/* The handle is about to die: magpie seals what it holds under it first
 * (its errors, e.g. for a handle magpie cannot query, are the real
 * function's to report). */
static void preload_retire(cudaStream_t s) {
  if (preload_usable() && s != NULL && s != PRELOAD_PER_THREAD && s != (cudaStream_t)1) (void)magpie_stream_retire(s);
}

PRELOAD_API cudaError_t cudaStreamDestroy(cudaStream_t s) {
  preload_retire(s);
  return real.cuda_stream_destroy ? real.cuda_stream_destroy(s) : PRELOAD_UNKNOWN;
}

/* ---- driver API ---- */

PRELOAD_API CUresult cuStreamDestroy_v2(cudaStream_t s) {
  preload_retire(s);
  return real.cu_stream_destroy ? real.cu_stream_destroy(s) : PRELOAD_UNKNOWN;
}

PRELOAD_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
  pthread_once(&preload_once, preload_init);
  int dev = -1;
  if (dptr != NULL && size != 0 && preload_usable() && !preload_in_capture(NULL) && real.cu_ctx_get_device(&dev) == 0) {
    void *p = preload_alloc_sync(size, dev);
    if (p != NULL) {
      *dptr = (CUdeviceptr)(uintptr_t)p;
      return PRELOAD_OK;
    }
  }
  return real.cu_mem_alloc ? real.cu_mem_alloc(dptr, size) : PRELOAD_UNKNOWN;
}

PRELOAD_API CUresult cuMemFree_v2(CUdeviceptr dptr) {
  pthread_once(&preload_once, preload_init);
  int dev = -1;
  void *p = (void *)(uintptr_t)dptr;
  if (preload_owned(p, &dev)) return preload_free_sync(p, dev);
  return real.cu_mem_free ? real.cu_mem_free(dptr) : PRELOAD_UNKNOWN;
}

static CUresult preload_cu_alloc_async(CUdeviceptr *dptr, size_t size, cudaStream_t s,
                                       CUresult (*fallback)(CUdeviceptr *, size_t, cudaStream_t)) {
  if (dptr != NULL && size != 0) {
    int code = PRELOAD_OK;
    void *p = preload_alloc_async(size, s, &code);
    if (p != NULL) {
      *dptr = (CUdeviceptr)(uintptr_t)p;
      return PRELOAD_OK;
    }
    if (code != PRELOAD_OK) return code;
  }
  return fallback ? fallback(dptr, size, s) : PRELOAD_UNKNOWN;
}

static CUresult preload_cu_free_async(CUdeviceptr dptr, cudaStream_t s,
                                      CUresult (*fallback)(CUdeviceptr, cudaStream_t)) {
  int dev = -1;
  void *p = (void *)(uintptr_t)dptr;
  if (preload_owned(p, &dev)) return preload_code(magpie_free_async(p, s));
  return fallback ? fallback(dptr, s) : PRELOAD_UNKNOWN;
}

PRELOAD_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cu_alloc_async(dptr, size, s, real.cu_mem_alloc_async);
}

PRELOAD_API CUresult cuMemFreeAsync(CUdeviceptr dptr, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cu_free_async(dptr, s, real.cu_mem_free_async);
}

PRELOAD_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cu_alloc_async(dptr, size, s ? s : PRELOAD_PER_THREAD, real.cu_mem_alloc_async_ptsz);
}

PRELOAD_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, cudaStream_t s) {
  pthread_once(&preload_once, preload_init);
  return preload_cu_free_async(dptr, s ? s : PRELOAD_PER_THREAD, real.cu_mem_free_async_ptsz);
}

/* ---- The default memory pool's figures ----
 * cudaMallocAsync allocates from the device's default pool; under this
 * library magpie serves those requests instead, so the pool's own usage
 * attributes would read 0, and programs that read them (PyTorch's
 * cudaMallocAsync backend, for torch.cuda.memory_allocated and the rest;
 * TensorRT-LLM's buffer manager) would see nothing allocated. For a
 * device's default pool:
 *   get ReservedMemCurrent/High, UsedMemCurrent/High: the pool's own figure
 *     (requests that reached it) plus magpie's (reserved, peak reserved, in
 *     use, peak in use); the high marks of the two may come from different
 *     moments, so their sum is an upper bound, as PyTorch says of its own;
 *   set ReservedMemHigh/UsedMemHigh (a reset; CUDA accepts only 0): the
 *     pool's, and magpie_stats_reset_peaks;
 *   trim to keep bytes: the pool's, and magpie_trim(device, keep).
 * Other pools and attributes go to the real functions unchanged. The pool
 * is matched against the default pools of the current device and of the
 * devices magpie holds memory on (asking for another device's pool could
 * create its context). */
enum {
  PRELOAD_POOL_RESERVED = 5, /* cudaMemPoolAttrReservedMemCurrent, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT */
  PRELOAD_POOL_RESERVED_HIGH = 6,
  PRELOAD_POOL_USED = 7,
  PRELOAD_POOL_USED_HIGH = 8
};

/* Each device's default pool once asked for (NULL before); written with
 * release, read with acquire (a race only asks twice). */
static _Atomic(void *) preload_pools[MAGPIE_MAX_DEVICES];

static void *preload_default_pool(int dev) {
  void *p = atomic_load_explicit(&preload_pools[dev], memory_order_acquire);
  if (p != NULL) return p;
  int rc = real.cuda_default_pool ? real.cuda_default_pool(&p, dev)
           : real.cu_default_pool ? real.cu_default_pool(&p, dev)
                                  : PRELOAD_UNKNOWN;
  if (rc != PRELOAD_OK || p == NULL) return NULL;
  atomic_store_explicit(&preload_pools[dev], p, memory_order_release);
  return p;
}

/* The device whose default pool is pool, or -1. */
static int preload_pool_device(void *pool) {
  if (pool == NULL || !preload_usable()) return -1;
  int cur = -1;
  if (real.cu_ctx_get_device(&cur) == PRELOAD_OK && cur >= 0 && cur < MAGPIE_MAX_DEVICES &&
      preload_default_pool(cur) == pool)
    return cur;
  for (int d = 0; d < MAGPIE_MAX_DEVICES; d++) {
    magpie_stats st;
    if (d == cur) continue;
    if (magpie_stats_get(d, &st) != MAGPIE_OK) break; /* no such device */
    if (st.reserved_bytes > 0 && preload_default_pool(d) == pool) return d;
  }
  return -1;
}

static int preload_pool_usage(int attr) { return attr >= PRELOAD_POOL_RESERVED && attr <= PRELOAD_POOL_USED_HIGH; }

/* rc: the real function's answer for pool's own figure in *value. */
static int preload_pool_get(void *pool, int attr, void *value, int rc) {
  if (rc != PRELOAD_OK || !preload_pool_usage(attr)) return rc;
  int dev = preload_pool_device(pool);
  magpie_stats st;
  if (dev < 0 || magpie_stats_get(dev, &st) != MAGPIE_OK) return rc;
  uint64_t add = attr == PRELOAD_POOL_RESERVED        ? st.reserved_bytes
                 : attr == PRELOAD_POOL_RESERVED_HIGH ? st.peak_reserved_bytes
                 : attr == PRELOAD_POOL_USED          ? st.in_use_bytes
                                                      : st.peak_in_use_bytes;
  uint64_t v;
  memcpy(&v, value, sizeof v);
  v += add;
  memcpy(value, &v, sizeof v);
  return rc;
}

static int preload_pool_set(void *pool, int attr, int rc) {
  if (rc == PRELOAD_OK && (attr == PRELOAD_POOL_RESERVED_HIGH || attr == PRELOAD_POOL_USED_HIGH)) {
    int dev = preload_pool_device(pool);
    if (dev >= 0) magpie_stats_reset_peaks(dev);
  }
  return rc;
}

static int preload_pool_trim(void *pool, size_t keep, int rc) {
  if (rc == PRELOAD_OK) {
    int dev = preload_pool_device(pool);
    if (dev >= 0) magpie_trim(dev, keep);
  }
  return rc;
}

PRELOAD_API cudaError_t cudaMemPoolGetAttribute(void *pool, int attr, void *value) {
  pthread_once(&preload_once, preload_init);
  if (real.cuda_pool_get == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_get(pool, attr, value, real.cuda_pool_get(pool, attr, value));
}

PRELOAD_API cudaError_t cudaMemPoolSetAttribute(void *pool, int attr, void *value) {
  pthread_once(&preload_once, preload_init);
  if (real.cuda_pool_set == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_set(pool, attr, real.cuda_pool_set(pool, attr, value));
}

PRELOAD_API cudaError_t cudaMemPoolTrimTo(void *pool, size_t keep) {
  pthread_once(&preload_once, preload_init);
  if (real.cuda_pool_trim == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_trim(pool, keep, real.cuda_pool_trim(pool, keep));
}

PRELOAD_API CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value) {
  pthread_once(&preload_once, preload_init);
  if (real.cu_pool_get == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_get(pool, attr, value, real.cu_pool_get(pool, attr, value));
}

PRELOAD_API CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value) {
  pthread_once(&preload_once, preload_init);
  if (real.cu_pool_set == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_set(pool, attr, real.cu_pool_set(pool, attr, value));
}

PRELOAD_API CUresult cuMemPoolTrimTo(void *pool, size_t keep) {
  pthread_once(&preload_once, preload_init);
  if (real.cu_pool_trim == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_trim(pool, keep, real.cu_pool_trim(pool, keep));
}

/* ---- Peer access (see the top) ---- */

#define PRELOAD_PEER_UNSUPPORTED 217 /* cudaErrorPeerAccessUnsupported, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED */
#define PRELOAD_PEER_ALREADY 704     /* cudaErrorPeerAccessAlreadyEnabled, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED */
#define PRELOAD_LOCATION_DEVICE 1    /* cudaMemLocationTypeDevice, CU_MEM_LOCATION_TYPE_DEVICE */

/* cudaMemAccessDesc and CUmemAccessDesc: a location (type, id) and flags
 * (0: none, 1: read, 3: read-write). */
typedef struct preload_access_desc {
  int type;
  int id;
  int flags;
} preload_access_desc;

/* rc: the real call's answer. Where it granted accessor access to owner's
 * memory (or it was granted already), magpie's mappings of owner are
 * granted to accessor too, and the grant's source (PRELOAD_GRANT_*) is
 * noted for the disables (preload_ipc.c). */
static int preload_grant(int rc, int owner, int accessor, unsigned source) {
  if ((rc != PRELOAD_OK && rc != PRELOAD_PEER_ALREADY) || !preload_usable()) return rc;
  if (owner < 0 || accessor < 0 || owner == accessor) return rc;
  if (magpie_device_enable_peer_access(owner, accessor) != MAGPIE_OK) return PRELOAD_PEER_UNSUPPORTED;
  preload_peer_granted(owner, accessor, source);
  return rc;
}

PRELOAD_API cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  pthread_once(&preload_once, preload_init);
  if (real.cuda_enable_peer == NULL) return PRELOAD_UNKNOWN;
  int rc = real.cuda_enable_peer(peer, flags);
  int cur = -1;
  if (real.cuda_get_device == NULL || real.cuda_get_device(&cur) != PRELOAD_OK) return rc;
  return preload_grant(rc, peer, cur, PRELOAD_GRANT_CTX);
}

PRELOAD_API CUresult cuCtxEnablePeerAccess(CUcontext peer_ctx, unsigned flags) {
  pthread_once(&preload_once, preload_init);
  if (real.cu_ctx_enable_peer == NULL) return PRELOAD_UNKNOWN;
  int rc = real.cu_ctx_enable_peer(peer_ctx, flags);
  if (!preload_usable()) return rc;
  int cur = -1, owner = -1;
  CUcontext popped = NULL;
  if (real.cu_ctx_get_device(&cur) != PRELOAD_OK || real.cu_ctx_push(peer_ctx) != PRELOAD_OK) return rc;
  if (real.cu_ctx_get_device(&owner) != PRELOAD_OK) owner = -1;
  real.cu_ctx_pop(&popped);
  return preload_grant(rc, owner, cur, PRELOAD_GRANT_CTX);
}

/* The device whose default pool is pool, asking every device's (a pool's
 * access is set before it serves anything, so the devices magpie holds
 * memory on do not suffice here); -1 if none. */
static int preload_pool_owner(void *pool) {
  int dev = preload_pool_device(pool), n = 0;
  if (dev >= 0 || real.cu_device_count == NULL || real.cu_device_count(&n) != PRELOAD_OK) return dev;
  for (int d = 0; dev < 0 && d < n && d < MAGPIE_MAX_DEVICES; d++)
    if (preload_default_pool(d) == pool) dev = d;
  return dev;
}

static int preload_pool_access(void *pool, const void *descs, size_t count, int rc) {
  if (rc != PRELOAD_OK || descs == NULL || !preload_usable()) return rc;
  int owner = preload_pool_owner(pool);
  const preload_access_desc *d = descs;
  for (size_t i = 0; owner >= 0 && i < count && rc == PRELOAD_OK; i++)
    if (d[i].type == PRELOAD_LOCATION_DEVICE)
      rc = d[i].flags != 0 ? preload_grant(rc, owner, d[i].id, PRELOAD_GRANT_POOL)
                           : preload_peer_revoke(rc, owner, d[i].id, PRELOAD_GRANT_POOL);
  return rc;
}

PRELOAD_API cudaError_t cudaMemPoolSetAccess(void *pool, const void *descs, size_t count) {
  pthread_once(&preload_once, preload_init);
  if (real.cuda_pool_set_access == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_access(pool, descs, count, real.cuda_pool_set_access(pool, descs, count));
}

PRELOAD_API CUresult cuMemPoolSetAccess(void *pool, const void *descs, size_t count) {
  pthread_once(&preload_once, preload_init);
  if (real.cu_pool_set_access == NULL) return PRELOAD_UNKNOWN;
  return preload_pool_access(pool, descs, count, real.cu_pool_set_access(pool, descs, count));
}
