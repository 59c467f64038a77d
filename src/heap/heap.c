/* Per-device heaps and the refill ladder (limbo and the maintenance thread:
 * heap_limbo.c).
 *
 * Lock order: heap_st.create_lock -> (region/epoch init, no other magpie
 * lock). depot.carve_lock -> (what a depot take and a slab carve take:
 * epoch_table.lock, stream_rec.seal_lock, region.lock, slab_set.slab_lock,
 * slab_st.desc_lock, registry.grow_lock, span_set.span_grow_lock ->
 * (region.lock, span_set.span_lock, and the lender's large_cache.lock,
 * stream_rec.seal_lock, epoch_table.lock), large_cache.lock, one at a
 * time; and
 * heap_recycle's record_table.lock and slab_set.reclaim_lock ->
 * (slab_set.slab_lock, large_cache.lock)).
 * heap_st.reaper_lock, klimbo_lock and gpool_set.lock are leaves.
 * None is held across a device synchronisation (the exit handler waits on
 * heap_st.reaper_idle_cv, which releases heap_st.reaper_lock). */
#include "heap/heap.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "base/meta.h"
#include "base/ticks.h"
#include "heap/heap_internal.h"

heap_state heap_st = {
    .create_lock = PTHREAD_MUTEX_INITIALIZER,
    .reaper_lock = PTHREAD_MUTEX_INITIALIZER,
    .reaper_cv = PTHREAD_COND_INITIALIZER,
    .reaper_idle_cv = PTHREAD_COND_INITIALIZER,
};

void heap_module_init(const backend_ops *ops, const magpie_config *cfg) {
  heap_st.ops = ops;
  heap_st.cfg = *cfg;
  epoch_set_low_hook(heap_events_low);
}

heap *heap_peek(int device) {
  if (device < 0 || device >= HEAP_MAX_DEVICES) return NULL;
  return atomic_load_acquire(&heap_st.heaps[device]);
}

/* The span set's lender: the large segments' free memory (pool/large.h,
 * memory lent to the span set). */
static int heap_lend_span(void *ctx, size_t want, uintptr_t *base, size_t *size) {
  return large_lend_span(ctx, want, base, size);
}
static void heap_take_back_span(void *ctx, uintptr_t base) { large_return_span(ctx, base); }

static heap *heap_create(int device) {
  const backend_ops *ops = heap_st.ops;
  size_t free_b = 0, total = 0;
  int rc = ops->mem_info(device, &free_b, &total);
  if (rc != MAGPIE_OK) {
    error_set(rc, "cannot query memory of device %d: %s", device, backend_error_detail());
    return NULL;
  }
  heap *h = meta_alloc_aligned(sizeof *h, _Alignof(heap));
  if (h == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory creating the heap of device %d", device);
    return NULL;
  }
  h->device = device;
  h->ops = ops;
  h->total_mem = total;
  /* Virtual range: four times the device (room for fragmentation of the
   * range itself), at least 4 GiB, at most 1 TiB. Reserving costs no
   * memory. */
  size_t hint = total > SIZE_MAX / 4 ? SIZE_MAX : total * 4; /* no wrap for a huge device */
  if (hint < ((size_t)4 << 30)) hint = (size_t)4 << 30;
  if (hint > ((size_t)1 << 40)) hint = (size_t)1 << 40;
  const magpie_config *cfg = &heap_st.cfg;
  rc = region_init(&h->region, device, ops, hint, cfg->ipc && ops->export_fds != NULL ? BACKEND_MAP_EXPORTABLE : 0);
  if (rc != MAGPIE_OK) {
    error_set(rc, "cannot set up device memory of device %d: %s", device, backend_error_detail());
    meta_free(h);
    return NULL;
  }
  if (cfg->limit_percent) region_set_limit(&h->region, (size_t)((unsigned __int128)total * cfg->limit_percent / 100));
  else if (cfg->limit) region_set_limit(&h->region, cfg->limit);
  h->release_threshold = cfg->release_threshold;
  atomic_store_relaxed(&h->class_budget_floor, HEAP_CLASS_BUDGET_FLOOR);
  h->reuse_wait = cfg->reuse_wait;
  epoch_table_init(&h->epochs, device, ops);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) depot_init(&h->depots[c]);
  stack_init(&h->limbo);
  pthread_mutex_init(&h->klimbo_lock, NULL);
  large_init(&h->large, &h->region, ops, total, h->reuse_wait, h);
  gpool_set_init(&h->graphs);
  span_set_init(&h->spans, &h->region);
  span_set_lender(&h->spans, (span_lender){heap_lend_span, heap_take_back_span, &h->large});
  slab_set_init(&h->slabs, &h->region, &h->spans, h->depots, h);
  record_table_init(&h->records, heap_records_sync, h);
  /* Events made now, while the device is likely idle (a failure here only
   * leaves creation to later). */
  if (ops->event_prefill > 0) epoch_pool_fill(&h->epochs, ops->event_prefill);
  if (h->release_threshold != SIZE_MAX) heap_wake_maintenance(); /* starts its timer */
  return h;
}

heap *heap_get(int device) {
  if (device < 0 || device >= HEAP_MAX_DEVICES) {
    error_set(MAGPIE_ERR_INVALID_ARGUMENT, "device %d out of range (0..%d)", device, HEAP_MAX_DEVICES - 1);
    return NULL;
  }
  heap *h = atomic_load_acquire(&heap_st.heaps[device]);
  if (likely(h != NULL)) return h;
  pthread_mutex_lock(&heap_st.create_lock);
  h = atomic_load_relaxed(&heap_st.heaps[device]);
  if (h == NULL) {
    h = heap_create(device);
    if (h != NULL) atomic_store_release(&heap_st.heaps[device], h);
  }
  pthread_mutex_unlock(&heap_st.create_lock);
  return h;
}

void heap_publish_in_use(heap *h, int64_t delta) {
  int64_t now = heap_count_in_use(h, delta);
  if (now > 0) heap_raise_peak(h, (size_t)now);
}

int64_t heap_count_in_use(heap *h, int64_t delta) {
  return atomic_add_relaxed(&h->stat_in_use_published, delta) + delta;
}

void heap_raise_peak(heap *h, size_t bytes) { atomic_max_size_relaxed(&h->stat_peak_in_use, bytes); }

/* Are kept large blocks in limbo? */
static int heap_klimbo_any(heap *h) {
  pthread_mutex_lock(&h->klimbo_lock);
  int any = h->klimbo != NULL;
  pthread_mutex_unlock(&h->klimbo_lock);
  return any;
}

void heap_set_threads_reclaim(heap_threads_reclaim_fn fn) { heap_st.threads_reclaim = fn; }

size_t heap_cached_bytes(heap *h) {
  size_t reserved = atomic_load_relaxed(&h->region.mapped);
  int64_t used = atomic_load_relaxed(&h->stat_in_use_published);
  size_t in_use = used > 0 ? (size_t)used : 0;
  return reserved > in_use ? reserved - in_use : 0;
}

void heap_note_cached(heap *h) {
  if (h->release_threshold != SIZE_MAX && heap_cached_bytes(h) > h->release_threshold) heap_wake_maintenance();
}

/* Parked recorded blocks and pending magazines whose streams completed
 * become ready (queries, no waiting). Returns magazines moved. */
static size_t heap_reclaim_small(heap *h) {
  record_poll(&h->records, h->depots, &h->large);
  size_t got = 0;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) got += (size_t)depot_reclaim(&h->depots[c]);
  return got;
}

/* Magazine m's class blocks back to their segments (large_class_put,
 * flags as its); on MAGPIE_OK the segments took its ticket over and m went
 * back to the empties. */
static int heap_class_blocks_back(heap *h, magazine *m, int flags) {
  int rc = large_class_put(&h->large, m->slots, m->count, &m->ticket, flags);
  if (rc == MAGPIE_OK) {
    m->ticket = (epoch_ticket){0}; /* the segments took it over */
    magazine_put_empty(m);
  }
  return rc;
}

/* The depot's class blocks go back to their segments (pool/large.h):
 * every magazine of the classes without slabs, ready ones and pending
 * ones with their tickets, at most as many as the depot held on entry.
 * Under slab_set.reclaim_lock, as slab release: snapshots take it to see
 * the depot whole. Returns the bytes given back. */
static size_t heap_release_class_blocks(heap *h) {
  size_t bytes = 0;
  pthread_mutex_lock(&h->slabs.reclaim_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    if (!sizeclass_table[c].seg) continue;
    depot *d = &h->depots[c];
    depot_scanners_wait(d); /* a sweep's magazines come back first */
    for (size_t n = stack_count(&d->full) + stack_count(&d->pending); n > 0; n--) {
      magazine *m = depot_give_up(d);
      if (m == NULL) break;
      size_t b = depot_magazine_bytes(m);
      if (heap_class_blocks_back(h, m, 0) != MAGPIE_OK) {
        depot_put(d, m); /* out of host memory: later */
        break;
      }
      bytes += b;
    }
  }
  pthread_mutex_unlock(&h->slabs.reclaim_lock);
  return bytes;
}

int heap_relieve(heap *h, enum heap_step step) {
  atomic_add_relaxed(&h->stat_ladder[step], 1);
  size_t got = 0;
  switch (step) {
  case HEAP_STEP_RECLAIM:
    got = heap_reclaim_small(h);
    got += large_reclaim(&h->large);
    break;
  case HEAP_STEP_SLABS:
    got = slab_release_free(&h->slabs, SIZE_MAX);
    got += heap_release_class_blocks(h);
    break;
  case HEAP_STEP_THREADS:
    if (heap_st.threads_reclaim) got = heap_st.threads_reclaim(h);
    break;
  case HEAP_STEP_WAIT:
    /* Blocking, off the fast path: limbo and recorded blocks whose streams
     * are gone (a device synchronisation is the only wait that covers
     * them), then every parked block, pending magazine and free large
     * block. Then slabs may have emptied. */
    if (stack_count(&h->limbo) > 0 || heap_klimbo_any(h) || record_sync_wanted(&h->records) > 0 ||
        atomic_load_acquire(&h->reaping) > 0) {
      heap_reap_wait(h);
      got++;
    }
    got += record_wait(&h->records, h->depots, &h->large); /* parked blocks: their streams */
    for (unsigned c = 0; c < SIZECLASS_COUNT; c++) got += (size_t)depot_wait_pending(&h->depots[c]);
    got += large_wait(&h->large);
    got += slab_release_free(&h->slabs, SIZE_MAX);
    got += heap_release_class_blocks(h);
    break;
  case HEAP_STEP_UNMAP:
    /* Another thread's release in flight (the maintenance thread's, above
     * a release threshold) holds granules this one cannot take: wait it
     * out, and retry even if this one found nothing left to unmap. */
    got = atomic_load_acquire(&h->region.releasing) > 0;
    got += large_release(&h->large, SIZE_MAX);
    region_releases_wait(&h->region);
    break;
  default: break;
  }
  return got > 0;
}

/* The out-of-memory ladder, cheapest step first, shared by small refills
 * and large allocations. */
static const enum heap_step heap_ladder[] = {HEAP_STEP_RECLAIM, HEAP_STEP_SLABS, HEAP_STEP_THREADS, HEAP_STEP_WAIT,
                                             HEAP_STEP_UNMAP};
enum { HEAP_LADDER_LEN = sizeof heap_ladder / sizeof heap_ladder[0] };

/* Run ladder step i; nonzero if retrying the allocation can now succeed.
 * The threads step only moves magazines to limbo, which the wait step
 * drains, so no retry follows it. */
static int heap_ladder_step(heap *h, unsigned i) {
  return heap_relieve(h, heap_ladder[i]) && heap_ladder[i] != HEAP_STEP_THREADS;
}

/* How long one allocation may keep going down the ladder while magpie
 * caches more than it needs. Threads at a limit together take what one
 * thread's steps gave back before that thread's retry comes, and give
 * back in turn when asked: four threads of stream_rotation_test under a
 * 24 MiB limit failed an allocation in about one run in twenty with one
 * pass of the ladder, and in one run in sixty with passes repeated only
 * while a step of this thread's helped (debug build), each time with
 * 0.1-0.5 MiB in use and 10-77 MiB cached, given back and taken again
 * by the others. */
#define HEAP_DESCEND_NS (50 * 1000 * 1000)

/* One more try of the allocation that went down the ladder. */
typedef int (*heap_retry_fn)(heap *h, void *ctx);

/* Down the ladder, cheapest step first, retrying after each step that can
 * have helped. The whole ladder again while a pass helped or magpie caches
 * at least a granule more than the request (need): then other threads
 * hold or move the memory, and a pass that found nothing waits a little
 * for them. Fails after a pass that found nothing with less cached, or
 * after HEAP_DESCEND_NS. Nothing here runs on the fast path. */
static int heap_descend(heap *h, heap_retry_fn retry, void *ctx, size_t need) {
  uint64_t deadline = 0;
  for (;;) {
    int helped = 0;
    for (unsigned i = 0; i < HEAP_LADDER_LEN; i++) {
      if (!heap_ladder_step(h, i)) continue;
      helped = 1;
      int rc = retry(h, ctx);
      if (rc != MAGPIE_ERR_OUT_OF_MEMORY) return rc;
    }
    size_t cached = heap_cached_bytes(h);
    if (!helped && (cached < need || cached - need < h->region.gran)) break;
    uint64_t now = ticks_now_ns();
    if (deadline == 0) deadline = now + HEAP_DESCEND_NS;
    else if (now >= deadline) break;
    if (!helped) ticks_sleep_ns(200 * 1000);
  }
  atomic_add_relaxed(&h->stat_ladder[HEAP_STEP_FAILED], 1);
  return MAGPIE_ERR_OUT_OF_MEMORY;
}

/* Reuse before mapping. A carve that would map a new granule first gives
 * back the slabs wholly free in the depot (after the epoch queries that
 * make pending magazines ready), so that their chunks serve the class that
 * needs memory now: memory moves between classes as their demand shifts,
 * rather than each class keeping its own high-water mark. Skipped while
 * the depot holds less than a granule, or less than a granule more than at
 * the last attempt that gave nothing back (a scan of every depot magazine
 * that finds nothing, repeated at every growth, would make growth
 * quadratic). Returns nonzero if anything was given back. */
static int heap_recycle(heap *h) {
  depot_totals t;
  depot_totals_get(h->depots, SIZECLASS_COUNT, &t);
  int64_t held = t.ready_bytes + t.pending_bytes;
  size_t cached = held > 0 ? (size_t)held : 0, gran = h->region.gran;
  if (cached < gran || cached < atomic_load_relaxed(&h->recycle_mark) + gran) return 0;
  atomic_add_relaxed(&h->stat_recycles, 1);
  heap_reclaim_small(h);
  size_t got = slab_release_free(&h->slabs, SIZE_MAX);
  got += heap_release_class_blocks(h);
  atomic_store_relaxed(&h->recycle_mark, got ? 0 : cached);
  return got > 0;
}

/* A magazine of up to cap class blocks of class cls (0: the class's
 * mag_cap) from the segments (flags: those of large_class_carve;
 * LARGE_NO_MAP gives SLAB_WOULD_MAP where only mapping would serve). */
static int heap_class_carve(heap *h, unsigned cls, uint32_t cap, uint64_t stream_id, cudaStream_t stream, int flags,
                            magazine **out) {
  magazine *m = magazine_get_empty(cls);
  if (m == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  if (cap != 0 && cap <= sizeclass_table[cls].mag_max) m->cap = cap;
  uint32_t got = 0;
  int rc =
      large_class_carve(&h->large, cls, sizeclass_table[cls].size, m->cap, stream_id, stream, flags, m->slots, &got);
  if (rc != MAGPIE_OK) {
    magazine_put_empty(m);
    return rc == LARGE_WOULD_MAP ? SLAB_WOULD_MAP : rc;
  }
  m->count = got;
  *out = m;
  return MAGPIE_OK;
}

/* A slab's worth (or a magazine of up to cap class blocks) of class cls,
 * from memory mapped (may_map 0: else SLAB_WOULD_MAP) or mapped now;
 * pressure: class blocks may come through a stream wait. */
static int heap_carve_from(heap *h, unsigned cls, uint32_t cap, uint64_t stream_id, cudaStream_t stream, int may_map,
                           int pressure, magazine **out) {
  if (!sizeclass_table[cls].seg) return slab_carve(&h->slabs, cls, may_map, out);
  int flags = (may_map ? 0 : LARGE_NO_MAP) | (pressure ? LARGE_MAY_WAIT_EVENT : 0);
  return heap_class_carve(h, cls, cap, stream_id, stream, flags, out);
}

/* Carve a slab of class cls, one thread per class at a time. Threads that
 * found the class empty together would otherwise each map a slab while
 * the first slab's magazines sat unused in the depot (bench/DECISIONS.md,
 * "Slabs of a class are carved one thread at a time"). Whoever waited
 * looks at the depot again first. A carve that would map recycles first
 * (heap_recycle). Class blocks carved from memory mapped already take
 * the large cache's lock alone: waiting on the class's lock as well, in
 * turn behind the large cache's, was most of what sixteen threads of the
 * mixed workload waited for (bench/DECISIONS.md, "Class blocks from mapped
 * memory need no carve lock"). */
static int heap_carve(heap *h, unsigned cls, uint32_t cap, uint64_t stream_id, cudaStream_t stream, int pressure,
                      int flags, magazine **out) {
  if (sizeclass_table[cls].seg) {
    int rc = heap_carve_from(h, cls, cap, stream_id, stream, 0, pressure, out);
    if (rc != SLAB_WOULD_MAP) return rc;
  }
  depot *d = &h->depots[cls];
  pthread_mutex_lock(&d->carve_lock);
  magazine *m = depot_take(d, stream_id);
  int rc = MAGPIE_OK;
  if (m != NULL) {
    *out = m;
  } else {
    rc = heap_carve_from(h, cls, cap, stream_id, stream, 0, pressure, out);
    if (rc == SLAB_WOULD_MAP) {
      int recycled = heap_recycle(h);
      if (!(flags & HEAP_NO_MAP)) rc = heap_carve_from(h, cls, cap, stream_id, stream, 1, pressure, out);
      else if (recycled) rc = heap_carve_from(h, cls, cap, stream_id, stream, 0, pressure, out);
    }
  }
  pthread_mutex_unlock(&d->carve_lock);
  return rc;
}

/* heap_refill's request, for its retries down the ladder. */
typedef struct heap_refill_req {
  unsigned cls;
  uint32_t cap;
  uint64_t stream_id;
  cudaStream_t stream;
  magazine **out;
} heap_refill_req;

static int heap_refill_retry(heap *h, void *ctx) {
  heap_refill_req *r = ctx;
  return heap_carve(h, r->cls, r->cap, r->stream_id, r->stream, 1, 0, r->out);
}

_Static_assert(HEAP_WOULD_MAP == SLAB_WOULD_MAP && HEAP_WOULD_MAP == LARGE_WOULD_MAP, "one would-map value");

int heap_refill(heap *h, unsigned cls, uint32_t cap, uint64_t stream_id, cudaStream_t stream, int flags,
                magazine **out) {
  record_poll(&h->records, h->depots, &h->large); /* recorded blocks whose streams completed */
  magazine *m = depot_take(&h->depots[cls], stream_id);
  if (m != NULL) {
    *out = m;
    return MAGPIE_OK;
  }
  int rc = heap_carve(h, cls, cap, stream_id, stream, 0, flags, out);
  if (rc != MAGPIE_ERR_OUT_OF_MEMORY) return rc;
  /* Pressure: order this stream after another stream's free (a stream
   * wait) before any host-side wait. Only under pressure: small refills
   * are frequent, and a wait taken whenever it saves a slab would tie
   * streams together (a synchronisation of one would wait for another's
   * unrelated work, as seen on a GPU test holding a stream for seconds). */
  if ((m = depot_take_waiting(&h->depots[cls], h->ops, stream_id, stream)) != NULL) {
    *out = m;
    return MAGPIE_OK;
  }
  heap_refill_req req = {cls, cap, stream_id, stream, out};
  return heap_descend(h, heap_refill_retry, &req, sizeclass_table[cls].size);
}

/* Class blocks cached class by class held a thread's high-water mark of
 * each class, so a thread's surplus goes back to the segments, where it
 * coalesces (bench/DECISIONS.md, "A thread's surplus class blocks go back
 * to the segments"). Only a thread's own surplus goes back: blocks flowing
 * from a freeing thread to an allocating one (workload 4) would otherwise
 * cross the large cache's lock twice, which made cross-thread frees
 * several times slower.
 *
 * The lock is only tried, and after a try finds it held the next
 * HEAP_PUT_BACKOFF such magazines go to the depot without trying: under
 * contention magazines circulate through the depot. Magazines in the depot
 * keep their blocks apart from the free memory around them, so a short
 * back-off holds less memory; trying every time was slower at sixteen
 * threads, and longer or adaptive back-offs held more (bench/DECISIONS.md,
 * "The give-back tries the lock and backs off for 4"). */
#define HEAP_PUT_BACKOFF 4

/* A round trip's magazine stays in the depot, where any thread takes it
 * without a lock, while the depot's bytes of the segment classes stay
 * within a budget: an eighth of the bytes in use plus the heap's floor
 * (heap.h, HEAP_CLASS_BUDGET_*). Past it, magazines go back to the
 * segments through the large cache's lock, which sixteen threads of the
 * mixed workload waited on for most of their time (bench/DECISIONS.md,
 * "Class magazines circulate in the depot within a budget"). The budget
 * follows the bytes in use, so a program caches more only while it uses
 * more; heap_recycle gives the depot's class blocks back before any
 * mapping. Is there room for m? The depots' byte counts are relaxed sums
 * kept by their own operations: a heuristic. */
static int heap_class_within_budget(heap *h, const magazine *m) {
  int64_t cached = 0;
  for (unsigned c = SIZECLASS_FINE_COUNT; c < SIZECLASS_COUNT; c++)
    if (sizeclass_table[c].seg)
      cached += atomic_load_relaxed(&h->depots[c].ready_bytes) + atomic_load_relaxed(&h->depots[c].pending_bytes);
  int64_t used = atomic_load_relaxed(&h->stat_in_use_published);
  size_t budget =
      ((used > 0 ? (size_t)used : 0) >> HEAP_CLASS_BUDGET_SHIFT) + atomic_load_relaxed(&h->class_budget_floor);
  return (size_t)(cached > 0 ? cached : 0) + depot_magazine_bytes(m) <= budget;
}

void heap_put(heap *h, magazine *m, int round_trip) {
  if (round_trip && sizeclass_table[m->cls].seg && !heap_class_within_budget(h, m)) {
    if (atomic_load_relaxed(&h->put_backoff) > 0) {
      atomic_sub_relaxed(&h->put_backoff, 1);
    } else {
      int rc = heap_class_blocks_back(h, m, LARGE_TRY);
      if (rc == MAGPIE_OK) return;
      if (rc == LARGE_BUSY) atomic_store_relaxed(&h->put_backoff, HEAP_PUT_BACKOFF);
    }
  }
  depot_put(&h->depots[m->cls], m);
}

/* heap_large_alloc's request, for its retries down the ladder. */
typedef struct heap_large_req {
  size_t size;
  uint64_t stream_id;
  cudaStream_t stream;
  uintptr_t *out;
  size_t *bsize;
  large_lent *lent;
} heap_large_req;

static int heap_large_retry(heap *h, void *ctx) {
  heap_large_req *r = ctx;
  return large_alloc_lent(&h->large, r->size, r->stream_id, r->stream, LARGE_MAY_WAIT_EVENT, r->out, r->bsize, r->lent);
}

int heap_large_alloc(heap *h, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                     size_t *bsize, large_lent *lent) {
  record_poll(&h->records, h->depots, &h->large); /* recorded blocks whose streams completed */
  /* Reuse before mapping, as for class carves: class blocks cached in the
   * depot may free the room (heap_recycle). */
  int rc = large_alloc_lent(&h->large, size, stream_id, stream, LARGE_NO_MAP, out, bsize, lent);
  if (rc == LARGE_WOULD_MAP) {
    int recycled = heap_recycle(h);
    if (!(flags & HEAP_NO_MAP)) rc = large_alloc_lent(&h->large, size, stream_id, stream, 0, out, bsize, lent);
    else if (recycled) rc = large_alloc_lent(&h->large, size, stream_id, stream, LARGE_NO_MAP, out, bsize, lent);
    if (rc == LARGE_WOULD_MAP) return HEAP_WOULD_MAP;
  }
  if (rc != MAGPIE_ERR_OUT_OF_MEMORY) return rc;
  /* Before any host-side wait: reuse a block another stream freed by
   * making this stream wait on the free's event. */
  heap_large_req req = {size, stream_id, stream, out, bsize, lent};
  rc = heap_large_retry(h, &req);
  return rc == MAGPIE_ERR_OUT_OF_MEMORY ? heap_descend(h, heap_large_retry, &req, size) : rc;
}

int heap_trim(heap *h, size_t keep) {
  /* Cheapest first; stop once the target is met. Thread caches are
   * emptied too (their blocks then need a device synchronisation). */
  static const enum heap_step steps[] = {HEAP_STEP_RECLAIM, HEAP_STEP_SLABS, HEAP_STEP_UNMAP,
                                         HEAP_STEP_THREADS, HEAP_STEP_WAIT,  HEAP_STEP_UNMAP};
  for (unsigned i = 0; i < sizeof steps / sizeof steps[0]; i++) {
    if (heap_cached_bytes(h) <= keep) break;
    heap_relieve(h, steps[i]);
  }
  /* Another thread's release (the maintenance thread's, above a release
   * threshold) may hold memory the steps above found gone from every list
   * but not yet unmapped: wait it out, so that the caller finds at most
   * keep bytes cached. */
  region_releases_wait(&h->region);
  return MAGPIE_OK;
}
