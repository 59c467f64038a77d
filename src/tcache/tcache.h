/* Thread caches: per thread, per stream, per size class, a loaded and a
 * previous magazine (Bonwick). The fast paths below touch only memory the
 * calling thread owns: no atomic read-modify-write, no lock, no driver call
 * beyond the backend's stream identity.
 *
 * Stream slots. A slot is (stream id, heap): the magazines of blocks of that
 * heap which that stream may reuse at once. Allocation identifies the stream
 * by id (unique for the process) on every call, so a recycled handle value
 * never reaches an old stream's magazines. Free matches the handle only:
 * a block freed into a slot whose handle was recycled is still caught,
 * because every allocation checks the id first (a mismatch sends the slot's
 * magazines to limbo, which waits for the whole device) and seals use the
 * handle of a free whose id matched. Special handles (0, 1, 2) name different streams on different
 * devices, so their frees always check the id.
 *
 * INVARIANT: every block in slot.loaded/prev/outbox may be used by work
 *            enqueued on the slot's stream after now.
 * INVARIANT: tc->last is tc->dummy (whose magazines are the sentinel) or a
 *            slot whose heap is its stream's own device (alloc-capable).
 *
 * Give-back from idle threads (asymmetric Dekker, as in hazard pointers).
 * The owner marks itself `busy` with a plain store around every operation
 * and then reads `steal`; a reclaimer sets `steal`, issues a process-wide
 * barrier (membarrier), then reads `busy`. Either the reclaimer sees the
 * owner busy (and asks it, through steal's TCACHE_ASKED bit, to give back
 * at its next operation, which that bit sends down the slow path) or the
 * owner sees `steal` and waits in its slow path until the reclaimer, which
 * took the idle thread's magazines, clears it. The fast paths pay two plain
 * stores and one load, no fence: the barrier is the reclaimer's. */
#ifndef MAGPIE_TCACHE_H
#define MAGPIE_TCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "device/backend.h"
#include "heap/heap.h"
#include "pool/magazine.h"
#include "pool/slab.h"
#include "tcache/tcache_upcalls.h"
#include "tcache/tslot.h"

/* The calling thread's cache. Not initial-exec: that model makes the whole
 * library need static TLS, which a dlopen after start-up cannot get with
 * glibc's defaults; TLS descriptors (defs.bzl) cost about the same on the
 * fast path. */
extern __thread tcache *tcache_tls;

/* id: the stream's id if the fast path looked it up, else 0. */
void *tcache_alloc_slow(size_t size, cudaStream_t stream, uint64_t id);
int tcache_free_slow(void *ptr, cudaStream_t stream);
/* Sets the error of an allocation of size bytes on stream s, which is
 * capturing a graph magpie was not told of (MAGPIE_ERR_CAPTURE, the
 * message naming magpie_capture_begin); the thread caches and capture.c
 * report it alike. */
void tcache_capture_error(cudaStream_t s, size_t size);
/* A block (slab sl) freed on a capturing stream s: out of the calling
 * thread's in-use count and into the heap's limbo, where it waits for a
 * device synchronisation (heap_limbo_block, heap_limbo_put_large). */
int tcache_free_to_limbo(void *ptr, struct slab *sl, cudaStream_t s);

static inline int tcache_special_handle(cudaStream_t s) { return (uintptr_t)s <= 2; }

/* Mark the owner busy, then see whether a reclaimer is at work. The signal
 * fence keeps the compiler from reordering the store after the load; the
 * reclaimer's membarrier orders them for the processor. */
static inline int tcache_enter(tcache *tc) {
  atomic_store_relaxed(&tc->busy, 1);
  atomic_signal_fence(memory_order_seq_cst);
  /* Acquire: a reclaimer that looked at this cache stored 0 with release
   * after its last read; the owner's writes that follow are ordered after
   * those reads (a plain load on x86-64). */
  return atomic_load_acquire(&tc->steal) == 0;
}

static inline void tcache_leave(tcache *tc) { atomic_store_release(&tc->busy, 0); }

/* The stream's id for the fast paths: ordinary handles straight from the
 * backend's fast form; special ones through stream_id (cached by context).
 * Returns 0 on any failure (ids are never 0). */
static MAGPIE_INLINE uint64_t tcache_stream_id(const tcache *tc, cudaStream_t stream) {
  if (unlikely(tcache_special_handle(stream))) {
    uint64_t v = 0;
    return tc->ops->stream_id(stream, &v) == MAGPIE_OK ? v : 0;
  }
  unsigned long long v;
  if (unlikely(tc->ops->stream_id_fast(stream, &v) != 0)) return 0;
  return (uint64_t)v;
}

/* Allocation fast path: a block from the loaded magazine of the last slot,
 * or NULL for the slow path (no cache yet, size 0 or large, a reclaimer at
 * work, another stream than the last, an empty magazine), with *id_out the
 * stream's id if it was looked up (else left as it was). The driver call
 * comes before the cache is marked busy: it touches none of the cache. */
static MAGPIE_INLINE void *tcache_alloc_fast(size_t size, cudaStream_t stream, uint64_t *id_out) {
  tcache *tc = tcache_tls;
  /* Size 0 goes to the slow path (a unique minimum block). */
  if (unlikely(tc == NULL || size == 0 || size > SIZECLASS_MAX_SIZE)) return NULL;
  uint64_t id = tcache_stream_id(tc, stream);
  *id_out = id; /* spares the slow path a second driver call */
  if (unlikely(!tcache_enter(tc))) return NULL;
  tslot *ts = tc->last;
  /* A failed lookup (0) matches only the dummy slot, whose magazines are
   * the empty sentinel. */
  if (unlikely(id != ts->id)) return NULL;
  unsigned c = sizeclass_of(size);
  magazine *m = ts->cl[c].loaded;
  if (unlikely(m->count == 0)) return NULL;
  MAGAZINE_ASSERT_VALID(m);
  MAGPIE_ASSERT(m->cls == c);
  tslot_count(ts, (int64_t)sizeclass_table[c].size);
  atomic_owner_inc_u64(&ts->cl[c].hits);
  void *p = m->slots[--m->count];
  if (m->count < ts->cl[c].low) ts->cl[c].low = m->count;
  tcache_leave(tc);
  return p;
}

/* The free fast path's checks and push, with tc marked busy: into the
 * loaded magazine of the last slot when the block is a small one of that
 * slot's heap and the magazine has room. 0: the slow path must serve.
 * Ordinary handles are matched by value (see above); special ones were
 * matched by id before this. */
static MAGPIE_INLINE int tcache_free_push(tcache *tc, slab *sl, void *ptr, cudaStream_t stream) {
  tslot *ts = tc->last;
  int k = large_or_slab_class(sl, (uintptr_t)ptr);
  if (unlikely(k < 0)) return 0;
  uint32_t c = (uint32_t)k;
  size_t bsize = sizeclass_table[c].size;
  /* record_stream: slabs with recorded blocks take the slow path
   * (sl->recorded, record.h). */
  if (unlikely(ts->handle != stream || ts->heap != sl->heap || atomic_load_relaxed(&sl->recorded) != 0)) return 0;
  magazine *m = ts->cl[c].loaded;
  /* A full magazine, or the free that brings an armed slot back to its
   * level (tcache_slot_drain): the slow path. */
  if (unlikely(m->count >= m->cap || ts->held - (int64_t)bsize <= ts->drain_at)) return 0;
  MAGAZINE_ASSERT_VALID(m);
  MAGPIE_ASSERT(m->cls == c);
  m->slots[m->count++] = ptr;
  tslot_count(ts, -(int64_t)bsize);
  return 1;
}

/* Special handles (0, 1, 2) name a stream through the current context: a
 * free on one is matched by id (tcache.c), out of line so that the fast
 * path below needs no frame. */
int tcache_free_special(void *ptr, cudaStream_t stream);

static MAGPIE_INLINE int tcache_free(void *ptr, cudaStream_t stream) {
  if (unlikely(tcache_special_handle(stream))) return tcache_free_special(ptr, stream);
  tcache *tc = tcache_tls;
  slab *sl = pagemap_lookup((uintptr_t)ptr);
  if (likely(tc != NULL && sl != NULL && tcache_enter(tc) && tcache_free_push(tc, sl, ptr, stream))) {
    tcache_leave(tc);
    return MAGPIE_OK;
  }
  return tcache_free_slow(ptr, stream);
}

/* Statistics: this device's live bytes over all threads, past and present,
 * and (*kept) the bytes of the large blocks they keep (tcache.kept_bytes). */
int64_t tcache_live_bytes(int device, int64_t *kept);
/* Statistics: per-class hits and misses of heap h (added to the arrays). */
void tcache_class_counts(heap *h, uint64_t *hits, uint64_t *misses);

/* Give back the calling thread's magazines of heap h (to limbo). Only from
 * a public entry point, never from inside an allocation. */
void tcache_flush_self(heap *h);
/* The stream id (handle s, still valid) is about to be destroyed: the
 * calling thread's slots for it are sealed on s to the depot and retired
 * (magpie_stream_retire). Other threads' slots for it meet the usual fate
 * of a stream's slots (limbo, at eviction or thread exit). */
void tcache_stream_retire(cudaStream_t s, uint64_t id);

/* Snapshots: call fn on every magazine of heap h held by a thread cache
 * (the caller's own included), each cache inspected while its owner is
 * outside magpie. Returns how many busy caches could not be inspected. */
int tcache_inspect(heap *h, void (*fn)(void *ctx, const magazine *m, int loaded), void *ctx);

/* In a child of fork() (its only thread): the forking thread's cache
 * belongs to the parent's heaps; drop it, so every call takes the slow
 * path and its set-up check. */
void tcache_after_fork_child(void);

/* At set-up (once, under the public layer's set-up lock): the device table
 * and checked mode of every cache made from now on; give-back from idle
 * threads (membarrier registration). */
void tcache_module_init(const backend_ops *ops, int check);

#endif /* MAGPIE_TCACHE_H */
