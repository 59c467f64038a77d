/* Size-class tables: block size, slab size, magazine capacity, and the
 * multiply-shift constant that turns a block offset into an index. */
#include "base/sizeclass.h"

sizeclass_info sizeclass_table[SIZECLASS_COUNT];

/* Slabs are runs of chunks of a shared granule when the granularity is 2
 * to 64 chunks: one chunk where it holds SIZECLASS_CHUNK_MIN_BLOCKS blocks,
 * else the fewest chunks whose tail (what no block fits in) is at most an
 * eighth of the run, else the run of the least tail. Few chunks mean few
 * blocks per slab: a class with one block live pins its slab, and slabs
 * of whole granules (2-8 MiB for classes of 40 KiB-1 MiB) held several
 * times a thread's live bytes (bench/DECISIONS.md, "Slabs are runs of
 * chunks of shared granules"). */
/* The k in kmin..kmax for which k units hold blocks of `size` with the
 * least tail fraction (ties to the smaller k); with eighth, the first k
 * whose tail is at most an eighth of its run. */
static size_t sizeclass_least_tail(size_t size, size_t unit, size_t kmin, size_t kmax, int eighth) {
  size_t best = 0, best_waste = 0;
  for (size_t k = kmin; k <= kmax; k++) {
    size_t run = k * unit, waste = run % size;
    if (eighth && waste * 8 <= run) return k;
    /* waste/run < best_waste/(best * unit), cross-multiplied */
    if (best == 0 || waste * best < best_waste * k) {
      best = k;
      best_waste = waste;
    }
  }
  return best;
}

unsigned sizeclass_chunks(size_t size, size_t granularity) {
  size_t n = granularity / SIZECLASS_CHUNK;
  if (granularity % SIZECLASS_CHUNK != 0 || n < 2 || n > 64) return 0;
  if (size * SIZECLASS_CHUNK_MIN_BLOCKS <= SIZECLASS_CHUNK) return 1;
  return (unsigned)sizeclass_least_tail(size, SIZECLASS_CHUNK, (size + SIZECLASS_CHUNK - 1) / SIZECLASS_CHUNK, n, 1);
}

/* Slab of one to four granules, whichever wastes the least tail (ties to
 * the smaller): where the granularity cannot be cut into chunks. */
static size_t sizeclass_pick_slab(size_t size, size_t granularity) {
  return sizeclass_least_tail(size, granularity, 1, 4, 0) * granularity;
}

/* Largest k <= SIZECLASS_MAG_MAX with k^3 <= v. */
static uint32_t sizeclass_icbrt(size_t v) {
  uint32_t k = 1;
  while (k < SIZECLASS_MAG_MAX && (size_t)(k + 1) * (k + 1) * (k + 1) <= v) k++;
  return k;
}

/* Magazine capacities. A thread whose blocks of a class come and go in a
 * random walk exchanges a magazine about once per cap^2 operations of the
 * class and holds about cap * size bytes of it; over classes used alike,
 * the bytes held for a given number of exchanges are least when cap falls
 * with the cube root of the size. Starting capacity: 5 blocks at 64 KiB
 * (cbrt(2^23 / size)), 20 at 1 KiB, 32 at 256 B, at most mag_max. 2^23
 * held less memory than 2^25 at the same speed; smaller still cost much of
 * the throughput in event records and depot exchanges (bench/DECISIONS.md,
 * "Magazine capacity falls with the cube root of the size"). Where a
 * thread's blocks only flow out (frees, no allocations: one exchange per
 * magazine, however large) its capacity grows up to mag_max (tcache_slots.c). */
void sizeclass_init(size_t magazine_bytes, size_t granularity) {
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    sizeclass_info *ci = &sizeclass_table[c];
    ci->size = sizeclass_size_calc(c);
    ci->seg = ci->size > SIZECLASS_SLAB_MAX;
    ci->chunks = sizeclass_chunks(ci->size, granularity);
    ci->slab_size = ci->chunks ? ci->chunks * SIZECLASS_CHUNK : sizeclass_pick_slab(ci->size, granularity);
    ci->blocks = (uint32_t)(ci->slab_size / ci->size);
    size_t cap = magazine_bytes / ci->size;
    if (cap < 2) cap = 2;
    if (cap > SIZECLASS_MAG_MAX) cap = SIZECLASS_MAG_MAX;
    ci->mag_max = (uint32_t)cap;
    uint32_t start = sizeclass_icbrt(((size_t)1 << 23) / ci->size);
    if (start < 2) start = 2;
    ci->mag_cap = start < ci->mag_max ? start : ci->mag_max;
    /* Class blocks: a magazine holds at most SIZECLASS_SEG_MAG_BYTES for a
     * thread on one stream (mag_max) and SIZECLASS_SEG_MAG_FEW_BYTES for
     * any other (mag_cap), so that what threads cache of the classes above
     * 64 KiB stays small next to their blocks' sizes: a thread on several
     * streams holds magazines for each of them (tcache_seg_cap). */
    if (ci->seg) {
      size_t most = SIZECLASS_SEG_MAG_BYTES / ci->size, few = SIZECLASS_SEG_MAG_FEW_BYTES / ci->size;
      ci->mag_max = (uint32_t)(most < 1 ? 1 : most < start ? most : start);
      ci->mag_cap = (uint32_t)(few < 1 ? 1 : few < ci->mag_max ? few : ci->mag_max);
    }
    ci->magic = sizeclass_magic(ci->size);
  }
}
