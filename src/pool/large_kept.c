/* Large blocks: marks on handed-out blocks, kept by a thread for its
 * stream (large_keep_block; the lock-free steps are large.h's) or held by
 * a graph pool (large_graph_mark).
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "pool/large.h"
#include "pool/large_internal.h"

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
