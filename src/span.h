/* Spans: granules (the smallest map, 2 MiB on the H200) cut into chunks of
 * SPAN_CHUNK bytes that serve as the slabs of small size classes, so that
 * several classes share one granule instead of mapping one each (sixteen
 * threads of workload 2 held 8 MiB of four small classes' slabs for under
 * 2 MiB of their blocks).
 *
 * A span is mapped when no span has a free chunk and unmapped when its
 * last chunk comes back. Mapped chunks no slab uses count as overhead.
 *
 * INVARIANT: used has bit i set iff chunk i (at base + i * SPAN_CHUNK)
 *            belongs to a slab (or is being made one); a span is on its
 *            heap's list iff used != 0.
 *
 * Lock order: heap.span_grow_lock -> (region.lock, heap.span_lock: leaves,
 * one at a time). A span is
 * mapped under span_grow_lock only (one map at a time per heap) and
 * unmapped with no lock held. */
#ifndef MAGPIE_SPAN_H
#define MAGPIE_SPAN_H

#include <stddef.h>
#include <stdint.h>

#include "pagemap.h"

#define SPAN_CHUNK_SHIFT 18
#define SPAN_CHUNK ((size_t)1 << SPAN_CHUNK_SHIFT)
/* A class is carved from chunks when a chunk holds at least this many of
 * its blocks (blocks up to 32 KiB). On the H200, workload 2 at sixteen
 * threads held 1.34-1.41 times its threads' peaks with 16 here (blocks up
 * to 16 KiB, 465-478 M ops/s), 1.27 with 8 (387-409 M ops/s; the run to
 * run spread of that figure is about as wide). */
#define SPAN_MIN_BLOCKS 8

/* A chunk is a slab, so the page map must tell chunks apart. */
_Static_assert(SPAN_CHUNK_SHIFT >= PAGEMAP_PAGE_SHIFT, "chunks smaller than page-map pages");

struct heap;

typedef struct span {
  uintptr_t base;    /* granule-aligned; immutable */
  size_t size;       /* the heap's granularity; immutable */
  uintptr_t raw;     /* what heap_unmap takes back; immutable */
  size_t raw_size;
  uint64_t used;     /* under heap.span_lock */
  unsigned nchunks;  /* size / SPAN_CHUNK, at most 64; immutable */
  struct span *next; /* the heap's list, under heap.span_lock */
} span;

/* Do slabs of blocks of `size` come from chunks, for this granularity? */
int span_serves(size_t size, size_t granularity);
/* A free chunk of heap h (mapping a new span if no span has one): its
 * address and span. MAGPIE_ERR_OUT_OF_MEMORY (device or host) otherwise. */
int span_chunk_get(struct heap *h, uintptr_t *base, span **out);
/* Give back a chunk; its span is unmapped if no other chunk is in use. */
void span_chunk_put(struct heap *h, span *sp, uintptr_t base);

#endif /* MAGPIE_SPAN_H */
