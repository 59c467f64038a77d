/* Slabs: granularity-aligned device ranges carved into blocks of one size
 * class, and the descriptors of large blocks (one block per descriptor).
 *
 * A new slab's blocks go straight into full magazines (the depot holds them);
 * slabs keep no free lists, so the only per-block state lives in magazines
 * and, in checked mode, in the slab's allocation bitmap.
 *
 * INVARIANT: base is a multiple of 2 MiB; every 2 MiB page of
 *            [base, base+size) maps to this descriptor in the page map while
 *            the memory is mapped.
 * INVARIANT: for a class slab, block i starts at base + i*bsize, i < nblocks,
 *            and (off * magic) >> 48 == off / bsize for off < size.
 * Descriptors are never returned to the host allocator (a stale lookup reads
 * a valid descriptor). */
#ifndef MAGPIE_SLAB_H
#define MAGPIE_SLAB_H

#include <stddef.h>
#include <stdint.h>

#include "atomic.h"
#include "magazine.h"
#include "pagemap.h"

#define SLAB_LARGE 0xffffu

struct heap;

typedef struct slab {
  uintptr_t base;
  size_t size;
  size_t bsize;   /* block size (large: the block's usable size) */
  uint64_t magic; /* 0 for large */
  uint32_t cls;   /* size class, or SLAB_LARGE */
  uint32_t nblocks;
  struct heap *heap;
  uintptr_t raw; /* what the region mapped (differs without VMM) */
  size_t raw_size;
  /* Checked mode: bit i set while block i is handed out. Atomic RMW by any
   * thread that allocates or frees a block of this slab (relaxed: it only
   * detects double frees, it publishes nothing). */
  _Atomic uint64_t *inuse;
  /* Blocks of this slab with a record_stream entry (record.c). Written
   * (relaxed RMW) under record_lock; read relaxed by the free fast path,
   * which sends the slab's frees to the slow path while nonzero. A record
   * happens before the free of its block (same thread, or the application
   * ordered the two threads), so the free reads the count including it. */
  _Atomic uint32_t recorded;
  /* Large blocks only, guarded by the heap's large lock. */
  uint32_t large_cached; /* 1 while in the large cache (free) */
  struct slab *lnext;
  epoch_ticket lticket;
  size_t request; /* bytes asked for (stats) */
} slab;

/* Map a slab of class cls and fill magazines with all its blocks: one is
 * returned, the rest go to the depot as ready. */
int slab_carve(struct heap *h, unsigned cls, magazine **out);

/* Is p the start of a block of s? Sets *index. */
static inline int slab_block_index(const slab *s, uintptr_t p, uint32_t *index) {
  uintptr_t off = p - s->base;
  if (s->cls == SLAB_LARGE) {
    *index = 0;
    return off == 0;
  }
  uint64_t i = ((uint64_t)off * s->magic) >> 48;
  *index = (uint32_t)i;
  return i * s->bsize == off && i < s->nblocks;
}

/* Checked mode: mark block i handed out (returns 0 if it already was). */
int slab_mark_used(slab *s, uint32_t i);
/* Checked mode: mark block i free (returns 0 if it already was: double free). */
int slab_mark_free(slab *s, uint32_t i);

/* Descriptors for large blocks (recycled, never freed). */
slab *slab_desc_get(void);
void slab_desc_put(slab *s);

#endif /* MAGPIE_SLAB_H */
