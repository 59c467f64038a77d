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
#include "base/types.h"

void registry_init(registry *r, size_t obj_size);

/* A new zeroed object with its link.idx set; NULL when out of memory or
 * indices. */
void *registry_new(registry *r);

static inline void *registry_get(registry *r, uint32_t idx) {
  char *chunk = atomic_load_acquire(&r->chunks[idx >> REGISTRY_CHUNK_SHIFT]);
  return chunk + (size_t)(idx & (REGISTRY_CHUNK_OBJS - 1)) * r->obj_size;
}

#endif /* MAGPIE_REGISTRY_H */
