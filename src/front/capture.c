/* See capture.h and magpie.h ("CUDA graphs").
 *
 * An announcement (magpie_capture_begin) is a registration: a pool, the
 * stream whose capture it names (NULL: the caller routes allocations
 * itself) and, once known, that capture's id. While any is registered,
 * front_st.slow_paths has SLOW_CAPTURE set (every allocation and free
 * comes here first) and heap_capture_hold keeps the maintenance thread
 * from synchronising the device.
 *
 * Lock order: capture_st.lock alone (capture.h); gpool_set.lock and the
 * heap's locks are taken outside it. */
#include "front/capture.h"

#include "base/error.h"
#include "base/meta.h"
#include "base/pagemap.h"
#include "front/global.h"
#include "front/observe.h"
#include "heap/heap.h"
#include "pool/gpool.h"
#include "pool/large.h"
#include "tcache/tcache.h"

/* INVARIANT: on capture_st.regs iff announced and not ended;
 * capture_st.count is the list's length; SLOW_CAPTURE is set iff it is
 * nonzero. All under capture_st.lock.
 * INVARIANT: a registration on the per-thread handle is resolved (its
 * capture id learnt) and ended only by the thread that announced it: the
 * handle names another stream in every thread, so another thread's query
 * would answer for its own capture. */
typedef struct capture_reg {
  uint64_t pool;
  cudaStream_t stream; /* NULL: the caller routes the capture's allocations */
  uint64_t capture_id; /* 0 until seen capturing */
  pthread_t owner;     /* the announcing thread (read for the per-thread handle) */
  struct capture_reg *next;
} capture_reg;

/* This file's state: the captures announced (magpie_capture_begin) and
 * their count, under lock (a leaf: held across stream capture queries,
 * never across a wait or another lock); graph pool ids, fetch_add
 * (relaxed: only uniqueness matters). */
static struct capture_state {
  pthread_mutex_t lock;
  capture_reg *regs;
  uint32_t count;
  _Atomic uint64_t next_pool;
} capture_st = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
};

/* Does registration r name the calling thread's view of its handle? Every
 * handle but the per-thread one names the same stream in every thread. */
static int capture_reg_mine(const capture_reg *r) {
  return r->stream != BACKEND_STREAM_PER_THREAD || pthread_equal(r->owner, pthread_self());
}

/* Pool ids carry their device: (device + 1) << 48 | a serial number. */
#define CAPTURE_POOL_SHIFT 48

static int capture_pool_device(uint64_t pool) {
  uint64_t d = pool >> CAPTURE_POOL_SHIFT;
  return d >= 1 && d <= HEAP_MAX_DEVICES && (pool & ((UINT64_C(1) << CAPTURE_POOL_SHIFT) - 1)) != 0 ? (int)d - 1 : -1;
}

/* The heap of pool's device (it exists once the pool was created), or NULL
 * with the error set for fn. */
static heap *capture_pool_heap(uint64_t pool, const char *fn) {
  int dev = capture_pool_device(pool);
  heap *h = dev >= 0 ? heap_peek(dev) : NULL;
  if (h == NULL)
    error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: %#llx is not a graph pool (magpie_graph_pool_create makes one)", fn,
              (unsigned long long)pool);
  return h;
}

/* The pool announced for capture id, or 0. Registrations that do not know
 * their capture's id yet (announced before their stream began capturing)
 * learn it here. */
static uint64_t capture_pool_of(const backend_ops *ops, uint64_t id) {
  uint64_t pool = 0;
  pthread_mutex_lock(&capture_st.lock);
  for (capture_reg *r = capture_st.regs; r != NULL && pool == 0; r = r->next) {
    if (r->capture_id == 0 && r->stream != NULL && capture_reg_mine(r)) {
      uint64_t cid;
      if (backend_capture_state(ops, r->stream, &cid) == BACKEND_CAPTURE_ACTIVE) r->capture_id = cid;
    }
    if (r->capture_id == id) pool = r->pool;
  }
  pthread_mutex_unlock(&capture_st.lock);
  return pool;
}

/* The key a stream's frees and allocations in a pool are matched by:
 * during a capture, the handle (CUDA refuses a capturing stream's id, and
 * invalidates the capture: see device/backend.h; a capturing stream
 * cannot be destroyed, so its handle names it for the capture's length);
 * outside, the stream's id. 0 with the error set for fn if s is not
 * valid; *dev its device (outside a capture: during one, the caller's). */
static uint64_t capture_stream_key(cudaStream_t s, int capturing, int *dev, const char *fn) {
  if (capturing) return (uint64_t)(uintptr_t)s;
  const backend_ops *ops = global_ops();
  uint64_t sid = 0;
  if (ops->stream_id(s, &sid) != MAGPIE_OK || (dev != NULL && ops->stream_device(s, dev) != MAGPIE_OK)) {
    error_set(MAGPIE_ERR_INVALID_STREAM, "%s: stream %p is not valid: %s", fn, (void *)s, backend_error_detail());
    return 0;
  }
  return sid;
}

/* A pool's block goes to the device's observer like any hand-out (the
 * simulated device's checker then unpoisons it under AddressSanitizer,
 * where a capture records the unpoisoning into the graph). Its frees
 * during a capture are not shown to the observer: a replay may use the
 * block again, in the capture's order, which the observer cannot see. */
static void *capture_handed_out(uintptr_t p, size_t bsize, cudaStream_t stream) {
  if (unlikely(atomic_load_relaxed(&front_st.slow_paths) & SLOW_OBSERVE)) observe_handout((void *)p, bsize, stream);
  return (void *)p;
}

/* A block of pool for stream, during capture id (0: outside any). */
static void *capture_pool_alloc(uint64_t pool, size_t size, cudaStream_t stream, uint64_t id, const char *fn) {
  heap *h = capture_pool_heap(pool, fn);
  if (h == NULL) return NULL;
  int sdev = h->device;
  uint64_t sid = capture_stream_key(stream, id != 0, &sdev, fn);
  if (sid == 0) return NULL;
  if (sdev != h->device) {
    error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: stream %p is on device %d, graph pool %#llx on device %d", fn,
              (void *)stream, sdev, (unsigned long long)pool, h->device);
    return NULL;
  }
  if (size == 0) size = 1;
  if (size > SIZE_MAX - LARGE_QUANTUM) {
    error_set(MAGPIE_ERR_SIZE_OVERFLOW, "%s: %zu bytes cannot be rounded to a block size", fn, size);
    return NULL;
  }
  size_t need = large_round(size), bsize = 0;
  uintptr_t p = 0;
  int rc = gpool_take(&h->graphs, pool, need, id, sid, &p, &bsize);
  if (rc == MAGPIE_OK) return capture_handed_out(p, bsize, stream);
  if (rc == MAGPIE_ERR_INVALID_ARGUMENT) {
    error_set(rc, "%s: graph pool %#llx was released (or never made)", fn, (unsigned long long)pool);
    return NULL;
  }
  rc = heap_graph_alloc(h, need, &p, &bsize);
  if (rc != MAGPIE_OK) {
    error_set(rc, "%s(%zu bytes) into graph pool %#llx: device %d has no memory left for it (%s)", fn, size,
              (unsigned long long)pool, h->device, magpie_error_string(rc));
    return NULL;
  }
  rc = gpool_add(&h->graphs, pool, p, bsize, id);
  if (rc != MAGPIE_OK) {
    heap_graph_retire(h, p, bsize, h->device);
    error_set(rc, "%s: graph pool %#llx was released meanwhile, or host memory ran out", fn, (unsigned long long)pool);
    return NULL;
  }
  return capture_handed_out(p, bsize, stream);
}

int capture_alloc(size_t size, cudaStream_t stream, void **out) {
  const backend_ops *ops = global_ops();
  uint64_t id;
  int st = backend_capture_state(ops, stream, &id);
  if (st == BACKEND_CAPTURE_NONE) return 0;
  *out = NULL;
  if (st == BACKEND_CAPTURE_INVALIDATED) {
    error_set(MAGPIE_ERR_CAPTURE,
              "magpie_malloc_async: the capture on stream %p was invalidated by an earlier error; end it and "
              "capture again",
              (void *)stream);
    return 1;
  }
  uint64_t pool = capture_pool_of(ops, id);
  if (pool == 0) {
    tcache_capture_error(stream, size);
    return 1;
  }
  *out = capture_pool_alloc(pool, size, stream, id, "magpie_malloc_async");
  return 1;
}

/* The free of graph pool block p (segment descriptor sl) on stream: during
 * a capture, tagged with it; outside, sealed on the stream. */
/* Blocks that left their graph pool go to h's limbo (after a device
 * synchronisation), and the list is freed. */
static void capture_retire(heap *h, gpool_retired *retired) {
  for (gpool_retired *r = retired; r != NULL; r = r->next) heap_graph_retire(h, r->base, r->size, r->dev);
  gpool_retired_free(retired);
}

int capture_graph_free(void *p, slab *sl, cudaStream_t stream) {
  const backend_ops *ops = global_ops();
  heap *h = sl->heap;
  uint64_t id = 0;
  int st = backend_capture_state(ops, stream, &id);
  int sdev = h->device;
  uint64_t sid = capture_stream_key(stream, st != BACKEND_CAPTURE_NONE, &sdev, "magpie_free_async");
  if (sid == 0) return magpie_last_error();
  epoch_ticket t = {0};
  if (st == BACKEND_CAPTURE_NONE) {
    /* The seal is the stream's, so its record and event are of the
     * stream's device (which may not be the block's). */
    heap *sh = sdev == h->device ? h : heap_get(sdev);
    if (sh == NULL) return magpie_last_error();
    stream_rec *rec = epoch_stream_acquire(&sh->epochs, sid);
    if (rec == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_free_async(%p): out of host memory", p);
    int rc = epoch_seal(rec, stream, &t);
    epoch_stream_release(rec);
    if (rc != MAGPIE_OK)
      return error_set(rc, "magpie_free_async(%p): cannot record an event on stream %p (%s); the block stays allocated",
                       p, (void *)stream, backend_error_detail());
  }
  size_t bsize = 0;
  gpool_retired *retired = NULL;
  /* During a capture the stream's device cannot be asked: every device's
   * synchronisation covers the block if it leaves for limbo. */
  int fdev = st == BACKEND_CAPTURE_NONE ? sdev : HEAP_SYNC_EVERY_DEVICE;
  int rc = gpool_free(&h->graphs, (uintptr_t)p, st == BACKEND_CAPTURE_NONE ? 0 : id, sid, fdev, &t, &bsize, &retired);
  if (t.rec != NULL) epoch_ticket_release(&t); /* not taken over */
  if (rc == MAGPIE_ERR_DOUBLE_FREE)
    return error_set(rc, "magpie_free_async(%p): graph pool block already free (double free)", p);
  if (rc != MAGPIE_OK) return error_set(rc, "magpie_free_async(%p): not the start of a graph pool's block", p);
  capture_retire(h, retired);
  return MAGPIE_OK;
}

int capture_free(void *p, cudaStream_t stream, int *rc) {
  slab *sl = pagemap_lookup((uintptr_t)p);
  if (sl == NULL || p == NULL) return 0;
  if (sl->cls == SLAB_LARGE && large_is_graph(sl, (uintptr_t)p)) {
    *rc = capture_graph_free(p, sl, stream);
    return 1;
  }
  uint64_t id;
  if (backend_capture_state(global_ops(), stream, &id) == BACKEND_CAPTURE_NONE) return 0;
  /* A block freed on a capturing stream, recorded or not, waits for a
   * device synchronisation: the stream can be neither asked its id nor
   * sealed while it captures. */
  *rc = tcache_free_to_limbo(p, sl, stream);
  return 1;
}

/* ---- the public API ---- */

MAGPIE_API int magpie_graph_pool_create(int device, uint64_t *pool) {
  int rc = global_device_check(device, "magpie_graph_pool_create");
  if (rc != MAGPIE_OK) return rc;
  if (pool == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_graph_pool_create: pool is NULL");
  heap *h = heap_get(device);
  if (h == NULL) return magpie_last_error();
  uint64_t id = ((uint64_t)(device + 1) << CAPTURE_POOL_SHIFT) |
                (atomic_fetch_add_explicit(&capture_st.next_pool, 1, memory_order_relaxed) + 1);
  rc = gpool_create(&h->graphs, id);
  if (rc != MAGPIE_OK) return error_set(rc, "magpie_graph_pool_create: out of host memory");
  *pool = id;
  return MAGPIE_OK;
}

MAGPIE_API int magpie_capture_begin(uint64_t pool, cudaStream_t stream) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  heap *h = capture_pool_heap(pool, "magpie_capture_begin");
  if (h == NULL) return magpie_last_error();
  const backend_ops *ops = global_ops();
  uint64_t id = 0;
  if (stream != NULL) {
    int sdev = h->device;
    if ((uintptr_t)stream == 1)
      return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_capture_begin: the legacy stream (1) cannot capture");
    /* A stream already capturing cannot be asked its device (device/backend.h). */
    int st = backend_capture_state(ops, stream, &id);
    if (st == BACKEND_CAPTURE_NONE && ops->stream_device(stream, &sdev) != MAGPIE_OK)
      return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_capture_begin: stream %p is not valid: %s", (void *)stream,
                       backend_error_detail());
    if (st != BACKEND_CAPTURE_ACTIVE) id = 0;
    if (sdev != h->device)
      return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                       "magpie_capture_begin: stream %p is on device %d, pool %#llx on device %d", (void *)stream, sdev,
                       (unsigned long long)pool, h->device);
  }
  capture_reg *r = meta_alloc(sizeof *r);
  if (r == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_capture_begin: out of host memory");
  if (gpool_capture(&h->graphs, pool, 1) != MAGPIE_OK) {
    meta_free(r);
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_capture_begin: graph pool %#llx was released",
                     (unsigned long long)pool);
  }
  r->pool = pool;
  r->stream = stream;
  r->capture_id = id;
  r->owner = pthread_self();
  heap_capture_hold(1);
  pthread_mutex_lock(&capture_st.lock);
  r->next = capture_st.regs;
  capture_st.regs = r;
  if (capture_st.count++ == 0) atomic_fetch_or_explicit(&front_st.slow_paths, SLOW_CAPTURE, memory_order_seq_cst);
  pthread_mutex_unlock(&capture_st.lock);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_capture_end(uint64_t pool, cudaStream_t stream) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  heap *h = capture_pool_heap(pool, "magpie_capture_end");
  if (h == NULL) return magpie_last_error();
  capture_reg *found = NULL;
  pthread_mutex_lock(&capture_st.lock);
  for (capture_reg **r = &capture_st.regs; *r != NULL; r = &(*r)->next) {
    if ((*r)->pool != pool || (*r)->stream != stream || !capture_reg_mine(*r)) continue;
    found = *r;
    *r = found->next;
    if (--capture_st.count == 0) atomic_fetch_and_explicit(&front_st.slow_paths, ~SLOW_CAPTURE, memory_order_seq_cst);
    break;
  }
  pthread_mutex_unlock(&capture_st.lock);
  if (found == NULL)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "magpie_capture_end: no capture was announced with pool %#llx and stream %p",
                     (unsigned long long)pool, (void *)stream);
  meta_free(found);
  gpool_capture(&h->graphs, pool, -1);
  heap_capture_hold(-1);
  return MAGPIE_OK;
}

MAGPIE_API void *magpie_graph_pool_malloc_async(uint64_t pool, size_t size, cudaStream_t stream) {
  if (global_ensure() != MAGPIE_OK) return NULL;
  uint64_t id;
  int st = backend_capture_state(global_ops(), stream, &id);
  return capture_pool_alloc(pool, size, stream, st == BACKEND_CAPTURE_NONE ? 0 : id, "magpie_graph_pool_malloc_async");
}

MAGPIE_API int magpie_graph_pool_release(uint64_t pool) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  heap *h = capture_pool_heap(pool, "magpie_graph_pool_release");
  if (h == NULL) return magpie_last_error();
  gpool_retired *retired = NULL;
  rc = gpool_release(&h->graphs, pool, &retired);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_graph_pool_release: graph pool %#llx was released already (or never made)",
                     (unsigned long long)pool);
  capture_retire(h, retired);
  return MAGPIE_OK;
}

MAGPIE_API size_t magpie_graph_pool_bytes(uint64_t pool) {
  if (global_ensure() != MAGPIE_OK) return 0;
  int dev = capture_pool_device(pool);
  heap *h = dev >= 0 ? heap_peek(dev) : NULL;
  return h != NULL ? gpool_pool_bytes(&h->graphs, pool) : 0;
}

MAGPIE_API int magpie_graph_pool_trim(uint64_t pool) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  heap *h = capture_pool_heap(pool, "magpie_graph_pool_trim");
  if (h == NULL) return magpie_last_error();
  gpool_retired *retired = NULL;
  rc = gpool_trim(&h->graphs, pool, &retired);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_graph_pool_trim: graph pool %#llx was released (or never made)",
                     (unsigned long long)pool);
  capture_retire(h, retired);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_graph_pool_blocks(uint64_t pool, magpie_pool_block *out, size_t cap, size_t *count) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  if (count == NULL || (out == NULL && cap > 0))
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "magpie_graph_pool_blocks: count is NULL, or out is NULL with cap %zu", cap);
  heap *h = capture_pool_heap(pool, "magpie_graph_pool_blocks");
  if (h == NULL) return magpie_last_error();
  gpool_info *tmp = cap > 0 ? meta_alloc(cap * sizeof *tmp) : NULL;
  if (cap > 0 && tmp == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_graph_pool_blocks: no host memory");
  rc = gpool_blocks(&h->graphs, pool, tmp, cap, count);
  for (size_t i = 0; rc == MAGPIE_OK && i < cap && i < *count; i++)
    out[i] = (magpie_pool_block){(void *)tmp[i].base, tmp[i].size, tmp[i].used};
  meta_free(tmp);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_graph_pool_blocks: no graph pool %#llx (never made, or released and empty)",
                     (unsigned long long)pool);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_graph_pool_take(uint64_t pool, void *ptr, cudaStream_t stream, size_t *size) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  if (size == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_graph_pool_take: size is NULL");
  heap *h = capture_pool_heap(pool, "magpie_graph_pool_take");
  if (h == NULL) return magpie_last_error();
  rc = gpool_take_at(&h->graphs, pool, (uintptr_t)ptr, size);
  if (rc == MAGPIE_ERR_INVALID_POINTER)
    return error_set(rc, "magpie_graph_pool_take: graph pool %#llx has no block at %p", (unsigned long long)pool, ptr);
  if (rc == MAGPIE_ERR_DOUBLE_FREE)
    return error_set(rc, "magpie_graph_pool_take: the block at %p of graph pool %#llx is in use", ptr,
                     (unsigned long long)pool);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_graph_pool_take: graph pool %#llx was released (or never made)",
                     (unsigned long long)pool);
  capture_handed_out((uintptr_t)ptr, *size, stream);
  return MAGPIE_OK;
}
