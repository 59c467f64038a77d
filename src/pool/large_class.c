/* Large blocks: class blocks, carved from the segments and given back to
 * them.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "base/assert.h"
#include "pool/large.h"
#include "pool/large_internal.h"

/* ---- class blocks ---- */

/* The unit large_or_slab_class reads for a class slab: no class block. */
const _Atomic uint8_t large_no_class = 0;

/* The lock, for the class blocks' paths: counted when found held. */
static void large_class_lock(large_cache *c) {
  if (pthread_mutex_trylock(&c->lock) == 0) return;
  atomic_add_relaxed(&c->class_contended, 1);
  pthread_mutex_lock(&c->lock);
}

int large_class_carve(large_cache *c, unsigned cls, size_t bsize, uint32_t n, uint64_t stream_id, cudaStream_t stream,
                      int flags, void **slots, uint32_t *got) {
  MAGPIE_ASSERT(bsize % LARGE_QUANTUM == 0 && cls + 1 < LARGE_CLASS_LIMIT);
  lticket *deferred = NULL;
  int rc = MAGPIE_OK;
  *got = 0;
  large_class_lock(c);
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
    if (pthread_mutex_trylock(&c->lock) != 0) {
      atomic_add_relaxed(&c->class_contended, 1);
      return LARGE_BUSY;
    }
  } else {
    large_class_lock(c);
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
    b->klass = 0;
    large_release_block(c, b, lt, &deferred);
  }
  large_ticket_unref(lt, &deferred);
  large_unlock(c, deferred);
  return MAGPIE_OK;
}
