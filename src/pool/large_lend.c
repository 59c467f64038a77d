/* Large blocks: free memory lent to the span set (pieces of holes in used
 * granules, else whole granules) and its return.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "base/assert.h"
#include "base/pagemap.h"
#include "pool/epoch.h"
#include "pool/large.h"
#include "pool/large_internal.h"

/* ---- memory lent to the span set ----
 *
 * The span set maps a granule of its own when every span is full, beside
 * the segments' free memory: a thread mapped its second span while a
 * large free block, ready, lay in its segment (bench/DECISIONS.md, "The
 * span set borrows granules of free large blocks"). The segments' free
 * memory serves it instead, ready for every stream, and comes back free
 * and ready once the span is empty: first a piece of a hole (a free block
 * holding no whole granule, so in granules something else uses), so that
 * the small classes fill the holes beside large and class blocks rather
 * than holding a granule of their own (bench/DECISIONS.md, "Spans fill
 * the holes of used granules"); else a whole mapped granule of the
 * smallest free block that has one. */

/* Offer the place at p in hole b for a piece of n bytes: taken where its
 * granule is mapped and has fewer free bytes than the best so far's, or as
 * many in a smaller hole. */
static void large_offer_piece(const lblock *b, uintptr_t p, size_t n, size_t g, const lblock **pick, uintptr_t *at,
                              size_t *least) {
  uintptr_t sb = b->seg->base;
  if (p < b->base || p + n > b->base + b->size || b->seg->gran[(p - sb) / g] != GRAN_MAPPED) return;
  size_t f = large_granule_free(b, p, g);
  if (f > *least || (f == *least && b->size >= (*pick)->size)) return;
  *least = f;
  *pick = b;
  *at = p;
}

/* A piece of n bytes (a power of two below the granule), aligned to n, of
 * a ready hole of a VMM segment: the fullest granule's, at the first or
 * last aligned place of a hole. NULL if there is none. */
static lblock *large_find_piece(large_cache *c, size_t n, uintptr_t *at) {
  size_t g = large_gran(c), least = SIZE_MAX;
  MAGPIE_ASSERT(n < g && g % n == 0);
  const lblock *pick = NULL;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
    size_t i, end;
    /* Holes only: a free block holding a whole granule is where large
     * blocks grow, and a piece at its edge would cut it off from the
     * blocks beside it once they are freed (bench/DECISIONS.md, as
     * above). */
    if (b->ticket != NULL || b->size < n || !b->seg->vmm || large_whole_granules(b, g, &i, &end)) continue;
    uintptr_t sb = b->seg->base;
    large_offer_piece(b, sb + (b->base - sb + n - 1) / n * n, n, g, &pick, at, &least);
    large_offer_piece(b, sb + (b->base + b->size - n - sb) / n * n, n, g, &pick, at, &least);
  }
  return (lblock *)pick;
}

/* The first mapped whole granule of the smallest free ready block that has
 * one, or NULL. */
static lblock *large_find_granule(large_cache *c, uintptr_t *at) {
  size_t g = large_gran(c);
  lblock *pick = NULL;
  for (lblock *b = large_free_first(c); b; b = large_free_next(c, b)) {
    size_t i, end;
    if ((pick != NULL && b->size >= pick->size) || !large_first_mapped_whole(b, g, &i, &end)) continue;
    pick = b;
    *at = b->seg->base + i * g;
  }
  return pick;
}

int large_lend_span(large_cache *c, size_t want, uintptr_t *base, size_t *size) {
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
    uintptr_t at = 0;
    size_t n = want;
    lblock *pick = want < g && g % want == 0 ? large_find_piece(c, want, &at) : NULL;
    if (pick == NULL) {
      n = g;
      pick = large_find_granule(c, &at);
    }
    if (pick == NULL) continue;
    lblock *u = large_carve_at(c, pick, n, at - pick->base);
    if (u == NULL) {
      rc = MAGPIE_ERR_OUT_OF_MEMORY;
      break;
    }
    MAGPIE_ASSERT(u->size == n && u->base == at && large_seg_tiles(u->seg));
    u->klass = LARGE_KLASS_LENT;
    /* Its pages name no block until the span's slabs claim theirs (the
     * leaves exist: the granule is mapped). */
    pagemap_set(at, n, NULL);
    atomic_add_relaxed(&c->in_use_bytes, n);
    atomic_add_relaxed(&c->lent_bytes, n);
    *base = at;
    *size = n;
    rc = MAGPIE_OK;
  }
  large_unlock(c, deferred);
  return rc;
}

void large_return_span(large_cache *c, uintptr_t base) {
  lticket *deferred = NULL;
  pthread_mutex_lock(&c->lock);
  lblock *b = NULL;
  for (lseg *sg = c->segs; sg && b == NULL; sg = sg->next) {
    if (base < sg->base || base >= sg->base + sg->size) continue;
    for (b = sg->first; b && b->base != base; b = b->next) {
    }
  }
  /* INVARIANT: what was lent is a USED block of its own. */
  MAGPIE_ASSERT(b != NULL && b->state == LBLOCK_USED && b->klass == LARGE_KLASS_LENT && b->size <= large_gran(c));
  if (b != NULL) {
    pagemap_set(base, b->size, b->seg->desc); /* the span's slabs cleared theirs */
    b->klass = 0;
    b->ticket = NULL; /* every slab block came back ready for every stream */
    atomic_sub_relaxed(&c->in_use_bytes, b->size);
    atomic_sub_relaxed(&c->lent_bytes, b->size);
    large_free_link(c, b);
    large_coalesce(c, b, &deferred);
  }
  large_unlock(c, deferred);
}
