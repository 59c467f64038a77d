/* Type-stable indexed objects. Lock order: grow_lock is a leaf. */
#include "base/registry.h"

#include <string.h>

#include "base/meta.h"

void registry_init(registry *r, size_t obj_size) {
  memset(r, 0, sizeof *r);
  r->obj_size = obj_size;
  atomic_store_relaxed(&r->next_idx, 1); /* 0 means "none" */
  pthread_mutex_init(&r->grow_lock, NULL);
}

void *registry_new(registry *r) {
  uint32_t idx = atomic_add_relaxed(&r->next_idx, 1);
  uint32_t ci = idx >> REGISTRY_CHUNK_SHIFT;
  if (ci >= REGISTRY_MAX_CHUNKS) {
    atomic_sub_relaxed(&r->next_idx, 1);
    return NULL;
  }
  char *chunk = atomic_load_acquire(&r->chunks[ci]);
  if (chunk == NULL) {
    pthread_mutex_lock(&r->grow_lock);
    chunk = atomic_load_relaxed(&r->chunks[ci]);
    if (chunk == NULL) {
      chunk = meta_alloc(r->obj_size * REGISTRY_CHUNK_OBJS);
      if (chunk != NULL) atomic_store_release(&r->chunks[ci], chunk);
    }
    pthread_mutex_unlock(&r->grow_lock);
    /* The index is lost on failure; out of host memory, that is the least
     * of the caller's problems, and reusing it would need more state. */
    if (chunk == NULL) return NULL;
  }
  registry_link *obj = (registry_link *)(chunk + (size_t)(idx & (REGISTRY_CHUNK_OBJS - 1)) * r->obj_size);
  obj->idx = idx;
  atomic_store_relaxed(&obj->next, 0);
  return obj;
}
