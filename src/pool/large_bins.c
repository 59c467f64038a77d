/* Large blocks: free blocks in bins by size, split (carving a block out of
 * a free one) and merge (coalescing free neighbours). All under the lock,
 * held by the caller. */
#include "base/assert.h"
#include "pool/large.h"
#include "pool/large_internal.h"

/* ---- lists (all under the lock) ---- */

/* A free block goes into the bin of its size; its size must not change
 * while it is there (unlink, resize, link). */
void large_free_link(large_cache *c, lblock *b) {
  unsigned k = large_bin_of(b->size);
  b->state = LBLOCK_FREE;
  b->fprev = NULL;
  b->fnext = c->bins[k];
  if (b->fnext) b->fnext->fprev = b;
  c->bins[k] = b;
  c->binmap[k / 64] |= (uint64_t)1 << (k % 64);
}

void large_free_unlink(large_cache *c, lblock *b) {
  unsigned k = large_bin_of(b->size);
  if (b->fprev) b->fprev->fnext = b->fnext;
  else c->bins[k] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
  b->fprev = b->fnext = NULL;
  if (c->bins[k] == NULL) c->binmap[k / 64] &= ~((uint64_t)1 << (k % 64));
}

/* ---- carving ---- */

/* Block r goes right after block a in its segment's address order. */
void large_link_after(lblock *a, lblock *r) {
  r->prev = a;
  r->next = a->next;
  if (r->next) r->next->prev = r;
  a->next = r;
}

/* Cut a USED block of need bytes from free block b (at its start or end).
 * The new block keeps a reference to b's ticket until it is handed out. */
lblock *large_carve(large_cache *c, lblock *b, size_t need, int at_end) {
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
  large_ticket_ref(u->ticket);
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

/* Cut a USED block of need bytes from free block b at offset off: at its
 * start or end as large_carve does, or between them, b keeping the part
 * before and the part after becoming a free block of its own under b's
 * ticket. NULL, b unchanged, if host memory ran out. */
lblock *large_carve_at(large_cache *c, lblock *b, size_t need, size_t off) {
  MAGPIE_ASSERT(off <= b->size && need <= b->size - off);
  if (off == 0) return large_carve(c, b, need, 0);
  if (off + need == b->size) return large_carve(c, b, need, 1);
  lblock *r = large_block_new(c);
  if (r == NULL) return NULL;
  lblock *u = large_carve(c, b, b->size - off, 1); /* [off, end) of b, then its tail split off */
  if (u == NULL) {
    large_block_drop(c, r);
    return NULL;
  }
  r->seg = u->seg;
  r->base = u->base + need;
  r->size = u->size - need;
  r->ticket = u->ticket;
  large_ticket_ref(r->ticket);
  u->size = need;
  large_link_after(u, r);
  large_free_link(c, r);
  MAGPIE_ASSERT(large_seg_tiles(u->seg));
  return u;
}

/* Return a carved block that could not be handed out (keeps its ticket). */
void large_uncarve(large_cache *c, lblock *u, lticket **deferred) {
  large_free_link(c, u);
  large_coalesce(c, u, deferred);
}

/* ---- merging ---- */

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
    large_ticket_unref(a->ticket, deferred);
    a->ticket = NULL;
  }
  if (b->ticket && lticket_done(b->ticket)) {
    large_ticket_unref(b->ticket, deferred);
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
  large_ticket_unref(b->ticket, deferred);
  b->ticket = NULL;
  return 1;
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

lblock *large_coalesce_dead(large_cache *c, lblock *b, lticket **deferred, lblock **dead) {
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
lblock *large_coalesce(large_cache *c, lblock *b, lticket **deferred) {
  return large_coalesce_dead(c, b, deferred, NULL);
}

/* Handed-out block b (out of the hash) becomes free under a reference of
 * its own to lt (NULL: ready for every stream): its bytes leave in_use, it
 * joins the bins and merges with its neighbours. */
void large_release_block(large_cache *c, lblock *b, lticket *lt, lticket **deferred) {
  atomic_sub_relaxed(&c->in_use_bytes, b->size);
  b->ticket = lt;
  large_ticket_ref(lt);
  large_free_link(c, b);
  large_coalesce(c, b, deferred);
}
