/* magpie_block_info: which block, of what size, on which device (the
 * preload library's question before it frees a pointer). Takes no lock for
 * a small block; a large block's lookup takes large_cache.lock (a leaf). */
#include "heap/heap.h"
#include "pool/large.h"

MAGPIE_API int magpie_block_info(const void *ptr, size_t *size, int *device) {
  slab *sl = pagemap_lookup((uintptr_t)ptr);
  if (device != NULL) *device = sl != NULL ? sl->heap->device : -1;
  uint32_t i = 0;
  size_t bsize = 0;
  if (sl == NULL || !slab_block_index(sl, (uintptr_t)ptr, &i)) return MAGPIE_ERR_INVALID_POINTER;
  if (sl->cls != SLAB_LARGE) bsize = sl->bsize;
  else if (!large_lookup(&sl->heap->large, (uintptr_t)ptr, &bsize)) return MAGPIE_ERR_INVALID_POINTER;
  if (size != NULL) *size = bsize;
  return MAGPIE_OK;
}
