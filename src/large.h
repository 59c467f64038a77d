/* Large blocks: requests above the largest size class, each mapped in
 * granularity units and described by its own slab descriptor. Freed large
 * blocks are cached with a ticket (one event per free: the 200 ns record is
 * small next to a 35 us mapping) and reused best-fit by a stream that may
 * use them; under memory pressure they are unmapped.
 *
 * Lock order: large_cache.lock is a leaf and no driver call is made while it
 * is held (event queries and mapping happen outside). */
#ifndef MAGPIE_LARGE_H
#define MAGPIE_LARGE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "magazine.h"

struct heap;
struct slab;

typedef struct large_cache {
  pthread_mutex_t lock;
  struct slab *free; /* cached blocks; under lock */
  /* Relaxed counters for statistics. */
  _Atomic size_t cached_bytes;
  _Atomic size_t in_use_bytes;
} large_cache;

void large_init(large_cache *c);
/* A block of at least size bytes usable by stream_id now. */
int large_alloc(struct heap *h, size_t size, uint64_t stream_id, struct slab **out);
/* Cache a freed block with the ticket sealed on its freeing stream (the
 * cache takes the ticket). MAGPIE_ERR_DOUBLE_FREE if it is already free. */
int large_free(struct heap *h, struct slab *s, const epoch_ticket *t);
/* Unmap cached blocks whose epochs completed (all of them, waiting, if
 * wait). Returns bytes given back. */
size_t large_release_cached(struct heap *h, int wait);

#endif /* MAGPIE_LARGE_H */
