/* The types and constants of base's modules, apart from their functions
 * (registry.h, stack.h, sizeclass.h, pagemap.h): the registry and stack
 * heads, a size-class row, the page map's shape. Each module's state
 * object is declared beside its functions (sizeclass_table, pagemap_top);
 * the layers above embed these heads in theirs (pool/magazine.h's
 * magazine_st, pool/epoch.c's event registry). */
#ifndef MAGPIE_TYPES_H
#define MAGPIE_TYPES_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* ---- registry.h: type-stable objects addressed by index ---- */

#define REGISTRY_CHUNK_SHIFT 10
#define REGISTRY_CHUNK_OBJS (1u << REGISTRY_CHUNK_SHIFT)
#define REGISTRY_MAX_CHUNKS 4096

/* Every registry object starts with this link. */
typedef struct registry_link {
  /* Index of the next node while on a stack. Written by the pusher (relaxed,
   * published by its release CAS on the head), read by poppers (relaxed,
   * after their acquire load of the head). Atomic because a popper may read
   * it while another thread re-pushes the node; the head's tag rejects that
   * read. */
  _Atomic uint32_t next;
  uint32_t idx; /* own index; immutable after creation */
} registry_link;

typedef struct registry {
  size_t obj_size;
  /* Chunk pointers. Written once (release) under grow_lock before any index
   * in the chunk is handed out; read with acquire by registry_get. */
  _Atomic(char *) chunks[REGISTRY_MAX_CHUNKS];
  /* Next never-used index; fetch_add by creators (relaxed: the chunk's
   * release/acquire publishes the memory). */
  _Atomic uint32_t next_idx;
  pthread_mutex_t grow_lock;
} registry;

/* ---- stack.h: a lock-free LIFO of registry objects ---- */

typedef struct stack {
  /* (tag << 32) | top index; 0 index = empty. CAS acq_rel by push and pop. */
  _Atomic uint64_t head;
  /* Approximate length for statistics and heuristics (relaxed). */
  _Atomic int64_t count;
} stack;

/* ---- sizeclass.h: size classes ---- */

#define SIZECLASS_SHIFT 8 /* 256-byte units */
#define SIZECLASS_MIN_SIZE ((size_t)1 << SIZECLASS_SHIFT)
#define SIZECLASS_MAX_SIZE ((size_t)1 << 20)
/* Classes up to SIZECLASS_SLAB_MAX (32 KiB): four per power of two above
 * 1 KiB. Above it, two (sizeclass.h). */
#define SIZECLASS_FINE_COUNT 24
#define SIZECLASS_COUNT 34

/* Most blocks one magazine holds (pool/magazine.h sizes its slots by it). */
#define SIZECLASS_MAG_MAX 64

/* Chunks: slabs are runs of chunks of this many bytes cut from shared
 * granules (pool/span.h): one chunk for classes of which it holds at least
 * SIZECLASS_CHUNK_MIN_BLOCKS blocks (up to 4 KiB), the fewest chunks that
 * waste at most an eighth for larger ones (sizeclass.c). Smaller chunks,
 * and chunk slabs for classes of 8 blocks a chunk rather than 16, held
 * less memory at the same speed within the spread (bench/DECISIONS.md,
 * "Chunks of 32 KiB, one chunk for eight blocks"). A granule of 2 MiB
 * holds 64 chunks, the most a span's mask takes. */
#define SIZECLASS_CHUNK_SHIFT 15
#define SIZECLASS_CHUNK ((size_t)1 << SIZECLASS_CHUNK_SHIFT)
#define SIZECLASS_CHUNK_MIN_BLOCKS 8

/* Classes above this have no slabs: their blocks are carved one by one from
 * the large segments and go back there, coalescing, when the depot gives
 * them back (pool/large.h, class blocks). Slabs of segregated classes keep
 * a class's memory until every block of a slab is free, which for large
 * classes held far more memory than class blocks do. The slab of a class
 * near here is a run of a few chunks (sizeclass.c): 96 KiB for two blocks
 * of 48 KiB, 64 KiB for one of 64 KiB. Those two classes have slabs: as
 * class blocks they sat among large blocks and split the free memory those
 * needed (bench/DECISIONS.md, "Slabs up to 64 KiB, class blocks above"). */
#define SIZECLASS_SLAB_MAX ((size_t)64 << 10)
/* Most bytes of one magazine of those classes (at least one block): for a
 * thread on one stream (mag_max), and for any other (mag_cap). */
#define SIZECLASS_SEG_MAG_BYTES ((size_t)1 << 20)
#define SIZECLASS_SEG_MAG_FEW_BYTES ((size_t)256 << 10)

/* Per-class tables, filled once by sizeclass_init(). */
typedef struct sizeclass_info {
  size_t size;      /* block bytes */
  size_t slab_size; /* bytes of one slab: chunks * SIZECLASS_CHUNK, or a granularity multiple */
  uint32_t blocks;  /* blocks per slab */
  uint32_t mag_cap; /* blocks per magazine to start with (slabs carve these) */
  uint32_t mag_max; /* most blocks per magazine (magazine_bytes / size) */
  uint32_t chunks;  /* a slab is this many contiguous chunks of a span (span.h); 0: whole granules */
  uint32_t seg;     /* 1: no slabs, class blocks of the large segments (size > SIZECLASS_SLAB_MAX) */
  uint64_t magic;   /* offset * magic >> 48 == offset / size, exact for offsets < 2^24 */
} sizeclass_info;

/* ---- pagemap.h: address -> slab descriptor ---- */

#define PAGEMAP_PAGE_SHIFT 15
#define PAGEMAP_ADDR_BITS 48
#define PAGEMAP_LEAF_BITS 17
#define PAGEMAP_TOP_BITS (PAGEMAP_ADDR_BITS - PAGEMAP_PAGE_SHIFT - PAGEMAP_LEAF_BITS)

/* An entry: the descriptor of the page's owner, untyped (base names no type
 * of the layers above; the pool stores its slab descriptors, pool/slab.h). */
typedef _Atomic(void *) pagemap_entry;

#endif /* MAGPIE_TYPES_H */
