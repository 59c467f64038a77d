/* Slab carving, release and descriptors.
 * Lock order: slab_set.reclaim_lock -> slab_set.slab_lock; slab_st.desc_lock
 * is a leaf. No lock is held across a driver call. */
#include "pool/slab.h"

#include <pthread.h>
#include <string.h>

#include "base/assert.h"
#include "base/meta.h"
#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "pool/depot.h"
#include "pool/span.h"

/* This file's state: recycled descriptors, under desc_lock (a leaf). */
static struct slab_state {
  pthread_mutex_t desc_lock;
  slab *desc_free;
} slab_st = {
    .desc_lock = PTHREAD_MUTEX_INITIALIZER,
};

slab *slab_desc_get(void) {
  pthread_mutex_lock(&slab_st.desc_lock);
  slab *s = slab_st.desc_free;
  if (s) slab_st.desc_free = s->lnext;
  pthread_mutex_unlock(&slab_st.desc_lock);
  if (s == NULL) return meta_alloc_aligned(sizeof *s, 64);
  /* Keep the in-use bitmap for reuse (slab_desc_for). */
  _Atomic uint64_t *bits = s->inuse;
  uint32_t words = s->inuse_words;
  memset(s, 0, sizeof *s);
  s->inuse = bits;
  s->inuse_words = words;
  return s;
}

void slab_desc_put(slab *s) {
  pthread_mutex_lock(&slab_st.desc_lock);
  s->lnext = slab_st.desc_free;
  slab_st.desc_free = s;
  pthread_mutex_unlock(&slab_st.desc_lock);
}

int slab_mark_used(slab *s, uint32_t i) {
  uint64_t bit = (uint64_t)1 << (i & 63);
  return (atomic_fetch_or_explicit(&s->inuse[i >> 6], bit, memory_order_relaxed) & bit) == 0;
}

int slab_mark_free(slab *s, uint32_t i) {
  uint64_t bit = (uint64_t)1 << (i & 63);
  return (atomic_fetch_and_explicit(&s->inuse[i >> 6], ~bit, memory_order_relaxed) & bit) != 0;
}

/* A descriptor with a zeroed in-use bitmap of at least words words (kept
 * across recycling: a stale lookup may still read it). */
static slab *slab_desc_for(uint32_t words) {
  slab *s = slab_desc_get();
  if (s == NULL) return NULL;
  _Atomic uint64_t *bits = s->inuse;
  uint32_t have = s->inuse_words;
  if (bits != NULL && have >= words) {
    memset((void *)bits, 0, have * sizeof(uint64_t));
  } else {
    bits = meta_alloc(words * sizeof(uint64_t));
    if (bits == NULL) {
      slab_desc_put(s);
      return NULL;
    }
    meta_free((void *)s->inuse);
    have = words;
  }
  s->inuse = bits;
  s->inuse_words = have;
  return s;
}

void slab_set_init(slab_set *ss, region *r, span_set *spans, depot *depots, struct heap *owner) {
  ss->region = r;
  ss->spans = spans;
  ss->depots = depots;
  ss->owner = owner;
  pthread_mutex_init(&ss->slab_lock, NULL);
  pthread_mutex_init(&ss->reclaim_lock, NULL);
  ss->list = NULL;
  atomic_store_relaxed(&ss->mapped, 0);
  atomic_store_relaxed(&ss->released, 0);
}

/* A carved slab joins the set's list (release and snapshots walk it). */
static void slab_link(slab_set *ss, slab *s) {
  pthread_mutex_lock(&ss->slab_lock);
  s->lprev = NULL;
  s->lnext = ss->list;
  if (ss->list) ss->list->lprev = s;
  ss->list = s;
  pthread_mutex_unlock(&ss->slab_lock);
  atomic_add_relaxed(&ss->mapped, 1);
}

/* The slab's memory goes back: its chunk to its span, or its granules. */
static void slab_give_back(slab_set *ss, slab *s) {
  if (s->span != NULL) span_chunk_put(ss->spans, s->span, s->base, (unsigned)(s->size / SPAN_CHUNK));
  else region_unmap(ss->region, s->base, s->size, s->raw, s->raw_size);
  s->span = NULL;
}

int slab_carve(slab_set *ss, unsigned cls, int may_map, magazine **out) {
  const sizeclass_info *ci = &sizeclass_table[cls];
  MAGPIE_ASSERT(!ci->seg);                            /* class blocks come from the large segments */
  if (!may_map && !ci->chunks) return SLAB_WOULD_MAP; /* slabs of whole granules are always mapped */
  slab *s = slab_desc_for((ci->blocks + 63) / 64);
  if (s == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  span *sp = NULL;
  int rc;
  if (ci->chunks) {
    rc = span_chunk_get(ss->spans, ci->chunks, may_map, &s->base, &sp);
    s->raw = s->base;
    s->raw_size = ci->slab_size;
  } else {
    rc = region_map(ss->region, ci->slab_size, &s->base, &s->raw, &s->raw_size);
  }
  if (rc != MAGPIE_OK) {
    slab_desc_put(s);
    return rc;
  }
  s->span = sp;
  s->size = ci->slab_size;
  s->bsize = ci->size;
  s->magic = ci->magic;
  s->cls = cls;
  s->nblocks = ci->blocks;
  s->heap = ss->owner;

  /* INVARIANT (slab.h): page-aligned base; the multiply-shift index is
   * exact over the slab (checked at its last block). */
  MAGPIE_ASSERT((s->base & (((uintptr_t)1 << PAGEMAP_PAGE_SHIFT) - 1)) == 0);
  MAGPIE_DEBUG_ONLY({
    uint32_t li = 0;
    MAGPIE_ASSERT(slab_block_index(s, s->base + (size_t)(s->nblocks - 1) * s->bsize, &li) && li == s->nblocks - 1);
  })
  /* Publish before any block leaves: frees must find the slab. */
  if (pagemap_set(s->base, s->size, s) != MAGPIE_OK) {
    slab_give_back(ss, s);
    slab_desc_put(s);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  magazine *first = NULL;
  uint32_t next = 0;
  while (next < s->nblocks) {
    magazine *m = magazine_get_empty(cls);
    /* Out of host memory: the blocks not yet in a magazine stay unused in
     * the slab (device memory kept, nothing handed out twice). */
    if (m == NULL) break;
    while (m->count < m->cap && next < s->nblocks) {
      /* Highest addresses first, so pops hand out ascending addresses. */
      uint32_t i = s->nblocks - 1 - next++;
      m->slots[m->count++] = (void *)(s->base + (size_t)i * s->bsize);
    }
    if (first == NULL) first = m;
    else depot_put(&ss->depots[cls], m);
  }
  /* Unusable: the tail no block fits in, the fallback's alignment, blocks
   * no magazine could hold. */
  s->stranded = (s->nblocks - next) * (size_t)s->bsize;
  region_overhead_add(ss->region, (int64_t)slab_overhead(s));
  slab_link(ss, s);
  if (first == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  *out = first;
  return MAGPIE_OK;
}

/* Count, per slab, the blocks in a chain of magazines. */
static void slab_count_chain(registry_link *chain) {
  for (registry_link *n = chain; n; n = stack_next(&magazine_st.registry, n)) {
    magazine *m = (magazine *)n;
    for (uint32_t i = 0; i < m->count; i++) ((slab *)pagemap_lookup((uintptr_t)m->slots[i]))->reclaim_free++;
  }
}

/* Drop the blocks of dead slabs from a chain's magazines and give the
 * magazines back (ready, empty ones to the pool). */
static void slab_return_chain(slab_set *ss, unsigned cls, registry_link *chain) {
  for (registry_link *n = chain, *next; n; n = next) {
    next = stack_next(&magazine_st.registry, n);
    magazine *m = (magazine *)n;
    uint32_t keep = 0;
    for (uint32_t i = 0; i < m->count; i++) {
      slab *s = pagemap_lookup((uintptr_t)m->slots[i]);
      s->reclaim_free = 0;
      if (!s->dead) m->slots[keep++] = m->slots[i];
    }
    m->count = keep;
    m->cls = cls;
    if (keep > 0) depot_put(&ss->depots[cls], m);
    else magazine_put_empty(m);
  }
}

size_t slab_release_free(slab_set *ss, size_t want) {
  registry_link *chains[SIZECLASS_COUNT] = {0};
  slab *dead = NULL;
  size_t bytes = 0;
  pthread_mutex_lock(&ss->reclaim_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    if (sizeclass_table[c].seg) continue; /* class blocks have no slab (heap.c gives them back) */
    chains[c] = stack_take_all(&ss->depots[c].full, &magazine_st.registry);
    for (registry_link *n = chains[c]; n; n = stack_next(&magazine_st.registry, n))
      atomic_sub_relaxed(&ss->depots[c].ready_bytes, (int64_t)depot_magazine_bytes((magazine *)n));
    slab_count_chain(chains[c]);
  }
  pthread_mutex_lock(&ss->slab_lock);
  for (slab *s = ss->list; s && bytes < want; s = s->lnext) {
    /* No block is counted free twice: at most every block is in a magazine. */
    MAGPIE_ASSERT(s->reclaim_free <= s->nblocks - s->stranded / s->bsize);
    if (s->reclaim_free != s->nblocks - s->stranded / s->bsize) continue;
    s->dead = 1;
    bytes += s->raw_size;
  }
  pthread_mutex_unlock(&ss->slab_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) slab_return_chain(ss, c, chains[c]);
  /* Unlink the dead (their blocks are in no magazine now). */
  pthread_mutex_lock(&ss->slab_lock);
  for (slab *s = ss->list, *next; s; s = next) {
    next = s->lnext;
    if (!s->dead) continue;
    if (s->lprev) s->lprev->lnext = s->lnext;
    else ss->list = s->lnext;
    if (s->lnext) s->lnext->lprev = s->lprev;
    s->lprev = NULL;
    s->lnext = dead;
    dead = s;
  }
  pthread_mutex_unlock(&ss->slab_lock);
  if (dead != NULL) region_release_begin(ss->region);
  pthread_mutex_unlock(&ss->reclaim_lock);
  /* Driver calls with no lock held. */
  for (slab *s = dead, *next; s; s = next) {
    next = s->lnext;
    pagemap_set(s->base, s->size, NULL); /* leaves exist: cannot fail */
    region_overhead_add(ss->region, -(int64_t)slab_overhead(s));
    slab_give_back(ss, s);
    atomic_sub_relaxed(&ss->mapped, 1);
    atomic_add_relaxed(&ss->released, 1);
    s->dead = 0;
    slab_desc_put(s);
  }
  if (dead != NULL) region_release_end(ss->region);
  return bytes;
}
