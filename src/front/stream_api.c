/* magpie_stream_retire: the application is about to destroy a stream. What
 * magpie holds under its handle is sealed while the handle is still valid,
 * so that no later call passes the handle to the driver (on a GPU,
 * cuStreamGetId on a destroyed handle crashes the process; measured with
 * CUDA 13.0, driver 580) and nothing waits for a device synchronisation
 * that one event covers: blocks recorded on it (pool/record.c,
 * record_retire) and the calling thread's cache slots for it
 * (tcache/tcache_reclaim.c, tcache_stream_retire). Takes no lock of its own; the
 * record table's lock is a leaf (pool/record.h). */
#include "base/error.h"
#include "front/global.h"
#include "heap/heap.h"
#include "pool/record.h"
#include "tcache/tcache.h"

MAGPIE_API int magpie_stream_retire(cudaStream_t stream) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  if (tcache_special_handle(stream))
    return error_set(MAGPIE_ERR_INVALID_STREAM,
                     "magpie_stream_retire(%p): the default and per-thread streams are never destroyed",
                     (void *)stream);
  const backend_ops *ops = global_ops();
  uint64_t id = 0;
  int dev = -1;
  /* A capturing stream cannot be asked its id (device/backend.h) nor
   * destroyed. */
  if (backend_capture_state(ops, stream, &id) != BACKEND_CAPTURE_NONE)
    return error_set(MAGPIE_ERR_CAPTURE,
                     "magpie_stream_retire(%p): the stream is capturing a CUDA graph; end the capture first",
                     (void *)stream);
  if (ops->stream_id(stream, &id) != MAGPIE_OK || ops->stream_device(stream, &dev) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_INVALID_STREAM,
                     "magpie_stream_retire(%p): not a valid stream (call it before destroying the stream): %s",
                     (void *)stream, backend_error_detail());
  tcache_stream_retire(stream, id);
  heap *h = heap_peek(dev);
  if (h == NULL) return MAGPIE_OK; /* nothing allocated on that device yet */
  stream_rec *rec = epoch_stream_acquire(&h->epochs, id);
  if (rec == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_stream_retire: out of host memory");
  rc = record_retire(&h->records, rec, stream);
  epoch_stream_release(rec);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_stream_retire(%p): cannot record an event on the stream: %s", (void *)stream,
                     backend_error_detail());
  return MAGPIE_OK;
}
