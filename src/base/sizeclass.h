/* Size classes: 256 B (the minimum alignment, as cudaMalloc gives) upward,
 * four classes per power of two above 1 KiB, so internal waste is at most
 * 25 % there (below 1 KiB classes step by the 256 B alignment). Lookup is a
 * count-leading-zeros and two shifts: no division, no table walk.
 *
 *   class:  0    1    2    3    4    5    6    7    8    9   ...  43
 *   bytes:  256  512  768  1K   1.25K 1.5K 1.75K 2K  2.5K 3K  ...  1M
 *
 * Requests above SIZECLASS_MAX_SIZE go to the large-block path. */
#ifndef MAGPIE_SIZECLASS_H
#define MAGPIE_SIZECLASS_H

#include <stddef.h>
#include <stdint.h>

#define SIZECLASS_SHIFT 8 /* 256-byte units */
#define SIZECLASS_MIN_SIZE ((size_t)1 << SIZECLASS_SHIFT)
#define SIZECLASS_MAX_SIZE ((size_t)1 << 20)
#define SIZECLASS_COUNT 44

/* Most blocks one magazine holds (pool/magazine.h sizes its slots by it). */
#define SIZECLASS_MAG_MAX 64

/* Chunks: small classes' slabs are chunks of this many bytes cut from a
 * shared granule (pool/span.h), when a chunk holds at least
 * SIZECLASS_CHUNK_MIN_BLOCKS of their blocks (blocks up to 32 KiB). On the
 * H200, workload 2 at sixteen threads held 1.34-1.41 times its threads'
 * peaks with 16 here (blocks up to 16 KiB, 465-478 M ops/s), 1.27 with 8
 * (387-409 M ops/s; the run to run spread of that figure is about as
 * wide). */
#define SIZECLASS_CHUNK_SHIFT 18
#define SIZECLASS_CHUNK ((size_t)1 << SIZECLASS_CHUNK_SHIFT)
#define SIZECLASS_CHUNK_MIN_BLOCKS 8

/* Class index of a request of 1..SIZECLASS_MAX_SIZE bytes. */
static inline unsigned sizeclass_of(size_t size) {
  size_t u = (size + SIZECLASS_MIN_SIZE - 1) >> SIZECLASS_SHIFT; /* units, >= 1 */
  if (u <= 4) return (unsigned)(u - 1);
  size_t v = u - 1; /* >= 4 */
  unsigned b = 63u - (unsigned)__builtin_clzll(v); /* floor(log2 v) >= 2 */
  return ((b - 2) << 2) + (unsigned)(v >> (b - 2));
}

/* Bytes of class c, by the same formula (tables below cache it). */
static inline size_t sizeclass_size_calc(unsigned c) {
  if (c < 8) return (size_t)(c + 1) << SIZECLASS_SHIFT;
  unsigned b = (c >> 2) + 1; /* c = 4(b-2) + m, m in [4,7] */
  unsigned m = c & 3u;
  return ((size_t)(m + 5) << (b - 2)) << SIZECLASS_SHIFT;
}

/* Per-class tables, filled once by sizeclass_init(). */
typedef struct sizeclass_info {
  size_t size;       /* block bytes */
  size_t slab_size;  /* bytes of one slab: a granularity multiple, or one chunk (span.h) */
  uint32_t blocks;   /* blocks per slab */
  uint32_t mag_cap;  /* blocks per magazine to start with (slabs carve these) */
  uint32_t mag_max;  /* most blocks per magazine (magazine_bytes / size) */
  uint32_t chunked;  /* 1: a slab is one span chunk (span.h); 0: whole granules */
  uint64_t magic;    /* offset * magic >> 48 == offset / size, exact for offsets < 2^24 */
} sizeclass_info;

extern sizeclass_info sizeclass_table[SIZECLASS_COUNT];

/* Do slabs of blocks of `size` come from chunks, for this granularity? */
int sizeclass_chunked(size_t size, size_t granularity);

/* magazine_bytes: target bytes per magazine; granularity: slab unit. */
void sizeclass_init(size_t magazine_bytes, size_t granularity);

#define SIZECLASS_MAGIC_SHIFT 48
static inline uint64_t sizeclass_magic(size_t size) {
  return (((uint64_t)1 << SIZECLASS_MAGIC_SHIFT) / size) + 1;
}

#endif /* MAGPIE_SIZECLASS_H */
