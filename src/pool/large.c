/* Large blocks: the entry points (allocation, lookup, free) and the best
 * fit over the bins that serves an allocation: segments, split and
 * coalesce are the other large*.c files' (large_internal.h lists them).
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "pool/large.h"

#include <stdlib.h>
#include <string.h>

#include "base/assert.h"
#include "pool/epoch.h"
#include "pool/large_internal.h"
#include "pool/slab.h"

void large_init(large_cache *c, region *r, const backend_ops *ops, size_t total_mem, int reuse_wait,
                struct heap *owner) {
  memset(c, 0, sizeof *c);
  c->region = r;
  c->ops = ops;
  c->total_mem = total_mem;
  c->reuse_wait = reuse_wait;
  c->owner = owner;
  /* Adaptive: a thread finding the lock held spins a little before it
   * sleeps. The lock is held briefly, and with a sleeping mutex each
   * hand-over waited for a sleeping thread to wake while the lock sat free
   * (bench/DECISIONS.md, "The large cache's lock is an adaptive mutex").
   * An ordinary mutex where the type is refused. */
  pthread_mutexattr_t attr;
  int adaptive = pthread_mutexattr_init(&attr) == 0;
  if (adaptive) {
    adaptive =
        pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP) == 0 && pthread_mutex_init(&c->lock, &attr) == 0;
    pthread_mutexattr_destroy(&attr);
  }
  if (!adaptive) pthread_mutex_init(&c->lock, NULL);
  pthread_cond_init(&c->granule_cv, NULL);
}

int large_block_ready_for(const lblock *b, uint64_t stream_id) {
  return b->ticket == NULL || b->ticket->t.rec->id == stream_id || lticket_done(b->ticket);
}

/* ---- best fit ---- */

/* Bytes of [a, a+n) in granules not mapped yet (the cost of using it). */
static size_t large_unmapped_in(large_cache *c, const lseg *sg, uintptr_t a, size_t n) {
  if (!sg->vmm) return 0;
  size_t g = large_gran(c);
  size_t cost = 0;
  for (size_t i = (a - sg->base) / g, last = (a + n - 1 - sg->base) / g; i <= last; i++)
    if (sg->gran[i] != GRAN_MAPPED) cost += g;
  return cost;
}

/* Where a block goes in a free block. Best fit first: the fewest bytes
 * to map, then the fewest whole free granules cut into, then a place
 * aligned to the block's own size (its largest power of two, at most a
 * granule), then, below a granule, the granule with the least free
 * memory, then the smallest free block. A granule cut into but not
 * covered can serve only blocks smaller than itself until everything in it
 * is free again, so a block of a granule or more goes on a granule
 * boundary where it can, and a smaller one into a granule something
 * already uses, where, aligned to its size, it leaves holes that merge
 * into aligned ones as their neighbours are freed (bench/DECISIONS.md,
 * "Large blocks keep whole granules whole"). */
typedef struct large_pick {
  lblock *b;
  size_t off;     /* the block's offset in b */
  size_t cost;    /* bytes of granules to map */
  unsigned spoil; /* whole free granules of b the block cuts into without covering (0-2) */
  unsigned odd;   /* 1: not aligned to its size */
  size_t gfree;   /* below a granule: free bytes of the granule it starts in (SIZE_MAX: not yet known) */
} large_pick;

/* Granules of free block b wholly free that [p, p + n) cuts into without
 * covering them: the first and the last granule it touches. */
static unsigned large_spoil(const lblock *b, uintptr_t p, size_t n, size_t g) {
  uintptr_t sb = b->seg->base;
  uintptr_t lo = sb + (b->base - sb + g - 1) / g * g, hi = sb + (b->base + b->size - sb) / g * g;
  if (lo >= hi) return 0; /* no granule of b is wholly free */
  uintptr_t q = p + n, first = sb + (p - sb) / g * g, last = sb + (q - 1 - sb) / g * g;
  unsigned spoil = 0;
  if (p != first && first >= lo && first + g <= hi) spoil++;
  if (q != last + g && last >= lo && last + g <= hi && (last != first || p == first)) spoil++;
  return spoil;
}

/* Free bytes of the granule holding p, which free block b overlaps. */
size_t large_granule_free(const lblock *b, uintptr_t p, size_t g) {
  uintptr_t sb = b->seg->base, lo = sb + (p - sb) / g * g, hi = lo + g;
  const lblock *x = b;
  while (x->base > lo && x->prev != NULL) x = x->prev;
  size_t n = 0;
  for (; x != NULL && x->base < hi; x = x->next) {
    if (x->state != LBLOCK_FREE || x->base + x->size <= lo) continue;
    uintptr_t a = x->base > lo ? x->base : lo, e = x->base + x->size < hi ? x->base + x->size : hi;
    n += e - a;
  }
  return n;
}

/* The alignment a block of need bytes is placed at where it can: its
 * largest power of two, at most a granule. */
static size_t large_align_of(size_t need, size_t g) {
  size_t a = (size_t)1 << (63 - __builtin_clzll((unsigned long long)need));
  return a < g ? a : g;
}

/* Free bytes of the granule of pick p (computed once, when two picks tie
 * up to it). */
static size_t large_pick_gfree(large_pick *p, size_t need, size_t g) {
  if (p->gfree == SIZE_MAX) p->gfree = need < g ? large_granule_free(p->b, p->b->base + p->off, g) : 0;
  return p->gfree;
}

static void large_consider_at(large_cache *c, lblock *b, size_t need, size_t off, large_pick *best) {
  size_t g = large_gran(c);
  uintptr_t p = b->base + off;
  large_pick cand = {.b = b,
                     .off = off,
                     .cost = large_unmapped_in(c, b->seg, p, need),
                     .spoil = large_spoil(b, p, need, g),
                     .odd = (p - b->seg->base) % large_align_of(need, g) != 0,
                     .gfree = SIZE_MAX};
  if (best->b != NULL) {
    if (cand.cost != best->cost) {
      if (cand.cost > best->cost) return;
    } else if (cand.spoil != best->spoil) {
      if (cand.spoil > best->spoil) return;
    } else if (cand.odd != best->odd) {
      if (cand.odd > best->odd) return;
    } else if (large_pick_gfree(&cand, need, g) != large_pick_gfree(best, need, g)) {
      if (cand.gfree > best->gfree) return;
    } else if (b->size >= best->b->size) {
      return;
    }
  }
  *best = cand;
}

/* Offer free block b's places for need bytes: its start and end, and its
 * first and last places aligned to the block's size. */
static void large_consider(large_cache *c, lblock *b, size_t need, large_pick *best) {
  large_consider_at(c, b, need, 0, best);
  if (b->size == need) return;
  large_consider_at(c, b, need, b->size - need, best);
  size_t a = large_align_of(need, large_gran(c));
  uintptr_t sb = b->seg->base, end = b->base + b->size;
  uintptr_t lo = sb + (b->base - sb + a - 1) / a * a, hi = sb + (end - need - sb) / a * a;
  if (lo > b->base && lo + need < end) large_consider_at(c, b, need, lo - b->base, best);
  if (hi > lo && hi + need < end) large_consider_at(c, b, need, hi - b->base, best);
}

/* Blocks looked at past the first ready, mapped fit, for one that cuts
 * into no whole free granule or lies in a fuller granule: bounded, so
 * that an allocation's time under the lock does not grow with the number
 * of free blocks of its size. */
#define LARGE_LOOK_PAST 16

/* Hand out carved block u (lock held). */
int large_hand_out(large_cache *c, lblock *u, lticket **deferred) {
  /* INVARIANT (large.h): every granule under a handed-out block is mapped. */
  MAGPIE_ASSERT(u->state == LBLOCK_USED && lseg_mapped_in(u->seg, c->region->gran, u->base, u->size) == u->size);
  MAGPIE_ASSERT((atomic_load_relaxed(&u->kept) & LARGE_KEPT_STATE) == 0);
  if (!large_hash_insert(c, u)) {
    backend_set_error_detail("out of host memory for the large-block table");
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  /* A new generation: a lender's word for this descriptor is stale now. */
  atomic_store_release(&u->kept, (atomic_load_relaxed(&u->kept) & ~LARGE_KEPT_STATE) + (LARGE_KEPT_STATE + 1));
  large_ticket_unref(u->ticket, deferred);
  u->ticket = NULL;
  atomic_add_relaxed(&c->in_use_bytes, u->size);
  return MAGPIE_OK;
}

/* Mappings one allocation waits out before it maps memory itself. Threads
 * that each found nothing free while another mapped used to map side by
 * side (the lock is dropped around the driver calls), blocks that were
 * seldom live at the same time. Waiting, a thread first finds what was
 * freed and what completed meanwhile: lower peaks, at some speed where
 * threads grow together (bench/DECISIONS.md, "An allocation waits out
 * other threads' mappings"). Bounded, so that a thread others keep
 * overtaking still maps in the end. */
#define LARGE_MAP_WAITS 16

/* Find, carve, map and hand out a block of need bytes for stream_id (lock
 * held on entry and exit; dropped around driver calls). Sets *out. With
 * LARGE_NO_MAP, LARGE_WOULD_MAP where only mapping memory would serve. */
int large_alloc_locked(large_cache *c, size_t need, uint64_t stream_id, cudaStream_t stream, int flags, lblock **out,
                       lticket **deferred) {
  int rc = MAGPIE_ERR_OUT_OF_MEMORY;
  int queried = 0, map_waits = 0;
  for (int round = 0; round < 64; round++) {
    large_pick best = {0}, wait = {0};
    /* The request's bin, then the bins above it, whose blocks all fit;
     * blocks of one bin are of nearly one size, so the first bin holding
     * a ready, wholly mapped block that fits holds the best fit of those,
     * and the search stops there (at most LARGE_LOOK_PAST blocks past the
     * first such fit), or, where that fit cuts into a whole free granule,
     * looks at most that many blocks further. Otherwise every
     * fitting block is looked at, as mapping is about to cost far more. */
    unsigned after = 0;
    for (unsigned k = large_bin_next(c, large_bin_of(need)); k < LARGE_BINS; k = large_bin_next(c, k + 1)) {
      for (lblock *b = c->bins[k]; b; b = b->fnext) {
        if (b->size < need) continue;
        if (best.b != NULL && best.cost == 0 && ++after > LARGE_LOOK_PAST) break;
        if (large_block_ready_for(b, stream_id)) {
          large_consider(c, b, need, &best);
        } else {
          large_consider(c, b, need, &wait);
        }
      }
      if (best.b != NULL && best.cost == 0 && (best.spoil == 0 || after > LARGE_LOOK_PAST)) break;
    }
    /* Best of all: ready and already mapped. */
    if (best.b != NULL && best.cost == 0) goto carve_best;
    /* Blocks waiting on other streams may have completed (and merged into
     * larger ones): one round of queries (one per stream) before mapping
     * more memory. Not of the allocating stream's own frees: it reuses
     * them as they are, and clearing their tickets let the shrink below
     * unmap them, to map as much again at once (bench/DECISIONS.md, "A
     * stream's own frees are not queried before mapping"). A trim and the
     * pressure ladder still query and settle everything first. */
    if (!queried) {
      queried = 1;
      if (large_query_pending_locked(c, stream_id, deferred) > 0) {
        large_settle_locked(c, deferred);
        continue;
      }
    }
    /* Reuse another stream's block through a stream wait rather than map
     * more when mapping failed, or when what the large layer holds beyond
     * its use already passes its reserve (as cudaMallocAsync's pools do
     * with internal dependencies allowed). */
    size_t held = atomic_load_relaxed(&c->mapped_bytes), used = atomic_load_relaxed(&c->in_use_bytes);
    int soft = c->reuse_wait && held > used && held - used > large_keep(c);
    int may_wait = !(flags & LARGE_READY_ONLY) && ((flags & LARGE_MAY_WAIT_EVENT) || soft);
    int use_wait = may_wait && wait.b != NULL && wait.cost == 0;
    if (may_wait && !use_wait && (best.b == NULL || best.cost > 0)) {
      /* No one block serves without mapping: a run of them may. */
      lblock *u = NULL;
      rc = large_run_take(c, need, stream_id, stream, &u, deferred);
      if (rc == MAGPIE_OK) {
        *out = u;
        return MAGPIE_OK;
      }
      if (rc != LARGE_NO_RUN) break;
      rc = MAGPIE_ERR_OUT_OF_MEMORY;
    }
    if (!use_wait && (flags & LARGE_NO_MAP)) return LARGE_WOULD_MAP;
    if (best.b != NULL && !use_wait) goto carve_best;
    if (use_wait) {
      /* Pressure (mapping just failed): order this stream after the free
       * instead of mapping. */
      lblock *u = large_carve_at(c, wait.b, need, wait.off);
      if (u == NULL) break;
      lticket *lt = u->ticket;
      large_ticket_ref(lt);
      pthread_mutex_unlock(&c->lock);
      rc = c->ops->stream_wait_event(stream, lt->t.ev->ev);
      pthread_mutex_lock(&c->lock);
      large_ticket_unref(lt, deferred);
      if (rc == MAGPIE_OK) rc = large_hand_out(c, u, deferred);
      if (rc != MAGPIE_OK) {
        large_uncarve(c, u, deferred);
        break;
      }
      atomic_add_relaxed(&c->stream_waits, 1);
      *out = u;
      return MAGPIE_OK;
    }
    /* Nothing free is large enough (or ready): a new segment. */
    if (c->growing) {
      /* Another thread is adding a segment: use it rather than add one. */
      while (c->growing) pthread_cond_wait(&c->granule_cv, &c->lock);
      continue;
    }
    c->growing = 1;
    pthread_mutex_unlock(&c->lock);
    lseg *sg = NULL;
    rc = large_seg_new(c, need, &sg);
    pthread_mutex_lock(&c->lock);
    c->growing = 0;
    pthread_cond_broadcast(&c->granule_cv);
    if (rc != MAGPIE_OK) break;
    large_seg_link(c, sg);
    /* Carve from the new segment at once: under contention, others would
     * take it and this call would grow again. */
    map_waits = LARGE_MAP_WAITS;
    best = (large_pick){.b = sg->first, .off = 0, .cost = large_unmapped_in(c, sg, sg->base, need), .gfree = SIZE_MAX};
    goto carve_best;

  carve_best : {
    if (best.cost > 0 && c->mapping > 0 && map_waits < LARGE_MAP_WAITS) {
      /* Another thread is mapping: wait for it, then look again. */
      map_waits++;
      while (c->mapping > 0) pthread_cond_wait(&c->granule_cv, &c->lock);
      queried = 0;
      continue;
    }
    lblock *u = large_carve_at(c, best.b, need, best.off);
    if (u == NULL) {
      backend_set_error_detail("out of host memory for a large-block descriptor");
      rc = MAGPIE_ERR_OUT_OF_MEMORY;
      break;
    }
    if (best.cost > 0) large_shrink_before_grow(c, best.cost);
    rc = large_map_under(c, u);
    if (rc == MAGPIE_OK) rc = large_hand_out(c, u, deferred);
    if (rc != MAGPIE_OK) {
      large_uncarve(c, u, deferred);
      break;
    }
    *out = u;
    return MAGPIE_OK;
  }
  }
  return rc == MAGPIE_OK ? MAGPIE_ERR_OUT_OF_MEMORY : rc; /* rounds ran out */
}

int large_alloc_lent(large_cache *c, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                     size_t *bsize, large_lent *lent) {
  if (size > SIZE_MAX - LARGE_QUANTUM) return MAGPIE_ERR_SIZE_OVERFLOW;
  size_t need = large_round(size);
  lticket *deferred = NULL;
  lblock *u = NULL;
  pthread_mutex_lock(&c->lock);
  int rc = large_alloc_locked(c, need, stream_id, stream, flags, &u, &deferred);
  if (rc == MAGPIE_OK) {
    *out = u->base;
    *bsize = u->size;
    /* Handed out just now (its generation new): lent at once, as a kept
     * block handed out again is. */
    if (lent != NULL) *lent = (large_lent){u, large_lend(u)};
  }
  large_unlock(c, deferred);
  return rc;
}

int large_alloc(large_cache *c, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                size_t *bsize) {
  return large_alloc_lent(c, size, stream_id, stream, flags, out, bsize, NULL);
}

int large_lookup(large_cache *c, uintptr_t p, size_t *bsize) {
  pthread_mutex_lock(&c->lock);
  lblock *b = large_hash_find(c, p, 0);
  unsigned k = b != NULL ? large_kept_state(b) : 0;
  if (k == LARGE_KEPT || k == LARGE_KEPT_LIMBO) b = NULL; /* freed by its user */
  if (b) *bsize = b->size;
  pthread_mutex_unlock(&c->lock);
  return b != NULL;
}

int large_free_kept(large_cache *c, lblock *const *bs, uint32_t n, const epoch_ticket *t) {
  lticket *lt = NULL, *deferred = NULL;
  pthread_mutex_lock(&c->lock);
  /* One reference: this call's, until every block holds its own. */
  if (t->rec != NULL && (lt = large_ticket_new(c, t)) == NULL) {
    pthread_mutex_unlock(&c->lock);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  for (uint32_t i = 0; i < n; i++) {
    lblock *b = large_hash_find(c, bs[i]->base, 1);
    /* INVARIANT: a kept block is a handed-out block of the hash, its
     * keeper's until freed. */
    MAGPIE_ASSERT(b == bs[i] && b->klass == 0 && large_kept_state(b) == LARGE_KEPT);
    if (b == NULL) continue;
    large_unkeep(b);
    large_release_block(c, b, lt, &deferred);
  }
  large_ticket_unref(lt, &deferred);
  large_unlock(c, deferred);
  return MAGPIE_OK;
}

int large_free(large_cache *c, uintptr_t p, const epoch_ticket *t, size_t *bsize) {
  lticket *lt = NULL, *deferred = NULL;
  pthread_mutex_lock(&c->lock);
  if (t->rec != NULL && (lt = large_ticket_new(c, t)) == NULL) {
    pthread_mutex_unlock(&c->lock);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  lblock *b = large_hash_find(c, p, 1);
  int rc = MAGPIE_OK;
  /* A block its keeper lent out: freed here unless the keeper took it
   * back first (then this is a second free). */
  uint64_t kept = b != NULL ? atomic_load_acquire(&b->kept) : 0;
  if ((kept & LARGE_KEPT_STATE) == LARGE_KEPT_OUT &&
      atomic_cas_strong_acq_rel(&b->kept, &kept, large_kept_word(kept, 0)))
    kept = large_kept_word(kept, 0); /* else kept holds the word the keeper left */
  if (b != NULL && (b->klass != 0 || (kept & LARGE_KEPT_STATE) != 0)) {
    /* A class block goes back through magazines, and a kept block was
     * freed already: put its entry back (the unlink left room, so the
     * insert cannot grow or fail). */
    large_hash_insert(c, b);
    rc = b->klass != 0 ? MAGPIE_ERR_INVALID_POINTER : MAGPIE_ERR_DOUBLE_FREE;
    b = NULL;
    if (rc == MAGPIE_ERR_DOUBLE_FREE) goto out;
  }
  if (b == NULL) {
    rc = MAGPIE_ERR_INVALID_POINTER;
    for (lblock *f = large_free_first(c); f; f = large_free_next(c, f))
      if (p >= f->base && p - f->base < f->size) rc = MAGPIE_ERR_DOUBLE_FREE;
  } else {
    *bsize = b->size;
    atomic_sub_relaxed(&c->in_use_bytes, b->size);
    b->ticket = lt;
    lt = NULL;
    large_free_link(c, b);
    large_coalesce(c, b, &deferred);
  }
out:
  if (lt != NULL) large_ticket_drop(c, lt); /* not taken: the caller keeps (and releases) its ticket */
  large_unlock(c, deferred);
  return rc;
}
