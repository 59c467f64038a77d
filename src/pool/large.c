/* Large blocks: segments, best fit, split and coalesce.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "pool/large.h"

#include <stdlib.h>
#include <string.h>

#include "base/assert.h"
#include "base/meta.h"
#include "base/pagemap.h"
#include "pool/epoch.h"
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

/* ---- tickets ---- */

static void lticket_ref(lticket *lt) {
  if (lt) lt->refs++;
}

/* Drop a reference; the last one queues the ticket on *deferred, to be
 * released once the lock is let go. */
static void lticket_unref(lticket *lt, lticket **deferred) {
  if (lt == NULL || --lt->refs > 0) return;
  lt->dnext = *deferred;
  *deferred = lt;
}

static void lticket_release_all(lticket *lt) {
  for (lticket *next; lt; lt = next) {
    next = lt->dnext;
    epoch_ticket_release(&lt->t);
    meta_free(lt);
  }
}

/* ---- descriptors (lock held): spares first, else the host allocator ---- */

static lblock *large_block_new(large_cache *c) {
  lblock *b = c->spare_blocks;
  if (b == NULL) return meta_alloc(sizeof *b);
  c->spare_blocks = b->hnext;
  /* As meta_alloc's but the keeping word (the last field), which a
   * lender's stale compare-and-swap may read now (large.h, lblock.kept):
   * its state is 0 (the block was free) and its generation stays. */
  memset(b, 0, offsetof(lblock, kept));
  return b;
}

/* Block descriptors are kept, never given back to the host allocator, so
 * that a stale lblock pointer a thread holds (tslot.lout) still names a
 * descriptor: their number is at most the most blocks the segments held
 * at once. */
static void large_block_drop(large_cache *c, lblock *b) {
  b->hnext = c->spare_blocks;
  c->spare_blocks = b;
}

/* A ticket for the free t (taken over once the caller links it), one
 * reference: the caller's. */
static lticket *large_ticket_new(large_cache *c, const epoch_ticket *t) {
  lticket *lt = c->spare_tickets;
  if (lt != NULL) {
    c->spare_tickets = lt->dnext;
    c->nspare_tickets--;
  } else if ((lt = meta_alloc(sizeof *lt)) == NULL) {
    return NULL;
  }
  *lt = (lticket){.t = *t, .refs = 1};
  return lt;
}

/* The descriptor of a ticket whose epoch is released elsewhere (or was
 * never taken). */
static void large_ticket_drop(large_cache *c, lticket *lt) {
  if (c->nspare_tickets >= LARGE_SPARES) {
    meta_free(lt);
    return;
  }
  lt->dnext = c->spare_tickets;
  c->spare_tickets = lt;
  c->nspare_tickets++;
}

/* Most deferred tickets large_unlock copies out to keep their descriptors. */
#define LARGE_UNLOCK_COPIES 16

/* Let go of the lock, then release the tickets deferred under it (no
 * driver call or other lock while it is held): their epochs are copied out
 * first, so that their descriptors stay as spares. */
static void large_unlock(large_cache *c, lticket *deferred) {
  epoch_ticket t[LARGE_UNLOCK_COPIES];
  unsigned n = 0;
  while (deferred != NULL && n < LARGE_UNLOCK_COPIES && c->nspare_tickets < LARGE_SPARES) {
    lticket *lt = deferred;
    deferred = lt->dnext;
    t[n++] = lt->t;
    large_ticket_drop(c, lt);
  }
  pthread_mutex_unlock(&c->lock);
  for (unsigned i = 0; i < n; i++) epoch_ticket_release(&t[i]);
  lticket_release_all(deferred);
}

static int lblock_ready_for(const lblock *b, uint64_t stream_id) {
  return b->ticket == NULL || b->ticket->t.rec->id == stream_id || lticket_done(b->ticket);
}

/* ---- lists and hash (all under the lock) ---- */

/* A free block goes into the bin of its size; its size must not change
 * while it is there (unlink, resize, link). */
static void large_free_link(large_cache *c, lblock *b) {
  unsigned k = large_bin_of(b->size);
  b->state = LBLOCK_FREE;
  b->fprev = NULL;
  b->fnext = c->bins[k];
  if (b->fnext) b->fnext->fprev = b;
  c->bins[k] = b;
  c->binmap[k / 64] |= (uint64_t)1 << (k % 64);
}

static void large_free_unlink(large_cache *c, lblock *b) {
  unsigned k = large_bin_of(b->size);
  if (b->fprev) b->fprev->fnext = b->fnext;
  else c->bins[k] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  if (c->bins[k] == NULL) c->binmap[k / 64] &= ~((uint64_t)1 << (k % 64));
}

MAGPIE_WRAPS static size_t large_hash_of(uintptr_t p, size_t cap) {
  return (size_t)(((uint64_t)p >> 12) * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
}

static int large_hash_grow(large_cache *c) {
  size_t cap = c->hash_cap ? c->hash_cap * 2 : 256;
  lblock **nh = meta_alloc(cap * sizeof *nh);
  if (nh == NULL) return 0;
  for (size_t i = 0; i < c->hash_cap; i++) {
    for (lblock *b = c->hash[i], *next; b; b = next) {
      next = b->hnext;
      size_t k = large_hash_of(b->base, cap);
      b->hnext = nh[k];
      nh[k] = b;
    }
  }
  meta_free(c->hash);
  c->hash = nh;
  c->hash_cap = cap;
  return 1;
}

static int large_hash_insert(large_cache *c, lblock *b) {
  if (c->hash_count >= c->hash_cap && !large_hash_grow(c) && c->hash_cap == 0) return 0;
  size_t k = large_hash_of(b->base, c->hash_cap);
  b->hnext = c->hash[k];
  c->hash[k] = b;
  c->hash_count++;
  return 1;
}

static lblock *large_hash_find(large_cache *c, uintptr_t p, int unlink) {
  if (c->hash_cap == 0) return NULL;
  for (lblock **pp = &c->hash[large_hash_of(p, c->hash_cap)]; *pp; pp = &(*pp)->hnext) {
    lblock *b = *pp;
    if (b->base != p) continue;
    if (unlink) {
      *pp = b->hnext;
      b->hnext = NULL;
      c->hash_count--;
    }
    return b;
  }
  return NULL;
}

/* ---- granules ---- */

static size_t large_gran(large_cache *c) { return c->region->gran; }

/* Bytes of [a, a+n) in granules not mapped yet (the cost of using it). */
static size_t large_unmapped_in(large_cache *c, const lseg *sg, uintptr_t a, size_t n) {
  if (!sg->vmm) return 0;
  size_t g = large_gran(c);
  size_t cost = 0;
  for (size_t i = (a - sg->base) / g, last = (a + n - 1 - sg->base) / g; i <= last; i++)
    if (sg->gran[i] != GRAN_MAPPED) cost += g;
  return cost;
}

/* ---- merging ---- */

/* Is every granule under [a, a+n) of sg mapped? Stops at the first that
 * is not (a segment's never-used tail spans most of its reserved range). */
static int large_wholly_mapped(const lseg *sg, size_t g, uintptr_t a, size_t n) {
  if (!sg->vmm) return 1;
  for (size_t i = (a - sg->base) / g, last = (a + n - 1 - sg->base) / g; i <= last; i++)
    if (sg->gran[i] != GRAN_MAPPED) return 0;
  return 1;
}

/* Can free neighbours a (lower) and b be one block? Clears completed
 * tickets on the way; on yes, a's ticket is the merged block's.
 *
 * A ready block joins a neighbour waiting on a stream when it is wholly
 * mapped: the merged block waits on that stream (the later ticket covers
 * both), so its own stream may use the whole of it at once and others
 * after the stream's seal completes, which usually takes microseconds.
 * Kept apart, blocks freed on one stream next to holes were too short
 * for its next large request, and the segments grew instead
 * (bench/DECISIONS.md, "A ready hole joins a free neighbour waiting on a
 * stream"). Unmapped ready ranges (a segment's never-used tail) stay
 * apart, ready for every stream. */
static int large_mergeable(lblock *a, lblock *b, size_t g, lticket **deferred) {
  if (a->ticket && lticket_done(a->ticket)) {
    lticket_unref(a->ticket, deferred);
    a->ticket = NULL;
  }
  if (b->ticket && lticket_done(b->ticket)) {
    lticket_unref(b->ticket, deferred);
    b->ticket = NULL;
  }
  if (a->ticket == NULL && b->ticket == NULL) return 1;
  if (a->ticket == NULL || b->ticket == NULL) {
    lblock *r = a->ticket == NULL ? a : b;
    if (!large_wholly_mapped(r->seg, g, r->base, r->size)) return 0;
    if (r == a) {
      a->ticket = b->ticket;
      b->ticket = NULL;
    }
    return 1;
  }
  if (a->ticket->t.rec != b->ticket->t.rec) return 0;
  /* Same stream: the later ticket covers both (events complete in order). */
  if (b->ticket->t.seq > a->ticket->t.seq) {
    lticket *t = a->ticket;
    a->ticket = b->ticket;
    b->ticket = t;
  }
  lticket_unref(b->ticket, deferred);
  b->ticket = NULL;
  return 1;
}

/* INVARIANT (large.h): the blocks of sg tile it in address order, without
 * gap or overlap, and the links agree both ways. Debug builds only. */
static __attribute__((unused)) int large_seg_tiles(const lseg *sg) {
  uintptr_t at = sg->base;
  const lblock *prev = NULL;
  for (const lblock *b = sg->first; b; prev = b, b = b->next) {
    if (b->seg != sg || b->prev != prev || b->base != at || b->size == 0) return 0;
    at += b->size;
  }
  return at == sg->base + sg->size;
}

/* Fold free block b into its lower neighbour a (mergeable). b is freed,
 * or, with dead non-NULL, marked LBLOCK_DEAD and put on *dead (linked
 * through hnext, which free blocks do not use). */
static void large_absorb(large_cache *c, lblock *a, lblock *b, lblock **dead) {
  large_free_unlink(c, a);
  large_free_unlink(c, b);
  a->size += b->size;
  a->next = b->next;
  if (b->next) b->next->prev = a;
  large_free_link(c, a);
  if (dead != NULL) {
    b->state = LBLOCK_DEAD;
    b->hnext = *dead; /* not wnext: b may still be on the work list */
    *dead = b;
  } else {
    large_block_drop(c, b);
  }
}

static lblock *large_coalesce_dead(large_cache *c, lblock *b, lticket **deferred, lblock **dead) {
  lblock *p = b->prev;
  if (p && p->state == LBLOCK_FREE && large_mergeable(p, b, large_gran(c), deferred)) {
    large_absorb(c, p, b, dead);
    b = p;
  }
  lblock *n = b->next;
  if (n && n->state == LBLOCK_FREE && large_mergeable(b, n, large_gran(c), deferred)) large_absorb(c, b, n, dead);
  MAGPIE_ASSERT(large_seg_tiles(b->seg));
  return b;
}

/* Merge free block b with free neighbours it may join; returns the block
 * that now contains b. */
static lblock *large_coalesce(large_cache *c, lblock *b, lticket **deferred) {
  return large_coalesce_dead(c, b, deferred, NULL);
}

/* Clear completed tickets of free blocks and merge what may be merged.
 * Returns the bytes that became ready. One walk of the free blocks lists
 * those whose ticket completed; each is then merged with the neighbours
 * it may join, blocks absorbed meanwhile marked dead (a later entry of the
 * list may be one) and freed at the end. Restarting the walk after each
 * merge, as before, was quadratic in the free blocks (bench/DECISIONS.md,
 * "Completed tickets settle in one walk"). Listed too: ready blocks whose
 * next block is free and ready (the merge tests of other blocks clear
 * completed tickets on the way and may leave such pairs apart); a trim
 * could not unmap a granule they share. */
static size_t large_settle_locked(large_cache *c, lticket **deferred) {
  size_t ready = 0;
  lblock *work = NULL, *dead = NULL;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
    if (b->ticket != NULL) {
      if (!lticket_done(b->ticket)) continue;
      lticket_unref(b->ticket, deferred);
      b->ticket = NULL;
      ready += b->size;
    } else {
      /* A ready block next to a ready one: left apart where a merge test
       * cleared one's completed ticket while the other still waited. */
      lblock *n = b->next;
      if (n == NULL || n->state != LBLOCK_FREE || n->ticket != NULL) continue;
    }
    b->wnext = work;
    work = b;
  }
  while (work != NULL) {
    lblock *b = work;
    work = b->wnext;
    if (b->state == LBLOCK_FREE) large_coalesce_dead(c, b, deferred, &dead);
  }
  while (dead != NULL) {
    lblock *b = dead;
    dead = b->hnext;
    large_block_drop(c, b);
  }
  return ready;
}

/* ---- segments ---- */

static void large_seg_destroy(lseg *sg) {
  meta_free(sg->gran);
  meta_free((void *)sg->ucls);
  meta_free(sg);
}

/* A new segment of at least need bytes with one free block spanning it.
 * Called without the lock (it maps memory without VMM). */
static int large_seg_new(large_cache *c, size_t need, lseg **out) {
  size_t g = large_gran(c);
  size_t size = region_round(c->region, need);
  lseg *sg = meta_alloc(sizeof *sg);
  lblock *b = meta_alloc(sizeof *b);
  slab *d = slab_desc_get();
  if (sg == NULL || b == NULL || d == NULL) goto fail_host;
  if (c->region->vmm) {
    /* Virtual space is cheap: claim room to grow into (the device's size,
     * at most an eighth of the reserved range, which slabs share), so later
     * blocks find free space next to earlier ones. */
    size_t roomy = region_round(c->region, c->total_mem < c->region->size / 8 ? c->total_mem : c->region->size / 8);
    uintptr_t a = size < roomy ? region_claim_va(c->region, roomy) : 0;
    if (a != 0) size = roomy;
    else a = region_claim_va(c->region, size);
    if (a == 0) {
      backend_set_error_detail("the reserved virtual range of %zu bytes is exhausted", c->region->size);
      goto fail_oom;
    }
    sg->base = a;
    sg->size = size;
    sg->vmm = 1;
    sg->ngran = size / g;
    sg->gran = meta_alloc(sg->ngran); /* zeroed: GRAN_UNMAPPED */
    /* One byte per quantum: host pages are touched only where class
     * blocks are carved (a large zeroed allocation is fresh mappings). */
    sg->ucls = meta_alloc(size / LARGE_QUANTUM);
    if (sg->gran == NULL || sg->ucls == NULL) goto fail_host; /* the VA claim is lost; harmless */
  } else {
    if ((sg->ucls = meta_alloc(size / LARGE_QUANTUM)) == NULL) goto fail_host;
    int rc = region_map(c->region, size, &sg->base, &sg->raw, &sg->raw_size);
    if (rc != MAGPIE_OK) {
      slab_desc_put(d);
      meta_free(b);
      large_seg_destroy(sg);
      return rc;
    }
    sg->size = size;
    sg->ngran = size / g;
  }
  d->base = sg->base;
  d->size = sg->size;
  d->cls = SLAB_LARGE;
  d->heap = c->owner;
  d->seg = sg;
  sg->desc = d;
  /* The page map learns a VMM segment's granules as they are mapped
   * (large_map_under): its reach is the device's size, and at 32 KiB
   * pages the whole of an 80 GiB device took 20 MiB of host memory. */
  if (!sg->vmm && pagemap_set(sg->base, sg->size, d) != MAGPIE_OK) {
    region_unmap(c->region, sg->base, sg->size, sg->raw, sg->raw_size);
    goto fail_host;
  }
  b->base = sg->base;
  b->size = sg->size;
  b->seg = sg;
  sg->first = b;
  *out = sg;
  return MAGPIE_OK;
fail_host:
  backend_set_error_detail("out of host memory for large-block metadata");
fail_oom:
  if (d) slab_desc_put(d);
  meta_free(b);
  if (sg) large_seg_destroy(sg);
  return MAGPIE_ERR_OUT_OF_MEMORY;
}

static void large_seg_link(large_cache *c, lseg *sg) {
  sg->next = c->segs;
  c->segs = sg;
  large_free_link(c, sg->first);
  if (!sg->vmm) atomic_add_relaxed(&c->mapped_bytes, sg->raw_size);
  atomic_add_relaxed(&c->segments, 1);
}

/* ---- carving ---- */

static size_t large_release_locked(large_cache *c, size_t want);

typedef struct large_pick {
  lblock *b;
  int at_end;
  size_t cost;
} large_pick;

static void large_consider(large_cache *c, lblock *b, size_t need, large_pick *best) {
  size_t c0 = large_unmapped_in(c, b->seg, b->base, need);
  size_t c1 = b->size > need ? large_unmapped_in(c, b->seg, b->base + b->size - need, need) : c0;
  size_t cost = c1 < c0 ? c1 : c0;
  if (best->b == NULL || cost < best->cost || (cost == best->cost && b->size < best->b->size)) {
    best->b = b;
    best->at_end = c1 < c0;
    best->cost = cost;
  }
}

/* Block r goes right after block a in its segment's address order. */
static void large_link_after(lblock *a, lblock *r) {
  r->prev = a;
  r->next = a->next;
  if (r->next) r->next->prev = r;
  a->next = r;
}

/* Cut a USED block of need bytes from free block b (at its start or end).
 * The new block keeps a reference to b's ticket until it is handed out. */
static lblock *large_carve(large_cache *c, lblock *b, size_t need, int at_end) {
  if (b->size == need) {
    large_free_unlink(c, b);
    b->state = LBLOCK_USED;
    return b;
  }
  lblock *u = large_block_new(c);
  if (u == NULL) return NULL;
  u->seg = b->seg;
  u->size = need;
  u->state = LBLOCK_USED;
  u->ticket = b->ticket;
  lticket_ref(u->ticket);
  large_free_unlink(c, b);
  b->size -= need;
  if (at_end) {
    u->base = b->base + b->size;
    large_link_after(b, u);
  } else {
    u->base = b->base;
    b->base += need;
    u->next = b;
    u->prev = b->prev;
    if (b->prev) b->prev->next = u;
    else b->seg->first = u;
    b->prev = u;
  }
  large_free_link(c, b);
  MAGPIE_ASSERT(large_seg_tiles(u->seg));
  return u;
}

/* Return a carved block that could not be handed out (keeps its ticket). */
static void large_uncarve(large_cache *c, lblock *u, lticket **deferred) {
  large_free_link(c, u);
  large_coalesce(c, u, deferred);
}

static int large_hand_out(large_cache *c, lblock *u, lticket **deferred);

/* ---- runs: adjacent free blocks of different streams ----
 *
 * Free neighbours waiting on different streams do not merge (one ticket
 * holds one event), so a request larger than each of them grew the
 * segment beside them while they lay free together (bench/DECISIONS.md,
 * "Runs of free blocks waiting on different streams"). Where a
 * stream may be made to wait (as for one block: pressure, or the layer
 * holding more than its reserve beyond its use), a run of such blocks
 * serves instead: the allocating stream waits on each foreign ticket's
 * event, then takes the run's first need bytes; what is left of its last
 * block stays free with that block's ticket. */
#define LARGE_RUN_BLOCKS 16 /* blocks a run may span */
#define LARGE_RUN_WAITS 4   /* distinct tickets a run may need waits on */
#define LARGE_NO_RUN (-1)   /* large_run_take: no run serves */

typedef struct large_run {
  lblock *b[LARGE_RUN_BLOCKS];
  unsigned n;
  lticket *wait[LARGE_RUN_WAITS];
  unsigned nwait;
  size_t bytes;
} large_run;

/* The shortest run starting at block s that holds need bytes, of at least
 * two free, wholly mapped blocks. 1 if found (*r set). */
static int large_run_from(large_cache *c, lblock *s, size_t need, uint64_t stream_id, large_run *r) {
  r->n = r->nwait = 0;
  r->bytes = 0;
  for (lblock *b = s; b != NULL && r->n < LARGE_RUN_BLOCKS; b = b->next) {
    if (b->state != LBLOCK_FREE || !large_wholly_mapped(b->seg, large_gran(c), b->base, b->size)) return 0;
    if (!lblock_ready_for(b, stream_id)) {
      unsigned k = 0;
      while (k < r->nwait && r->wait[k] != b->ticket) k++;
      if (k == r->nwait) {
        if (r->nwait == LARGE_RUN_WAITS) return 0;
        r->wait[r->nwait++] = b->ticket;
      }
    }
    r->b[r->n++] = b;
    r->bytes += b->size;
    if (r->bytes >= need) return r->n >= 2;
  }
  return 0;
}

/* Put run r's blocks back as they were, free, in place of u (which spans
 * them exactly; u is freed). */
static void large_run_restore(large_cache *c, const large_run *r, lblock *u) {
  lblock *prev = u->prev, *next = u->next;
  for (unsigned i = 0; i < r->n; i++) {
    lblock *b = r->b[i];
    b->prev = i == 0 ? prev : r->b[i - 1];
    b->next = i + 1 == r->n ? next : r->b[i + 1];
    large_free_link(c, b);
  }
  if (prev) prev->next = r->b[0];
  else u->seg->first = r->b[0];
  if (next) next->prev = r->b[r->n - 1];
  large_block_drop(c, u);
  MAGPIE_ASSERT(large_seg_tiles(r->b[0]->seg));
}

/* Serve need bytes for stream_id from the best run (fewest waits, then
 * least left over), handed out in *out (lock held on entry and exit;
 * dropped around the waits, while the run is out of the free lists as
 * one USED block). LARGE_NO_RUN where none serves (or no descriptor);
 * an error code where a wait or the hand-out failed (the run is back as
 * it was). */
static int large_run_take(large_cache *c, size_t need, uint64_t stream_id, cudaStream_t stream, lblock **out,
                          lticket **deferred) {
  large_run best, r;
  int found = 0;
  for (lseg *sg = c->segs; sg; sg = sg->next)
    for (lblock *s = sg->first; s; s = s->next)
      if (s->state == LBLOCK_FREE && large_run_from(c, s, need, stream_id, &r) &&
          (!found || r.nwait < best.nwait || (r.nwait == best.nwait && r.bytes < best.bytes))) {
        best = r;
        found = 1;
      }
  if (!found) return LARGE_NO_RUN;
  lblock *u = large_block_new(c);
  if (u == NULL) return LARGE_NO_RUN;
  lblock *first = best.b[0], *last = best.b[best.n - 1];
  for (unsigned i = 0; i < best.n; i++) large_free_unlink(c, best.b[i]);
  u->seg = first->seg;
  u->base = first->base;
  u->size = best.bytes;
  u->state = LBLOCK_USED;
  u->prev = first->prev;
  u->next = last->next;
  if (u->prev) u->prev->next = u;
  else u->seg->first = u;
  if (u->next) u->next->prev = u;
  for (unsigned k = 0; k < best.nwait; k++) lticket_ref(best.wait[k]);
  pthread_mutex_unlock(&c->lock);
  int rc = MAGPIE_OK;
  for (unsigned k = 0; k < best.nwait && rc == MAGPIE_OK; k++)
    rc = c->ops->stream_wait_event(stream, best.wait[k]->t.ev->ev);
  pthread_mutex_lock(&c->lock);
  for (unsigned k = 0; k < best.nwait; k++) lticket_unref(best.wait[k], deferred);
  /* Handed out at its final size before the rest is cut off, so that a
   * failed hand-out leaves only the run to put back. */
  if (rc == MAGPIE_OK) {
    u->size = need;
    rc = large_hand_out(c, u, deferred);
    if (rc != MAGPIE_OK) u->size = best.bytes;
  }
  if (rc != MAGPIE_OK) {
    large_run_restore(c, &best, u);
    return rc;
  }
  /* What the request leaves of the last block stays free, with its ticket. */
  lblock *rest = best.bytes > need ? last : NULL;
  if (rest != NULL) {
    rest->size = best.bytes - need;
    rest->base = u->base + need;
    large_link_after(u, rest);
    large_free_link(c, rest);
  }
  for (unsigned i = 0; i < best.n; i++) {
    if (best.b[i] == rest) continue;
    lticket_unref(best.b[i]->ticket, deferred);
    large_block_drop(c, best.b[i]);
  }
  atomic_add_relaxed(&c->stream_waits, best.nwait);
  MAGPIE_ASSERT(large_seg_tiles(u->seg));
  *out = u;
  return MAGPIE_OK;
}

/* Map the unmapped granules under u (lock held on entry and exit; dropped
 * around each driver call). */
static int large_map_under(large_cache *c, lblock *u) {
  lseg *sg = u->seg;
  if (!sg->vmm) return MAGPIE_OK;
  size_t g = large_gran(c);
  size_t g0 = (u->base - sg->base) / g, g1 = (u->base + u->size - 1 - sg->base) / g + 1;
  /* Claim: wait until no granule here is in another thread's hands. A
   * granule shared with a neighbour may be mapped by the neighbour's
   * carver; one inside u may be being unmapped by a trim. */
  for (;;) {
    int busy = 0;
    for (size_t i = g0; i < g1 && !busy; i++) busy = sg->gran[i] >= GRAN_MAPPING;
    if (!busy) break;
    pthread_cond_wait(&c->granule_cv, &c->lock);
  }
  int maps = 0;
  for (size_t i = g0; i < g1; i++)
    if (sg->gran[i] == GRAN_UNMAPPED) {
      sg->gran[i] = GRAN_MAPPING;
      maps = 1;
    }
  c->mapping += maps;
  int rc = MAGPIE_OK;
  for (size_t i = g0; i < g1;) {
    if (sg->gran[i] != GRAN_MAPPING) {
      i++;
      continue;
    }
    size_t j = i;
    while (j < g1 && sg->gran[j] == GRAN_MAPPING) j++;
    if (rc == MAGPIE_OK) {
      pthread_mutex_unlock(&c->lock);
      /* Pages first (they stay set when the granules are unmapped): a
       * block is found by its frees once it is handed out. */
      rc = pagemap_set(sg->base + i * g, (j - i) * g, sg->desc);
      if (rc != MAGPIE_OK) backend_set_error_detail("out of host memory for the page map");
      else rc = region_map_at(c->region, sg->base + i * g, (j - i) * g);
      pthread_mutex_lock(&c->lock);
    }
    uint8_t st = rc == MAGPIE_OK ? GRAN_MAPPED : GRAN_UNMAPPED;
    for (size_t k = i; k < j; k++) sg->gran[k] = st;
    if (rc == MAGPIE_OK) atomic_add_relaxed(&c->mapped_bytes, (j - i) * g);
    i = j;
  }
  c->mapping -= maps;
  pthread_cond_broadcast(&c->granule_cv);
  return rc;
}

/* Hand out carved block u (lock held). */
static int large_hand_out(large_cache *c, lblock *u, lticket **deferred) {
  /* INVARIANT (large.h): every granule under a handed-out block is mapped. */
  MAGPIE_ASSERT(u->state == LBLOCK_USED && lseg_mapped_in(u->seg, c->region->gran, u->base, u->size) == u->size);
  MAGPIE_ASSERT((atomic_load_relaxed(&u->kept) & LARGE_KEPT_STATE) == 0);
  if (!large_hash_insert(c, u)) {
    backend_set_error_detail("out of host memory for the large-block table");
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  /* A new generation: a lender's word for this descriptor is stale now. */
  atomic_store_release(&u->kept, (atomic_load_relaxed(&u->kept) & ~LARGE_KEPT_STATE) + (LARGE_KEPT_STATE + 1));
  lticket_unref(u->ticket, deferred);
  u->ticket = NULL;
  atomic_add_relaxed(&c->in_use_bytes, u->size);
  return MAGPIE_OK;
}

/* Streams whose free blocks are queried in one round (one query per
 * stream: its latest ticket vouches for all earlier ones). */
#define LARGE_QUERY_MAX 64

/* Query, outside the lock, the latest pending ticket of each stream with
 * free blocks waiting on it but skip_stream (EPOCH_NO_STREAM: none
 * skipped) (lock held on entry and exit); the caller merges what
 * completed (large_settle_locked). Returns how many tickets were queried. */
static int large_query_pending_locked(large_cache *c, uint64_t skip_stream, lticket **deferred) {
  lticket *q[LARGE_QUERY_MAX];
  int nq = 0;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
    lticket *lt = b->ticket;
    if (lt == NULL || lticket_done(lt) || lt->t.rec->id == skip_stream) continue;
    int i = 0;
    while (i < nq && q[i]->t.rec != lt->t.rec) i++;
    if (i < nq) {
      if (lt->t.seq > q[i]->t.seq) q[i] = lt;
    } else if (nq < LARGE_QUERY_MAX) {
      q[nq++] = lt;
    }
  }
  if (nq == 0) return 0;
  for (int i = 0; i < nq; i++) lticket_ref(q[i]);
  pthread_mutex_unlock(&c->lock);
  for (int i = 0; i < nq; i++) epoch_ready(&q[i]->t, EPOCH_NO_STREAM);
  pthread_mutex_lock(&c->lock);
  for (int i = 0; i < nq; i++) lticket_unref(q[i], deferred);
  return nq;
}

/* The granules [*i, *end) lying wholly inside free block b, if b is ready
 * and its segment can unmap granules; 0 otherwise. */
static int large_whole_granules(const lblock *b, size_t g, size_t *i, size_t *end) {
  const lseg *sg = b->seg;
  if (!sg->vmm || b->ticket != NULL || b->size < g) return 0;
  *i = (b->base - sg->base + g - 1) / g;
  *end = (b->base + b->size - sg->base) / g;
  return *i < *end;
}

/* The first mapped granule of those (*i; *end as above), if any. */
static int large_first_mapped_whole(const lblock *b, size_t g, size_t *i, size_t *end) {
  if (!large_whole_granules(b, g, i, end)) return 0;
  while (*i < *end && b->seg->gran[*i] != GRAN_MAPPED) (*i)++;
  return *i < *end;
}

/* Mapped bytes in whole granules of free ready blocks (unmappable now). */
static size_t large_free_whole_locked(large_cache *c) {
  size_t g = large_gran(c), sum = 0, i, end;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b))
    if (large_whole_granules(b, g, &i, &end))
      for (; i < end; i++) sum += b->seg->gran[i] == GRAN_MAPPED ? g : 0;
  return sum;
}

/* Growing while free memory sits mapped in holes too small for the
 * request: give back as much of it as is about to be mapped, beyond a
 * small reserve kept for reuse (1/128 of the large bytes in use, at least
 * 8 MiB). Peak reserved memory then follows peak live memory instead of
 * the history of sizes, at the price of one unmap per granule remapped.
 * A larger reserve kept whole granules mapped that the segments then
 * grew beside, holding more memory (bench/DECISIONS.md, "The reserve kept
 * before the segments grow"). */
static size_t large_keep(large_cache *c) {
  size_t keep = atomic_load_relaxed(&c->in_use_bytes) / 128;
  return keep < 8 * ((size_t)1 << 20) ? 8 * ((size_t)1 << 20) : keep;
}

static void large_shrink_before_grow(large_cache *c, size_t growing) {
  size_t keep = large_keep(c);
  /* Mapped bytes outside blocks in use bound what lies in whole free
   * granules: where that is within the reserve, skip the walk of every
   * free block's granules (a segment's unmapped tail alone may be tens of
   * thousands of granules). */
  size_t mapped = atomic_load_relaxed(&c->mapped_bytes), used = atomic_load_relaxed(&c->in_use_bytes);
  if (mapped <= used || mapped - used <= keep) return;
  size_t avail = large_free_whole_locked(c);
  if (avail > keep) large_release_locked(c, avail - keep < growing ? avail - keep : growing);
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
static int large_alloc_locked(large_cache *c, size_t need, uint64_t stream_id, cudaStream_t stream, int flags,
                              lblock **out, lticket **deferred) {
  int rc = MAGPIE_ERR_OUT_OF_MEMORY;
  int queried = 0, map_waits = 0;
  for (int round = 0; round < 64; round++) {
    large_pick best = {0}, wait = {0};
    /* The request's bin, then the bins above it, whose blocks all fit;
     * blocks of one bin are of nearly one size, so the first bin holding
     * a ready, wholly mapped block that fits holds the best fit of those,
     * and the search stops there. Otherwise every fitting block is looked
     * at, as mapping is about to cost far more. */
    for (unsigned k = large_bin_next(c, large_bin_of(need)); k < LARGE_BINS; k = large_bin_next(c, k + 1)) {
      for (lblock *b = c->bins[k]; b; b = b->fnext) {
        if (b->size < need) continue;
        if (lblock_ready_for(b, stream_id)) {
          large_consider(c, b, need, &best);
        } else {
          large_consider(c, b, need, &wait);
        }
      }
      if (best.b != NULL && best.cost == 0) break;
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
      lblock *u = large_carve(c, wait.b, need, wait.at_end);
      if (u == NULL) break;
      lticket *lt = u->ticket;
      lticket_ref(lt);
      pthread_mutex_unlock(&c->lock);
      rc = c->ops->stream_wait_event(stream, lt->t.ev->ev);
      pthread_mutex_lock(&c->lock);
      lticket_unref(lt, deferred);
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
    best = (large_pick){.b = sg->first, .at_end = 0, .cost = large_unmapped_in(c, sg, sg->base, need)};
    goto carve_best;

  carve_best : {
    if (best.cost > 0 && c->mapping > 0 && map_waits < LARGE_MAP_WAITS) {
      /* Another thread is mapping: wait for it, then look again. */
      map_waits++;
      while (c->mapping > 0) pthread_cond_wait(&c->granule_cv, &c->lock);
      queried = 0;
      continue;
    }
    lblock *u = large_carve(c, best.b, need, best.at_end);
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

int large_alloc(large_cache *c, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                size_t *bsize) {
  if (size > SIZE_MAX - LARGE_QUANTUM) return MAGPIE_ERR_SIZE_OVERFLOW;
  size_t need = large_round(size);
  lticket *deferred = NULL;
  lblock *u = NULL;
  pthread_mutex_lock(&c->lock);
  int rc = large_alloc_locked(c, need, stream_id, stream, flags, &u, &deferred);
  if (rc == MAGPIE_OK) {
    *out = u->base;
    *bsize = u->size;
  }
  large_unlock(c, deferred);
  return rc;
}

/* ---- class blocks ---- */

int large_class_carve(large_cache *c, unsigned cls, size_t bsize, uint32_t n, uint64_t stream_id, cudaStream_t stream,
                      int flags, void **slots, uint32_t *got) {
  MAGPIE_ASSERT(bsize % LARGE_QUANTUM == 0 && cls + 1 < LARGE_CLASS_LIMIT);
  lticket *deferred = NULL;
  int rc = MAGPIE_OK;
  *got = 0;
  pthread_mutex_lock(&c->lock);
  while (*got < n) {
    lblock *u = NULL;
    /* Only the first block may map memory or wait: the rest fill the
     * magazine from what is mapped and ready already. */
    rc = large_alloc_locked(c, bsize, stream_id, stream, *got == 0 ? flags : LARGE_NO_MAP, &u, &deferred);
    if (rc != MAGPIE_OK) break;
    u->klass = cls + 1;
    atomic_store_relaxed(&u->seg->ucls[(u->base - u->seg->base) / LARGE_QUANTUM], (uint8_t)(cls + 1));
    atomic_add_relaxed(&c->class_bytes, u->size);
    slots[(*got)++] = (void *)u->base;
  }
  large_unlock(c, deferred);
  return *got > 0 ? MAGPIE_OK : rc;
}

int large_class_put(large_cache *c, void *const *blocks, uint32_t n, const epoch_ticket *t, int flags) {
  if (n == 0) return MAGPIE_OK;
  if (flags & LARGE_TRY) {
    if (pthread_mutex_trylock(&c->lock) != 0) return LARGE_BUSY;
  } else {
    pthread_mutex_lock(&c->lock);
  }
  lticket *lt = NULL;
  /* One reference: this call's, until every block holds its own. A
   * descriptor from the host allocator takes no magpie lock (the private
   * arena's own only). */
  if (t->rec != NULL && (lt = large_ticket_new(c, t)) == NULL) {
    pthread_mutex_unlock(&c->lock);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  lticket *deferred = NULL;
  for (uint32_t i = 0; i < n; i++) {
    lblock *b = large_hash_find(c, (uintptr_t)blocks[i], 1);
    /* INVARIANT: a magazine's class block is a handed-out class block. */
    MAGPIE_ASSERT(b != NULL && b->state == LBLOCK_USED && b->klass != 0);
    if (b == NULL) continue;
    atomic_store_relaxed(&b->seg->ucls[(b->base - b->seg->base) / LARGE_QUANTUM], 0);
    atomic_sub_relaxed(&c->class_bytes, b->size);
    atomic_sub_relaxed(&c->in_use_bytes, b->size);
    b->klass = 0;
    b->ticket = lt;
    lticket_ref(lt);
    large_free_link(c, b);
    large_coalesce(c, b, &deferred);
  }
  lticket_unref(lt, &deferred);
  large_unlock(c, deferred);
  return MAGPIE_OK;
}

/* ---- granules lent to the span set ----
 *
 * The span set maps a granule of its own when every span is full, beside
 * the segments' free memory: a thread mapped its second span while a
 * large free block, ready, lay in its segment (bench/DECISIONS.md, "The
 * span set borrows granules of free large blocks"). A whole mapped
 * granule of a free ready block serves the span set instead: the smallest
 * such block gives it, and it comes back free and ready once the span is
 * empty. */

/* The mapped granule [at, at + g) of free ready block b becomes a USED
 * block not in the hash (lock held); NULL if host memory ran out. */
static lblock *large_cut_granule(large_cache *c, lblock *b, uintptr_t at, size_t g) {
  MAGPIE_ASSERT(b->ticket == NULL && at >= b->base && at + g <= b->base + b->size);
  size_t rest = b->base + b->size - (at + g);
  lblock *r = NULL;
  if (rest > 0 && at > b->base && (r = large_block_new(c)) == NULL) return NULL;
  /* From its end: [at, end) of b, then its tail split off. */
  lblock *u = at == b->base ? large_carve(c, b, g, 0) : large_carve(c, b, b->base + b->size - at, 1);
  if (u == NULL) {
    if (r != NULL) large_block_drop(c, r);
    return NULL;
  }
  if (at > b->base && rest > 0) {
    *r = (lblock){.base = at + g, .size = rest, .seg = u->seg};
    large_link_after(u, r);
    u->size = g;
    large_free_link(c, r);
  }
  MAGPIE_ASSERT(u->size == g && u->base == at && large_seg_tiles(u->seg));
  return u;
}

int large_lend_granule(large_cache *c, uintptr_t *base) {
  size_t g = large_gran(c);
  lticket *deferred = NULL;
  int rc = LARGE_WOULD_MAP;
  pthread_mutex_lock(&c->lock);
  for (int round = 0; round < 2 && rc == LARGE_WOULD_MAP; round++) {
    if (round == 1) {
      /* Blocks whose seals completed count too: ask, then merge. */
      large_query_pending_locked(c, EPOCH_NO_STREAM, &deferred);
      large_settle_locked(c, &deferred);
    }
    lblock *pick = NULL;
    uintptr_t at = 0;
    for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
      size_t i, end;
      if ((pick != NULL && b->size >= pick->size) || !large_first_mapped_whole(b, g, &i, &end)) continue;
      pick = b;
      at = b->seg->base + i * g;
    }
    if (pick == NULL) continue;
    lblock *u = large_cut_granule(c, pick, at, g);
    if (u == NULL) {
      rc = MAGPIE_ERR_OUT_OF_MEMORY;
      break;
    }
    u->klass = LARGE_KLASS_LENT;
    /* Its pages name no block until the span's slabs claim theirs (the
     * leaves exist: the granule is mapped). */
    pagemap_set(at, g, NULL);
    atomic_add_relaxed(&c->in_use_bytes, g);
    atomic_add_relaxed(&c->lent_bytes, g);
    *base = at;
    rc = MAGPIE_OK;
  }
  large_unlock(c, deferred);
  return rc;
}

void large_return_granule(large_cache *c, uintptr_t base) {
  size_t g = large_gran(c);
  lticket *deferred = NULL;
  pthread_mutex_lock(&c->lock);
  lblock *b = NULL;
  for (lseg *sg = c->segs; sg && b == NULL; sg = sg->next) {
    if (base < sg->base || base >= sg->base + sg->size) continue;
    for (b = sg->first; b && b->base != base; b = b->next) {
    }
  }
  /* INVARIANT: a lent granule is a USED block of its own. */
  MAGPIE_ASSERT(b != NULL && b->state == LBLOCK_USED && b->klass == LARGE_KLASS_LENT && b->size == g);
  if (b != NULL) {
    pagemap_set(base, g, b->seg->desc); /* the span's slabs cleared theirs */
    b->klass = 0;
    b->ticket = NULL; /* every slab block came back ready for every stream */
    atomic_sub_relaxed(&c->in_use_bytes, g);
    atomic_sub_relaxed(&c->lent_bytes, g);
    large_free_link(c, b);
    large_coalesce(c, b, &deferred);
  }
  large_unlock(c, deferred);
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

int large_graph_mark(large_cache *c, uintptr_t p, int on) {
  pthread_mutex_lock(&c->lock);
  lblock *b = large_hash_find(c, p, 0);
  int ok = b != NULL && b->klass == 0;
  if (ok) {
    lseg *sg = b->seg;
    atomic_store_relaxed(&sg->ucls[(p - sg->base) / LARGE_QUANTUM], on ? LARGE_GRAPH_MARK : 0);
  }
  pthread_mutex_unlock(&c->lock);
  return ok;
}

int large_keep_block(large_cache *c, uintptr_t p, size_t max, lblock **out) {
  pthread_mutex_lock(&c->lock);
  lblock *b = large_hash_find(c, p, 0);
  uint64_t v = b != NULL ? atomic_load_acquire(&b->kept) : 0;
  unsigned k = (unsigned)(v & LARGE_KEPT_STATE);
  /* Handed out, or lent by its keeper (who may take it back meanwhile:
   * the compare-and-swap decides). */
  int ok = b != NULL && b->klass == 0 && b->size <= max && (k == 0 || k == LARGE_KEPT_OUT) &&
           atomic_cas_strong_acq_rel(&b->kept, &v, large_kept_word(v, LARGE_KEPT));
  if (ok) *out = b;
  pthread_mutex_unlock(&c->lock);
  return ok;
}

size_t large_reclaim(large_cache *c) {
  lticket *deferred = NULL;
  pthread_mutex_lock(&c->lock);
  large_query_pending_locked(c, EPOCH_NO_STREAM, &deferred);
  size_t ready = large_settle_locked(c, &deferred);
  large_unlock(c, deferred);
  return ready;
}

size_t large_wait(large_cache *c) {
  size_t waited = 0;
  for (;;) {
    lticket *deferred = NULL, *lt = NULL;
    pthread_mutex_lock(&c->lock);
    for (lblock *b = large_free_first(c); b && lt == NULL; b = large_free_next(c, b)) {
      if (b->ticket == NULL || lticket_done(b->ticket)) continue;
      lt = b->ticket;
      waited += b->size;
      lticket_ref(lt);
    }
    pthread_mutex_unlock(&c->lock);
    if (lt == NULL) break;
    int rc = epoch_wait(&lt->t);
    pthread_mutex_lock(&c->lock);
    lticket_unref(lt, &deferred);
    large_unlock(c, deferred);
    if (rc != MAGPIE_OK) break; /* the driver failed: leave the rest */
  }
  large_reclaim(c);
  return waited;
}

/* One run of mapped granules lying wholly in a free ready block, marked
 * UNMAPPING. */
static int large_find_unmappable(large_cache *c, lseg **seg, size_t *g0, size_t *g1, size_t max_gran) {
  size_t g = large_gran(c), i, end;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
    if (!large_first_mapped_whole(b, g, &i, &end)) continue;
    lseg *sg = b->seg;
    size_t j = i;
    while (j < end && sg->gran[j] == GRAN_MAPPED && j - i < max_gran) sg->gran[j++] = GRAN_UNMAPPING;
    *seg = sg;
    *g0 = i;
    *g1 = j;
    return 1;
  }
  return 0;
}

/* Without VMM: a segment that is one free ready block, unlinked. */
static lseg *large_find_idle_seg(large_cache *c) {
  for (lseg **pp = &c->segs; *pp; pp = &(*pp)->next) {
    lseg *sg = *pp;
    lblock *b = sg->first;
    if (sg->vmm || b->state != LBLOCK_FREE || b->next != NULL || b->ticket != NULL) continue;
    large_free_unlink(c, b);
    *pp = sg->next;
    return sg;
  }
  return NULL;
}

/* Unmap up to want bytes (lock held; dropped around driver calls). */
static size_t large_release_locked(large_cache *c, size_t want) {
  size_t g = large_gran(c);
  size_t released = 0;
  while (released < want) {
    lseg *sg = NULL;
    size_t g0 = 0, g1 = 0;
    size_t left = want - released;
    size_t max_gran = left / g + (left % g != 0);
    if (large_find_unmappable(c, &sg, &g0, &g1, max_gran)) {
      region_release_begin(c->region);
      pthread_mutex_unlock(&c->lock);
      int rc = region_unmap_at(c->region, sg->base + g0 * g, (g1 - g0) * g);
      region_release_end(c->region);
      pthread_mutex_lock(&c->lock);
      for (size_t k = g0; k < g1; k++) sg->gran[k] = rc == MAGPIE_OK ? GRAN_UNMAPPED : GRAN_MAPPED;
      pthread_cond_broadcast(&c->granule_cv);
      if (rc != MAGPIE_OK) break;
      size_t bytes = (g1 - g0) * g;
      released += bytes;
      atomic_sub_relaxed(&c->mapped_bytes, bytes);
      atomic_add_relaxed(&c->bytes_unmapped, bytes);
      continue;
    }
    sg = large_find_idle_seg(c);
    if (sg == NULL) break;
    region_release_begin(c->region);
    pthread_mutex_unlock(&c->lock);
    pagemap_set(sg->base, sg->size, NULL); /* leaves exist: cannot fail */
    region_unmap(c->region, sg->base, sg->size, sg->raw, sg->raw_size);
    region_release_end(c->region);
    pthread_mutex_lock(&c->lock);
    released += sg->raw_size;
    atomic_sub_relaxed(&c->mapped_bytes, sg->raw_size);
    atomic_add_relaxed(&c->bytes_unmapped, sg->raw_size);
    atomic_sub_relaxed(&c->segments, 1);
    slab_desc_put(sg->desc);
    large_block_drop(c, sg->first);
    large_seg_destroy(sg);
  }
  return released;
}

size_t large_release(large_cache *c, size_t want) {
  lticket *deferred = NULL;
  pthread_mutex_lock(&c->lock);
  large_settle_locked(c, &deferred);
  size_t released = large_release_locked(c, want);
  large_unlock(c, deferred);
  return released;
}
