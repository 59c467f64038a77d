/* magpie_sim: a simulated CUDA device for testing stream-ordered code
 * without a GPU.
 *
 * Device memory is ordinary host memory. Each stream is a worker thread that
 * runs the closures enqueued on it, in order. The simulator creates only the
 * happens-before edges CUDA has:
 *   - host -> stream at enqueue (work sees everything the host did before
 *     enqueueing it);
 *   - stream -> host only through an event query that reports completion,
 *     an event/stream synchronize, or a device synchronize;
 *   - stream -> stream only through a wait (magpie_sim_stream_wait or
 *     magpie_sim_stream_wait_event).
 * So a block reused by another stream before the earlier use completed is a
 * real data race that ThreadSanitizer reports. Streams behave like CUDA
 * streams created with cudaStreamNonBlocking: the default stream (handle 0)
 * is an ordinary stream with no implicit synchronisation with the others,
 * which gives fewer edges than CUDA's legacy stream, never more.
 *
 * Destroyed stream handles are recycled, most recently destroyed first, so
 * code under test always meets handle reuse. Handle 0 and
 * MAGPIE_SIM_STREAM_PER_THREAD (a different stream in each thread, like
 * cudaStreamPerThread) are always valid.
 *
 * Closures must not call magpie_sim_* functions (CUDA host functions may not
 * call CUDA either): doing so would add edges CUDA does not have. Host
 * threads that use the same stream, event or handle table through these
 * functions may become ordered with each other (the CUDA driver's own locks
 * do the same); a stream's work is never ordered before anything except
 * through the edges above. Events belong to the current device when they
 * are created and may only be recorded on streams of that device; waiting
 * on an event never recorded is a no-op; a destroyed event or stream handle
 * is reported as invalid until it is reused. Limits: 16 devices, 16384
 * stream handles at once, 4096 streams per device at once.
 *
 * Memory capacity: MAGPIE_SIM_MEMORY=bytes (suffixes k, m, g), default 4 GiB
 * (address space only: pages are touched as the allocator uses them).
 * Devices: MAGPIE_SIM_DEVICES=n (default 1); magpie_sim_set_device picks the
 * calling thread's current device, on which new streams are created.
 * MAGPIE_SIM_VMM=0 makes the device report no virtual memory management, so
 * magpie's fallback path (whole-slab allocations) runs on it. The
 * environment is read once, at first use; a malformed value makes every
 * call fail with MAGPIE_ERR_CONFIG and a message naming the variable.
 *
 * Access rights, as on a machine of several GPUs: a device's memory is
 * accessible to that device's work only, until peer access is granted
 * (magpie_device_enable_peer_access; in the device table, map's and
 * import_map's peers, set_access and, for plain allocations without VMM,
 * peer_enable), and again once it is taken back
 * (magpie_device_disable_peer_access; revoke_access, peer_disable). Every
 * pair of devices can be connected, as on an NVLink machine, unless
 * magpie_sim_set_peer_capable says otherwise (a PCIe
 * machine without peer-to-peer); a grant to a device that cannot be
 * connected fails with MAGPIE_ERR_NO_PEER_ACCESS. Since a simulated kernel
 * is host code that could touch any address, the rights are enforced where
 * the work says what it touches: magpie_sim_launch_access refuses, at
 * enqueue, work whose stream's device may not access its range, the fault a
 * GPU would raise when the kernel ran; magpie_sim_access_check asks the same
 * question anywhere. Work launched with magpie_sim_launch is not checked.
 *
 * Sharing memory with other processes (IPC): memory the device table maps
 * exportable (as magpie does with MAGPIE_CONF=ipc=1, the default) is backed
 * by one memfd per 2 MiB granule, mapped shared, instead of anonymous
 * memory. Another process using the simulated device maps the same
 * physical memory from those descriptors (passed over a Unix socket, as
 * magpie_ipc_import does), on its device of the same UUID; writes on either
 * side are seen by the other. As with CUDA, the memory lives until its last
 * mapping in any process is gone: the exporter's unmap or exit leaves the
 * importers' mappings intact, and an import takes none of the importing
 * device's capacity (the exporter's device counts it). Each exportable
 * granule keeps a file descriptor open in the exporting process (a 4 GiB
 * device has 2048 granules), so the simulator raises the process's soft
 * limit of open descriptors (RLIMIT_NOFILE) to its hard limit at first use
 * (code that still uses select() must not use descriptors above 1023); a
 * map that runs out fails with MAGPIE_ERR_OUT_OF_MEMORY saying so (raise
 * the hard limit, or set MAGPIE_CONF=ipc=0).
 *
 * The simulator is a library of its own, not part of libmagpie.so or
 * libmagpie.a: link libmagpie_sim.so (-lmagpie_sim) or libmagpie_sim.a
 * (Bazel: //sim) to call these functions. magpie uses the simulated device
 * (MAGPIE_BACKEND=sim, or no usable GPU) when the simulator is linked into
 * the program or loaded, or else loads libmagpie_sim.so itself: first from
 * the folder of libmagpie.so (of the program, where magpie is linked
 * statically), then from the dynamic loader's search path
 * (LD_LIBRARY_PATH).
 */
#ifndef MAGPIE_SIM_H
#define MAGPIE_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "magpie.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Like cudaStreamPerThread (value 2). */
#define MAGPIE_SIM_STREAM_PER_THREAD ((cudaStream_t)0x2)

typedef struct magpie_sim_event_st *magpie_sim_event;

/* All functions return 0 or a magpie_error code (MAGPIE_ERR_INVALID_STREAM
 * for a destroyed or unknown handle), and never abort. A failure is also
 * kept as the simulator's last error of the calling thread
 * (magpie_sim_last_error below), which is separate from magpie's own
 * (magpie_last_error), as a CUDA driver's error state is separate from an
 * allocator's. */
MAGPIE_API int magpie_sim_device_count(void);
MAGPIE_API int magpie_sim_set_device(int device);
MAGPIE_API int magpie_sim_get_device(void);

/* NULL on failure (see magpie_sim_last_error). */
MAGPIE_API cudaStream_t magpie_sim_stream_create(void);
/* Pending work still runs, as with cudaStreamDestroy. */
MAGPIE_API int magpie_sim_stream_destroy(cudaStream_t s);
MAGPIE_API int magpie_sim_launch(cudaStream_t s, void (*fn)(void *), void *arg);
/* Launches a stream holds before they run. A launch onto a full queue
 * blocks the calling thread until the stream has run one, as a CUDA host
 * thread blocks when a stream's command queue is full; a host that runs
 * ahead of its streams is held back instead of growing the queue without
 * bound. */
#define MAGPIE_SIM_QUEUE_DEPTH 1024u
/* Later work on waiter starts after everything enqueued on waited so far. */
MAGPIE_API int magpie_sim_stream_wait(cudaStream_t waiter, cudaStream_t waited);
MAGPIE_API int magpie_sim_stream_synchronize(cudaStream_t s);
MAGPIE_API int magpie_sim_device_synchronize(void);
/* The stream's unique id (never reused, unlike handles); 0 if invalid. */
MAGPIE_API uint64_t magpie_sim_stream_id(cudaStream_t s);
/* The device a stream belongs to, or -1 if the handle is invalid. */
MAGPIE_API int magpie_sim_stream_device(cudaStream_t s);

/* Events, as cudaEvent_t: record captures the work enqueued so far;
 * query returns 0 when it completed, MAGPIE_SIM_NOT_READY otherwise. */
#define MAGPIE_SIM_NOT_READY 600
MAGPIE_API magpie_sim_event magpie_sim_event_create(void);
MAGPIE_API int magpie_sim_event_destroy(magpie_sim_event e);
MAGPIE_API int magpie_sim_event_record(magpie_sim_event e, cudaStream_t s);
MAGPIE_API int magpie_sim_event_query(magpie_sim_event e);
MAGPIE_API int magpie_sim_event_synchronize(magpie_sim_event e);
MAGPIE_API int magpie_sim_stream_wait_event(cudaStream_t s, magpie_sim_event e);

/* Stream capture, as CUDA's cudaStreamBeginCapture / cudaStreamEndCapture /
 * cudaGraphLaunch. While a stream captures, work enqueued on it (launches,
 * event records) is not run: it is recorded into the capture, and the graph
 * that magpie_sim_stream_end_capture returns runs it, in capture order, on
 * the stream it is launched on, once per launch (nodes of a simulated graph
 * run one after another: more order than a GPU's graph, never less).
 * An event recorded on a capturing stream belongs to the capture: nothing
 * is enqueued for it, a graph launch records nothing into it, and it stays
 * the capture's (even after the capture ended) until it is recorded again
 * outside a capture. A capturing stream waiting on an event of its own
 * capture, or on one never recorded, or on itself, is a no-op.
 *
 * What CUDA forbids during a capture fails here with MAGPIE_ERR_CAPTURE and
 * invalidates the capture concerned (its end then fails with
 * MAGPIE_ERR_CAPTURE and no graph), and is counted
 * (magpie_sim_capture_violations):
 *   - synchronising a capturing stream; querying, synchronising or waiting
 *     (from outside its capture) on an event recorded in a capture, also
 *     after that capture ended (nothing left to invalidate then); destroying
 *     a capturing stream (it stays, capturing);
 *   - synchronising the device while any of its streams captures (all those
 *     captures are invalidated; nothing is synchronised);
 *   - making a capturing stream wait on an event recorded outside the
 *     capture or on another stream (the simulator captures one stream:
 *     joining a second stream into a capture is refused with
 *     MAGPIE_ERR_CAPTURE too, as CUDA refuses a join of two captures), or
 *     another stream wait on a capturing stream;
 *   - using the default stream (0) or the legacy handle (1) of a device
 *     (launch, graph launch, event record, wait, synchronize) while a
 *     global-mode capture runs there (CUDA's legacy stream synchronises with
 *     other streams): every such capture is invalidated;
 *   - asking a capturing stream its id or its device (magpie_sim_stream_id,
 *     magpie_sim_stream_device): CUDA refuses cuStreamGetId,
 *     cuStreamGetDevice and cuStreamGetFlags on a capturing stream and
 *     invalidates its capture, in every mode (measured: H100, CUDA 13.0,
 *     driver 580); magpie_sim_stream_capture_info is the query allowed;
 *   - the calls CUDA calls potentially unsafe, from a thread whose capture
 *     mode prohibits them: reserving, mapping, unmapping, allocating or
 *     freeing device memory, granting peers access to it, exporting or
 *     importing it, querying or synchronising an event (recorded
 *     outside any capture) or a stream (one not capturing). Prohibited in
 *     MAGPIE_SIM_CAPTURE_GLOBAL while any other thread runs a global-mode
 *     capture, and in GLOBAL and THREAD_LOCAL while the thread itself runs
 *     a capture begun in a mode other than RELAXED (measured on the same
 *     H100: in the relaxed mode these pass). The captures invalidated are
 *     those that prohibited the call.
 * Work enqueued (launch, record, wait) on a stream whose capture is already
 * invalidated also fails with MAGPIE_ERR_CAPTURE, as in CUDA, but is not
 * counted again; magpie_sim_stream_capture_info is always allowed.
 * Capture modes are per thread (magpie_sim_thread_exchange_capture_mode,
 * as cudaThreadExchangeStreamCaptureMode; default GLOBAL); the mode given
 * to begin is the capture's, for the rules above, and a capture's thread is
 * the one that began it. Host threads that enqueue work while captures are
 * under way may become ordered with each other (as through the driver's
 * locks); a stream's work never is.
 * Errors that are not violations (not counted, no capture invalidated):
 * beginning a capture on the default stream (0 or 1; CUDA cannot capture
 * its legacy stream: capture a created or the per-thread stream) or on a
 * stream already capturing, and ending one on a stream that does not
 * capture, all MAGPIE_ERR_CAPTURE; an unknown mode, MAGPIE_ERR_INVALID_ARGUMENT.
 * A capture still under way when its stream is retired (a per-thread
 * stream at its thread's exit) is dropped. */
#define MAGPIE_SIM_CAPTURE_GLOBAL 0
#define MAGPIE_SIM_CAPTURE_THREAD_LOCAL 1
#define MAGPIE_SIM_CAPTURE_RELAXED 2
/* magpie_sim_stream_capture_info's states (as cudaStreamCaptureStatus). */
#define MAGPIE_SIM_CAPTURE_NONE 0
#define MAGPIE_SIM_CAPTURE_ACTIVE 1
#define MAGPIE_SIM_CAPTURE_INVALIDATED 2

typedef struct magpie_sim_graph_st *magpie_sim_graph;

MAGPIE_API int magpie_sim_stream_begin_capture(cudaStream_t s, int mode);
/* Ends the capture begun on s. *graph: the graph (destroy it with
 * magpie_sim_graph_destroy), or NULL when the capture was invalidated
 * (MAGPIE_ERR_CAPTURE, the reason in the last error). */
MAGPIE_API int magpie_sim_stream_end_capture(cudaStream_t s, magpie_sim_graph *graph);
/* *status: a MAGPIE_SIM_CAPTURE_* state; *id: the capture's id, unique in
 * the process, while one is under way (else 0); either may be NULL. Never
 * invalidates; NONE for the default stream, which cannot capture. */
MAGPIE_API int magpie_sim_stream_capture_info(cudaStream_t s, int *status, uint64_t *id);
/* Swaps the calling thread's capture mode with *mode. */
MAGPIE_API int magpie_sim_thread_exchange_capture_mode(int *mode);
/* Enqueues the graph's work on s (one replay); a graph may be launched any
 * number of times, on any stream of its device, until destroyed. Each node
 * is enqueued as a magpie_sim_launch would be (a full queue blocks, see
 * MAGPIE_SIM_QUEUE_DEPTH); a failure (out of host memory) enqueues nothing.
 * Launched onto a capturing stream, the graph's work is recorded into that
 * capture (where CUDA would add the graph as a child node). */
MAGPIE_API int magpie_sim_graph_launch(magpie_sim_graph g, cudaStream_t s);
/* Replays already enqueued still run. */
MAGPIE_API int magpie_sim_graph_destroy(magpie_sim_graph g);
/* Forbidden calls made so far (each failed and counted, see above). */
MAGPIE_API uint64_t magpie_sim_capture_violations(void);

/* Capacity and use of the simulated device memory, in bytes. */
MAGPIE_API int magpie_sim_mem_info(int device, size_t *free_bytes, size_t *total_bytes);

/* Peer access (see the access rights above). Whether device's memory can
 * be made accessible from peer (capable 1, the default for every pair) or
 * not (0: no peer-to-peer path, as on a PCIe machine without P2P); one
 * direction only. Rights granted before stay. MAGPIE_ERR_INVALID_ARGUMENT
 * for an unknown device or device == peer. */
MAGPIE_API int magpie_sim_set_peer_capable(int device, int peer, int capable);
/* Whether work of device may touch every byte of [p, p+n) (n == 0: nothing
 * to touch, MAGPIE_OK). MAGPIE_OK: all of it is mapped simulated device
 * memory (of any device, a VMM granule or a plain allocation) accessible
 * from device. MAGPIE_ERR_NO_PEER_ACCESS: some of it is another device's
 * memory not opened to device (the message names both devices and the
 * first such address). MAGPIE_ERR_INVALID_ARGUMENT: some of it is not
 * mapped device memory, or device is unknown. An answer about the present:
 * memory unmapped afterwards is not watched. */
MAGPIE_API int magpie_sim_access_check(int device, const void *p, size_t n);
/* magpie_sim_launch of fn(arg) on s for a simulated kernel that touches
 * [p, p+n): first, on the host at enqueue, magpie_sim_access_check from
 * s's device; when it fails, nothing is enqueued (fn never runs) and its
 * error is returned, as a GPU faults on a kernel touching memory its device
 * may not access. On a capturing stream the check is made when the launch
 * is captured; the graph's replays are not checked again. */
MAGPIE_API int magpie_sim_launch_access(cudaStream_t s, void (*fn)(void *), void *arg, const void *p, size_t n);

/* Stream-order checker. While on, every block magpie hands out is checked
 * against the uses recorded when its bytes were last freed: each such use
 * (everything enqueued on the freeing stream before the free, and for a
 * block recorded with magpie_record_stream everything enqueued on each
 * recorded stream before the free, up to four streams) must be
 * ordered before the receiving stream's future work, through stream order,
 * stream waits and waits on events, or have been observed complete by the
 * host (an event query that reported completion, an event, stream or device
 * synchronize). Vector clocks kept at enqueue time decide this, not timing:
 * a premature reuse is reported even when the two uses never overlap in
 * time. Each violation is counted and the first few are printed to stderr.
 * On with MAGPIE_CONF=check_streams=1 (magpie_config.check_streams) when
 * magpie uses the simulated device, or switched here; under
 * AddressSanitizer freed blocks are poisoned in stream order, except
 * recorded ones (their recorded streams may still use them); blocks handed out
 * while it was off are not tracked. It serialises magpie's allocation calls
 * on one lock: for tests, not for speed. */
MAGPIE_API int magpie_sim_check_enable(int on);
MAGPIE_API int magpie_sim_check_enabled(void);
/* Violations found so far, and hand-outs checked. */
MAGPIE_API uint64_t magpie_sim_check_violations(void);
MAGPIE_API uint64_t magpie_sim_check_handouts(void);
/* Operations the checker could not track for lack of host memory (its
 * verdicts may then miss violations; never invents one). */
MAGPIE_API uint64_t magpie_sim_check_incomplete(void);
/* Copies the first violation's message ("" if none) into buf; returns its
 * length. */
MAGPIE_API size_t magpie_sim_check_message(char *buf, size_t len);

/* The code of the last magpie_sim_* call that failed on this thread
 * (MAGPIE_OK if none has), and its message ("function: reason"; "success"
 * if none). A later success leaves them as they were. */
MAGPIE_API int magpie_sim_last_error(void);
MAGPIE_API const char *magpie_sim_last_error_message(void);

/* For magpie's own use: the simulated device's table of operations, if
 * abi_version is the layout magpie was built with, else NULL. */
MAGPIE_API const void *magpie_sim_device_table(unsigned abi_version);

#ifdef __cplusplus
}
#endif

#endif /* MAGPIE_SIM_H */
