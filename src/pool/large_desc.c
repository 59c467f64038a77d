/* Large blocks: the descriptors of tickets and blocks, kept as spares, and
 * the tickets' references, released once the lock is let go.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include <string.h>

#include "base/meta.h"
#include "pool/epoch.h"
#include "pool/large.h"
#include "pool/large_internal.h"

/* ---- tickets ---- */

void large_ticket_ref(lticket *lt) {
  if (lt) lt->refs++;
}

/* Drop a reference; the last one queues the ticket on *deferred, to be
 * released once the lock is let go. */
void large_ticket_unref(lticket *lt, lticket **deferred) {
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

lblock *large_block_new(large_cache *c) {
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
 * that a stale lblock pointer a thread holds (tslot.lent) still names a
 * descriptor: their number is at most the most blocks the segments held
 * at once. */
void large_block_drop(large_cache *c, lblock *b) {
  b->hnext = c->spare_blocks;
  c->spare_blocks = b;
}

/* A ticket for the free t (taken over once the caller links it), one
 * reference: the caller's. */
lticket *large_ticket_new(large_cache *c, const epoch_ticket *t) {
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
void large_ticket_drop(large_cache *c, lticket *lt) {
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
void large_unlock(large_cache *c, lticket *deferred) {
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
