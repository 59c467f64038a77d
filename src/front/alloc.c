/* The public allocation API: thin wrappers over the thread-cache fast
 * paths (tcache.h), which fall through to the slow paths in tcache.c. A
 * device's observer (the simulated device's stream-order checker) watches
 * hand-outs and frees here, behind one read-mostly flag (observe.h). */
#include "base/error.h"
#include "front/capture.h"
#include "front/global.h"
#include "front/observe.h"
#include "pool/large.h"
#include "tcache/tcache.h"

/* Everything but a fast-path hit: the slow path; while a capture is
 * announced, capturing streams' allocations go to their graph pools
 * (capture.c, which shows them to the observer itself); and the observer's
 * view of every other hand-out while it is on. The calls stay out of line
 * so that the fast paths need no frame of their own. */
static MAGPIE_NOINLINE void *alloc_slow(size_t size, cudaStream_t stream, uint64_t id) {
  int slow = atomic_load_relaxed(&front_st.slow_paths);
  void *p;
  if (unlikely(slow & SLOW_CAPTURE) && capture_alloc(size, stream, &p)) return p;
  p = tcache_alloc_slow(size, stream, id);
  if (unlikely(slow & SLOW_OBSERVE) && p != NULL) {
    size_t usable = magpie_usable_size(p);
    observe_handout(p, usable > size ? usable : size, stream);
  }
  return p;
}

static MAGPIE_INLINE void *alloc_checked(size_t size, cudaStream_t stream) {
  uint64_t id = 0;
  if (likely(!atomic_load_relaxed(&front_st.slow_paths))) {
    void *p = tcache_alloc_fast(size, stream, &id);
    if (likely(p != NULL)) return p;
  }
  return alloc_slow(size, stream, id);
}

static MAGPIE_NOINLINE int free_watched(void *ptr, cudaStream_t stream) {
  int slow = atomic_load_relaxed(&front_st.slow_paths), rc;
  if ((slow & SLOW_CAPTURE) && capture_free(ptr, stream, &rc)) return rc;
  if (slow & SLOW_OBSERVE) observe_free(ptr, stream);
  return tcache_free(ptr, stream);
}

static MAGPIE_INLINE int free_checked(void *ptr, cudaStream_t stream) {
  if (unlikely(atomic_load_relaxed(&front_st.slow_paths))) return free_watched(ptr, stream);
  return tcache_free(ptr, stream);
}

MAGPIE_API void *magpie_malloc_async(size_t size, cudaStream_t stream) { return alloc_checked(size, stream); }

MAGPIE_API int magpie_free_async(void *ptr, cudaStream_t stream) { return free_checked(ptr, stream); }

MAGPIE_API void *magpie_malloc(size_t size) { return alloc_checked(size, (cudaStream_t)0); }

MAGPIE_API int magpie_free(void *ptr) { return free_checked(ptr, (cudaStream_t)0); }

MAGPIE_API size_t magpie_usable_size(const void *ptr) {
  size_t size = 0;
  return magpie_block_info(ptr, &size, NULL) == MAGPIE_OK ? size : 0;
}

MAGPIE_API int magpie_trim(int device, size_t keep_bytes) {
  int rc = global_device_check(device, "magpie_trim");
  if (rc != MAGPIE_OK) return rc;
  heap *h = heap_peek(device);
  if (h == NULL) return MAGPIE_OK; /* nothing allocated there */
  tcache_flush_self(h);
  return heap_trim(h, keep_bytes);
}

/* The heap whose cap fn changes (created if need be), or NULL with the
 * error set. */
static heap *limit_heap(int device, const char *fn) {
  return global_device_check(device, fn) == MAGPIE_OK ? heap_get(device) : NULL; /* heap_get sets its error */
}

MAGPIE_API int magpie_set_limit(int device, size_t bytes) {
  heap *h = limit_heap(device, "magpie_set_limit");
  if (h == NULL) return magpie_last_error();
  if (bytes != 0 && bytes < h->region.gran)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "magpie_set_limit: %zu bytes is below the %zu bytes (%zu MiB) in which magpie maps device "
                     "memory; give at least that much (0: no limit)",
                     bytes, h->region.gran, h->region.gran >> 20);
  region_set_limit(&h->region, bytes == 0 ? SIZE_MAX : bytes);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_set_limit_fraction(int device, double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "magpie_set_limit_fraction: %g is not in [0, 1] (0 refuses every mapping, 1 is the whole device)",
                     fraction);
  heap *h = limit_heap(device, "magpie_set_limit_fraction");
  if (h == NULL) return magpie_last_error();
  size_t bytes = (size_t)(fraction * (double)h->total_mem);
  region_set_limit(&h->region, bytes != 0 ? bytes : 1); /* 1 refuses every mapping; 0 would read as none */
  return MAGPIE_OK;
}

MAGPIE_API int magpie_device_count(void) {
  if (global_ensure() != MAGPIE_OK) return -1;
  int n = 0;
  if (global_ops()->device_count(&n) != MAGPIE_OK) return -1;
  return n;
}

MAGPIE_API void *magpie_torch_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)device;
  if (size < 0) {
    error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_torch_malloc: negative size %zd", size);
    return NULL;
  }
  return alloc_checked((size_t)size, stream);
}

MAGPIE_API void magpie_torch_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  free_checked(ptr, stream); /* errors are kept in magpie_last_error */
}
