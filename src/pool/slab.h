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
 *            the memory is mapped. A class's slab is a run of chunks of a
 *            span (span != NULL, span.h), or whole granules where the
 *            granularity cannot be cut into chunks.
 * INVARIANT: for a class slab, block i starts at base + i*bsize, i < nblocks,
 *            and (off * magic) >> SIZECLASS_MAGIC_SHIFT == off / bsize for off < size.
 * Descriptors are never returned to the host allocator (a stale lookup reads
 * a valid descriptor): they are recycled through slab_desc_get/put. */
#ifndef MAGPIE_SLAB_H
#define MAGPIE_SLAB_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "pool/depot.h"
#include "pool/magazine.h"
#include "pool/region.h"
#include "pool/span.h"

#define SLAB_LARGE 0xffffu

struct heap;

/* The free fast path reads the first line only (base .. size); a
 * descriptor is line-aligned so that a free of a block whose slab is out of
 * the cache costs one miss here, not three. */
typedef struct slab {
  _Alignas(64) uintptr_t base;
  size_t bsize; /* block size (large: the block's usable size) */
  union {
    uint64_t magic; /* a class slab's (above) */
    /* A large segment's lseg.ucls, on this line: a free finds a class
     * block's class here and in the table, without the segment's own
     * lines (large_class_of; bench/DECISIONS.md, "The large path's
     * searches and a class block's class read fewer lines"). Immutable
     * while published. */
    _Atomic uint8_t *ucls;
  };
  uint32_t cls; /* size class, or SLAB_LARGE */
  uint32_t nblocks;
  /* The heap the slab belongs to (the front's way from a block to its
   * device); opaque to this layer. Immutable while published. */
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
  struct lseg *seg;   /* large segments only */
  struct slab *lnext; /* descriptor free list; the set's slab list */
  struct slab *lprev; /* the set's slab list (under slab_set.slab_lock) */
  /* Slab release (under slab_set.reclaim_lock): free blocks counted in
   * the depot's magazines. */
  uint32_t reclaim_free;
  uint32_t dead;   /* being given back: its blocks leave the magazines */
  size_t stranded; /* bytes of blocks no magazine took (host OOM) */
} slab;
_Static_assert(offsetof(slab, size) + sizeof(size_t) <= 64, "the free fast path's fields share one line");

/* Bytes of a class slab no block serves. */
static inline size_t slab_overhead(const slab *s) { return s->raw_size - (size_t)s->nblocks * s->bsize + s->stranded; }

/* A device's class slabs, and where their memory and blocks go. */
typedef struct slab_set {
  region *region;            /* maps whole-granule slabs; immutable */
  span_set *spans;           /* chunk runs for classes' slabs; immutable */
  depot *depots;             /* the device's per-class depots; immutable */
  struct heap *owner;        /* stored in each slab (slab.heap); immutable */
  pthread_mutex_t slab_lock; /* guards list */
  slab *list;
  /* Serialises slab release (it borrows the depots' ready magazines);
   * snapshots take it too. */
  pthread_mutex_t reclaim_lock;
  /* Statistics, relaxed counters that publish nothing. */
  _Atomic uint64_t mapped;   /* slabs mapped now */
  _Atomic uint64_t released; /* slabs given back so far */
} slab_set;

void slab_set_init(slab_set *ss, region *r, span_set *spans, depot *depots, struct heap *owner);
/* slab_carve could not carve without mapping (span.h's SPAN_WOULD_MAP). */
#define SLAB_WOULD_MAP SPAN_WOULD_MAP

/* Make a slab of class cls (from free chunks of a mapped span, else, if
 * may_map, from newly mapped memory; else SLAB_WOULD_MAP) and fill
 * magazines with all its blocks: one is returned, the rest go to the depot
 * as ready. */
int slab_carve(slab_set *ss, unsigned cls, int may_map, magazine **out);
/* Give back slabs all of whose blocks sit in the depots' ready magazines,
 * until want bytes are unmapped. Returns bytes given back. Classes without
 * slabs (sizeclass_info.seg) are left alone. */
size_t slab_release_free(slab_set *ss, size_t want);

/* The block index of offset off in a class slab of magic magic (the
 * INVARIANT above). For a descriptor whose magic is not a class slab's
 * (a large segment's) the product may wrap, which the builtin defines and
 * the sanitizers accept; the index then means nothing. */
static inline uint64_t slab_magic_index(uintptr_t off, uint64_t magic) {
  uint64_t i;
  (void)__builtin_mul_overflow((uint64_t)off, magic, &i);
  return i >> SIZECLASS_MAGIC_SHIFT;
}

/* Is p the start of a block of s? Sets *index. */
static inline int slab_block_index(const slab *s, uintptr_t p, uint32_t *index) {
  uintptr_t off = p - s->base;
  if (s->cls == SLAB_LARGE) {
    *index = 0;
    return 1; /* large.c knows the blocks of a segment */
  }
  uint64_t i = slab_magic_index(off, s->magic);
  *index = (uint32_t)i;
  return i * s->bsize == off && i < s->nblocks;
}

/* Checked mode: is block i handed out? (relaxed: the caller's own block,
 * marked by the allocation that returned it, which is ordered before) */
static inline int slab_is_used(const slab *s, uint32_t i) {
  return (atomic_load_relaxed(&s->inuse[i >> 6]) >> (i & 63)) & 1;
}
/* Checked mode: mark block i handed out (returns 0 if it already was). */
int slab_mark_used(slab *s, uint32_t i);
/* Checked mode: mark block i free (returns 0 if it already was: double free). */
int slab_mark_free(slab *s, uint32_t i);

/* Descriptors (recycled, never freed). */
slab *slab_desc_get(void);
void slab_desc_put(slab *s);

#endif /* MAGPIE_SLAB_H */
