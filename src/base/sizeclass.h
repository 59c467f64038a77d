/* Size classes: 256 B (the minimum alignment, as cudaMalloc gives) upward.
 * Below 1 KiB classes step by the 256 B alignment; up to 32 KiB (the
 * classes with slabs) there are four per power of two, so internal waste
 * is at most 25 %; above it (class blocks of the large segments, up to
 * 1 MiB) two, at 1.5 and 2 times a power of two (at most a third wasted,
 * half just above 32 KiB). Lookup is a count-leading-zeros, two shifts and
 * one comparison: no division, no table walk.
 *
 *   class:  0    1    2    3    4     5    6     7   ...  23   24   25   26  ...  33
 *   bytes:  256  512  768  1K   1.25K 1.5K 1.75K 2K  ...  32K  48K  64K  96K ...  1M
 *
 * Fewer classes above 32 KiB: a thread's class blocks come and go class by
 * class, and each class held its own high-water mark of them, so fewer
 * classes held less memory (bench/DECISIONS.md, "Two classes per power of
 * two above 32 KiB").
 *
 * Requests above SIZECLASS_MAX_SIZE go to the large-block path. */
#ifndef MAGPIE_SIZECLASS_H
#define MAGPIE_SIZECLASS_H

#include <stddef.h>
#include <stdint.h>

#include "base/types.h"

/* The constants and the row type, sizeclass_info, are in base/types.h. */

/* Class index of a request of 1..SIZECLASS_MAX_SIZE bytes. */
static inline unsigned sizeclass_of(size_t size) {
  size_t v = ((size + SIZECLASS_MIN_SIZE - 1) >> SIZECLASS_SHIFT) - 1; /* units - 1, >= 0 */
  /* b = max(floor(log2 v), 2): below 8 units the formula gives q = v, the
   * classes of 256 B steps, so no branch sets them apart (sizes in a mixed
   * stream would mispredict it). */
  unsigned b = 63u - (unsigned)__builtin_clzll(v | 4u);
  unsigned q = ((b - 2) << 2) + (unsigned)(v >> (b - 2)); /* four per power of two */
  /* Above 32 KiB, pairs of those become one: q and q + 1 (q even). */
  return q < SIZECLASS_FINE_COUNT ? q : (q + SIZECLASS_FINE_COUNT) >> 1;
}

/* Bytes of class c, by the same formula (sizeclass_table caches it). */
static inline size_t sizeclass_size_calc(unsigned c) {
  if (c < 8) return (size_t)(c + 1) << SIZECLASS_SHIFT;
  if (c >= SIZECLASS_FINE_COUNT) c = 2 * c - SIZECLASS_FINE_COUNT + 1; /* the odd quarter step */
  unsigned b = (c >> 2) + 1;                                           /* c = 4(b-2) + m, m in [4,7] */
  unsigned m = c & 3u;
  return ((size_t)(m + 5) << (b - 2)) << SIZECLASS_SHIFT;
}

/* The table, this module's state (defined in sizeclass.c): filled once by
 * sizeclass_init during set-up, before the set-up is published (release);
 * read-only afterwards. A plain global array: the fast paths index it
 * (tcache/tcache.h). */
extern sizeclass_info sizeclass_table[SIZECLASS_COUNT];

/* Chunks per slab of blocks of `size` for this granularity (slabs are runs
 * of span chunks), or 0 when slabs are whole granules. */
unsigned sizeclass_chunks(size_t size, size_t granularity);

/* magazine_bytes: target bytes per magazine; granularity: slab unit. */
void sizeclass_init(size_t magazine_bytes, size_t granularity);

#define SIZECLASS_MAGIC_SHIFT 48
static inline uint64_t sizeclass_magic(size_t size) { return (((uint64_t)1 << SIZECLASS_MAGIC_SHIFT) / size) + 1; }

#endif /* MAGPIE_SIZECLASS_H */
