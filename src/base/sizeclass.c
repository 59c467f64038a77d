/* Size-class tables: block size, slab size, magazine capacity, and the
 * multiply-shift constant that turns a block offset into an index. */
#include "base/sizeclass.h"

#include "base/globals.h"

/* Slabs are runs of chunks of a shared granule when the granularity is 2
 * to 64 chunks: one chunk where it holds SIZECLASS_CHUNK_MIN_BLOCKS blocks,
 * else the fewest chunks whose tail (what no block fits in) is at most an
 * eighth of the run, else the run of the least tail. Few chunks mean few
 * blocks per slab: a class with one block live pins its slab, and slabs
 * of whole granules (2-8 MiB for classes of 40 KiB-1 MiB) made one thread
 * of the mixed 256 B-2 MiB workload hold 4.5 times its peak live bytes on
 * the simulated device; with runs (at most four blocks above 256 KiB),
 * see bench/HISTORY.md. */
unsigned sizeclass_chunks(size_t size, size_t granularity) {
  size_t n = granularity / SIZECLASS_CHUNK;
  if (granularity % SIZECLASS_CHUNK != 0 || n < 2 || n > 64) return 0;
  if (size * SIZECLASS_CHUNK_MIN_BLOCKS <= SIZECLASS_CHUNK) return 1;
  size_t first = (size + SIZECLASS_CHUNK - 1) / SIZECLASS_CHUNK, best = 0, best_waste = 0;
  for (size_t k = first; k <= n; k++) {
    size_t run = k * SIZECLASS_CHUNK, waste = run % size;
    if (waste * 8 <= run) return (unsigned)k;
    /* waste/run < best_waste/(best * CHUNK), cross-multiplied */
    if (best == 0 || waste * best < best_waste * k) {
      best = k;
      best_waste = waste;
    }
  }
  return (unsigned)best;
}

/* Slab of one to four granules, whichever wastes the least tail (ties to
 * the smaller): where the granularity cannot be cut into chunks. */
static size_t sizeclass_pick_slab(size_t size, size_t granularity) {
  size_t best = granularity;
  size_t best_waste_num = granularity % size, best_den = granularity;
  for (size_t k = 2; k <= 4; k++) {
    size_t slab = k * granularity;
    size_t waste = slab % size;
    /* waste/slab < best_waste_num/best_den, cross-multiplied */
    if (waste * best_den < best_waste_num * slab) {
      best = slab;
      best_waste_num = waste;
      best_den = slab;
    }
  }
  return best;
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
 * (cbrt(2^23 / size)), 20 at 1 KiB, 32 at 256 B, at most mag_max. On the
 * H200 (workload 2, sixteen threads), 2^23 held 12 % less memory than
 * 2^25 at the same speed within noise; 2^21 held 25 % less but cost about
 * 40 % of the throughput (more event records and depot exchanges). Where
 * a thread's blocks only flow out (frees, no allocations: one exchange per
 * magazine, however large) its capacity grows up to mag_max (tcache.c). */
void sizeclass_init(size_t magazine_bytes, size_t granularity) {
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    sizeclass_info *ci = &globals.sizeclass_table[c];
    ci->size = sizeclass_size_calc(c);
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
    ci->magic = sizeclass_magic(ci->size);
  }
}
