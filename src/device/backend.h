/* The device layer: a table of operations, one implementation per device
 * kind (backend_cuda.c; the simulated device's sim/backend_sim.c, a library
 * of its own that depends on this header alone). These two files are the
 * only ones that know which device they drive; everything above calls
 * through the table.
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

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "magpie.h"

/* event_query's answer for an event whose work has not completed. */
#define BACKEND_NOT_READY (-1)

/* map's flags. EXPORTABLE: the physical memory can be exported to other
 * processes (export_fds); CUDA creates it with a POSIX file descriptor
 * handle type, the simulated device backs it with a memfd. */
#define BACKEND_MAP_EXPORTABLE 1u

/* stream_capture's states (as CUstreamCaptureStatus). */
enum { BACKEND_CAPTURE_NONE = 0, BACKEND_CAPTURE_ACTIVE = 1, BACKEND_CAPTURE_INVALIDATED = 2 };

/* A watcher of the allocator's hand-outs and frees that a device offers
 * (the simulated device's stream-order checker). While it is on, the
 * allocator calls on_handout after handing a block out and on_free before
 * freeing one; both synchronise on their own. */
typedef struct backend_observer {
  /* Block p (at least size bytes) was handed out for work on stream. */
  void (*on_handout)(void *p, size_t size, cudaStream_t stream);
  /* Block p is about to be freed on stream (the stream of its last use),
   * before the allocator may hand it out again. */
  void (*on_free)(void *p, cudaStream_t stream);
  /* Optional (NULL: none): live block p was recorded on stream
   * (magpie_record_stream), so its free also covers the work enqueued on
   * stream before that free. */
  void (*on_record)(void *p, cudaStream_t stream);
  /* On or off: changed only through backend_observer_set (by the device's
   * own switch, and by magpie's set-up for check_streams=1). */
  _Atomic int enabled;
  /* The allocator's word whose bit BACKEND_OBSERVER_BIT copies enabled:
   * its fast paths read the word (relaxed: it only decides whether the
   * slow paths are taken, the calls made); the allocator's other bits are
   * its own. NULL until backend_observer_attach. */
  _Atomic(_Atomic int *) mirror;
} backend_observer;

#define BACKEND_OBSERVER_BIT 1

/* Switches o on or off, and the attached allocator's bit with it. */
void backend_observer_set(backend_observer *o, int on);
/* Makes *flag follow o's state from now on (set-up, once). */
void backend_observer_attach(backend_observer *o, _Atomic int *flag);

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
   * device and by every device whose bit is set in peers (bit d: device d;
   * the caller checked can_access_peer); addr and size are multiples of the
   * granularity. Each granule is its own physical allocation, so any run of
   * granules can be unmapped or exported later. flags: BACKEND_MAP_*. */
  int (*map)(int device, uintptr_t addr, size_t size, unsigned flags, uint64_t peers);
  /* Undoes map or import_map, granule by granule. */
  int (*unmap)(int device, uintptr_t addr, size_t size);
  /* Fallback where VMM is unsupported: a plain device allocation. */
  int (*mem_alloc)(int device, size_t size, uintptr_t *out);
  int (*mem_free)(int device, uintptr_t ptr, size_t size);

  /* The eight operations below are optional (NULL: the device cannot share
   * memory with other devices or processes; callers report that).
   * Peer access (cudaMemPoolSetAccess, cuMemSetAccess). can_access_peer:
   * *can = 1 if memory of device can be made accessible from peer, 0 if the
   * two cannot be connected; MAGPIE_ERR_INVALID_ARGUMENT for device == peer
   * or an unknown device.
   * set_access: [addr, addr+size), granules mapped by map or import_map on
   * device, becomes readable and writable from device and from every device
   * in peers; other devices' rights are unchanged. revoke_access: the same
   * range stops being accessible from every device in peers (cuMemSetAccess
   * with PROT_NONE; device itself is never in peers), other devices' rights
   * unchanged; the caller makes sure no work of those devices still touches
   * it, as a kernel touching memory it may not access faults.
   * peer_enable: without VMM, every mem_alloc allocation of device, present
   * and future, becomes accessible from peer (cuCtxEnablePeerAccess);
   * MAGPIE_OK if it already was. peer_disable undoes it
   * (cuCtxDisablePeerAccess); MAGPIE_OK if it was not enabled. */
  int (*can_access_peer)(int device, int peer, int *can);
  int (*set_access)(int device, uintptr_t addr, size_t size, uint64_t peers);
  int (*revoke_access)(int device, uintptr_t addr, size_t size, uint64_t peers);
  int (*peer_enable)(int device, int peer);
  int (*peer_disable)(int device, int peer);

  /* Sharing with other processes. device_uuid: 16 bytes naming the device
   * the same way in every process of the machine (CUDA: the GPU's UUID),
   * whatever its ordinal there. export_fds: for each granule of
   * [addr, addr+size), mapped with BACKEND_MAP_EXPORTABLE, a new file
   * descriptor for its physical memory, in address order (fds has size /
   * granularity entries); the caller closes them. On failure no descriptor
   * stays open. import_map: maps granule i of [addr, addr+size) (reserved
   * on device, unmapped) to the memory fds[i] exported, in this process or
   * another, readable and writable by device and the devices in peers; the
   * descriptors stay the caller's. The memory lives until every mapping of
   * it, in every process, is unmapped: the exporter's unmap or death leaves
   * an importer's mapping intact. Undone with unmap. */
  int (*device_uuid)(int device, unsigned char uuid[16]);
  int (*export_fds)(int device, uintptr_t addr, size_t size, int *fds);
  int (*import_map)(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers);

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

  /* Wait for all work on the device (never called on an allocation path).
   * A device synchronisation while any stream of the device captures a
   * graph invalidates that capture, in CUDA and in the simulator: callers
   * make it only while no capture they know of is under way (heap.c). */
  int (*device_synchronize)(int device);

  /* Stream capture (CUDA graphs). The capture state of `stream` (an
   * ordinary or per-thread handle; never the legacy stream, 0 or 1, whose
   * use during another thread's capture is itself forbidden): *status is a
   * BACKEND_CAPTURE_* value and, while one is under way, *capture_id the
   * capture's id (unique in the process; 0 when none). Never invalidates a
   * capture: it is the query CUDA allows on a capturing stream.
   * Everything else CUDA forbids during a capture is the caller's to
   * avoid: on a capturing stream, stream_id, stream_id_fast and
   * stream_device fail (MAGPIE_ERR_CAPTURE: CUDA refuses them there, and
   * the capture is invalidated), as does recording an event meant to be
   * queried; a device synchronisation fails while any stream captures.
   * The memory operations (reserve, unreserve, map, unmap, mem_alloc,
   * mem_free, set_access, revoke_access, peer_enable, peer_disable,
   * export_fds, import_map),
   * event_query and event_synchronize run in the
   * relaxed capture mode, so a capture in progress on another thread
   * neither refuses them nor is invalidated by them. */
  int (*stream_capture)(cudaStream_t stream, int *status, uint64_t *capture_id);

  /* Optional (NULL: this module's own): the calling thread's error detail
   * buffer (BACKEND_DETAIL_LEN bytes), for a table implemented in another
   * shared object, which has its own copy of detail.c. Once the table is
   * adopted, both sides read and write the detail there. */
  char *(*error_detail)(void);
  /* Optional (NULL: none): the device's watcher of hand-outs and frees. */
  backend_observer *observer;
} backend_ops;

/* The per-thread default stream's handle (CUDA's cudaStreamPerThread,
 * CU_STREAM_PER_THREAD; the simulated device's too): another stream in
 * every thread. */
#define BACKEND_STREAM_PER_THREAD ((cudaStream_t)0x2)

/* The capture state (BACKEND_CAPTURE_*) of handle s through ops, with
 * *id the capture's id while one is active (else 0): NONE for the legacy
 * handles 0 and 1 (they cannot capture, and must not be asked during
 * another thread's capture), for a table without stream_capture and when
 * the query fails (the caller's next use of s reports an invalid handle).
 * The one form every caller uses: the query CUDA allows on a capturing
 * stream, where it refuses the stream's id.
 * RULE: a stream handle magpie stored earlier (a record entry's, a capture
 * registration's, an import's) is asked this first, before its id or
 * device or an event record on it: CUDA invalidates a capture whose stream
 * is asked its id, and an event recorded there belongs to the capture.
 * The per-thread handle (0x2) names another stream in each thread: a
 * stored one is asked only from the thread that stored it. */
static inline int backend_capture_state(const backend_ops *ops, cudaStream_t s, uint64_t *id) {
  int st = BACKEND_CAPTURE_NONE;
  *id = 0;
  if ((uintptr_t)s <= 1 || ops->stream_capture == NULL || ops->stream_capture(s, &st, id) != MAGPIE_OK)
    return BACKEND_CAPTURE_NONE;
  return st;
}

/* The sharing operations (can_access_peer .. import_map) of from, as they
 * are, into to: what a wrapping table (timing, fault injection) passes
 * through untouched. */
static inline void backend_copy_sharing(backend_ops *to, const backend_ops *from) {
  to->can_access_peer = from->can_access_peer;
  to->set_access = from->set_access;
  to->revoke_access = from->revoke_access;
  to->peer_enable = from->peer_enable;
  to->peer_disable = from->peer_disable;
  to->device_uuid = from->device_uuid;
  to->export_fds = from->export_fds;
  to->import_map = from->import_map;
}

/* The layout a table handed across shared objects must have
 * (magpie_sim_device_table): a version raised by hand when the table's
 * meaning changes, and its size. */
#define BACKEND_ABI_VERSION 5u
#define BACKEND_ABI ((BACKEND_ABI_VERSION << 16) | (unsigned)sizeof(backend_ops))

/* The CUDA driver's table; the simulated device's is found at set-up
 * (src/front/init.c). */
const backend_ops *backend_cuda(void);

/* Size of the error detail buffer, terminating zero included. */
#define BACKEND_DETAIL_LEN 256

/* The reason for the last failed operation on this thread ("" if none). */
const char *backend_error_detail(void);
/* This module's own buffer of the calling thread, whatever table is adopted
 * (what a table's error_detail returns). */
char *backend_local_error_detail(void);
/* Makes the detail live in source's buffer (NULL: this module's own), for
 * reads and writes alike; at set-up, when a table is adopted. */
void backend_use_error_detail(char *(*source)(void));
/* Implementations set it (printf-style). */
void backend_set_error_detail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif /* MAGPIE_BACKEND_H */
