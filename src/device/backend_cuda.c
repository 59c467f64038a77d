/* The CUDA backend: the backend table (backend.h) over the CUDA driver API.
 *
 * The driver is loaded by init() through the one loader (cuda_driver.h,
 * cuda_loader.c: dlopen("libcuda.so.1") once per process), so the library
 * loads and runs on machines without it; init() then answers
 * MAGPIE_ERR_NO_DEVICE with the loader's reason. Entry points come from
 * cuGetProcAddress_v2 (a CUDA 12.0 or newer driver) at the ABI versions
 * declared in cuda_driver.h, with the legacy meaning of stream handle 0 (as
 * the runtime API without --default-stream per-thread), and are called
 * through the loader's table `cudrv`.
 *
 * Each device's primary context (the one the runtime API uses) is retained on
 * first use and never released, as the runtime does; it is pushed around the
 * calls that need a current context and popped after.
 *
 * Lock order: cuda_st.lock is this file's only lock. It is held by init() and
 * by the first use of a device's context (cuda_device_ctx), never while
 * calling anything outside this file but the driver and its loader (which
 * takes no magpie lock), so it sits below every other magpie lock; the
 * driver takes its own locks inside it and never calls back.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/backend.h"

#include "device/backend_cuda.h"
#include "device/cuda_driver.h"

/* The device arrays are cuda_st.devices and cuda_st.ctx (backend_cuda.h). */
#define CUDA_MAX_DEVICES MAGPIE_MAX_DEVICES

enum { CUDA_STATE_UNINIT = 0, CUDA_STATE_READY = 1, CUDA_STATE_FAILED = 2 };

cuda_state cuda_st = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
};

/* The driver's entry points are the loader's table `cudrv` (NULL for an
 * optional one the driver lacks). It is filled by cudrv_load, which init
 * calls under cuda_st.lock before the release store of cuda_st.state; every
 * operation reads it after its acquire load of cuda_st.state (cuda_ready), so
 * plain fields suffice. */

/* --- errors ------------------------------------------------------------ */

static const char *cuda_error_name(cudrv_result r) {
  const char *name = NULL;
  if (cudrv.get_error_name == NULL || cudrv.get_error_name(r, &name) != CUDRV_SUCCESS || name == NULL)
    return "CUDA_ERROR_UNKNOWN_CODE";
  return name;
}

/* Sets the detail "<what> failed: CUDA_ERROR_X (n)" and returns code. */
__attribute__((format(printf, 3, 4))) int cuda_fail(int code, cudrv_result r, const char *fmt, ...) {
  char what[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  backend_set_error_detail("%s failed: %s (%d)", what, cuda_error_name(r), (int)r);
  return code;
}

int cuda_code(cudrv_result r) { return r == CUDRV_ERROR_OUT_OF_MEMORY ? MAGPIE_ERR_OUT_OF_MEMORY : MAGPIE_ERR_BACKEND; }

/* For calls given a caller's stream: a bad handle or a stream whose context
 * is gone is the caller's stream being invalid, not a driver failure. */
static int cuda_stream_code(cudrv_result r) {
  switch (r) {
  case CUDRV_ERROR_INVALID_VALUE:
  case CUDRV_ERROR_INVALID_HANDLE:
  case CUDRV_ERROR_INVALID_CONTEXT:
  case CUDRV_ERROR_CONTEXT_IS_DESTROYED: return MAGPIE_ERR_INVALID_STREAM;
  /* cuStreamGetId, cuStreamGetDevice and cuStreamGetFlags on a capturing
   * stream (CUDA 13.0, driver 580: refused, and the capture invalidated). */
  case CUDRV_ERROR_STREAM_CAPTURE_UNSUPPORTED:
  case CUDRV_ERROR_STREAM_CAPTURE_INVALIDATED: return MAGPIE_ERR_CAPTURE;
  default: return cuda_code(r);
  }
}

int cuda_ready(void) { return atomic_load_explicit(&cuda_st.state, memory_order_acquire) == CUDA_STATE_READY; }

int cuda_not_ready(void) {
  backend_set_error_detail("CUDA backend used before a successful init()");
  return MAGPIE_ERR_NO_DEVICE;
}

int cuda_check_device(int device) {
  if (device < 0 || device >= cuda_st.ndevices) {
    backend_set_error_detail("CUDA device %d does not exist (%d device%s)", device, cuda_st.ndevices,
                             cuda_st.ndevices == 1 ? "" : "s");
    return MAGPIE_ERR_INVALID_ARGUMENT;
  }
  return MAGPIE_OK;
}

/* --- init -------------------------------------------------------------- */

__attribute__((format(printf, 2, 3))) static int cuda_init_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cuda_st.init_detail, sizeof cuda_st.init_detail, fmt, ap);
  va_end(ap);
  return code;
}

static int cuda_init_locked(void) {
  const char *why = NULL;
  if (cudrv_load(CUDRV_LOAD_LIBRARY, &why) != 0) return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "%s", why);

  cudrv_result r = cudrv.init(0);
  if (r != CUDRV_SUCCESS)
    return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "cuInit failed: %s (%d)", cuda_error_name(r), (int)r);
  int version = 0;
  r = cudrv.driver_get_version(&version);
  if (r != CUDRV_SUCCESS)
    return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "cuDriverGetVersion failed: %s (%d)", cuda_error_name(r), (int)r);
  if (version < CUDRV_REQUEST_VERSION)
    return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "CUDA driver %d.%d is too old: 12.0 or newer is needed", version / 1000,
                          version % 1000 / 10);
  int n = 0;
  r = cudrv.device_get_count(&n);
  if (r != CUDRV_SUCCESS)
    return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "cuDeviceGetCount failed: %s (%d)", cuda_error_name(r), (int)r);
  if (n <= 0) return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "the CUDA driver reports no device");
  if (n > CUDA_MAX_DEVICES) n = CUDA_MAX_DEVICES; /* the rest stay unused */
  for (int i = 0; i < n; i++) {
    r = cudrv.device_get(&cuda_st.devices[i], i);
    if (r != CUDRV_SUCCESS)
      return cuda_init_fail(MAGPIE_ERR_NO_DEVICE, "cuDeviceGet(%d) failed: %s (%d)", i, cuda_error_name(r), (int)r);
  }
  cuda_st.ndevices = n;
  const char *vmm = getenv("MAGPIE_CUDA_VMM");
  cuda_st.vmm_off = vmm != NULL && strcmp(vmm, "0") == 0;
  return MAGPIE_OK;
}

static int cuda_init(void) {
  if (cuda_ready()) return MAGPIE_OK;
  if (pthread_mutex_lock(&cuda_st.lock) != 0) {
    backend_set_error_detail("CUDA backend init: pthread_mutex_lock failed");
    return MAGPIE_ERR_BACKEND;
  }
  if (atomic_load_explicit(&cuda_st.state, memory_order_relaxed) == CUDA_STATE_UNINIT) {
    cuda_st.init_code = cuda_init_locked();
    atomic_store_explicit(&cuda_st.state, cuda_st.init_code == MAGPIE_OK ? CUDA_STATE_READY : CUDA_STATE_FAILED,
                          memory_order_release);
  }
  int code = cuda_st.init_code;
  if (code != MAGPIE_OK) backend_set_error_detail("%s", cuda_st.init_detail);
  pthread_mutex_unlock(&cuda_st.lock);
  return code;
}

/* --- contexts ---------------------------------------------------------- */

int cuda_device_ctx(int device, cudrv_context *out) {
  cudrv_context ctx = atomic_load_explicit(&cuda_st.ctx[device], memory_order_acquire);
  if (ctx != NULL) {
    *out = ctx;
    return MAGPIE_OK;
  }
  if (pthread_mutex_lock(&cuda_st.lock) != 0) {
    backend_set_error_detail("CUDA device %d context: pthread_mutex_lock failed", device);
    return MAGPIE_ERR_BACKEND;
  }
  int rc = MAGPIE_OK;
  ctx = atomic_load_explicit(&cuda_st.ctx[device], memory_order_relaxed);
  if (ctx == NULL) {
    cudrv_result r = cudrv.primary_ctx_retain(&ctx, cuda_st.devices[device]);
    if (r == CUDRV_SUCCESS) atomic_store_explicit(&cuda_st.ctx[device], ctx, memory_order_release);
    else rc = cuda_fail(cuda_code(r), r, "cuDevicePrimaryCtxRetain(device %d)", device);
  }
  pthread_mutex_unlock(&cuda_st.lock);
  *out = ctx;
  return rc;
}

/* Makes device's primary context current until cuda_pop. */
/* The relaxed capture mode (backend.h). With CUDA 13.0 (driver 580), while
 * another thread captures in the global mode, a thread in the default
 * global mode that queries or synchronises an event recorded outside the
 * capture, queries or synchronises its own stream, or allocates device
 * memory gets CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the other thread's
 * capture is invalidated; in the relaxed mode all of these succeed and the
 * capture survives (a context synchronisation fails in every mode;
 * bench/DECISIONS.md, "Device calls run in the relaxed capture mode"). So
 * every such call here runs relaxed: cuda_relax swaps the thread's mode to
 * relaxed and returns the one it had (-1 if the swap failed), cuda_unrelax
 * puts it back. Each is one cheap driver call. */
static int cuda_relax(void) {
  cudrv_capture_mode mode = CUDRV_STREAM_CAPTURE_MODE_RELAXED;
  return cudrv.thread_exchange_capture_mode(&mode) == CUDRV_SUCCESS ? mode : -1;
}

static void cuda_unrelax(int saved) {
  cudrv_capture_mode mode = saved;
  if (saved >= 0) cudrv.thread_exchange_capture_mode(&mode);
}

/* The mode cuda_push replaced, for cuda_pop (pushes do not nest). */
static _Thread_local int cuda_saved_mode = -1;

/* Every call between cuda_push and cuda_pop (the memory calls, device
 * synchronisation) runs in the relaxed capture mode (see cuda_relax):
 * PyTorch's allocator maps memory during captures the same way. */
int cuda_push(int device, const char *op) {
  cudrv_context ctx;
  int rc = cuda_device_ctx(device, &ctx);
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.ctx_push_current(ctx);
  if (r != CUDRV_SUCCESS) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuCtxPushCurrent(device %d) for %s", device, op);
  cuda_saved_mode = cuda_relax();
  return MAGPIE_OK;
}

/* Undoes cuda_push; passes rc through unless the pop itself fails. */
int cuda_pop(int rc, const char *op) {
  cuda_unrelax(cuda_saved_mode);
  cuda_saved_mode = -1;
  cudrv_context ctx;
  cudrv_result r = cudrv.ctx_pop_current(&ctx);
  if (r != CUDRV_SUCCESS && rc == MAGPIE_OK) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuCtxPopCurrent after %s", op);
  return rc;
}

/* The special handles (0, legacy, per-thread) name a stream of the current
 * context, and a thread that never used CUDA has none (the driver answers
 * CUDA_ERROR_INVALID_CONTEXT). The runtime API then
 * makes device 0's primary context current; so does this (slow path, once
 * per thread). Returns 1 if it did, so the caller retries. */
static int cuda_bind_default_ctx(cudrv_stream stream) {
  if ((uintptr_t)stream > (uintptr_t)CUDRV_STREAM_PER_THREAD) return 0;
  cudrv_context cur = NULL;
  if (cudrv.ctx_get_current(&cur) != CUDRV_SUCCESS || cur != NULL) return 0;
  cudrv_context ctx;
  if (cuda_device_ctx(0, &ctx) != MAGPIE_OK) return 0;
  return cudrv.ctx_set_current(ctx) == CUDRV_SUCCESS;
}

static int cuda_ordinal(cudrv_device dev, int *device) {
  for (int i = 0; i < cuda_st.ndevices; i++)
    if (cuda_st.devices[i] == dev) {
      *device = i;
      return MAGPIE_OK;
    }
  backend_set_error_detail("CUDA device handle %d is not among the %d devices", (int)dev, cuda_st.ndevices);
  return MAGPIE_ERR_BACKEND;
}

/* --- devices and memory ------------------------------------------------ */

static int cuda_device_count(int *count) {
  if (!cuda_ready()) return cuda_not_ready();
  *count = cuda_st.ndevices;
  return MAGPIE_OK;
}

static int cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemGetInfo");
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.mem_get_info(free_bytes, total_bytes);
  if (r != CUDRV_SUCCESS) rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemGetInfo(device %d)", device);
  return cuda_pop(rc, "cuMemGetInfo");
}

static int cuda_vmm_supported(int device, int *supported) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  int v = 0;
  cudrv_result r = cudrv.device_get_attribute(&v, CUDRV_DEVICE_ATTRIBUTE_VMM_SUPPORTED, cuda_st.devices[device]);
  if (r != CUDRV_SUCCESS)
    return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device %d)",
                     device);
  *supported = v != 0 && !cuda_st.vmm_off;
  return MAGPIE_OK;
}

/* Pinned device memory on device, with no export handle type: what the
 * granularity is asked for, and what map makes without
 * BACKEND_MAP_EXPORTABLE. */
void cuda_alloc_prop(int device, cudrv_mem_alloc_prop *prop) {
  memset(prop, 0, sizeof *prop);
  prop->type = CUDRV_MEM_ALLOCATION_TYPE_PINNED;
  prop->requested_handle_types = CUDRV_MEM_HANDLE_TYPE_NONE;
  prop->location.type = CUDRV_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = cuda_st.devices[device];
}

/* The caller has checked device; no context needed. */
int cuda_granule(int device, size_t *bytes) {
  cudrv_mem_alloc_prop prop;
  cuda_alloc_prop(device, &prop);
  cudrv_result r = cudrv.mem_get_granularity(bytes, &prop, CUDRV_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDRV_SUCCESS) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemGetAllocationGranularity(device %d)", device);
  if (*bytes == 0 || (*bytes & (*bytes - 1)) != 0) {
    backend_set_error_detail("CUDA device %d: granularity %zu is not a power of two", device, *bytes);
    return MAGPIE_ERR_BACKEND;
  }
  return MAGPIE_OK;
}

static int cuda_granularity(int device, size_t *bytes) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  return rc != MAGPIE_OK ? rc : cuda_granule(device, bytes);
}

/* Checks device and that addr and size are nonzero multiples of the
 * granularity, which it returns in *g. */
int cuda_check_range(int device, uintptr_t addr, size_t size, size_t *g, const char *op) {
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_granule(device, g);
  if (rc != MAGPIE_OK) return rc;
  if (size == 0 || size % *g != 0 || addr % *g != 0) {
    backend_set_error_detail(
        "%s(0x%llx, %zu bytes): not a nonzero multiple of the "
        "granularity (%zu bytes)",
        op, (unsigned long long)addr, size, *g);
    return MAGPIE_ERR_INVALID_ARGUMENT;
  }
  return MAGPIE_OK;
}

static int cuda_reserve(int device, size_t size, uintptr_t *base) {
  if (!cuda_ready()) return cuda_not_ready();
  size_t g;
  int rc = cuda_check_range(device, 0, size, &g, "reserve");
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemAddressReserve");
  if (rc != MAGPIE_OK) return rc;
  cudrv_deviceptr p = 0;
  /* Aligned to the granularity so that every granule of it can be mapped. */
  cudrv_result r = cudrv.mem_address_reserve(&p, size, g, 0, 0);
  if (r == CUDRV_SUCCESS) *base = (uintptr_t)p;
  else rc = cuda_fail(cuda_code(r), r, "cuMemAddressReserve(%zu bytes)", size);
  return cuda_pop(rc, "cuMemAddressReserve");
}

static int cuda_unreserve(int device, uintptr_t base, size_t size) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemAddressFree");
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.mem_address_free((cudrv_deviceptr)base, size);
  if (r != CUDRV_SUCCESS)
    rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemAddressFree(0x%llx, %zu bytes)", (unsigned long long)base, size);
  return cuda_pop(rc, "cuMemAddressFree");
}

static int cuda_unmap(int device, uintptr_t addr, size_t size) {
  if (!cuda_ready()) return cuda_not_ready();
  size_t g;
  int rc = cuda_check_range(device, addr, size, &g, "unmap");
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemUnmap");
  if (rc != MAGPIE_OK) return rc;
  /* Granule by granule, as mapped; go on past a failure to free the rest. */
  for (size_t off = 0; off < size; off += g) {
    cudrv_result r = cudrv.mem_unmap((cudrv_deviceptr)(addr + off), g);
    if (r != CUDRV_SUCCESS && rc == MAGPIE_OK)
      rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemUnmap(0x%llx, %zu bytes)", (unsigned long long)(addr + off), g);
  }
  return cuda_pop(rc, "cuMemUnmap");
}

static int cuda_mem_alloc(int device, size_t size, uintptr_t *out) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemAlloc");
  if (rc != MAGPIE_OK) return rc;
  cudrv_deviceptr p = 0;
  cudrv_result r = cudrv.mem_alloc(&p, size);
  if (r == CUDRV_SUCCESS) *out = (uintptr_t)p;
  else rc = cuda_fail(cuda_code(r), r, "cuMemAlloc(%zu bytes)", size);
  return cuda_pop(rc, "cuMemAlloc");
}

static int cuda_mem_free(int device, uintptr_t ptr, size_t size) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemFree");
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.mem_free((cudrv_deviceptr)ptr);
  if (r != CUDRV_SUCCESS)
    rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemFree(0x%llx, %zu bytes)", (unsigned long long)ptr, size);
  return cuda_pop(rc, "cuMemFree");
}

/* --- events ------------------------------------------------------------ */

static int cuda_event_create(int device, void **event) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuEventCreate");
  if (rc != MAGPIE_OK) return rc;
  cudrv_event e = NULL;
  /* No timing: cheaper to record, and magpie only orders work. */
  cudrv_result r = cudrv.event_create(&e, CUDRV_EVENT_DISABLE_TIMING);
  if (r == CUDRV_SUCCESS) *event = e;
  else rc = cuda_fail(cuda_code(r), r, "cuEventCreate(device %d)", device);
  return cuda_pop(rc, "cuEventCreate");
}

static int cuda_event_destroy(void *event) {
  if (!cuda_ready()) return cuda_not_ready();
  cudrv_result r = cudrv.event_destroy((cudrv_event)event);
  if (r != CUDRV_SUCCESS) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuEventDestroy(%p)", event);
  return MAGPIE_OK;
}

static int cuda_event_record(void *event, cudaStream_t stream) {
  if (!cuda_ready()) return cuda_not_ready();
  cudrv_result r = cudrv.event_record((cudrv_event)event, stream);
  if (r != CUDRV_SUCCESS && cuda_bind_default_ctx(stream)) r = cudrv.event_record((cudrv_event)event, stream);
  if (r != CUDRV_SUCCESS)
    return cuda_fail(cuda_stream_code(r), r, "cuEventRecord(event %p, stream %p)", event, (void *)stream);
  return MAGPIE_OK;
}

static int cuda_event_query(void *event) {
  if (!cuda_ready()) return cuda_not_ready();
  int saved = cuda_relax();
  cudrv_result r = cudrv.event_query((cudrv_event)event);
  cuda_unrelax(saved);
  if (r == CUDRV_SUCCESS) return MAGPIE_OK;
  if (r == CUDRV_ERROR_NOT_READY) return BACKEND_NOT_READY;
  return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuEventQuery(%p)", event);
}

static int cuda_event_synchronize(void *event) {
  if (!cuda_ready()) return cuda_not_ready();
  int saved = cuda_relax();
  cudrv_result r = cudrv.event_synchronize((cudrv_event)event);
  cuda_unrelax(saved);
  if (r != CUDRV_SUCCESS) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuEventSynchronize(%p)", event);
  return MAGPIE_OK;
}

static int cuda_stream_wait_event(cudaStream_t stream, void *event) {
  if (!cuda_ready()) return cuda_not_ready();
  cudrv_result r = cudrv.stream_wait_event(stream, (cudrv_event)event, 0);
  if (r != CUDRV_SUCCESS && cuda_bind_default_ctx(stream)) r = cudrv.stream_wait_event(stream, (cudrv_event)event, 0);
  if (r != CUDRV_SUCCESS)
    return cuda_fail(cuda_stream_code(r), r, "cuStreamWaitEvent(stream %p, event %p)", (void *)stream, event);
  return MAGPIE_OK;
}

/* --- streams ----------------------------------------------------------- */

static int cuda_stream_id_slow(cudaStream_t stream, uint64_t *id, cudrv_result r) {
  unsigned long long v = 0;
  if (cuda_bind_default_ctx(stream) && (r = cudrv.stream_get_id(stream, &v)) == CUDRV_SUCCESS) {
    *id = v;
    return MAGPIE_OK;
  }
  return cuda_fail(cuda_stream_code(r), r, "cuStreamGetId(stream %p)", (void *)stream);
}

/* The hot path: one driver call, no context push (the driver resolves a
 * real handle by itself and a special one through the current context).
 * Ids are never reused, but handle values are, at once (driver 580), and
 * the driver does not check handles: a destroyed one crashes it. So a
 * caller may pass only handles it knows live, and must key any state by
 * id, never by handle. */
/* Special handles (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) name the
 * legacy or per-thread stream of the calling thread's current context; both
 * live as long as the context. So their ids are cached per thread by
 * context: cuCtxGetCurrent replaces cuStreamGetId, which costs several
 * times as much, more through the special-handle path (bench/DECISIONS.md,
 * "Special handles' ids are cached per context"). A context destroyed and
 * re-created at the same address (cuDevicePrimaryCtxReset) would need the
 * cache dropped; magpie retains primary contexts, so they are not reset
 * under it. */
#define CUDA_SPECIAL_CACHE 4
typedef struct cuda_special_ids {
  cudrv_context ctx;
  unsigned long long legacy, per_thread; /* 0 = not yet known */
} cuda_special_ids;
static __thread cuda_special_ids cuda_special_cache[CUDA_SPECIAL_CACHE];

static int cuda_stream_id_special(cudaStream_t stream, uint64_t *id) {
  cudrv_context ctx = NULL;
  if (cudrv.ctx_get_current(&ctx) == CUDRV_SUCCESS && ctx != NULL) {
    int per_thread = (uintptr_t)stream == (uintptr_t)CUDRV_STREAM_PER_THREAD;
    for (int i = 0; i < CUDA_SPECIAL_CACHE; i++) {
      cuda_special_ids *c = &cuda_special_cache[i];
      if (c->ctx != ctx) continue;
      unsigned long long v = per_thread ? c->per_thread : c->legacy;
      if (v != 0) {
        *id = v;
        return MAGPIE_OK;
      }
    }
  }
  unsigned long long v = 0;
  cudrv_result r = cudrv.stream_get_id(stream, &v);
  if (r != CUDRV_SUCCESS) return cuda_stream_id_slow(stream, id, r);
  if (ctx != NULL) {
    cuda_special_ids *slot = &cuda_special_cache[0];
    for (int i = 0; i < CUDA_SPECIAL_CACHE; i++) {
      if (cuda_special_cache[i].ctx == ctx) {
        slot = &cuda_special_cache[i];
        break;
      }
      if (cuda_special_cache[i].ctx == NULL) slot = &cuda_special_cache[i];
    }
    if (slot->ctx != ctx) *slot = (cuda_special_ids){.ctx = ctx};
    if ((uintptr_t)stream == (uintptr_t)CUDRV_STREAM_PER_THREAD) slot->per_thread = v;
    else slot->legacy = v;
  }
  *id = v;
  return MAGPIE_OK;
}

static int cuda_stream_id(cudaStream_t stream, uint64_t *id) {
  if (!cuda_ready()) return cuda_not_ready();
  if ((uintptr_t)stream <= (uintptr_t)CUDRV_STREAM_PER_THREAD) return cuda_stream_id_special(stream, id);
  unsigned long long v;
  cudrv_result r = cudrv.stream_get_id(stream, &v);
  if (r != CUDRV_SUCCESS) return cuda_stream_id_slow(stream, id, r);
  *id = v;
  return MAGPIE_OK;
}

/* The fast path's form: a jump into the driver, no frame of its own. The
 * tcache exists only after init succeeded, so no readiness check. */
static int cuda_stream_id_fast(cudaStream_t stream, unsigned long long *id) { return cudrv.stream_get_id(stream, id); }

/* Drivers before 12.8 lack cuStreamGetDevice: ask the stream's context. */
static int cuda_stream_device_by_ctx(cudaStream_t stream, cudrv_device *dev) {
  cudrv_context ctx = NULL;
  cudrv_result r = cudrv.stream_get_ctx(stream, &ctx);
  if (r != CUDRV_SUCCESS && cuda_bind_default_ctx(stream)) r = cudrv.stream_get_ctx(stream, &ctx);
  if (r != CUDRV_SUCCESS) return cuda_fail(cuda_stream_code(r), r, "cuStreamGetCtx(stream %p)", (void *)stream);
  r = cudrv.ctx_push_current(ctx);
  if (r != CUDRV_SUCCESS)
    return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuCtxPushCurrent(context of stream %p)", (void *)stream);
  int rc = MAGPIE_OK;
  r = cudrv.ctx_get_device(dev);
  if (r != CUDRV_SUCCESS) rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuCtxGetDevice(context of stream %p)", (void *)stream);
  return cuda_pop(rc, "cuCtxGetDevice");
}

static int cuda_stream_device(cudaStream_t stream, int *device) {
  if (!cuda_ready()) return cuda_not_ready();
  cudrv_device dev = 0;
  if (cudrv.stream_get_device != NULL) {
    cudrv_result r = cudrv.stream_get_device(stream, &dev);
    if (r != CUDRV_SUCCESS && cuda_bind_default_ctx(stream)) r = cudrv.stream_get_device(stream, &dev);
    if (r != CUDRV_SUCCESS) return cuda_fail(cuda_stream_code(r), r, "cuStreamGetDevice(stream %p)", (void *)stream);
  } else {
    int rc = cuda_stream_device_by_ctx(stream, &dev);
    if (rc != MAGPIE_OK) return rc;
  }
  return cuda_ordinal(dev, device);
}

/* Capture state: one cuStreamIsCapturing when the stream is not capturing
 * (the common answer); the capture's id from cuStreamGetCaptureInfo only
 * when it is. Both are allowed on a capturing stream. */
static int cuda_stream_capture(cudaStream_t stream, int *status, uint64_t *capture_id) {
  if (!cuda_ready()) return cuda_not_ready();
  cudrv_capture_status st = CUDRV_STREAM_CAPTURE_STATUS_NONE;
  cudrv_result r = cudrv.stream_is_capturing(stream, &st);
  if (r != CUDRV_SUCCESS && r != CUDRV_ERROR_STREAM_CAPTURE_INVALIDATED && cuda_bind_default_ctx(stream))
    r = cudrv.stream_is_capturing(stream, &st);
  if (r == CUDRV_ERROR_STREAM_CAPTURE_INVALIDATED) st = CUDRV_STREAM_CAPTURE_STATUS_INVALIDATED;
  else if (r != CUDRV_SUCCESS)
    return cuda_fail(cuda_stream_code(r), r, "cuStreamIsCapturing(stream %p)", (void *)stream);
  cudrv_uint64 id = 0;
  if (st == CUDRV_STREAM_CAPTURE_STATUS_ACTIVE) {
    r = cudrv.stream_get_capture_info(stream, &st, &id, NULL, NULL, NULL);
    if (r == CUDRV_ERROR_STREAM_CAPTURE_INVALIDATED) st = CUDRV_STREAM_CAPTURE_STATUS_INVALIDATED;
    else if (r != CUDRV_SUCCESS)
      return cuda_fail(cuda_stream_code(r), r, "cuStreamGetCaptureInfo(stream %p)", (void *)stream);
  }
  *status = st == CUDRV_STREAM_CAPTURE_STATUS_ACTIVE        ? BACKEND_CAPTURE_ACTIVE
            : st == CUDRV_STREAM_CAPTURE_STATUS_INVALIDATED ? BACKEND_CAPTURE_INVALIDATED
                                                            : BACKEND_CAPTURE_NONE;
  *capture_id = *status == BACKEND_CAPTURE_ACTIVE ? (uint64_t)id : 0;
  return MAGPIE_OK;
}

static int cuda_device_synchronize(int device) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuCtxSynchronize");
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.ctx_synchronize();
  if (r != CUDRV_SUCCESS) rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuCtxSynchronize(device %d)", device);
  return cuda_pop(rc, "cuCtxSynchronize");
}

static const backend_ops cuda_ops = {
    .name = "cuda",
    /* cuEventCreate can stall for long on a device busy with kernels: make
     * them while the device is idle, and in the background after
     * (bench/DECISIONS.md, "Events come from a pool refilled in the
     * background"). */
    .event_prefill = 1024,
    .init = cuda_init,
    .device_count = cuda_device_count,
    .mem_info = cuda_mem_info,
    .vmm_supported = cuda_vmm_supported,
    .granularity = cuda_granularity,
    .reserve = cuda_reserve,
    .unreserve = cuda_unreserve,
    .map = cuda_map,
    .unmap = cuda_unmap,
    .mem_alloc = cuda_mem_alloc,
    .mem_free = cuda_mem_free,
    .can_access_peer = cuda_can_access_peer,
    .set_access = cuda_set_access,
    .revoke_access = cuda_revoke_access,
    .peer_enable = cuda_peer_enable,
    .peer_disable = cuda_peer_disable,
    .device_uuid = cuda_device_uuid,
    .export_fds = cuda_export_fds,
    .import_map = cuda_import_map,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .stream_wait_event = cuda_stream_wait_event,
    .stream_id = cuda_stream_id,
    .stream_id_fast = cuda_stream_id_fast,
    .stream_device = cuda_stream_device,
    .device_synchronize = cuda_device_synchronize,
    .stream_capture = cuda_stream_capture,
};

const backend_ops *backend_cuda(void) { return &cuda_ops; }
