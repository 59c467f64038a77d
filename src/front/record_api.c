/* magpie_record_stream: the public entry point of record_stream (the
 * parking itself is pool/record.c), and block_resolve, which it shares
 * with magpie_ipc_export. Takes no lock of its own; the record
 * table's lock is a leaf (pool/record.h). */
#include "base/error.h"
#include "base/pagemap.h"
#include "front/block.h"
#include "front/global.h"
#include "front/observe.h"
#include "heap/heap.h"
#include "pool/record.h"

int block_resolve(const char *fn, void *ptr, slab **out_sl, size_t *out_bytes, int *graph) {
  *graph = 0;
  if (ptr == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: NULL pointer", fn);
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  slab *sl = pagemap_lookup((uintptr_t)ptr);
  if (sl == NULL) return error_set(MAGPIE_ERR_INVALID_POINTER, "%s(%p): not a pointer returned by magpie", fn, ptr);
  if (sl->cls == SLAB_LARGE && large_is_graph(sl, (uintptr_t)ptr)) {
    *graph = 1;
    return MAGPIE_OK;
  }
  uint32_t bi = 0;
  size_t bytes = sl->bsize;
  if (!slab_block_index(sl, (uintptr_t)ptr, &bi) ||
      (sl->cls == SLAB_LARGE && !large_lookup(&sl->heap->large, (uintptr_t)ptr, &bytes)))
    return error_set(MAGPIE_ERR_INVALID_POINTER, "%s(%p): not the start of an allocated block", fn, ptr);
  /* Checked mode knows which small and class blocks are handed out: a
   * freed one is refused (without it, a freed block still in a magazine
   * looks like any other). */
  int cls_block = sl->cls == SLAB_LARGE && large_class_of(sl, (uintptr_t)ptr) >= 0;
  if (global_config()->check && ((sl->cls != SLAB_LARGE && !slab_is_used(sl, bi)) ||
                                 (cls_block && !large_class_is_used(sl->seg, (uintptr_t)ptr))))
    return error_set(MAGPIE_ERR_INVALID_POINTER, "%s(%p): the block is free (checked mode)", fn, ptr);
  *out_sl = sl;
  *out_bytes = bytes;
  return MAGPIE_OK;
}

MAGPIE_API int magpie_record_stream(void *ptr, cudaStream_t stream) {
  slab *sl = NULL;
  size_t bytes = 0;
  int graph = 0;
  int rc = block_resolve("magpie_record_stream", ptr, &sl, &bytes, &graph);
  if (rc != MAGPIE_OK) return rc;
  /* A graph pool's block: the pool's rules decide its reuse (pool/gpool.h);
   * no entry is kept for it. */
  if (graph) return MAGPIE_OK;
  if (stream == BACKEND_STREAM_PER_THREAD)
    return error_set(MAGPIE_ERR_INVALID_STREAM,
                     "magpie_record_stream(%p): the per-thread default stream handle "
                     "names another stream in every thread; pass a stream created by the application",
                     ptr);
  const backend_ops *ops = global_ops();
  uint64_t id = 0;
  int dev = -1;
  /* A capturing stream cannot be asked its id (device/backend.h), and a
   * use recorded there happens at each replay, not now. */
  if (backend_capture_state(ops, stream, &id) != BACKEND_CAPTURE_NONE)
    return error_set(MAGPIE_ERR_CAPTURE,
                     "magpie_record_stream(%p): stream %p is capturing a CUDA graph; a block the graph uses must "
                     "stay allocated while the graph may be replayed (blocks allocated during the capture follow "
                     "their graph pool's rules)",
                     ptr, (void *)stream);
  if (ops->stream_id(stream, &id) != MAGPIE_OK || ops->stream_device(stream, &dev) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_record_stream(%p): stream %p is not valid: %s", ptr,
                     (void *)stream, backend_error_detail());
  heap *h = sl->heap;
  if (dev != h->device)
    return error_set(MAGPIE_ERR_INVALID_STREAM,
                     "magpie_record_stream(%p): stream %p is on device %d, the block "
                     "on device %d",
                     ptr, (void *)stream, dev, h->device);
  stream_rec *rec = epoch_stream_acquire(&h->epochs, id);
  if (rec == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_record_stream: out of host memory");
  /* A class block of a segment is parked and freed as its class's are. */
  rc = record_add(&h->records, sl, large_block_class(sl, (uintptr_t)ptr), (uintptr_t)ptr, bytes, rec, stream);
  epoch_stream_release(rec); /* the entry took its own reference */
  if (rc == MAGPIE_ERR_INVALID_POINTER) return error_set(rc, "magpie_record_stream(%p): the block is free", ptr);
  if (rc != MAGPIE_OK) return error_set(rc, "magpie_record_stream(%p): out of host memory", ptr);
  if (unlikely(atomic_load_relaxed(&front_st.slow_paths) & SLOW_OBSERVE)) observe_record(ptr, stream);
  return MAGPIE_OK;
}
