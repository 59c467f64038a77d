/* Slab carving and descriptors.
 * Lock order: slab_desc_lock is a leaf. */
#include "slab.h"

#include <pthread.h>
#include <string.h>

#include "depot.h"
#include "heap.h"
#include "meta.h"
#include "sizeclass.h"

static pthread_mutex_t slab_desc_lock = PTHREAD_MUTEX_INITIALIZER;
static slab *slab_desc_free; /* recycled large descriptors; under the lock */

slab *slab_desc_get(void) {
  pthread_mutex_lock(&slab_desc_lock);
  slab *s = slab_desc_free;
  if (s) slab_desc_free = s->lnext;
  pthread_mutex_unlock(&slab_desc_lock);
  if (s == NULL) return meta_alloc(sizeof *s);
  memset(s, 0, sizeof *s);
  return s;
}

void slab_desc_put(slab *s) {
  pthread_mutex_lock(&slab_desc_lock);
  s->lnext = slab_desc_free;
  slab_desc_free = s;
  pthread_mutex_unlock(&slab_desc_lock);
}

int slab_mark_used(slab *s, uint32_t i) {
  uint64_t bit = (uint64_t)1 << (i & 63);
  return (atomic_fetch_or_explicit(&s->inuse[i >> 6], bit, memory_order_relaxed) & bit) == 0;
}

int slab_mark_free(slab *s, uint32_t i) {
  uint64_t bit = (uint64_t)1 << (i & 63);
  return (atomic_fetch_and_explicit(&s->inuse[i >> 6], ~bit, memory_order_relaxed) & bit) != 0;
}

int slab_carve(struct heap *h, unsigned cls, magazine **out) {
  const sizeclass_info *ci = &sizeclass_table[cls];
  slab *s = meta_alloc(sizeof *s);
  if (s == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  s->inuse = meta_alloc(((ci->blocks + 63) / 64) * sizeof(uint64_t));
  if (s->inuse == NULL) {
    meta_free(s);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  int rc = heap_map(h, ci->slab_size, &s->base, &s->raw, &s->raw_size);
  if (rc != MAGPIE_OK) {
    meta_free((void *)s->inuse);
    meta_free(s);
    return rc;
  }
  s->size = ci->slab_size;
  s->bsize = ci->size;
  s->magic = ci->magic;
  s->cls = cls;
  s->nblocks = ci->blocks;
  s->heap = h;

  /* Publish before any block leaves: frees must find the slab. */
  if (pagemap_set(s->base, s->size, s) != MAGPIE_OK) {
    heap_unmap(h, s->base, s->size, s->raw, s->raw_size);
    meta_free((void *)s->inuse);
    meta_free(s);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  magazine *first = NULL;
  uint32_t next = 0;
  while (next < s->nblocks) {
    magazine *m = magazine_get_empty(cls);
    /* Out of host memory: the blocks not yet in a magazine stay unused in
     * the slab (device memory kept, nothing handed out twice). */
    if (m == NULL) break;
    while (m->count < m->cap && next < s->nblocks) {
      /* Highest addresses first, so pops hand out ascending addresses. */
      uint32_t i = s->nblocks - 1 - next++;
      m->slots[m->count++] = (void *)(s->base + (size_t)i * s->bsize);
    }
    if (first == NULL) first = m;
    else depot_put(h, m);
  }
  heap_slab_added(h, s);
  if (first == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  *out = first;
  return MAGPIE_OK;
}
