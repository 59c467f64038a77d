/* A stand-in for the CUDA driver, built with the soname libcuda.so.1, for
 * preload_procaddr_test: a function of its own for each exported variant,
 * and cuGetProcAddress_v2 / cuGetProcAddress answering a base name, ABI
 * version and stream flags as cuda.h says the driver does (the newest
 * variant not newer than the version; its _ptsz form under
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM where there is one, else
 * the legacy form). cuMemFree has a variant at 99000 that no CUDA has, as
 * a newer ABI would. It counts the lookups it answers and the calls to
 * cuMemAlloc_v2 / cuMemFree_v2, and names its functions without dlsym
 * (fake_cuda_function). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;

/* What cuMemAlloc_v2 hands out. */
#define FAKE_CUDA_DPTR 0xfa4e0000ull

enum { FAKE_CUDA_NOT_FOUND = 500, FAKE_CUDA_PTDS = 2 };

/* The variants: each returns its own code, so that no two bodies are the
 * same and the compiler cannot fold them into one address. cuInit answers
 * CUDA_ERROR_NO_DEVICE (100). */
#define FAKE_CUDA_STUBS(X)              \
  X(cuInit, 100)                        \
  X(cuMemAlloc, 7001)                   \
  X(cuMemFree, 7002)                    \
  X(cuMemFree_v3, 7003)                 \
  X(cuMemGetInfo_v2, 7004)              \
  X(cuMemAllocManaged, 7005)            \
  X(cuMemAllocAsync, 7006)              \
  X(cuMemAllocAsync_ptsz, 7007)         \
  X(cuMemFreeAsync, 7008)               \
  X(cuMemFreeAsync_ptsz, 7009)          \
  X(cuStreamDestroy, 7010)              \
  X(cuStreamDestroy_v2, 7011)           \
  X(cuStreamBeginCapture, 7012)         \
  X(cuStreamBeginCapture_ptsz, 7013)    \
  X(cuStreamBeginCapture_v2, 7014)      \
  X(cuStreamBeginCapture_v2_ptsz, 7015) \
  X(cuStreamEndCapture, 7016)           \
  X(cuStreamEndCapture_ptsz, 7017)      \
  X(cuMemPoolGetAttribute, 7018)        \
  X(cuMemPoolSetAttribute, 7019)        \
  X(cuMemPoolTrimTo, 7020)              \
  X(cuMemPoolSetAccess, 7021)           \
  X(cuCtxEnablePeerAccess, 7022)
#define FAKE_CUDA_STUB(name, code) \
  CUresult name(void) { return code; }
FAKE_CUDA_STUBS(FAKE_CUDA_STUB)

static pthread_mutex_t fake_cuda_lock = PTHREAD_MUTEX_INITIALIZER;
static int fake_cuda_allocs, fake_cuda_frees;

CUresult cuMemAlloc_v2(unsigned long long *dptr, size_t bytes) {
  pthread_mutex_lock(&fake_cuda_lock);
  fake_cuda_allocs++;
  pthread_mutex_unlock(&fake_cuda_lock);
  if (dptr == NULL || bytes == 0) return 1;
  *dptr = FAKE_CUDA_DPTR;
  return 0;
}

CUresult cuMemFree_v2(unsigned long long dptr) {
  pthread_mutex_lock(&fake_cuda_lock);
  fake_cuda_frees++;
  pthread_mutex_unlock(&fake_cuda_lock);
  return dptr == FAKE_CUDA_DPTR ? 0 : 1;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags);

/* Each variant: base name, ABI version, per-thread form, exported name. */
static const struct fake_cuda_variant {
  const char *symbol;
  int version;
  int ptsz;
  const char *name;
  void *fn;
} fake_cuda_variants[] = {
    {"cuInit", 2000, 0, "cuInit", (void *)cuInit},
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc", (void *)cuMemAlloc},
    {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2", (void *)cuMemAlloc_v2},
    {"cuMemFree", 2000, 0, "cuMemFree", (void *)cuMemFree},
    {"cuMemFree", 3020, 0, "cuMemFree_v2", (void *)cuMemFree_v2},
    {"cuMemFree", 99000, 0, "cuMemFree_v3", (void *)cuMemFree_v3},
    {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2", (void *)cuMemGetInfo_v2},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged", (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync", (void *)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, "cuMemAllocAsync_ptsz", (void *)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, "cuMemFreeAsync", (void *)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, "cuMemFreeAsync_ptsz", (void *)cuMemFreeAsync_ptsz},
    {"cuStreamDestroy", 2000, 0, "cuStreamDestroy", (void *)cuStreamDestroy},
    {"cuStreamDestroy", 4000, 0, "cuStreamDestroy_v2", (void *)cuStreamDestroy_v2},
    {"cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture", (void *)cuStreamBeginCapture},
    {"cuStreamBeginCapture", 10000, 1, "cuStreamBeginCapture_ptsz", (void *)cuStreamBeginCapture_ptsz},
    {"cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2", (void *)cuStreamBeginCapture_v2},
    {"cuStreamBeginCapture", 10010, 1, "cuStreamBeginCapture_v2_ptsz", (void *)cuStreamBeginCapture_v2_ptsz},
    {"cuStreamEndCapture", 10000, 0, "cuStreamEndCapture", (void *)cuStreamEndCapture},
    {"cuStreamEndCapture", 10000, 1, "cuStreamEndCapture_ptsz", (void *)cuStreamEndCapture_ptsz},
    {"cuMemPoolGetAttribute", 11020, 0, "cuMemPoolGetAttribute", (void *)cuMemPoolGetAttribute},
    {"cuMemPoolSetAttribute", 11020, 0, "cuMemPoolSetAttribute", (void *)cuMemPoolSetAttribute},
    {"cuMemPoolTrimTo", 11020, 0, "cuMemPoolTrimTo", (void *)cuMemPoolTrimTo},
    {"cuMemPoolSetAccess", 11020, 0, "cuMemPoolSetAccess", (void *)cuMemPoolSetAccess},
    {"cuCtxEnablePeerAccess", 4000, 0, "cuCtxEnablePeerAccess", (void *)cuCtxEnablePeerAccess},
};
#define FAKE_CUDA_VARIANTS (sizeof fake_cuda_variants / sizeof *fake_cuda_variants)

/* The lookups answered, in order. */
static struct {
  char symbol[64];
  int version;
  uint64_t flags;
} fake_cuda_log[1024];
static int fake_cuda_logged;

/* The variant for symbol at version with flags; *status as the driver's
 * (0 found, 1 no such symbol, 2 version too old). */
static void *fake_cuda_find(const char *symbol, int version, uint64_t flags, int *status) {
  pthread_mutex_lock(&fake_cuda_lock);
  if (fake_cuda_logged < (int)(sizeof fake_cuda_log / sizeof *fake_cuda_log)) {
    strncpy(fake_cuda_log[fake_cuda_logged].symbol, symbol, sizeof fake_cuda_log[0].symbol - 1);
    fake_cuda_log[fake_cuda_logged].version = version;
    fake_cuda_log[fake_cuda_logged].flags = flags;
    fake_cuda_logged++;
  }
  pthread_mutex_unlock(&fake_cuda_lock);
  const struct fake_cuda_variant *best = NULL;
  int known = 0;
  for (size_t i = 0; i < FAKE_CUDA_VARIANTS; i++) {
    const struct fake_cuda_variant *v = &fake_cuda_variants[i];
    if (strcmp(v->symbol, symbol) != 0) continue;
    known = 1;
    if (v->version > version || (v->ptsz && !(flags & FAKE_CUDA_PTDS))) continue;
    if (best == NULL || v->version > best->version || (v->version == best->version && v->ptsz)) best = v;
  }
  *status = best != NULL ? 0 : known ? 2 : 1;
  return best != NULL ? best->fn : NULL;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  int found;
  if (symbol == NULL || pfn == NULL || flags > 3) return 1; /* CUDA_ERROR_INVALID_VALUE */
  *pfn = fake_cuda_find(symbol, version, flags, &found);
  if (status != NULL) *status = found;
  return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
  int found;
  if (symbol == NULL || pfn == NULL || flags > 3) return 1;
  *pfn = fake_cuda_find(symbol, version, flags, &found);
  return found == 0 ? 0 : FAKE_CUDA_NOT_FOUND;
}

/* ---- for the test ---- */

/* The function exported as name, or NULL. */
void *fake_cuda_function(const char *name) {
  for (size_t i = 0; i < FAKE_CUDA_VARIANTS; i++)
    if (strcmp(fake_cuda_variants[i].name, name) == 0) return fake_cuda_variants[i].fn;
  return NULL;
}

/* Lookups of symbol answered so far at version (-1: any) with flags (-1:
 * any). */
int fake_cuda_lookups(const char *symbol, int version, long long flags) {
  int n = 0;
  pthread_mutex_lock(&fake_cuda_lock);
  for (int i = 0; i < fake_cuda_logged; i++)
    n += strcmp(fake_cuda_log[i].symbol, symbol) == 0 && (version < 0 || fake_cuda_log[i].version == version) &&
         (flags < 0 || fake_cuda_log[i].flags == (uint64_t)flags);
  pthread_mutex_unlock(&fake_cuda_lock);
  return n;
}

/* Calls so far to cuMemAlloc_v2 (alloc) or cuMemFree_v2. */
int fake_cuda_calls(int alloc) {
  pthread_mutex_lock(&fake_cuda_lock);
  int n = alloc ? fake_cuda_allocs : fake_cuda_frees;
  pthread_mutex_unlock(&fake_cuda_lock);
  return n;
}
