/* Spans: granules shared by the slabs of small classes; see span.h.
 * Lock order: heap.span_lock is a leaf; no driver call is made under it. */
#include "span.h"

#include <pthread.h>

#include "heap.h"
#include "meta.h"

int span_serves(size_t size, size_t granularity) {
  size_t n = granularity / SPAN_CHUNK;
  return granularity % SPAN_CHUNK == 0 && n >= 2 && n <= 64 && size * SPAN_MIN_BLOCKS <= SPAN_CHUNK;
}

static uint64_t span_full(const span *sp) { return sp->nchunks == 64 ? ~(uint64_t)0 : ((uint64_t)1 << sp->nchunks) - 1; }

int span_chunk_get(struct heap *h, uintptr_t *base, span **out) {
  pthread_mutex_lock(&h->span_lock);
  for (span *sp = h->spans; sp; sp = sp->next) {
    if (sp->used == span_full(sp)) continue;
    unsigned i = (unsigned)__builtin_ctzll(~sp->used);
    sp->used |= (uint64_t)1 << i;
    pthread_mutex_unlock(&h->span_lock);
    atomic_sub_relaxed(&h->stat_overhead, (int64_t)SPAN_CHUNK);
    *base = sp->base + (uintptr_t)i * SPAN_CHUNK;
    *out = sp;
    return MAGPIE_OK;
  }
  pthread_mutex_unlock(&h->span_lock);
  /* No free chunk: map a granule (no lock held). Two threads may both get
   * here; each maps one and the spare chunks serve later carves. */
  span *sp = meta_alloc(sizeof *sp);
  if (sp == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  size_t g = h->region.gran;
  int rc = heap_map(h, g, &sp->base, &sp->raw, &sp->raw_size);
  if (rc != MAGPIE_OK) {
    meta_free(sp);
    return rc;
  }
  sp->size = g;
  sp->nchunks = (unsigned)(g / SPAN_CHUNK);
  sp->used = 1; /* chunk 0 is the caller's */
  /* Overhead: every mapped byte but the chunk handed out (fallback
   * alignment included). */
  atomic_add_relaxed(&h->stat_overhead, (int64_t)(sp->raw_size - SPAN_CHUNK));
  pthread_mutex_lock(&h->span_lock);
  sp->next = h->spans;
  h->spans = sp;
  pthread_mutex_unlock(&h->span_lock);
  *base = sp->base;
  *out = sp;
  return MAGPIE_OK;
}

void span_chunk_put(struct heap *h, span *sp, uintptr_t base) {
  unsigned i = (unsigned)((base - sp->base) >> SPAN_CHUNK_SHIFT);
  atomic_add_relaxed(&h->stat_overhead, (int64_t)SPAN_CHUNK);
  pthread_mutex_lock(&h->span_lock);
  sp->used &= ~((uint64_t)1 << i);
  int empty = sp->used == 0;
  if (empty) {
    span **pp = &h->spans;
    while (*pp != sp) pp = &(*pp)->next;
    *pp = sp->next;
  }
  pthread_mutex_unlock(&h->span_lock);
  if (!empty) return;
  atomic_sub_relaxed(&h->stat_overhead, (int64_t)sp->raw_size);
  heap_unmap(h, sp->base, sp->size, sp->raw, sp->raw_size);
  meta_free(sp);
}
