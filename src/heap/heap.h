/* A heap: everything magpie holds for one device.
 *
 *   region   — the device's virtual range and mapped memory
 *   depots   — per size class, magazines no thread holds
 *   epochs   — stream records and the event pool
 *   large    — free large blocks waiting for reuse
 *   limbo    — magazines of streams that died before their blocks could be
 *              sealed (and, in the record table, recorded blocks whose
 *              recorded stream died before their free; blocks freed on a
 *              capturing stream; graph pools' blocks after their release);
 *              a background thread synchronises the device, while no
 *              capture it knows of runs, and returns them to the pools.
 *   graphs   — graph pools (pool/gpool.h): memory of captured CUDA graphs
 *
 * Heaps are created on first use of their device and live for the process. */
#ifndef MAGPIE_HEAP_H
#define MAGPIE_HEAP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/sizeclass.h"
#include "device/backend.h"
#include "pool/depot.h"
#include "pool/epoch.h"
#include "pool/gpool.h"
#include "pool/large.h"
#include "pool/record.h"
#include "pool/region.h"
#include "pool/slab.h"
#include "pool/span.h"

#define HEAP_MAX_DEVICES MAGPIE_MAX_DEVICES

/* Out-of-memory ladder steps, cheapest first (magpie_stats.ladder_steps). */
enum heap_step {
  HEAP_STEP_RECLAIM = 0, /* query pending epochs, merge what completed */
  HEAP_STEP_SLABS = 1,   /* give back slabs wholly free in the depot */
  HEAP_STEP_THREADS = 2, /* take idle threads' magazines, ask busy ones */
  HEAP_STEP_WAIT = 3,    /* block until pending epochs (and limbo) drain */
  HEAP_STEP_UNMAP = 4,   /* unmap free large granules / segments */
  HEAP_STEP_FAILED = 5,  /* the request failed after every step */
  HEAP_STEP_COUNT = 6
};

/* A thread's surplus class blocks of the segment classes stay in the
 * depot while the depot's bytes of those classes are within an eighth
 * (HEAP_CLASS_BUDGET_SHIFT) of the bytes in use plus
 * HEAP_CLASS_BUDGET_FLOOR (heap.c, heap_put). */
#define HEAP_CLASS_BUDGET_FLOOR ((size_t)4 << 20)
#define HEAP_CLASS_BUDGET_SHIFT 3

/* Statistics below are relaxed counters, written by any thread on slow
 * paths and read by magpie_stats_get; none publishes other memory. Byte
 * counters of a layer move when whole magazines move between layers. */
typedef struct heap {
  int device;
  const backend_ops *ops;
  size_t total_mem;
  size_t release_threshold; /* set once at creation */
  int reuse_wait;           /* magpie_config.reuse_wait; set once */
  region region;
  epoch_table epochs;
  depot depots[SIZECLASS_COUNT];
  stack limbo;
  /* Kept large blocks (pool/large.h) whose thread let them go where their
   * stream's handle may be gone: freed, ready for every stream, after the
   * next device synchronisation (heap_reap). Under klimbo_lock. */
  pthread_mutex_t klimbo_lock;
  struct heap_kept *klimbo;
  /* Blocks freed on a capturing stream (heap_limbo_block), per class, in
   * a magazine that goes to limbo when full or at the next reap. Under
   * klimbo_lock. */
  magazine *lpart[SIZECLASS_COUNT];
  large_cache large;
  gpool_set graphs;
  span_set spans; /* granules shared by classes' slabs */
  slab_set slabs; /* class slabs, for release and snapshots */
  /* Lines of their own: every refill and large allocation reads
   * records.parked_count, and threads' publications (tcache_publish)
   * write the two counters below; on one line, each publication took the
   * line from every reader. */
  _Alignas(64) record_table records;                  /* blocks with record_stream entries */
  _Alignas(64) _Atomic int64_t stat_in_use_published; /* sum of threads' published live bytes */
  _Atomic size_t stat_peak_in_use;
  _Alignas(64) _Atomic uint64_t stat_limbo;
  _Atomic uint64_t stat_device_syncs; /* limbo drains that synchronised the device */
  _Atomic int64_t stat_limbo_bytes;
  _Atomic int64_t stat_kept_limbo_bytes; /* kept large blocks in limbo (part of stat_limbo_bytes) */
  _Atomic uint64_t stat_ladder[HEAP_STEP_COUNT];
  _Atomic uint64_t stat_threads_flushed;
  _Atomic uint64_t stat_threads_stolen;
  /* Reuse before mapping (heap.c, heap_recycle): attempts, and the depot's
   * bytes at the last one that gave nothing back (relaxed; a heuristic). */
  _Atomic uint64_t stat_recycles;
  /* Magazines of class blocks heap_put sends to the depot before it tries
   * the large cache's lock again: set after a try found it held, counted
   * down by each such magazine (relaxed, any thread; a heuristic that
   * publishes nothing). */
  _Atomic int32_t put_backoff;
  /* The depot's budget of segment-class bytes beyond an eighth of the
   * bytes in use (heap_put): HEAP_CLASS_BUDGET_FLOOR, set at creation;
   * tests lower it before use. */
  _Atomic size_t class_budget_floor; /* relaxed: a setting, publishes nothing */
  _Atomic size_t recycle_mark;
  /* Threads inside heap_reap: raised (seq_cst, against heap_capture_hold)
   * on entry, lowered (release) on exit, read with acquire by
   * heap_reap_wait and with seq_cst by heap_capture_hold. */
  _Atomic int reaping;
  /* A reap's moves out of limbo (heap_reap): reap_moving counts the
   * reapers moving now (raised seq_cst before, lowered release after),
   * reap_moves counts moves finished (release). Statistics read both
   * around their reads and read again if a move overlapped them
   * (front/stats.c): a block moved from limbo is out of one layer's
   * figure before it is in another's. */
  _Atomic int reap_moving;
  _Atomic uint64_t reap_moves;
  /* Per class allocations served by magazines / slow paths, folded in from
   * thread slots when they are retired. */
  _Atomic uint64_t stat_class_hits[SIZECLASS_COUNT];
  _Atomic uint64_t stat_class_misses[SIZECLASS_COUNT];
} heap;

/* The thread-cache layer's give-back (tcache.c registers it: the heap lies
 * below the thread caches and cannot name them). Gives back the calling
 * thread's own magazines if it is allocating, empties idle threads'
 * magazines of heap h into limbo, asks busy threads to do the same at
 * their next call and waits (bounded) until they have; returns the bytes
 * taken. */
typedef size_t (*heap_threads_reclaim_fn)(heap *h);
void heap_set_threads_reclaim(heap_threads_reclaim_fn fn);

/* Set up the heap layer for a backend and a configuration (once, from
 * global init; cfg is copied). */
void heap_module_init(const backend_ops *ops, const magpie_config *cfg);
/* The heap of a device (created on first use); NULL with the error set. */
heap *heap_get(int device);
/* The heap if it exists, else NULL (no creation). */
heap *heap_peek(int device);

/* A magazine of class cls usable by stream_id (handle stream) now: from
 * the depot, else a new slab (or, for class blocks, up to cap blocks
 * carved from the segments: 0 for the class's mag_cap, at most its
 * mag_max); under pressure, through a stream wait on another stream's
 * pending magazine, then down the ladder (which waits for pending epochs
 * and gives back cached large blocks) before failing with
 * MAGPIE_ERR_OUT_OF_MEMORY. */
int heap_refill(heap *h, unsigned cls, uint32_t cap, uint64_t stream_id, cudaStream_t stream, int flags,
                magazine **out);
/* flags of heap_refill and heap_large_alloc: memory mapped already only
 * (after the heap's own recycling), else HEAP_WOULD_MAP (a return value)
 * with nothing mapped. A thread cache lets its own cached blocks go before
 * it asks again without it (tcache_alloc.c). */
#define HEAP_NO_MAP 1
#define HEAP_WOULD_MAP 1
/* A non-empty magazine leaving a thread's slot (its ticket taken over):
 * to the depot, except that class blocks (the classes without slabs)
 * that came and went in that slot (round_trip: the thread allocates their
 * class too) go back to their segments, where they coalesce and serve
 * any size, if the large cache's lock is free at that moment and no
 * recent try found it held (put_backoff). */
void heap_put(heap *h, magazine *m, int round_trip);
/* How often threads found the large cache's lock held on the class blocks'
 * paths so far (large_cache.class_contended): a count that only rises. */
static inline uint64_t heap_class_contention(heap *h) { return atomic_load_relaxed(&h->large.class_contended); }

/* A large block of at least size bytes usable by stream_id (handle
 * stream) now; under pressure, goes down the same ladder. With lent
 * non-NULL, handed out lent to the caller (large_alloc_lent). flags: as
 * heap_refill's. */
int heap_large_alloc(heap *h, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                     size_t *bsize, large_lent *lent);

/* Run one ladder step; returns nonzero if it freed or readied anything. */
int heap_relieve(heap *h, enum heap_step step);

/* Give back cached memory until at most keep bytes are reserved beyond
 * what is in use (magpie_trim). Does not wait for pending epochs; does
 * wait for other threads' releases already past their lists. */
int heap_trim(heap *h, size_t keep);

/* Cached bytes (reserved - in use), from the cheap counters. */
size_t heap_cached_bytes(heap *h);

/* A slow path freed memory: wake the background releaser if the cache is
 * above the release threshold. */
void heap_note_cached(heap *h);

/* ---- Limbo ----
 * Blocks whose freeing stream cannot be sealed (its handle may be gone, or
 * it captures a graph) wait in limbo for a device synchronisation, made by
 * the maintenance thread off the allocation path (heap_reap).
 * RULE: a block in limbo is ordered after the work of the stream that
 * freed it by synchronising that stream's own device, never another's:
 * a device-0 block freed on a device-1 stream waits for device 1. Each
 * entry carries its devices (sdev below: the freeing stream's device, or
 * HEAP_SYNC_EVERY_DEVICE where it cannot be asked, as on a capturing
 * stream); a reap synchronises the heap's own device and every device its
 * entries name. */
#define HEAP_SYNC_EVERY_DEVICE (-1)

/* A non-empty magazine whose stream (on device sdev) can no longer be
 * sealed: reusable after that device's synchronisation. */
void heap_limbo_put(heap *h, magazine *m, int sdev);
/* The same for a kept large block (LARGE_KEPT, its bytes out of
 * its thread's kept_bytes already): freed after the synchronisation.
 * MAGPIE_ERR_OUT_OF_MEMORY (host metadata): nothing done. */
int heap_limbo_put_large(heap *h, lblock *b, int sdev);

/* A block of class cls (a slab's or a class block) freed on a capturing
 * stream: no event can be recorded there and the graph's position of the
 * free is no point of the stream's real order, so it waits in limbo for a
 * device synchronisation. MAGPIE_ERR_OUT_OF_MEMORY (host): nothing done. */
int heap_limbo_block(heap *h, unsigned cls, void *p, int sdev);

/* ---- CUDA graphs ----
 * Captures under way that magpie was told of (front/capture.c): while
 * their count is nonzero, heap_reap makes no device synchronisation (it
 * would invalidate them); a hold returns only once no reap that began
 * before it is still under way; when the count drops to 0 the maintenance
 * thread is woken to drain what waited. */
void heap_capture_hold(int delta);
/* A large block of at least size bytes for a graph pool: ready for every
 * stream (no stream wait, no host wait), mapped in relaxed capture mode,
 * marked as a graph pool's (large_graph_mark); counted in use. */
int heap_graph_alloc(heap *h, size_t size, uintptr_t *out, size_t *bsize);
/* A graph pool's block [p, p+size) leaves the pool: unmarked, no longer in
 * use, and freed to the large cache after the next synchronisation of the
 * heap's device (its graphs' replays) and of sdev, the device of the
 * stream that freed it last (limbo). */
void heap_graph_retire(heap *h, uintptr_t p, size_t size, int sdev);

/* In a child of fork() (its only thread): forget the parent's maintenance
 * thread, so that exit does not wait for it. */
void heap_after_fork_child(void);

/* Add an in-use delta (a graph pool's block) and raise the peak to the
 * count. */
void heap_publish_in_use(heap *h, int64_t delta);
/* Add a thread's unpublished in-use delta; returns the count. The thread
 * caches raise the peak themselves (heap_raise_peak), from what they find
 * in use: their counts are published late (tcache.c, tcache_publish). */
int64_t heap_count_in_use(heap *h, int64_t delta);
void heap_raise_peak(heap *h, size_t bytes);

#endif /* MAGPIE_HEAP_H */
