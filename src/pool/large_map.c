/* Large blocks: mapping granules under a block and unmapping those lying
 * wholly in free blocks (a granule in another thread's hands is
 * GRAN_MAPPING or GRAN_UNMAPPING, waited for on granule_cv), the shrink
 * before the segments grow, and release.
 *
 * Lock order: large_cache.lock is a leaf. No driver call is made under it,
 * and tickets whose last reference drops under it are released after it is
 * unlocked (releasing takes the epoch table's lock). */
#include "base/pagemap.h"
#include "pool/large.h"
#include "pool/large_internal.h"
#include "pool/slab.h"

static size_t large_release_locked(large_cache *c, size_t want);

/* Map the unmapped granules under u (lock held on entry and exit; dropped
 * around each driver call). */
int large_map_under(large_cache *c, lblock *u) {
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

/* The granules [*i, *end) lying wholly inside free block b, if b is ready
 * and its segment can unmap granules; 0 otherwise. */
int large_whole_granules(const lblock *b, size_t g, size_t *i, size_t *end) {
  const lseg *sg = b->seg;
  if (!sg->vmm || b->ticket != NULL || b->size < g) return 0;
  *i = (b->base - sg->base + g - 1) / g;
  *end = (b->base + b->size - sg->base) / g;
  return *i < *end;
}

/* The first mapped granule of those (*i; *end as above), if any. */
int large_first_mapped_whole(const lblock *b, size_t g, size_t *i, size_t *end) {
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
size_t large_keep(large_cache *c) {
  size_t keep = atomic_load_relaxed(&c->in_use_bytes) / 128;
  return keep < 8 * ((size_t)1 << 20) ? 8 * ((size_t)1 << 20) : keep;
}

void large_shrink_before_grow(large_cache *c, size_t growing) {
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
