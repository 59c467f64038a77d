/* Graph pools: device memory that captured CUDA graphs own.
 *
 * A graph replays its kernels at fixed addresses for as long as it lives,
 * so memory handed out while a stream captures must stay out of everyone
 * else's reach until the graph is gone. A pool holds that memory: the
 * blocks allocated into it (front/capture.c routes allocations on a
 * capturing stream, or asked for explicitly) are large blocks (large.c)
 * taken ready for every stream and marked in their segment
 * (large_graph_mark), so that their frees come back here, and the pool
 * keeps them, free or not, until it is released. They are never handed to
 * work outside the pool while it lives.
 *
 * Reuse inside a pool. A request comes from a capture c (0: an allocation
 * into the pool outside any capture) on stream s. A free block serves it
 * when it fits within a quarter (blocks are not split) and
 *   - it was freed during a capture: by the same capture on the same
 *     stream (stream order is the graph's order there), or by anyone once
 *     every capture of the pool under way at the free has ended (graphs
 *     that share a pool are replayed in the order they were captured, one
 *     at a time, as with PyTorch's shared pools);
 *   - it was freed outside any capture: once the free's ticket (an event
 *     recorded on the freeing stream) completed, or at once by an
 *     allocation outside any capture on the freeing stream.
 *
 * Release. magpie_graph_pool_release drops the creator's reference: from
 * then on the pool's free blocks, and each block still in use when it is
 * freed, leave the pool (gpool_release, gpool_free's retire list) and go to
 * the heap's limbo, where they wait for a device synchronisation, made only
 * while no capture runs: replays of graphs that used them may still be on
 * any stream. The pool itself goes once it holds no block and no capture
 * uses it.
 *
 * INVARIANT: a gblock is in its set's hash iff it belongs to a pool; used
 *            blocks are on no free list; bytes is the sum of the sizes of
 *            the blocks of all pools of the set.
 *
 * Lock order: gpool_set.lock is a leaf. epoch_ready (a comparison, or one
 * event query on an event recorded outside any capture; never a wait) is
 * the only driver call made under it. */
#ifndef MAGPIE_GPOOL_H
#define MAGPIE_GPOOL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "pool/epoch.h"

typedef struct gblock {
  uintptr_t base;
  size_t size; /* the large block's size */
  struct gpool *pool;
  int used;
  int captured; /* handed to a capture once: a graph may use it until the pool is released */
  /* A free block's origin: the capture of its free (0: outside any) and
   * the freeing stream's id; during a capture, the pool's quiet count at
   * the free (gpool.quiet); outside, the free's ticket (rec NULL: ready). */
  uint64_t free_capture;
  uint64_t free_stream;
  int free_dev; /* the device of the stream of its last free, -1 if unknown */
  uint64_t free_quiet;
  epoch_ticket ticket;
  struct gblock *pnext, *pprev; /* the pool's blocks */
  struct gblock *hnext;         /* hash chain */
} gblock;

typedef struct gpool {
  uint64_t id;
  int released;      /* the creator's reference is gone */
  uint32_t captures; /* captures using the pool now */
  /* Times the pool's captures all ended: a block freed during a capture
   * with free_quiet < quiet may serve any request. */
  uint64_t quiet;
  gblock *blocks;
  size_t bytes, used_bytes;
  struct gpool *next;
} gpool;

typedef struct gpool_set {
  pthread_mutex_t lock;
  gpool *pools;
  gblock **hash;
  size_t hash_cap, hash_count;
  /* Statistics: written under the lock (relaxed), read without it. */
  _Atomic size_t bytes;      /* held by pools */
  _Atomic size_t used_bytes; /* handed out from pools */
  _Atomic uint64_t npools;
} gpool_set;

/* A block leaving its pool for the heap's limbo (gpool_free, gpool_release):
 * base and size; the caller frees the list with gpool_retired_free. */
typedef struct gpool_retired {
  uintptr_t base;
  size_t size;
  int dev; /* the device of the stream that freed it last, -1 if unknown */
  struct gpool_retired *next;
} gpool_retired;

void gpool_set_init(gpool_set *s);
/* A new pool named id (nonzero, unique: the caller's choice). */
int gpool_create(gpool_set *s, uint64_t id);
/* A capture starts (delta 1) or stops (-1) using pool id.
 * MAGPIE_ERR_INVALID_ARGUMENT for an unknown or released pool (start). */
int gpool_capture(gpool_set *s, uint64_t id, int delta);
/* A free block of pool id for a request of need bytes (rounded already)
 * from capture (0: none) on stream id stream. MAGPIE_OK with *out and
 * *bsize; GPOOL_NONE when none may serve; MAGPIE_ERR_INVALID_ARGUMENT for
 * an unknown or released pool. */
#define GPOOL_NONE 1
int gpool_take(gpool_set *s, uint64_t id, size_t need, uint64_t capture, uint64_t stream, uintptr_t *out,
               size_t *bsize);
/* A new block [p, p+size) of pool id, handed out (to capture; 0: none).
 * MAGPIE_ERR_INVALID_ARGUMENT when the pool is gone or released (the caller
 * retires the block). */
int gpool_add(gpool_set *s, uint64_t id, uintptr_t p, size_t size, uint64_t capture);
/* Free block p: during capture `capture` (0: outside any) on stream id
 * `stream` of device dev (-1: unknown, as on a capturing stream), with the
 * free's ticket t (taken over on success; NULL or t->rec NULL: ready). A
 * block that leaves for limbo later drops its ticket: the synchronisation
 * of dev there covers it. *retired: the block when its pool was released
 * (it leaves for limbo), else NULL. *bsize: its size.
 * MAGPIE_ERR_INVALID_POINTER / MAGPIE_ERR_DOUBLE_FREE. */
int gpool_free(gpool_set *s, uintptr_t p, uint64_t capture, uint64_t stream, int dev, epoch_ticket *t, size_t *bsize,
               gpool_retired **retired);
/* Drop the creator's reference to pool id: its free blocks leave (*retired);
 * MAGPIE_ERR_INVALID_ARGUMENT if unknown or released already. */
int gpool_release(gpool_set *s, uint64_t id, gpool_retired **retired);
void gpool_retired_free(gpool_retired *r);
/* The free block of pool id at p handed out again, whatever its free's
 * ticket (a checkpoint restored: the caller orders its use). *bsize: its
 * size. MAGPIE_ERR_INVALID_POINTER if the pool has no block at p,
 * MAGPIE_ERR_DOUBLE_FREE if it is in use, MAGPIE_ERR_INVALID_ARGUMENT for an
 * unknown or released pool. */
int gpool_take_at(gpool_set *s, uint64_t id, uintptr_t p, size_t *bsize);
/* The free blocks of pool id that no capture was ever handed leave it
 * (*retired), as at its release; the others stay, for a graph may replay
 * into them until the pool is released. MAGPIE_ERR_INVALID_ARGUMENT if
 * unknown or released. */
int gpool_trim(gpool_set *s, uint64_t id, gpool_retired **retired);
/* A block of a pool as gpool_blocks lists it. */
typedef struct gpool_info {
  uintptr_t base;
  size_t size;
  int used;
} gpool_info;
/* Up to cap of pool id's blocks into out (newest first); *count: how many
 * it holds. MAGPIE_ERR_INVALID_ARGUMENT if unknown. */
int gpool_blocks(gpool_set *s, uint64_t id, gpool_info *out, size_t cap, size_t *count);
/* Bytes held by pool id (0 if unknown), for tests and statistics. */
size_t gpool_pool_bytes(gpool_set *s, uint64_t id);

#endif /* MAGPIE_GPOOL_H */
