/* Type-stable objects addressed by 32-bit index (magazines, event nodes).
 *
 * Objects are never returned to the host allocator, so a stale index always
 * names readable memory of the right type: this is what lets the lock-free
 * stacks read a node's link after another thread popped it (the tag in the
 * stack head then makes that thread's compare-and-swap fail). Index 0 is
 * never handed out and means "none".
 *
 * Lock order: registry.grow_lock is a leaf (nothing is taken under it). */
#ifndef MAGPIE_REGISTRY_H
#define MAGPIE_REGISTRY_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"

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

void registry_init(registry *r, size_t obj_size);

/* A new zeroed object with its link.idx set; NULL when out of memory or
 * indices. */
void *registry_new(registry *r);

static inline void *registry_get(registry *r, uint32_t idx) {
  char *chunk = atomic_load_acquire(&r->chunks[idx >> REGISTRY_CHUNK_SHIFT]);
  return chunk + (size_t)(idx & (REGISTRY_CHUNK_OBJS - 1)) * r->obj_size;
}

#endif /* MAGPIE_REGISTRY_H */
