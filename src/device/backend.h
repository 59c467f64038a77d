/* The device layer: a table of operations, one implementation per device
 * kind (backend_cuda.c, backend_sim.c). These two files are the only ones
 * that know which device they drive; everything above calls through the
 * table.
 *
 * Conventions: every operation returns MAGPIE_OK or a magpie_error code
 * (MAGPIE_ERR_BACKEND for a driver failure, MAGPIE_ERR_OUT_OF_MEMORY when
 * the device has no physical memory left, MAGPIE_ERR_INVALID_STREAM for a
 * stream handle that is not valid). A failing operation leaves nothing half
 * done (a failed map leaves the range unmapped) and puts a short reason in
 * backend_error_detail() for the error message. No operation aborts.
 *
 * Threading: every operation may be called from any thread at any time after
 * init() returned MAGPIE_OK.
 */
#ifndef MAGPIE_BACKEND_H
#define MAGPIE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "magpie.h"

/* event_query's answer for an event whose work has not completed. */
#define BACKEND_NOT_READY (-1)

typedef struct backend_ops {
  const char *name; /* "cuda" or "sim" */
  /* Events to create ahead of need, at heap creation and in the background
   * when the pool runs low (0: create on demand). Where creating an event
   * can stall behind a busy device (CUDA), none is created on an
   * allocation path in the steady state. */
  int event_prefill;

  /* Load the driver / start the simulator. MAGPIE_ERR_NO_DEVICE if there is
   * no device to drive. Idempotent. */
  int (*init)(void);
  int (*device_count)(int *count);
  int (*mem_info)(int device, size_t *free_bytes, size_t *total_bytes);

  /* Virtual memory. granularity: the unit of map/unmap (2 MiB on an H200).
   * vmm_supported 0 means reserve/map/unmap are unavailable and the heap
   * uses mem_alloc/mem_free for whole slabs instead. */
  int (*vmm_supported)(int device, int *supported);
  int (*granularity)(int device, size_t *bytes);
  int (*reserve)(int device, size_t size, uintptr_t *base);
  int (*unreserve)(int device, uintptr_t base, size_t size);
  /* Back [addr, addr+size) with physical memory readable and writable by the
   * device; addr and size are multiples of the granularity. */
  int (*map)(int device, uintptr_t addr, size_t size);
  int (*unmap)(int device, uintptr_t addr, size_t size);
  /* Fallback where VMM is unsupported: a plain device allocation. */
  int (*mem_alloc)(int device, size_t size, uintptr_t *out);
  int (*mem_free)(int device, uintptr_t ptr, size_t size);

  /* Events (opaque handles). event_query returns MAGPIE_OK once the work
   * captured by the last record completed, BACKEND_NOT_READY before. A query
   * that reports completion orders that work before the caller (acquire). */
  int (*event_create)(int device, void **event);
  int (*event_destroy)(void *event);
  int (*event_record)(void *event, cudaStream_t stream);
  int (*event_query)(void *event);
  int (*event_synchronize)(void *event);
  int (*stream_wait_event)(cudaStream_t stream, void *event);

  /* Stream identity. stream_id is on the allocation hot path: it must be the
   * cheapest correct way to get an id that is unique over the life of the
   * process (never reused when a handle value is). Special handles (0,
   * per-thread) give the id of the stream they name for the calling thread
   * and its current device. */
  int (*stream_id)(cudaStream_t stream, uint64_t *id);
  /* The allocation fast path's form of stream_id, for ordinary handles only
   * (not 0, 1, 2) and only after init() succeeded: 0 with the id, nonzero
   * on any failure, with no error detail (the slow path then calls
   * stream_id, which says why). It costs the caller no frame beyond the
   * id's own: for CUDA it jumps straight into the driver. */
  int (*stream_id_fast)(cudaStream_t stream, unsigned long long *id);
  int (*stream_device)(cudaStream_t stream, int *device);

  /* Wait for all work on the device (never called on an allocation path). */
  int (*device_synchronize)(int device);
} backend_ops;

/* The two implementations. */
const backend_ops *backend_cuda(void);
const backend_ops *backend_sim(void);

/* The reason for the last failed operation on this thread ("" if none). */
const char *backend_error_detail(void);
/* Implementations set it (printf-style). */
void backend_set_error_detail(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));

#endif /* MAGPIE_BACKEND_H */
