/* Slabs: granularity-aligned device ranges carved into blocks of one size
 * class, and the page-map descriptors of large segments (cls SLAB_LARGE,
 * seg pointing at the segment, whose blocks large.c keeps).
 *
 * A new slab's blocks go straight into full magazines (the depot holds them);
 * slabs keep no free lists, so the only per-block state lives in magazines
 * and, in checked mode, in the slab's allocation bitmap.
 *
 * INVARIANT: base is a multiple of the page-map page; every page of
 *            [base, base+size) maps to this descriptor in the page map while
 *            the memory is mapped. A small class's slab is one chunk of a
 *            span (span != NULL, span.h); others map whole granules.
 * INVARIANT: for a class slab, block i starts at base + i*bsize, i < nblocks,
 *            and (off * magic) >> 48 == off / bsize for off < size.
 * Descriptors are never returned to the host allocator (a stale lookup reads
 * a valid descriptor): they are recycled through slab_desc_get/put. */
#ifndef MAGPIE_SLAB_H
#define MAGPIE_SLAB_H

#include <stddef.h>
#include <stdint.h>

#include "atomic.h"
#include "magazine.h"
#include "pagemap.h"

#define SLAB_LARGE 0xffffu

struct heap;

/* The free fast path reads the first line only (base .. recorded); a
 * descriptor is line-aligned so that a free of a block whose slab is out of
 * the cache costs one miss here, not three. */
typedef struct slab {
  _Alignas(64) uintptr_t base;
  size_t bsize;   /* block size (large: the block's usable size) */
  uint64_t magic; /* 0 for large */
  uint32_t cls;   /* size class, or SLAB_LARGE */
  uint32_t nblocks;
  struct heap *heap;
  /* Blocks of this slab (or large segment) with a record_stream entry
   * (record.c). Written (relaxed RMW) under record_lock; read relaxed by the
   * free fast path, which sends the slab's frees to the slow path while
   * nonzero. A record happens before the free of its block (same thread, or
   * the application ordered the two threads), so the free reads the count
   * including it. */
  _Atomic uint32_t recorded;
  uint32_t inuse_words;
  size_t size;
  uintptr_t raw; /* what the region mapped (differs without VMM); a chunk: itself */
  size_t raw_size;
  struct span *span; /* the span a chunk slab belongs to, else NULL */
  /* Checked mode: bit i set while block i is handed out. Atomic RMW by any
   * thread that allocates or frees a block of this slab (relaxed: it only
   * detects double frees, it publishes nothing). */
  _Atomic uint64_t *inuse;
  struct lseg *seg;     /* large segments only */
  struct slab *lnext;   /* descriptor free list; the heap's slab list */
  struct slab *lprev;   /* the heap's slab list (under its slab lock) */
  /* Slab release (under the heap's reclaim lock): free blocks counted in
   * the depot's magazines. */
  uint32_t reclaim_free;
  uint32_t dead;        /* being given back: its blocks leave the magazines */
  size_t stranded;      /* bytes of blocks no magazine took (host OOM) */
} slab;
_Static_assert(offsetof(slab, recorded) + sizeof(uint32_t) <= 64, "the free fast path's fields share one line");

/* Bytes of a class slab no block serves. */
static inline size_t slab_overhead(const slab *s) {
  return s->raw_size - (size_t)s->nblocks * s->bsize + s->stranded;
}

/* Map a slab of class cls and fill magazines with all its blocks: one is
 * returned, the rest go to the depot as ready. */
int slab_carve(struct heap *h, unsigned cls, magazine **out);
/* Give back slabs all of whose blocks sit in the depot's ready magazines,
 * until want bytes are unmapped. Returns bytes given back. */
size_t slab_release_free(struct heap *h, size_t want);

/* Is p the start of a block of s? Sets *index. */
static inline int slab_block_index(const slab *s, uintptr_t p, uint32_t *index) {
  uintptr_t off = p - s->base;
  if (s->cls == SLAB_LARGE) {
    *index = 0;
    return 1; /* large.c knows the blocks of a segment */
  }
  uint64_t i = ((uint64_t)off * s->magic) >> 48;
  *index = (uint32_t)i;
  return i * s->bsize == off && i < s->nblocks;
}

/* Checked mode: mark block i handed out (returns 0 if it already was). */
int slab_mark_used(slab *s, uint32_t i);
/* Checked mode: mark block i free (returns 0 if it already was: double free). */
int slab_mark_free(slab *s, uint32_t i);

/* Descriptors (recycled, never freed). */
slab *slab_desc_get(void);
void slab_desc_put(slab *s);

#endif /* MAGPIE_SLAB_H */
