/* Statistics and the public magpie_stats_get. */
#include "stats.h"

#include <string.h>

#include "error.h"
#include "init.h"
#include "sizeclass.h"
#include "tcache.h"

void stats_collect(heap *h, magpie_stats *out) {
  memset(out, 0, sizeof *out);
  int64_t live = tcache_live_bytes(h->device);
  size_t reserved = atomic_load_relaxed(&h->region.mapped);
  out->in_use_bytes = live > 0 ? (size_t)live : 0;
  out->reserved_bytes = reserved;
  out->cached_bytes = reserved > out->in_use_bytes ? reserved - out->in_use_bytes : 0;
  out->peak_reserved_bytes = atomic_load_relaxed(&h->stat_peak_reserved);
  size_t peak = atomic_load_relaxed(&h->stat_peak_in_use);
  out->peak_in_use_bytes = peak > out->in_use_bytes ? peak : out->in_use_bytes;
  if (out->peak_reserved_bytes < reserved) out->peak_reserved_bytes = reserved;
  out->large_in_use_bytes = atomic_load_relaxed(&h->large.in_use_bytes);
  out->slab_count = atomic_load_relaxed(&h->stat_slabs);
  out->depot_exchanges = atomic_load_relaxed(&h->stat_exchanges);
  out->events_recorded = atomic_load_relaxed(&h->epochs.events_recorded);
  out->cross_stream_migrations = atomic_load_relaxed(&h->stat_migrations);
  out->same_stream_reuses = atomic_load_relaxed(&h->stat_same_stream);
  out->limbo_magazines = atomic_load_relaxed(&h->stat_limbo);
}

void stats_describe(heap *h, char *buf, size_t n) {
  magpie_stats s;
  stats_collect(h, &s);
  size_t dev_free = 0, dev_total = 0;
  h->ops->mem_info(h->device, &dev_free, &dev_total);
  size_t large = atomic_load_relaxed(&h->large.cached_bytes);
  size_t small = s.cached_bytes > large ? s.cached_bytes - large : 0;
  snprintf(buf, n,
           "device free %zu of %zu bytes; magpie reserved %zu, in use %zu, cached %zu "
           "(large blocks cached %zu, small blocks in magazines and slab tails %zu)",
           dev_free, dev_total, s.reserved_bytes, s.in_use_bytes, s.cached_bytes, large, small);
}

void stats_print(int device, FILE *out) {
  heap *h = heap_peek(device);
  if (h == NULL) return;
  magpie_stats s;
  stats_collect(h, &s);
  fprintf(out,
          "magpie device %d: in use %zu B (peak %zu), reserved %zu B (peak %zu), cached %zu B, "
          "slabs %llu, depot exchanges %llu, events %llu, cross-stream migrations %llu, "
          "same-stream reuses %llu, limbo %llu\n",
          device, s.in_use_bytes, s.peak_in_use_bytes, s.reserved_bytes, s.peak_reserved_bytes, s.cached_bytes,
          (unsigned long long)s.slab_count, (unsigned long long)s.depot_exchanges,
          (unsigned long long)s.events_recorded, (unsigned long long)s.cross_stream_migrations,
          (unsigned long long)s.same_stream_reuses, (unsigned long long)s.limbo_magazines);
}

MAGPIE_API int magpie_stats_get(int device, magpie_stats *out) {
  if (out == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_stats_get: out is NULL");
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  heap *h = heap_peek(device);
  if (h == NULL) {
    int n = 0;
    if (global_ops()->device_count(&n) != MAGPIE_OK || device < 0 || device >= n)
      return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_stats_get: no device %d (the backend has %d)",
                       device, n);
    memset(out, 0, sizeof *out); /* nothing allocated there yet */
    return MAGPIE_OK;
  }
  stats_collect(h, out);
  return MAGPIE_OK;
}

MAGPIE_API size_t magpie_size_class_size(unsigned i) {
  return i < SIZECLASS_COUNT ? sizeclass_table[i].size : 0;
}
_Static_assert(SIZECLASS_COUNT <= MAGPIE_STATS_CLASSES, "magpie_stats has room for every size class");
