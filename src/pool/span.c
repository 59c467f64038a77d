/* Spans: granules shared by the slabs of size classes; see span.h.
 * Lock order: span_set.span_grow_lock -> (region.lock, span_set.span_lock,
 * the lender's locks: leaves, one at a time). The only driver calls under
 * a lock are a span's map, and the lender's event queries before a lend,
 * under span_grow_lock. */
#include "pool/span.h"

#include <pthread.h>

#include "base/assert.h"
#include "base/meta.h"

void span_set_init(span_set *ss, region *r) {
  ss->region = r;
  pthread_mutex_init(&ss->span_lock, NULL);
  pthread_mutex_init(&ss->span_grow_lock, NULL);
  ss->list = NULL;
  ss->lender = (span_lender){0};
}

void span_set_lender(span_set *ss, span_lender l) { ss->lender = l; }

/* Bits [i, i+n) of a span's mask. */
static uint64_t span_bits(unsigned i, unsigned n) { return (n == 64 ? ~(uint64_t)0 : ((uint64_t)1 << n) - 1) << i; }

static uint64_t span_full(const span *sp) { return span_bits(0, sp->nchunks); }

/* The first run of n free chunks in sp, or -1. */
static int span_find_run(const span *sp, unsigned n) {
  for (unsigned i = 0; i + n <= sp->nchunks; i++)
    if ((sp->used & span_bits(i, n)) == 0) return (int)i;
  return -1;
}

/* A run of n free chunks of an existing span, or 0. */
static int span_take_free(span_set *ss, unsigned n, uintptr_t *base, span **out) {
  pthread_mutex_lock(&ss->span_lock);
  for (span *sp = ss->list; sp; sp = sp->next) {
    if (sp->used == span_full(sp)) continue;
    MAGPIE_ASSERT(sp->used != 0); /* INVARIANT (span.h): on the list iff used != 0 */
    int i = span_find_run(sp, n);
    if (i < 0) continue;
    sp->used |= span_bits((unsigned)i, n);
    pthread_mutex_unlock(&ss->span_lock);
    region_overhead_add(ss->region, -(int64_t)(n * SPAN_CHUNK));
    *base = sp->base + (uintptr_t)i * SPAN_CHUNK;
    *out = sp;
    return 1;
  }
  pthread_mutex_unlock(&ss->span_lock);
  return 0;
}

/* What a new span of at least n chunks asks the lender for: the power of
 * two that holds them, SPAN_LENT_PIECE at least, at most the granule. */
static size_t span_want(const span_set *ss, unsigned n) {
  size_t want = SPAN_LENT_PIECE, g = ss->region->gran;
  while (want < (size_t)n * SPAN_CHUNK) want *= 2;
  return want < g ? want : g;
}

int span_chunk_get(span_set *ss, unsigned n, int may_map, uintptr_t *base, span **out) {
  MAGPIE_ASSERT(n >= 1 && (size_t)n * SPAN_CHUNK <= ss->region->gran);
  if (span_take_free(ss, n, base, out)) return MAGPIE_OK;
  if (!may_map && ss->lender.lend == NULL) return SPAN_WOULD_MAP;
  /* No free chunk: lent memory, else map a granule, one thread at a time. Threads of other
   * classes that ran dry meanwhile wait here and take the new span's
   * spare chunks: threads starting together each mapped a granule of
   * their own otherwise, and some of those sat almost unused
   * (bench/DECISIONS.md, "Spans are mapped one at a time per set"). */
  pthread_mutex_lock(&ss->span_grow_lock);
  if (span_take_free(ss, n, base, out)) {
    pthread_mutex_unlock(&ss->span_grow_lock);
    return MAGPIE_OK;
  }
  span *sp = meta_alloc(sizeof *sp);
  int rc = sp == NULL ? MAGPIE_ERR_OUT_OF_MEMORY : MAGPIE_OK;
  if (rc == MAGPIE_OK) {
    size_t lent_size = 0;
    sp->lent = ss->lender.lend != NULL &&
               ss->lender.lend(ss->lender.ctx, span_want(ss, n), &sp->base, &lent_size) == MAGPIE_OK;
    if (sp->lent) {
      sp->raw = sp->base;
      sp->raw_size = lent_size;
    } else if (!may_map) {
      rc = SPAN_WOULD_MAP;
    } else {
      rc = region_map(ss->region, ss->region->gran, &sp->base, &sp->raw, &sp->raw_size);
    }
  }
  if (rc != MAGPIE_OK) {
    pthread_mutex_unlock(&ss->span_grow_lock);
    meta_free(sp);
    return rc;
  }
  sp->size = sp->lent ? sp->raw_size : ss->region->gran;
  sp->nchunks = (unsigned)(sp->size / SPAN_CHUNK);
  sp->used = span_bits(0, n); /* the first n chunks are the caller's */
  /* Overhead: every mapped byte but the chunks handed out (fallback
   * alignment included). Lent bytes leave the lender's free
   * bytes at the same time, so the layers still add up. */
  region_overhead_add(ss->region, (int64_t)(sp->raw_size - n * SPAN_CHUNK));
  pthread_mutex_lock(&ss->span_lock);
  sp->next = ss->list;
  ss->list = sp;
  pthread_mutex_unlock(&ss->span_lock);
  pthread_mutex_unlock(&ss->span_grow_lock);
  *base = sp->base;
  *out = sp;
  return MAGPIE_OK;
}

void span_chunk_put(span_set *ss, span *sp, uintptr_t base, unsigned n) {
  unsigned i = (unsigned)((base - sp->base) >> SPAN_CHUNK_SHIFT);
  uint64_t bits = span_bits(i, n);
  region_overhead_add(ss->region, (int64_t)(n * SPAN_CHUNK));
  pthread_mutex_lock(&ss->span_lock);
  /* Chunks in use go back once. */
  MAGPIE_ASSERT(i + n <= sp->nchunks && (sp->used & bits) == bits);
  sp->used &= ~bits;
  int empty = sp->used == 0;
  if (empty) {
    span **pp = &ss->list;
    while (*pp != sp) pp = &(*pp)->next;
    *pp = sp->next;
  }
  pthread_mutex_unlock(&ss->span_lock);
  if (!empty) return;
  region_overhead_add(ss->region, -(int64_t)sp->raw_size);
  if (sp->lent) ss->lender.take_back(ss->lender.ctx, sp->base);
  else region_unmap(ss->region, sp->base, sp->size, sp->raw, sp->raw_size);
  meta_free(sp);
}
