/* Statistics and the public magpie_stats_get. */
#include "front/stats.h"

#include <sched.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "base/sizeclass.h"
#include "device/backend_timed.h"
#include "front/global.h"
#include "heap/heap.h"
#include "pool/large.h"
#include "pool/record.h"
#include "tcache/tcache.h"

static size_t stats_nonneg(int64_t v) { return v > 0 ? (size_t)v : 0; }

static void stats_collect_once(heap *h, magpie_stats *out) {
  memset(out, 0, sizeof *out);
  int64_t kept_threads = 0;
  int64_t live = tcache_live_bytes(h->device, &kept_threads);
  size_t reserved = atomic_load_relaxed(&h->region.held);
  /* Graph pools' blocks (pool/gpool.h) are in use: the graphs own them,
   * free in their pool or not; the large cache counts them in use too. */
  out->graph_pool_bytes = atomic_load_relaxed(&h->graphs.bytes);
  out->in_use_bytes = stats_nonneg(live) + out->graph_pool_bytes;
  out->reserved_bytes = reserved;
  out->cached_bytes = reserved > out->in_use_bytes ? reserved - out->in_use_bytes : 0;
  out->peak_reserved_bytes = atomic_load_relaxed(&h->region.peak_held);
  size_t peak = atomic_load_relaxed(&h->stat_peak_in_use);
  out->peak_in_use_bytes = peak > out->in_use_bytes ? peak : out->in_use_bytes;
  if (out->peak_reserved_bytes < reserved) out->peak_reserved_bytes = reserved;
  /* Class blocks (pool/large.h) are in use for the large cache, and
   * counted where they are (threads, depot, in use) like slab blocks. */
  size_t lu = atomic_load_relaxed(&h->large.in_use_bytes), lc = atomic_load_relaxed(&h->large.class_bytes);
  lc += atomic_load_relaxed(&h->large.lent_bytes); /* spans' granules: their slabs' blocks are counted as such */
  out->large_in_use_bytes = lu > lc ? lu - lc : 0;
  /* Blocks parked by record_stream (record.c): freed, not yet back in a
   * pool; the large cache still counts large ones in use. */
  size_t parked_small = 0, parked_large = 0;
  record_pending(&h->records, &parked_small, &parked_large);
  out->large_in_use_bytes -= parked_large <= out->large_in_use_bytes ? parked_large : out->large_in_use_bytes;
  /* Large blocks kept by threads for their streams (tcache.c), or in limbo
   * on their way back: freed, not in use. */
  size_t kept = stats_nonneg(kept_threads);
  size_t kept_all = kept + stats_nonneg(atomic_load_relaxed(&h->stat_kept_limbo_bytes));
  out->large_in_use_bytes -= kept_all <= out->large_in_use_bytes ? kept_all : out->large_in_use_bytes;
  out->slab_count = atomic_load_relaxed(&h->slabs.mapped);
  depot_totals dt;
  depot_totals_get(h->depots, SIZECLASS_COUNT, &dt);
  out->depot_exchanges = dt.exchanges;
  out->events_recorded = atomic_load_relaxed(&h->epochs.events_recorded);
  out->event_queries = atomic_load_relaxed(&h->epochs.events_queried);
  out->event_queries_pending = atomic_load_relaxed(&h->epochs.queries_pending);
  out->cross_stream_migrations = dt.migrations;
  out->same_stream_reuses = dt.same_stream;
  out->limbo_magazines = atomic_load_relaxed(&h->stat_limbo);

  /* Layers. Small blocks in threads = handed to threads - given back -
   * small blocks in use (frees land in the freeing thread's magazines). */
  size_t small_in_use = out->in_use_bytes > out->large_in_use_bytes ? out->in_use_bytes - out->large_in_use_bytes : 0;
  int64_t in_threads = dt.thread_in - dt.thread_out - (int64_t)small_in_use;
  large_account la;
  large_account_get(&h->large, &la);
  out->thread_cached_bytes = stats_nonneg(in_threads) + kept;
  out->depot_bytes = stats_nonneg(dt.ready_bytes);
  out->epoch_pending_bytes = stats_nonneg(dt.pending_bytes) + stats_nonneg(atomic_load_relaxed(&h->stat_limbo_bytes)) +
                             la.free_pending + parked_small + parked_large;
  out->large_free_bytes = la.free_ready;
  out->overhead_bytes = stats_nonneg(atomic_load_relaxed(&h->region.overhead)) + la.overhead;
  out->large_mapped_bytes = atomic_load_relaxed(&h->large.mapped_bytes);
  size_t limit = region_limit(&h->region);
  out->limit_bytes = limit == SIZE_MAX ? 0 : limit;
  out->large_segment_count = atomic_load_relaxed(&h->large.segments);
  out->slabs_released = atomic_load_relaxed(&h->slabs.released);
  out->large_bytes_unmapped = atomic_load_relaxed(&h->large.bytes_unmapped);
  out->stream_waits = atomic_load_relaxed(&h->large.stream_waits) + dt.stream_waits;
  out->threads_flushed = atomic_load_relaxed(&h->stat_threads_flushed);
  out->threads_stolen = atomic_load_relaxed(&h->stat_threads_stolen);
  out->device_syncs = atomic_load_relaxed(&h->stat_device_syncs);
  out->graph_pools = atomic_load_relaxed(&h->graphs.npools);
  for (unsigned i = 0; i < HEAP_STEP_COUNT && i < MAGPIE_STATS_LADDER; i++)
    out->ladder_steps[i] = atomic_load_relaxed(&h->stat_ladder[i]);
  tcache_class_counts(h, out->class_hits, out->class_misses);
}

/* Reads that a reap's moves out of limbo overlapped are read again
 * (heap.h, reap_moving): between the reaper's two counter updates a moved
 * block is in neither layer's figure, and the statistics identity
 * (reserved = in use + every cached layer) did not hold for that read
 * (tests/lifecycle_test under ThreadSanitizer, once). The moves take
 * microseconds (the device synchronisation before them is outside); a
 * read overlapped for STATS_RETRY_NS stands as it is. */
#define STATS_RETRY_NS 2000000

static uint64_t stats_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void stats_collect(heap *h, magpie_stats *out) {
  uint64_t start = 0;
  for (;;) {
    uint64_t moves = atomic_load_acquire(&h->reap_moves);
    int moving = atomic_load_seq_cst(&h->reap_moving) > 0;
    if (!moving) {
      stats_collect_once(h, out);
      atomic_thread_fence(memory_order_seq_cst);
      if (atomic_load_seq_cst(&h->reap_moving) == 0 && atomic_load_acquire(&h->reap_moves) == moves) return;
    }
    uint64_t now = stats_now_ns();
    if (start == 0) start = now;
    if (now - start > STATS_RETRY_NS) break;
    sched_yield();
  }
  stats_collect_once(h, out);
}

void stats_describe(heap *h, char *buf, size_t n) {
  magpie_stats s;
  stats_collect(h, &s);
  size_t dev_free = 0, dev_total = 0;
  h->ops->mem_info(h->device, &dev_free, &dev_total);
  int k = snprintf(buf, n,
                   "device free %zu of %zu bytes; magpie reserved %zu, in use %zu, cached %zu (in thread "
                   "magazines %zu, depot %zu, waiting on streams %zu, free large segments %zu, overhead %zu)",
                   dev_free, dev_total, s.reserved_bytes, s.in_use_bytes, s.cached_bytes, s.thread_cached_bytes,
                   s.depot_bytes, s.epoch_pending_bytes, s.large_free_bytes, s.overhead_bytes);
  if (s.limit_bytes && k > 0 && (size_t)k < n)
    snprintf(buf + k, n - (size_t)k, "; limit %zu bytes (MAGPIE_CONF limit=)", s.limit_bytes);
}

void stats_print(int device, FILE *out) {
  heap *h = heap_peek(device);
  if (h == NULL) return;
  magpie_stats s;
  stats_collect(h, &s);
  fprintf(
      out,
      "magpie device %d: in use %zu B (peak %zu), reserved %zu B (peak %zu), cached %zu B\n"
      "  cached by layer: thread magazines %zu, depot %zu, waiting on streams %zu, free large %zu, "
      "overhead %zu\n"
      "  slabs %llu (released %llu), large segments %llu (mapped %zu B, unmapped %llu B), limit %zu B\n"
      "  depot exchanges %llu, events %llu (queried %llu, %llu of those pending), cross-stream migrations "
      "%llu, same-stream reuses %llu, limbo %llu (device syncs %llu), stream waits %llu, threads flushed %llu, stolen "
      "%llu\n"
      "  out-of-memory ladder: reclaim %llu, slabs %llu, threads %llu, wait %llu, unmap %llu, failed %llu\n",
      device, s.in_use_bytes, s.peak_in_use_bytes, s.reserved_bytes, s.peak_reserved_bytes, s.cached_bytes,
      s.thread_cached_bytes, s.depot_bytes, s.epoch_pending_bytes, s.large_free_bytes, s.overhead_bytes,
      (unsigned long long)s.slab_count, (unsigned long long)s.slabs_released, (unsigned long long)s.large_segment_count,
      s.large_mapped_bytes, (unsigned long long)s.large_bytes_unmapped, s.limit_bytes,
      (unsigned long long)s.depot_exchanges, (unsigned long long)s.events_recorded, (unsigned long long)s.event_queries,
      (unsigned long long)s.event_queries_pending, (unsigned long long)s.cross_stream_migrations,
      (unsigned long long)s.same_stream_reuses, (unsigned long long)s.limbo_magazines,
      (unsigned long long)s.device_syncs, (unsigned long long)s.stream_waits, (unsigned long long)s.threads_flushed,
      (unsigned long long)s.threads_stolen, (unsigned long long)s.ladder_steps[0],
      (unsigned long long)s.ladder_steps[1], (unsigned long long)s.ladder_steps[2],
      (unsigned long long)s.ladder_steps[3], (unsigned long long)s.ladder_steps[4],
      (unsigned long long)s.ladder_steps[5]);
  backend_timed_print(out);
  fputs("  size class: hits / misses\n", out);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    if (s.class_hits[c] == 0 && s.class_misses[c] == 0) continue;
    fprintf(out, "    %8zu B: %llu / %llu\n", sizeclass_table[c].size, (unsigned long long)s.class_hits[c],
            (unsigned long long)s.class_misses[c]);
  }
}

MAGPIE_API int magpie_stats_get(int device, magpie_stats *out) {
  if (out == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_stats_get: out is NULL");
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  heap *h = heap_peek(device);
  if (h == NULL) {
    if ((rc = global_device_check(device, "magpie_stats_get")) != MAGPIE_OK) return rc;
    memset(out, 0, sizeof *out); /* nothing allocated there yet */
    return MAGPIE_OK;
  }
  stats_collect(h, out);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_stats_reset_peaks(int device) {
  int rc = global_device_check(device, "magpie_stats_reset_peaks");
  if (rc != MAGPIE_OK) return rc;
  heap *h = heap_peek(device);
  if (h == NULL) return MAGPIE_OK; /* no peaks yet */
  magpie_stats s;
  stats_collect(h, &s);
  /* Relaxed stores: a thread raising a peak between the collection and
   * the store may have its raise lost; the next slow path raises it
   * again (peaks are sampled on slow paths anyway, see stats.h). */
  atomic_store_relaxed(&h->stat_peak_in_use, s.in_use_bytes);
  region_reset_peak(&h->region);
  return MAGPIE_OK;
}

/* From the formula, not the table: answers before set-up too. */
MAGPIE_API size_t magpie_size_class_size(unsigned i) { return i < SIZECLASS_COUNT ? sizeclass_size_calc(i) : 0; }
_Static_assert(SIZECLASS_COUNT <= MAGPIE_STATS_CLASSES, "magpie_stats has room for every size class");
