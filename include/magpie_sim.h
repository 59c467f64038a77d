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

/* Capacity and use of the simulated device memory, in bytes. */
MAGPIE_API int magpie_sim_mem_info(int device, size_t *free_bytes, size_t *total_bytes);

/* Stream-order checker. While on, every block magpie hands out is checked
 * against the uses recorded when its bytes were last freed: each such use
 * (everything enqueued on the freeing stream before the free) must be
 * ordered before the receiving stream's future work, through stream order,
 * stream waits and waits on events, or have been observed complete by the
 * host (an event query that reported completion, an event, stream or device
 * synchronize). Vector clocks kept at enqueue time decide this, not timing:
 * a premature reuse is reported even when the two uses never overlap in
 * time. Each violation is counted and the first few are printed to stderr.
 * On with MAGPIE_CONF=check_streams=1 (magpie_config.check_streams) when
 * magpie uses the simulated device, or switched here; blocks handed out
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
