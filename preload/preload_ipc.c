/* libmagpie_preload.so, with magpie_preload.c: legacy CUDA IPC and the
 * disables of peer access, for programs that share memory with other
 * processes or devices.
 *
 * Interposed:
 *   runtime  cudaIpcGetMemHandle, cudaIpcOpenMemHandle,
 *            cudaIpcCloseMemHandle, cudaDeviceDisablePeerAccess,
 *            cudaMemPoolExportPointer
 *   driver   cuIpcGetMemHandle, cuIpcOpenMemHandle (and _v2, the name
 *            cuda.h maps it to), cuIpcCloseMemHandle,
 *            cuCtxDisablePeerAccess, cuMemPoolExportPointer
 *
 * Legacy IPC. A block magpie served (cudaMalloc, cudaMallocAsync,
 * cuMemAlloc under this library) is not CUDA's allocation, so CUDA cannot
 * export it: cudaIpcGetMemHandle of a pointer in magpie's memory writes
 * magpie's compact handle (magpie_ipc_export_compact) into the 64 bytes of
 * the cudaIpcMemHandle_t, with magpie_ipc_export's guarantees (the block
 * is not reused while any process has it open, a dead importer's hold is
 * released). cudaIpcOpenMemHandle tells a compact handle from CUDA's
 * (magpie_ipc_is_compact) and imports it (magpie_ipc_import_compact); with
 * cudaIpcMemLazyEnablePeerAccess the current device is given access too,
 * as CUDA gives it. As CUDA does, a handle opened again for the same device
 * returns the same address and counts the opens, and the last
 * cudaIpcCloseMemHandle of it waits for the opening device's work
 * (synchronising it), then closes the import (magpie_ipc_close). Every
 * other pointer and handle goes to CUDA unchanged: memory magpie did not
 * serve, and handles exported by a process without magpie. Both processes
 * must run magpie (this library, or libmagpie's own API): CUDA cannot open
 * a compact handle.
 *
 * cudaMemPoolExportPointer / cuMemPoolExportPointer of a magpie block fail
 * with cudaErrorNotSupported (801): the block is in no pool, and CUDA
 * exports pointers of shared pools only (made with a handle type), which a
 * device's default pool, whose allocations magpie serves, is not. Shared
 * pools' allocations (cudaMallocFromPoolAsync) stay CUDA's, and so do their
 * exported pointers. A program that makes a shared pool the device's
 * current one (cudaDeviceSetMemPool) and exports cudaMallocAsync pointers
 * gets the refusal: it must allocate those with cudaMallocFromPoolAsync.
 * cudaMemPoolImportPointer is not interposed: its data never names magpie
 * memory.
 *
 * Peer access. magpie_preload.c grants magpie's mappings of a device to
 * another where the program grants it; here the disables take the grant
 * back (magpie_device_disable_peer_access: every mapping, present and
 * future), after the real call succeeded: cudaDeviceDisablePeerAccess /
 * cuCtxDisablePeerAccess for the context's grant, and cudaMemPoolSetAccess
 * to none (magpie_preload.c) for the pool's. magpie serves both kinds of
 * block from the same mappings, so they stay open while either grant
 * stands (preload_grants).
 *
 * Lock order: preload_ipc_lock (this process's opens of compact handles)
 * is held across magpie_ipc_import_compact and nothing else that takes a
 * lock of this library (magpie never calls back). */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "magpie.h"
#include "preload/preload_ipc.h"

#define PRELOAD_API __attribute__((visibility("default")))

typedef int cudaError_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;

/* cudaIpcMemHandle_t and CUipcMemHandle: 64 opaque bytes, passed by value. */
typedef struct preload_ipc_handle {
  char reserved[64];
} preload_ipc_handle;
_Static_assert(sizeof(preload_ipc_handle) == MAGPIE_IPC_COMPACT_SIZE, "a compact handle fills a CUDA IPC handle");

/* The codes both APIs share for the failures reported here. */
enum {
  PRELOAD_IPC_OK = 0,
  PRELOAD_IPC_INVALID_VALUE = 1,
  PRELOAD_IPC_OUT_OF_MEMORY = 2,
  PRELOAD_IPC_MAP_FAILED = 205,       /* cudaErrorMapBufferObjectFailed, CUDA_ERROR_MAP_FAILED */
  PRELOAD_IPC_PEER_UNSUPPORTED = 217, /* cudaErrorPeerAccessUnsupported, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED */
  PRELOAD_IPC_INVALID_HANDLE = 400,   /* cudaErrorInvalidResourceHandle, CUDA_ERROR_INVALID_HANDLE */
  PRELOAD_IPC_NOT_SUPPORTED = 801,    /* cudaErrorNotSupported, CUDA_ERROR_NOT_SUPPORTED */
  PRELOAD_IPC_UNKNOWN = 999
};
#define PRELOAD_IPC_LAZY_PEER 1u /* cudaIpcMemLazyEnablePeerAccess, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */

/* The real functions, resolved once (preload_ipc_once orders them before
 * every use). */
static struct {
  cudaError_t (*cuda_get_handle)(preload_ipc_handle *, void *);
  cudaError_t (*cuda_open)(void **, preload_ipc_handle, unsigned);
  cudaError_t (*cuda_close)(void *);
  CUresult (*cu_get_handle)(preload_ipc_handle *, CUdeviceptr);
  CUresult (*cu_open)(CUdeviceptr *, preload_ipc_handle, unsigned);
  CUresult (*cu_open_v2)(CUdeviceptr *, preload_ipc_handle, unsigned);
  CUresult (*cu_close)(CUdeviceptr);
  cudaError_t (*cuda_pool_export)(void *, void *);
  CUresult (*cu_pool_export)(void *, CUdeviceptr);
  cudaError_t (*cuda_disable_peer)(int);
  CUresult (*cu_ctx_disable_peer)(CUcontext);
  cudaError_t (*cuda_get_device)(int *);
  CUresult (*cu_ctx_get_device)(int *);
  CUresult (*cu_ctx_push)(CUcontext);
  CUresult (*cu_ctx_pop)(CUcontext *);
} preload_ipc_real;

static pthread_once_t preload_ipc_once = PTHREAD_ONCE_INIT;

static void preload_ipc_init(void) {
  preload_ipc_real.cuda_get_handle = preload_runtime_sym("cudaIpcGetMemHandle");
  preload_ipc_real.cuda_open = preload_runtime_sym("cudaIpcOpenMemHandle");
  preload_ipc_real.cuda_close = preload_runtime_sym("cudaIpcCloseMemHandle");
  preload_ipc_real.cuda_pool_export = preload_runtime_sym("cudaMemPoolExportPointer");
  preload_ipc_real.cuda_disable_peer = preload_runtime_sym("cudaDeviceDisablePeerAccess");
  preload_ipc_real.cuda_get_device = preload_runtime_sym("cudaGetDevice");
  preload_ipc_real.cu_get_handle = preload_driver_sym("cuIpcGetMemHandle");
  preload_ipc_real.cu_open = preload_driver_sym("cuIpcOpenMemHandle");
  preload_ipc_real.cu_open_v2 = preload_driver_sym("cuIpcOpenMemHandle_v2");
  preload_ipc_real.cu_close = preload_driver_sym("cuIpcCloseMemHandle");
  preload_ipc_real.cu_pool_export = preload_driver_sym("cuMemPoolExportPointer");
  preload_ipc_real.cu_ctx_disable_peer = preload_driver_sym("cuCtxDisablePeerAccess");
  preload_ipc_real.cu_ctx_get_device = preload_driver_sym("cuCtxGetDevice");
  preload_ipc_real.cu_ctx_push = preload_driver_sym("cuCtxPushCurrent_v2");
  preload_ipc_real.cu_ctx_pop = preload_driver_sym("cuCtxPopCurrent_v2");
}

/* magpie is usable here and the helpers this file needs were found. */
static int preload_ipc_usable(void) {
  pthread_once(&preload_ipc_once, preload_ipc_init);
  return preload_usable() && preload_ipc_real.cu_ctx_get_device && preload_ipc_real.cu_ctx_push &&
         preload_ipc_real.cu_ctx_pop;
}

/* Does p lie in magpie's memory (preload_owned), with this file's helpers
 * found? */
static int preload_ipc_owned(const void *p) {
  int dev = -1;
  return preload_ipc_usable() && preload_owned(p, &dev);
}

/* The calling thread's current device (its context's), or -1. */
static int preload_ipc_current_device(void) {
  int dev = -1;
  if (preload_ipc_real.cu_ctx_get_device == NULL || preload_ipc_real.cu_ctx_get_device(&dev) != PRELOAD_IPC_OK)
    return -1;
  return dev;
}

/* ---- legacy IPC ---- */

/* A compact handle opened in this process: the same handle opened again
 * for the same device and peer returns ptr and counts (CUDA's rule), and
 * the last close closes magpie's import. */
typedef struct preload_import {
  unsigned char handle[MAGPIE_IPC_COMPACT_SIZE];
  int device; /* current at the open: its work is waited for at the last close */
  int peer;   /* the import's extra device (magpie_ipc_import_compact), or -1 */
  void *ptr;
  unsigned opens;
  struct preload_import *next;
} preload_import;

/* Guards preload_imports and every entry's opens; held across the import
 * itself, so that two threads opening one handle share one mapping. */
static pthread_mutex_t preload_ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static preload_import *preload_imports;

static int preload_ipc_code(int magpie_rc) {
  switch (magpie_rc) {
  case MAGPIE_OK: return PRELOAD_IPC_OK;
  case MAGPIE_ERR_INVALID_POINTER:
  case MAGPIE_ERR_INVALID_ARGUMENT: return PRELOAD_IPC_INVALID_VALUE;
  case MAGPIE_ERR_OUT_OF_MEMORY: return PRELOAD_IPC_OUT_OF_MEMORY;
  case MAGPIE_ERR_NO_PEER_ACCESS: return PRELOAD_IPC_PEER_UNSUPPORTED;
  /* The handle names nothing that can be opened: the exporter is gone or
   * refused (freed, revoked), or its device is not visible here. */
  case MAGPIE_ERR_IPC: return PRELOAD_IPC_INVALID_HANDLE;
  case MAGPIE_ERR_BACKEND: return PRELOAD_IPC_MAP_FAILED;
  default: return PRELOAD_IPC_UNKNOWN;
  }
}

/* Export of a pointer in magpie's memory (*served set), else nothing. A
 * pointer that is not a block's start, or a block that cannot be exported,
 * is refused as CUDA refuses a pointer it did not allocate. */
static int preload_ipc_get(preload_ipc_handle *h, void *p, int *served) {
  *served = h != NULL && preload_ipc_owned(p);
  if (!*served) return PRELOAD_IPC_OK;
  int rc = magpie_ipc_export_compact(p, 0, (magpie_ipc_compact *)h);
  return rc == MAGPIE_ERR_IPC ? PRELOAD_IPC_NOT_SUPPORTED : preload_ipc_code(rc);
}

/* Open of a compact handle (the caller checked it is one) for dev, the
 * calling thread's current device (-1: unknown). */
static int preload_ipc_open(void **out, const preload_ipc_handle *h, unsigned flags, int dev) {
  if (out == NULL || (flags & ~PRELOAD_IPC_LAZY_PEER) != 0) return PRELOAD_IPC_INVALID_VALUE;
  /* magpie's handle, in a process where magpie cannot run on CUDA: CUDA
   * cannot open it either. */
  if (!preload_ipc_usable()) return PRELOAD_IPC_INVALID_HANDLE;
  int peer = (flags & PRELOAD_IPC_LAZY_PEER) ? dev : -1;
  pthread_mutex_lock(&preload_ipc_lock);
  preload_import *e = preload_imports;
  while (e != NULL && (e->device != dev || e->peer != peer || memcmp(e->handle, h, sizeof e->handle) != 0)) e = e->next;
  int rc = MAGPIE_OK;
  if (e != NULL) {
    e->opens++;
  } else if ((e = calloc(1, sizeof *e)) == NULL) {
    rc = MAGPIE_ERR_OUT_OF_MEMORY;
  } else if ((rc = magpie_ipc_import_compact((const magpie_ipc_compact *)h, peer, &e->ptr, NULL)) != MAGPIE_OK) {
    free(e);
    e = NULL;
  } else {
    memcpy(e->handle, h, sizeof e->handle);
    e->device = dev;
    e->peer = peer;
    e->opens = 1;
    e->next = preload_imports;
    preload_imports = e;
  }
  if (e != NULL) *out = e->ptr;
  pthread_mutex_unlock(&preload_ipc_lock);
  return preload_ipc_code(rc);
}

/* Close of p if this process opened it as a compact handle (*served set):
 * one open less; the last waits for the opening device's work, then
 * closes magpie's import. */
static int preload_ipc_close(void *p, int *served) {
  *served = 0;
  if (p == NULL || !preload_ipc_usable()) return PRELOAD_IPC_OK;
  pthread_mutex_lock(&preload_ipc_lock);
  preload_import **pp = &preload_imports;
  while (*pp != NULL && (*pp)->ptr != p) pp = &(*pp)->next;
  preload_import *e = *pp;
  if (e != NULL) {
    *served = 1;
    if (--e->opens > 0) e = NULL; /* still open */
    else *pp = e->next;
  }
  pthread_mutex_unlock(&preload_ipc_lock);
  if (e == NULL) return PRELOAD_IPC_OK;
  /* The kernels of the opening device may still use the mapping: wait for
   * them first (a device that cannot be waited for has lost its context,
   * and nothing of it runs any more). */
  int synced = preload_sync_device(e->device);
  int rc = magpie_ipc_close(p, NULL);
  if (rc != MAGPIE_OK) { /* still imported: open as before, for another close */
    pthread_mutex_lock(&preload_ipc_lock);
    e->opens = 1;
    e->next = preload_imports;
    preload_imports = e;
    pthread_mutex_unlock(&preload_ipc_lock);
    return preload_ipc_code(rc);
  }
  free(e);
  return preload_ipc_code(synced);
}

PRELOAD_API cudaError_t cudaIpcGetMemHandle(preload_ipc_handle *handle, void *devPtr) {
  int served = 0, rc = preload_ipc_get(handle, devPtr, &served);
  if (served) return rc;
  return preload_ipc_real.cuda_get_handle ? preload_ipc_real.cuda_get_handle(handle, devPtr) : PRELOAD_IPC_UNKNOWN;
}

PRELOAD_API CUresult cuIpcGetMemHandle(preload_ipc_handle *pHandle, CUdeviceptr dptr) {
  int served = 0, rc = preload_ipc_get(pHandle, (void *)(uintptr_t)dptr, &served);
  if (served) return rc;
  return preload_ipc_real.cu_get_handle ? preload_ipc_real.cu_get_handle(pHandle, dptr) : PRELOAD_IPC_UNKNOWN;
}

PRELOAD_API cudaError_t cudaIpcOpenMemHandle(void **devPtr, preload_ipc_handle handle, unsigned flags) {
  pthread_once(&preload_ipc_once, preload_ipc_init);
  if (magpie_ipc_is_compact(&handle)) {
    /* The runtime's current device (its context may not be current yet). */
    int dev = -1;
    if (preload_ipc_real.cuda_get_device == NULL || preload_ipc_real.cuda_get_device(&dev) != PRELOAD_IPC_OK) dev = -1;
    return preload_ipc_open(devPtr, &handle, flags, dev);
  }
  return preload_ipc_real.cuda_open ? preload_ipc_real.cuda_open(devPtr, handle, flags) : PRELOAD_IPC_UNKNOWN;
}

static CUresult preload_cu_open(CUdeviceptr *pdptr, const preload_ipc_handle *h, unsigned flags) {
  void *p = NULL;
  int rc = preload_ipc_open(pdptr != NULL ? &p : NULL, h, flags, preload_ipc_current_device());
  if (rc == PRELOAD_IPC_OK) *pdptr = (CUdeviceptr)(uintptr_t)p;
  return rc;
}

PRELOAD_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, preload_ipc_handle handle, unsigned flags) {
  pthread_once(&preload_ipc_once, preload_ipc_init);
  if (magpie_ipc_is_compact(&handle)) return preload_cu_open(pdptr, &handle, flags);
  return preload_ipc_real.cu_open_v2 ? preload_ipc_real.cu_open_v2(pdptr, handle, flags) : PRELOAD_IPC_UNKNOWN;
}

/* The name programs built before cuda.h mapped it to _v2 call (the same
 * signature). */
PRELOAD_API CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, preload_ipc_handle handle, unsigned flags) {
  pthread_once(&preload_ipc_once, preload_ipc_init);
  if (magpie_ipc_is_compact(&handle)) return preload_cu_open(pdptr, &handle, flags);
  return preload_ipc_real.cu_open ? preload_ipc_real.cu_open(pdptr, handle, flags) : PRELOAD_IPC_UNKNOWN;
}

PRELOAD_API cudaError_t cudaIpcCloseMemHandle(void *devPtr) {
  int served = 0, rc = preload_ipc_close(devPtr, &served);
  if (served) return rc;
  return preload_ipc_real.cuda_close ? preload_ipc_real.cuda_close(devPtr) : PRELOAD_IPC_UNKNOWN;
}

PRELOAD_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  int served = 0, rc = preload_ipc_close((void *)(uintptr_t)dptr, &served);
  if (served) return rc;
  return preload_ipc_real.cu_close ? preload_ipc_real.cu_close(dptr) : PRELOAD_IPC_UNKNOWN;
}

/* ---- a pool's exported pointers (see the top) ---- */

PRELOAD_API cudaError_t cudaMemPoolExportPointer(void *exportData, void *ptr) {
  if (preload_ipc_owned(ptr)) return PRELOAD_IPC_NOT_SUPPORTED;
  return preload_ipc_real.cuda_pool_export ? preload_ipc_real.cuda_pool_export(exportData, ptr) : PRELOAD_IPC_UNKNOWN;
}

PRELOAD_API CUresult cuMemPoolExportPointer(void *shareData_out, CUdeviceptr ptr) {
  if (preload_ipc_owned((void *)(uintptr_t)ptr)) return PRELOAD_IPC_NOT_SUPPORTED;
  return preload_ipc_real.cu_pool_export ? preload_ipc_real.cu_pool_export(shareData_out, ptr) : PRELOAD_IPC_UNKNOWN;
}

/* ---- peer access: the disables ---- */

/* preload_grants[owner][accessor]: the PRELOAD_GRANT_* sources standing
 * for magpie's grant of owner's mappings to accessor. Set by the enables
 * (magpie_preload.c) after magpie granted, cleared by the disables before
 * magpie takes the grant back; fetch_or / fetch_and, relaxed: a bit orders
 * nothing else, and an enable racing a disable of the same pair is the
 * program's race, as it is in CUDA. */
static _Atomic unsigned char preload_grants[MAGPIE_MAX_DEVICES][MAGPIE_MAX_DEVICES];

static int preload_pair_ok(int owner, int accessor) {
  return owner >= 0 && accessor >= 0 && owner < MAGPIE_MAX_DEVICES && accessor < MAGPIE_MAX_DEVICES &&
         owner != accessor;
}

void preload_peer_granted(int owner, int accessor, unsigned source) {
  if (preload_pair_ok(owner, accessor))
    atomic_fetch_or_explicit(&preload_grants[owner][accessor], (unsigned char)source, memory_order_relaxed);
}

int preload_peer_revoke(int rc, int owner, int accessor, unsigned source) {
  if (rc != PRELOAD_IPC_OK || !preload_pair_ok(owner, accessor) || !preload_usable()) return rc;
  unsigned left =
      atomic_fetch_and_explicit(&preload_grants[owner][accessor], (unsigned char)~source, memory_order_relaxed) &
      ~source;
  if (left != 0) return rc; /* the other source still grants it */
  return magpie_device_disable_peer_access(owner, accessor) == MAGPIE_OK ? rc : PRELOAD_IPC_UNKNOWN;
}

PRELOAD_API cudaError_t cudaDeviceDisablePeerAccess(int peerDevice) {
  pthread_once(&preload_ipc_once, preload_ipc_init);
  if (preload_ipc_real.cuda_disable_peer == NULL) return PRELOAD_IPC_UNKNOWN;
  int rc = preload_ipc_real.cuda_disable_peer(peerDevice);
  int cur = -1;
  if (rc != PRELOAD_IPC_OK || preload_ipc_real.cuda_get_device == NULL ||
      preload_ipc_real.cuda_get_device(&cur) != PRELOAD_IPC_OK)
    return rc;
  return preload_peer_revoke(rc, peerDevice, cur, PRELOAD_GRANT_CTX);
}

PRELOAD_API CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
  pthread_once(&preload_ipc_once, preload_ipc_init);
  if (preload_ipc_real.cu_ctx_disable_peer == NULL) return PRELOAD_IPC_UNKNOWN;
  int rc = preload_ipc_real.cu_ctx_disable_peer(peerContext);
  if (rc != PRELOAD_IPC_OK || !preload_ipc_usable()) return rc;
  int cur = preload_ipc_current_device(), owner = -1;
  CUcontext popped = NULL;
  if (cur < 0 || preload_ipc_real.cu_ctx_push(peerContext) != PRELOAD_IPC_OK) return rc;
  owner = preload_ipc_current_device();
  preload_ipc_real.cu_ctx_pop(&popped);
  return preload_peer_revoke(rc, owner, cur, PRELOAD_GRANT_CTX);
}
