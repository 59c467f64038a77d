/* A heap: everything magpie holds for one device.
 *
 *   region   — the device's virtual range and mapped memory
 *   depots   — per size class, magazines no thread holds
 *   epochs   — stream records and the event pool
 *   large    — free large blocks waiting for reuse
 *   limbo    — magazines of streams that died before their blocks could be
 *              sealed; a background thread synchronises the device and
 *              returns them to the depot.
 *
 * Heaps are created on first use of their device and live for the process. */
#ifndef MAGPIE_HEAP_H
#define MAGPIE_HEAP_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "depot.h"
#include "epoch.h"
#include "large.h"
#include "region.h"
#include "sizeclass.h"
#include "slab.h"

#define HEAP_MAX_DEVICES 64

typedef struct heap {
  int device;
  const backend_ops *ops;
  size_t total_mem;
  region region;
  epoch_table epochs;
  depot depots[SIZECLASS_COUNT];
  stack limbo;
  large_cache large;
  /* Statistics: relaxed counters, written by any thread on slow paths and
   * read by magpie_stats_get. */
  _Atomic size_t stat_peak_reserved;
  _Atomic int64_t stat_in_use_published; /* sum of threads' published live bytes */
  _Atomic size_t stat_peak_in_use;
  _Atomic int64_t stat_retired_live; /* live bytes of retired thread slots */
  _Atomic uint64_t stat_slabs;
  _Atomic uint64_t stat_exchanges;
  _Atomic uint64_t stat_migrations;
  _Atomic uint64_t stat_same_stream;
  _Atomic uint64_t stat_limbo;
} heap;

/* Set up the heap layer for a backend (once, from global init). */
void heap_module_init(const backend_ops *ops);
/* The heap of a device (created on first use); NULL with the error set. */
heap *heap_get(int device);
/* The heap if it exists, else NULL (no creation). */
heap *heap_peek(int device);

int heap_map(heap *h, size_t size, uintptr_t *addr, uintptr_t *raw, size_t *raw_size);
void heap_unmap(heap *h, uintptr_t addr, size_t size, uintptr_t raw, size_t raw_size);
void heap_slab_added(heap *h, slab *s);

/* A magazine of class cls usable by stream_id now: from the depot, else a
 * new slab; under pressure, waits for pending epochs and gives back cached
 * large blocks before failing with MAGPIE_ERR_OUT_OF_MEMORY. */
int heap_refill(heap *h, unsigned cls, uint64_t stream_id, magazine **out);

/* A large block of at least size bytes usable by stream_id now; under
 * pressure, gives back cached large blocks (completed ones first, then
 * waiting for the rest) before failing with MAGPIE_ERR_OUT_OF_MEMORY. */
int heap_large_alloc(heap *h, size_t size, uint64_t stream_id, slab **out);

/* A non-empty magazine whose stream can no longer be sealed (destroyed):
 * reusable only after a device synchronisation, done off the allocation
 * path by the reaper thread. */
void heap_limbo_put(heap *h, magazine *m);

/* Add a thread's unpublished in-use delta and raise the peak. */
void heap_publish_in_use(heap *h, int64_t delta);

#endif /* MAGPIE_HEAP_H */
