/* Large blocks: runs of adjacent free blocks waiting on different streams,
 * taken together by a request no single free block serves.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "base/assert.h"
#include "pool/large.h"
#include "pool/large_internal.h"

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
    if (!large_block_ready_for(b, stream_id)) {
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
int large_run_take(large_cache *c, size_t need, uint64_t stream_id, cudaStream_t stream, lblock **out,
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
  for (unsigned k = 0; k < best.nwait; k++) large_ticket_ref(best.wait[k]);
  pthread_mutex_unlock(&c->lock);
  int rc = MAGPIE_OK;
  for (unsigned k = 0; k < best.nwait && rc == MAGPIE_OK; k++)
    rc = c->ops->stream_wait_event(stream, best.wait[k]->t.ev->ev);
  pthread_mutex_lock(&c->lock);
  for (unsigned k = 0; k < best.nwait; k++) large_ticket_unref(best.wait[k], deferred);
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
    large_ticket_unref(best.b[i]->ticket, deferred);
    large_block_drop(c, best.b[i]);
  }
  atomic_add_relaxed(&c->stream_waits, best.nwait);
  MAGPIE_ASSERT(large_seg_tiles(u->seg));
  *out = u;
  return MAGPIE_OK;
}
