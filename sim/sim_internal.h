/* The simulated device's internal interface, shared by sim_stream.c,
 * sim_event.c, sim_memory.c, sim_graph.c and backend_sim.c (and the module
 * tests).
 *
 * The design rule every part follows: the simulator creates only CUDA's
 * happens-before edges (see include/magpie_sim.h). A worker thread (one per
 * stream) never performs a release that a host thread or another worker
 * acquires, except where CUDA orders the two: completion cells (event
 * record, stream synchronize, stream waits) and device synchronize. The
 * consequences for the data structures:
 *   - stream queues are lock-free MPSC queues: producers release, the worker
 *     acquires, one edge per enqueued node; the wake-up adds no edge;
 *   - objects touched by a worker and by other threads are freed by the
 *     thread that already holds every edge (the worker itself for its
 *     stream, the reaper thread for completion cells), never by whichever
 *     thread happens to drop the last reference, because a last-reference
 *     acquire would order one stream's work before another thread's;
 *   - stream capture (sim_graph.c) is host-side only: a capture records
 *     closures instead of enqueueing them, a graph launch enqueues copies
 *     of them as ordinary launches, and no worker reads either.
 * Failures set backend_set_error_detail() and return a magpie_error code;
 * the public wrappers turn the detail into the simulator's last error of
 * the thread (magpie_sim_last_error).
 *
 * Dependencies: the device interface (device/backend.h) and the public
 * headers only; nothing of the allocator.
 */
#ifndef MAGPIE_SIM_INTERNAL_H
#define MAGPIE_SIM_INTERNAL_H

#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "device/backend.h"
#include "magpie.h"
#include "magpie_sim.h"

#define SIM_MAX_DEVICES 16
/* Unit of map/unmap and alignment of every reservation and allocation. */
#define SIM_GRANULARITY ((size_t)2 << 20)
#define SIM_DEFAULT_CAPACITY ((size_t)4 << 30)
/* Stream handles that can exist at once (destroyed ones are recycled). */
#define SIM_MAX_HANDLES 16384
/* Streams per device that can exist at once, counting destroyed streams
 * whose workers are still draining, default and per-thread streams. */
#define SIM_MAX_STREAMS 4096

/* For arithmetic meant to wrap (hashes): exempt from clang's
 * -fsanitize=unsigned-integer-overflow. */
#if defined(__clang__)
#define SIM_WRAPS __attribute__((no_sanitize("unsigned-integer-overflow")))
#else
#define SIM_WRAPS
#endif

/* The simulated device's table (backend_sim.c); outside the simulator,
 * through magpie_sim_device_table. */
const backend_ops *backend_sim(void);

/* Futex wait and wake on a 32-bit atomic. ThreadSanitizer does not see
 * these system calls, so they add no happens-before edge: the atomics around
 * them carry exactly the edges the simulator means. Spurious returns are
 * allowed; callers re-check. */
static inline void sim_futex_wait(_Atomic uint32_t *word, uint32_t expected) {
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static inline void sim_futex_wake_one(_Atomic uint32_t *word) {
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static inline void sim_futex_wake_all(_Atomic uint32_t *word) {
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* ---- configuration, start-up, errors (sim_stream.c) ---- */

/* Puts a printf-style reason in backend_error_detail() and returns code. */
int sim_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* For the public magpie_sim_* functions: if rc is an error, makes it the
 * thread's last error of the simulator (magpie_sim_last_error), with
 * "fn: detail" as the message. Returns rc. */
int sim_public_result(const char *fn, int rc);

/* Reads the environment once (thread-safe) and starts the reaper. Returns
 * MAGPIE_OK, or MAGPIE_ERR_CONFIG with the offending variable in the detail
 * on every call if a variable was malformed. */
int sim_init(void);
/* MAGPIE_OK, or MAGPIE_ERR_NO_DEVICE (detail set) in a child forked after
 * the simulator started: nothing of it may be used there. */
int sim_usable(void);
/* Number of simulated devices (valid after sim_init succeeded). */
int sim_device_count(void);
/* sim_init, then: is `device` one of the simulated devices? MAGPIE_OK or
 * the error (set with sim_fail). */
static inline int sim_check_device(int device) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  if (device < 0 || device >= sim_device_count())
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d does not exist (%d simulated)", device, sim_device_count());
  return MAGPIE_OK;
}
/* The calling thread's current device. */
int sim_current_device(void);
int sim_set_current_device(int device);

/* Parses a decimal count, with an optional k/m/g suffix (powers of 1024)
 * when allow_suffix. Returns 0 on success, -1 on a malformed value or
 * overflow. */
int sim_parse_size(const char *text, int allow_suffix, uint64_t *out);

/* ---- streams (sim_stream.c) ---- */

struct sim_stream;
struct sim_cell;

/* A stream handle is the address of a slot in sim_slots. Slots live for the
 * whole process; destroying a stream empties its slot and pushes it on a
 * LIFO free list, so the next stream created gets the most recently
 * destroyed handle, with a new id.
 *
 * INVARIANT: id != 0 iff the slot holds a live (not destroyed) stream, and
 * then stream and device describe that stream. Ids are never reused.
 *
 * The fields are atomic so that stream_id on one thread and destroy on
 * another do not race on plain memory; a handle used while another thread
 * destroys it is still the caller's bug (CUDA has the same rule).
 * id, stream, device: written by the creating thread (stream and device
 *   first, then id with release) and by the destroying thread (id cleared
 *   first); read by any thread resolving the handle. stream_id loads id
 *   relaxed (it needs only the value); sim_stream_resolve loads id with
 *   acquire, pairing with the creator's release, before using stream.
 * next_free: only under the slot lock in sim_stream.c. */
struct sim_slot {
  _Alignas(64) _Atomic uint64_t id;
  _Atomic(struct sim_stream *) stream;
  _Atomic int device;
  uint32_t next_free; /* index + 1 of the next free slot, 0 = none */
};

extern struct sim_slot sim_slots[SIM_MAX_HANDLES];

/* Id of a special handle (0, 1, MAGPIE_SIM_STREAM_PER_THREAD) for the
 * calling thread's current device, creating the stream on first use; 0 for
 * anything that is not a valid handle. */
uint64_t sim_stream_id_slow(cudaStream_t h);

/* The allocation hot path: a range check and one load for a created
 * stream's handle; special handles take the (still lock-free once created)
 * slow path. 0 means invalid (destroyed, or not a handle). */
extern _Atomic uint32_t sim_capture_live;
/* CUDA refuses a capturing stream's identity: cuStreamGetId,
 * cuStreamGetDevice and cuStreamGetFlags on it fail with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the capture, in any
 * capture mode (measured: H100, CUDA 13.0, driver 580); cuStreamGetCtx and
 * the capture queries pass. 1 (detail set, capture invalidated, counted)
 * if h's stream captures; 0 otherwise. what: "asked its id", ... */
int sim_capture_identity_refused(cudaStream_t h, const char *what);

static inline uint64_t sim_stream_id(cudaStream_t h) {
  uintptr_t base = (uintptr_t)sim_slots, p = (uintptr_t)h;
  uint64_t id;
  if (p >= base && p - base < sizeof sim_slots && (p - base) % sizeof(struct sim_slot) == 0)
    id = atomic_load_explicit(&sim_slots[(p - base) / sizeof(struct sim_slot)].id, memory_order_relaxed);
  else id = sim_stream_id_slow(h);
  if (id != 0 && atomic_load_explicit(&sim_capture_live, memory_order_relaxed) != 0 &&
      sim_capture_identity_refused(h, "asked its id"))
    return 0;
  return id;
}

/* The device of the stream h names, or -1 if h is invalid. */
int sim_stream_device_of_handle(cudaStream_t h);
/* Resolves h (creating a default or per-thread stream on first use).
 * MAGPIE_ERR_INVALID_STREAM for a destroyed or unknown handle. */
int sim_stream_resolve(cudaStream_t h, struct sim_stream **out);
int sim_stream_device(const struct sim_stream *s);

int sim_stream_create(cudaStream_t *out);
int sim_stream_destroy(cudaStream_t h);
int sim_stream_launch(cudaStream_t h, void (*fn)(void *), void *arg);

/* One unit of launched work: what a launch enqueues and a graph holds. */
struct sim_closure {
  void (*fn)(void *);
  void *arg;
};

/* Enqueues n launches on s, in order, as n magpie_sim_launch calls would
 * once s is resolved (the stream-order checker sees n launches; each waits
 * for room in s's queue, MAGPIE_SIM_QUEUE_DEPTH). Every node is allocated
 * first, so a failure (out of host memory) enqueues nothing. Knows nothing
 * of captures: callers have asked sim_capture_enqueue first. */
int sim_stream_enqueue_launches(struct sim_stream *s, const struct sim_closure *work, size_t n);
int sim_stream_wait(cudaStream_t waiter, cudaStream_t waited);
int sim_stream_synchronize(cudaStream_t h);
int sim_stream_device_synchronize(int device);

/* Enqueue on s a marker that completes c when it runs. On success the
 * queue owns one of the caller's references to c; on failure the caller
 * still owns it. */
int sim_stream_enqueue_marker(struct sim_stream *s, struct sim_cell *c);
/* Enqueue on s a wait: later work on s starts after c completed. Takes over
 * one reference like sim_stream_enqueue_marker. */
int sim_stream_enqueue_wait(struct sim_stream *s, struct sim_cell *c);

/* Whether h is the default stream (0) or the legacy handle (1), both the
 * device's default stream here; only these two. */
static inline int sim_stream_is_legacy(cudaStream_t h) { return h == NULL || h == (cudaStream_t)1; }

/* ---- completion cells and events (sim_event.c) ---- */

/* A cell is one point on one stream: it completes when the marker that was
 * enqueued for it runs. Reference-counted; the last reference hands it to
 * the reaper thread, which frees it. NULL when out of host memory. */
struct sim_cell *sim_event_cell_new(uint32_t refs);
void sim_event_cell_ref(struct sim_cell *c);
void sim_event_cell_unref(struct sim_cell *c);
/* Marks c complete (release) and wakes its waiters; called by the worker
 * running the marker. */
void sim_event_cell_complete(struct sim_cell *c);
/* 1 if complete (acquire: the marked work happens before the caller). */
int sim_event_cell_is_complete(struct sim_cell *c);
/* Blocks until complete (acquire). */
void sim_event_cell_wait(struct sim_cell *c);
/* Starts the reaper thread; called once by sim_init. */
void sim_event_start_reaper(void);

int sim_event_create(int device, magpie_sim_event *out);
int sim_event_destroy(magpie_sim_event e);
int sim_event_record(magpie_sim_event e, cudaStream_t s);
/* MAGPIE_OK when complete, MAGPIE_SIM_NOT_READY before, or an error. */
int sim_event_query(magpie_sim_event e);
int sim_event_synchronize(magpie_sim_event e);
int sim_event_stream_wait(cudaStream_t s, magpie_sim_event e);

/* ---- memory (sim_memory.c) ---- */

/* Reads MAGPIE_SIM_MEMORY and MAGPIE_SIM_VMM, and raises the soft limit of
 * open descriptors to the hard one (each exportable granule keeps one);
 * called once by sim_init. Returns MAGPIE_OK or MAGPIE_ERR_CONFIG with the
 * reason in detail. */
int sim_memory_configure(char *detail, size_t detail_len);
/* Capacity of one device (tests set small ones). Bytes already in use stay
 * in use; a capacity below them leaves no free memory until they are
 * given back. */
int sim_memory_set_capacity(int device, size_t bytes);
/* Whether reserve/map/unmap are offered (MAGPIE_SIM_VMM). */
int sim_memory_vmm_supported(void);
void sim_memory_set_vmm(int supported);

int sim_memory_info(int device, size_t *free_bytes, size_t *total_bytes);
int sim_memory_reserve(int device, size_t size, uintptr_t *base);
int sim_memory_unreserve(int device, uintptr_t base, size_t size);
/* As the device table's map (flags: BACKEND_MAP_*; peers: devices that
 * may access the granules besides device). */
int sim_memory_map(int device, uintptr_t addr, size_t size, unsigned flags, uint64_t peers);
/* Undoes map or import_map; capacity comes back for the granules map
 * mapped, not for imported ones (they took none). */
int sim_memory_unmap(int device, uintptr_t addr, size_t size);
int sim_memory_alloc(int device, size_t size, uintptr_t *out);
int sim_memory_free(int device, uintptr_t ptr, size_t size);

/* Access rights and sharing, as the device table's operations of the same
 * names (device/backend.h). set_access, revoke_access, peer_enable,
 * peer_disable, export_fds and import_map follow the capture rule of the
 * calls above
 * (sim_capture_unsafe_call). */
int sim_memory_can_access_peer(int device, int peer, int *can);
/* Whether device's memory can be opened to peer (magpie_sim_set_peer_capable). */
int sim_memory_set_peer_capable(int device, int peer, int capable);
int sim_memory_set_access(int device, uintptr_t addr, size_t size, uint64_t peers);
int sim_memory_revoke_access(int device, uintptr_t addr, size_t size, uint64_t peers);
int sim_memory_peer_enable(int device, int peer);
int sim_memory_peer_disable(int device, int peer);
int sim_memory_export_fds(int device, uintptr_t addr, size_t size, int *fds);
int sim_memory_import_map(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers);
/* magpie_sim_access_check and magpie_sim_launch_access, without the
 * thread's last error. */
int sim_memory_access_check(int device, uintptr_t p, size_t n);
int sim_memory_launch_access(cudaStream_t h, void (*fn)(void *), void *arg, const void *p, size_t n);

/* ---- stream capture and graphs (sim_graph.c; rules in magpie_sim.h) ---- */

struct sim_capture; /* one capture under way, owned by its stream's slot */

/* s's capture slot: the capture under way on s, or NULL. Read and written
 * only under the capture lock of sim_graph.c, by host threads; the worker
 * never touches it. */
struct sim_capture **sim_stream_capture_slot(struct sim_stream *s);

/* Captures under way in the process. Written (relaxed) only under the
 * capture lock, which orders the writers; read relaxed without the lock by
 * the enqueue paths, which take the lock only when it is nonzero. A thread
 * ordered after a begin (by program order or any happens-before edge) sees
 * it nonzero by coherence; a thread not ordered with a begin or an end was
 * concurrent with it, and either answer is a correct serialisation. */
static inline int sim_capture_any(void) { return atomic_load_explicit(&sim_capture_live, memory_order_relaxed) != 0; }

/* The hooks below are called by host threads, only while sim_capture_any()
 * (or, for events, while the event is marked as recorded in a capture).
 * Each returns MAGPIE_OK to let the operation go on, or an error with the
 * detail set: MAGPIE_ERR_CAPTURE for a call the rules forbid (counted, the
 * concerned captures invalidated) or for work enqueued on a stream whose
 * capture was already invalidated (refused, not counted). h is the handle
 * the caller named (for the legacy-stream rule), s the stream it resolved. */

/* Launches (n closures, in order). *taken: 1 if they were recorded into
 * s's capture (the caller enqueues nothing), 0 if they run as usual. */
int sim_capture_enqueue(cudaStream_t h, struct sim_stream *s, const struct sim_closure *work, size_t n, int *taken);
/* An event record on s. *capture_id: the capture the record belongs to
 * (the caller enqueues nothing and marks the event), or 0 if it is an
 * ordinary record. */
int sim_capture_record(cudaStream_t h, struct sim_stream *s, uint64_t *capture_id);
/* A stream wait: waiter (ha, a) on waited (hb, b). */
int sim_capture_stream_wait(cudaStream_t ha, struct sim_stream *a, cudaStream_t hb, struct sim_stream *b);
/* A wait of (h, s) on event e, whose last record belongs to capture
 * event_capture (0: none) and made a cell (recorded != 0) or not. *skip: 1
 * when the wait is already satisfied by the capture's order (the caller
 * enqueues nothing). */
int sim_capture_event_wait(cudaStream_t h, struct sim_stream *s, magpie_sim_event e, uint64_t event_capture,
                           int recorded, int *skip);
/* A query or synchronize (what) of event e, recorded in capture
 * event_capture (nonzero): always refused; invalidates that capture if it
 * is still under way. */
int sim_capture_event_refuse(magpie_sim_event e, uint64_t event_capture, const char *what);
int sim_capture_stream_synchronize(cudaStream_t h, struct sim_stream *s);
int sim_capture_device_synchronize(int device);
int sim_capture_stream_destroy(cudaStream_t h, struct sim_stream *s);
/* s is retired (destroyed, or a per-thread stream whose thread exits):
 * a capture still under way on it is dropped without a graph. */
void sim_capture_stream_retire(struct sim_stream *s);
/* For the simulator's own closures (the checker's poisoning under
 * AddressSanitizer), with none of the rules, since they are not the user's
 * calls: records work into s's capture if s captures. 1: recorded; -1: s's
 * capture is invalidated, or no host memory (nothing recorded, and no
 * graph will run it); 0: s does not capture. Any time, not only while
 * sim_capture_any(). */
int sim_capture_adopt(struct sim_stream *s, const struct sim_closure *work);
/* A call CUDA counts as potentially unsafe during a capture (what:
 * "mapping device memory", "querying an event", ...) by the calling
 * thread: refused when the thread's capture mode prohibits it. Measured on
 * an H100 (CUDA 13.0, driver 580): while another thread captures in the
 * global mode, a thread in the global mode that allocates or maps memory,
 * queries or synchronises an event recorded outside the capture, or
 * queries or synchronises a stream of its own is refused and the capture
 * invalidated; in the relaxed mode all of these pass. Costs one
 * thread-local read in the relaxed mode. */
int sim_capture_unsafe_call(const char *what);
/* Sets the calling thread's capture mode (no validation), returns the old. */
int sim_capture_exchange_mode(int mode);
/* The capture state of h, as magpie_sim_stream_capture_info. */
int sim_capture_info(cudaStream_t h, int *status, uint64_t *id);

/* ---- stream-order checker (sim_check.c; model in its header comment) ---- */

struct sim_vc;           /* a vector clock: stream id -> operation count */
struct sim_check_stream; /* the checker's state of one stream */

/* The checker's state slot of s (under the checker's lock) and s's id. */
struct sim_check_stream **sim_stream_check_state(struct sim_stream *s);
uint64_t sim_stream_uid(const struct sim_stream *s);

/* Hooks, called by host threads at enqueue time; each does nothing while
 * the checker is off. */
void sim_check_launch(struct sim_stream *s); /* work enqueued on s */
/* A marker enqueued on s (event record, synchronize): a new point on s and
 * a copy of s's clock there for whoever observes the marker; NULL when off. */
struct sim_vc *sim_check_mark(struct sim_stream *s);
void sim_check_join_stream(struct sim_stream *waiter, struct sim_stream *waited);
void sim_check_join_vc(struct sim_stream *waiter, const struct sim_vc *vc);
/* A host saw the work up to vc complete. */
void sim_check_observe(const struct sim_vc *vc);
/* Clocks of all of device's streams (for device synchronize); NULL when off. */
struct sim_vc *sim_check_device_snapshot(int device);
/* s is being destroyed: its final clock stays known to device synchronize. */
void sim_check_stream_retire(struct sim_stream *s);
void sim_vc_free(struct sim_vc *vc);

#endif /* MAGPIE_SIM_INTERNAL_H */
