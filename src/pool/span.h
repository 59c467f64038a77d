/* Spans: granules (the smallest map, 2 MiB on the H200), or pieces of them
 * lent by the large segments, cut into chunks of SPAN_CHUNK bytes. A size
 * class's slab is a run of one or more contiguous chunks of one span, so
 * that classes share granules instead of mapping whole ones each: a
 * class's slab of a whole granule held far more than its blocks, most of
 * it in carved blocks no allocation had reached (bench/DECISIONS.md,
 * "Slabs are runs of chunks of shared granules").
 *
 * A span is mapped when no span has a free chunk and unmapped when its
 * last chunk comes back. Mapped chunks no slab uses count as overhead.
 *
 * INVARIANT: used has bit i set iff chunk i (at base + i * SPAN_CHUNK)
 *            belongs to a slab (or is being made one); a slab's chunks are
 *            contiguous bits; a span is on its set's list iff used != 0.
 *
 * A span's memory is lent by the set's lender (the large segments' free
 * memory, heap.c: a piece of SPAN_LENT_PIECE bytes or more of a hole in a
 * granule something else uses, else a whole granule) and given back there
 * when the span is empty, or, where the lender has none, a granule mapped
 * for it.
 *
 * Lock order: span_set.span_grow_lock -> (region.lock, span_set.span_lock,
 * the lender's lock: leaves, one at a time). A span is mapped or lent
 * under span_grow_lock only (one at a time per set), and unmapped or given
 * back with no lock held. */
#ifndef MAGPIE_SPAN_H
#define MAGPIE_SPAN_H

#include <stddef.h>
#include <stdint.h>

#include <pthread.h>

#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "pool/region.h"

#define SPAN_CHUNK_SHIFT SIZECLASS_CHUNK_SHIFT
#define SPAN_CHUNK SIZECLASS_CHUNK

/* A chunk is a slab, so the page map must tell chunks apart. */
_Static_assert(SPAN_CHUNK_SHIFT >= PAGEMAP_PAGE_SHIFT, "chunks smaller than page-map pages");

typedef struct span {
  uintptr_t base; /* aligned to size; immutable */
  size_t size;    /* the granule, or the piece lent; immutable */
  uintptr_t raw;  /* what region_unmap takes back; immutable */
  size_t raw_size;
  uint64_t used;     /* under span_set.span_lock */
  unsigned nchunks;  /* size / SPAN_CHUNK, at most 64; immutable */
  int lent;          /* 1: the lender's memory (given back, not unmapped); immutable */
  struct span *next; /* the set's list, under span_set.span_lock */
} span;

/* The least a span asks its lender for: pieces this small let the small
 * classes fill the holes that large and class blocks leave in their
 * granules (bench/DECISIONS.md, "Spans fill the holes of used
 * granules"). */
#define SPAN_LENT_PIECE ((size_t)256 << 10)

/* Where a span's memory may come from before a granule is mapped: memory
 * some other layer holds mapped, free and ready for every stream (lend:
 * want bytes, a power of two, or a whole granule: MAGPIE_OK, *base and
 * *size, else nonzero), and where it goes back (take_back) once the span
 * is empty. Called under span_grow_lock (lend) and with no lock held
 * (take_back). */
typedef struct span_lender {
  int (*lend)(void *ctx, size_t want, uintptr_t *base, size_t *size);
  void (*take_back)(void *ctx, uintptr_t base);
  void *ctx;
} span_lender;

/* A device's spans. */
typedef struct span_set {
  region *region;            /* maps and unmaps the granules; immutable */
  pthread_mutex_t span_lock; /* guards list and the spans' used masks */
  span *list;
  /* Held across one span's map: threads that find every span full
   * together share that span instead of each mapping one. */
  pthread_mutex_t span_grow_lock;
  span_lender lender; /* set once before the set is used; lend NULL: none */
} span_set;

void span_set_init(span_set *ss, region *r);
void span_set_lender(span_set *ss, span_lender l);

/* What span_chunk_get returns when no span has a free run and may_map is 0
 * (positive: no error is set; the caller may recycle memory and retry). */
#define SPAN_WOULD_MAP 1

/* n contiguous free chunks of one span of ss (n * SPAN_CHUNK at most the
 * granularity): the run's address and span. When no span has such a run,
 * a new span takes lent memory, or a mapped granule if may_map, else
 * SPAN_WOULD_MAP is returned. MAGPIE_ERR_OUT_OF_MEMORY (device or host)
 * otherwise. */
int span_chunk_get(span_set *ss, unsigned n, int may_map, uintptr_t *base, span **out);
/* Give back a run of n chunks taken together; the span is unmapped if no
 * other chunk is in use. */
void span_chunk_put(span_set *ss, span *sp, uintptr_t base, unsigned n);

#endif /* MAGPIE_SPAN_H */
