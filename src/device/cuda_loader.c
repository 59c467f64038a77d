/* The CUDA driver loader (cuda_driver.h): dlopen("libcuda.so.1") once per
 * process, cuGetProcAddress_v2 from dlsym, and every entry point of the
 * table from it at the ABI version listed in cuda_driver.h.
 *
 * The load runs under pthread_once, so it happens once however many
 * threads and callers (the backend, the demo's and benchmarks' device
 * layers, the preload library, the GPU tests) ask, and its writes to the
 * table are visible to every caller once cudrv_load returns. It calls only
 * dlopen, dlsym and cuGetProcAddress: no magpie lock is taken inside it, and
 * a caller may hold its own locks across it.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "device/cuda_driver.h"

/* Entry points arrive as void *; POSIX makes them convertible to function
 * pointers, and memcpy says so without a cast ISO C would frown on. */
_Static_assert(sizeof(void *) == sizeof(cudrv_pfn_init), "function pointers must fit a void *");

cudrv_api cudrv;

static pthread_once_t cudrv_once = PTHREAD_ONCE_INIT;

/* The outcome for each of CUDRV_LOAD_LIBRARY and CUDRV_LOAD_ALL: written by
 * the once routine, read-only after (pthread_once orders them). */
static int cudrv_failed[2];
static char cudrv_why[2][256];

__attribute__((format(printf, 2, 3))) static void cudrv_fail(int what, const char *fmt, ...) {
  if (cudrv_failed[what]) return; /* the first failure says it */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cudrv_why[what], sizeof cudrv_why[what], fmt, ap);
  va_end(ap);
  cudrv_failed[what] = 1;
}

/* Resolves one entry point into *slot; 0 if the driver lacks it at that
 * version (*slot is then NULL). */
static int cudrv_resolve(const char *symbol, int version, void *slot) {
  void *fn = NULL;
  cudrv_proc_query_result found = CUDRV_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  cudrv_result r =
      cudrv.get_proc_address(symbol, &fn, CUDRV_REQUEST_FOR(version), CUDRV_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
  if (r != CUDRV_SUCCESS || found != CUDRV_GET_PROC_ADDRESS_SUCCESS) fn = NULL;
  memcpy(slot, &fn, sizeof fn);
  return fn != NULL;
}

#define CUDRV_MISSING "CUDA driver lacks %s (CUDA %d.%d ABI): driver too old?"
#define CUDRV_ABI(version) CUDRV_REQUEST_FOR(version) / 1000, CUDRV_REQUEST_FOR(version) % 1000 / 10

static void cudrv_load_once(void) {
  /* Never closed: once cuInit ran the driver may own threads. */
  void *dl = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (dl == NULL) {
    const char *why = dlerror();
    cudrv_fail(CUDRV_LOAD_LIBRARY, "CUDA driver not found: dlopen(libcuda.so.1): %s", why ? why : "unknown error");
    cudrv_fail(CUDRV_LOAD_ALL, "%s", cudrv_why[CUDRV_LOAD_LIBRARY]);
    return;
  }
  cudrv.library = dl;
  void *fn = dlsym(dl, CUDRV_GET_PROC_ADDRESS_SYMBOL);
  memcpy(&cudrv.get_proc_address, &fn, sizeof fn);
  if (fn == NULL) {
    cudrv_fail(CUDRV_LOAD_LIBRARY, "CUDA driver too old: no %s (a CUDA 12.0 or newer driver is needed)",
               CUDRV_GET_PROC_ADDRESS_SYMBOL);
    cudrv_fail(CUDRV_LOAD_ALL, "%s", cudrv_why[CUDRV_LOAD_LIBRARY]);
    return;
  }
  /* Every entry point is resolved, so that a failed load still names the
   * first one missing of each kind. */
#define CUDRV_RESOLVE_REQUIRED(field, symbol, version)                          \
  if (!cudrv_resolve(#symbol, version, &cudrv.field)) {                         \
    cudrv_fail(CUDRV_LOAD_LIBRARY, CUDRV_MISSING, #symbol, CUDRV_ABI(version)); \
    cudrv_fail(CUDRV_LOAD_ALL, CUDRV_MISSING, #symbol, CUDRV_ABI(version));     \
  }
  CUDRV_REQUIRED_FUNCS(CUDRV_RESOLVE_REQUIRED)
#undef CUDRV_RESOLVE_REQUIRED
#define CUDRV_RESOLVE_TOOL(field, symbol, version)    \
  if (!cudrv_resolve(#symbol, version, &cudrv.field)) \
    cudrv_fail(CUDRV_LOAD_ALL, CUDRV_MISSING, #symbol, CUDRV_ABI(version));
  CUDRV_TOOL_FUNCS(CUDRV_RESOLVE_TOOL)
#undef CUDRV_RESOLVE_TOOL
#define CUDRV_RESOLVE_OPTIONAL(field, symbol, version) cudrv_resolve(#symbol, version, &cudrv.field);
  CUDRV_OPTIONAL_FUNCS(CUDRV_RESOLVE_OPTIONAL)
#undef CUDRV_RESOLVE_OPTIONAL
}

int cudrv_load(int what, const char **why) {
  if (what != CUDRV_LOAD_ALL) what = CUDRV_LOAD_LIBRARY;
  if (pthread_once(&cudrv_once, cudrv_load_once) != 0) {
    if (why != NULL) *why = "CUDA driver loader: pthread_once failed";
    return -1;
  }
  if (!cudrv_failed[what]) return 0;
  if (why != NULL) *why = cudrv_why[what];
  return -1;
}
