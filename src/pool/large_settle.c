/* Large blocks: free blocks whose tickets complete, queried, waited for
 * and merged (settled) with their neighbours.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "pool/epoch.h"
#include "pool/large.h"
#include "pool/large_internal.h"

/* Streams whose free blocks are queried in one round (one query per
 * stream: its latest ticket vouches for all earlier ones). */
#define LARGE_QUERY_MAX 64

/* Query, outside the lock, the latest pending ticket of each stream with
 * free blocks waiting on it but skip_stream (EPOCH_NO_STREAM: none
 * skipped) (lock held on entry and exit); the caller merges what
 * completed (large_settle_locked). Returns how many tickets were queried. */
int large_query_pending_locked(large_cache *c, uint64_t skip_stream, lticket **deferred) {
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
  for (int i = 0; i < nq; i++) large_ticket_ref(q[i]);
  pthread_mutex_unlock(&c->lock);
  for (int i = 0; i < nq; i++) epoch_ready(&q[i]->t, EPOCH_NO_STREAM);
  pthread_mutex_lock(&c->lock);
  for (int i = 0; i < nq; i++) large_ticket_unref(q[i], deferred);
  return nq;
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
size_t large_settle_locked(large_cache *c, lticket **deferred) {
  size_t ready = 0;
  lblock *work = NULL, *dead = NULL;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
    if (b->ticket != NULL) {
      if (!lticket_done(b->ticket)) continue;
      large_ticket_unref(b->ticket, deferred);
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
      large_ticket_ref(lt);
    }
    pthread_mutex_unlock(&c->lock);
    if (lt == NULL) break;
    int rc = epoch_wait(&lt->t);
    pthread_mutex_lock(&c->lock);
    large_ticket_unref(lt, &deferred);
    large_unlock(c, deferred);
    if (rc != MAGPIE_OK) break; /* the driver failed: leave the rest */
  }
  large_reclaim(c);
  return waited;
}
