/* Large blocks: whole granules of free blocks lent to the span set and
 * their return.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "base/assert.h"
#include "base/pagemap.h"
#include "pool/epoch.h"
#include "pool/large.h"
#include "pool/large_internal.h"

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
  lblock *u = large_carve_at(c, b, g, at - b->base);
  MAGPIE_ASSERT(u == NULL || (u->size == g && u->base == at && large_seg_tiles(u->seg)));
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
