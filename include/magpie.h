/* magpie: a lock-free, stream-ordered caching allocator for CUDA device memory.
 *
 * The one public header. It needs no CUDA header: cudaStream_t is declared
 * here exactly as CUDA declares it (a repeated identical typedef is valid C11
 * and C++), so the same handle works with the runtime, the driver API
 * (CUstream) and the simulated device (magpie_sim.h).
 *
 * Semantics follow cudaMallocAsync/cudaFreeAsync:
 *   - magpie_malloc_async(size, s) returns memory usable by work enqueued on
 *     s after the call.
 *   - magpie_free_async(p, s): s is the stream of the last use. The block may
 *     be reused by later work on s at once, and by any other stream only once
 *     the work enqueued on s before the free has completed.
 * Failures return NULL or a nonzero code and set a thread-local error
 * (magpie_last_error / magpie_last_error_message); the library never aborts.
 */
#ifndef MAGPIE_H
#define MAGPIE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>     /* FILE, for magpie_snapshot_json */
#include <sys/types.h> /* ssize_t, for the PyTorch entry points */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st *cudaStream_t;

#define MAGPIE_VERSION_MAJOR 0
#define MAGPIE_VERSION_MINOR 1
#define MAGPIE_VERSION_PATCH 0
#define MAGPIE_VERSION_STRING "0.1.0"

#if defined(__GNUC__)
#define MAGPIE_API __attribute__((visibility("default")))
#else
#define MAGPIE_API
#endif

/* Error codes. 0 is success; every failure has its own code and message. */
enum magpie_error {
  MAGPIE_OK = 0,
  MAGPIE_ERR_INVALID_POINTER = 1, /* not a block magpie handed out (or interior) */
  MAGPIE_ERR_DOUBLE_FREE = 2,     /* block already free (checked mode) */
  MAGPIE_ERR_SIZE_OVERFLOW = 3,   /* size cannot be rounded without overflow */
  MAGPIE_ERR_OUT_OF_MEMORY = 4,   /* device memory exhausted after reclaiming */
  MAGPIE_ERR_TOO_LARGE = 5,       /* larger than the device's total memory */
  MAGPIE_ERR_INVALID_STREAM = 6,  /* stream handle not valid (destroyed?) */
  MAGPIE_ERR_INVALID_ARGUMENT = 7,
  MAGPIE_ERR_BACKEND = 8,   /* the CUDA driver (or sim) reported an error */
  MAGPIE_ERR_NO_DEVICE = 9, /* requested backend has no device */
  MAGPIE_ERR_CONFIG = 10,   /* bad MAGPIE_CONF / config value */
  MAGPIE_ERR_ALREADY_INITIALIZED = 11,
  MAGPIE_ERR_CAPTURE = 12,        /* not permitted while a stream captures a CUDA graph */
  MAGPIE_ERR_IPC = 13,            /* a handle of another process cannot be served or opened */
  MAGPIE_ERR_NO_PEER_ACCESS = 14, /* the devices cannot access each other's memory */
  MAGPIE_ERR_COUNT_
};

/* Which device implementation serves allocations. */
enum magpie_backend_kind {
  MAGPIE_BACKEND_AUTO = 0, /* CUDA when a device is present, else sim */
  MAGPIE_BACKEND_CUDA = 1,
  MAGPIE_BACKEND_SIM = 2
};

/* Configuration. Fill with magpie_config_default(), change fields, pass to
 * magpie_init() before the first allocation. Without magpie_init() the
 * library configures itself from the environment on first use:
 *   MAGPIE_BACKEND=cuda|sim
 *   MAGPIE_CONF=key=value,key=value  (keys: the field names below) */
typedef struct magpie_config {
  int backend; /* enum magpie_backend_kind */
  int check;   /* 1: detect double frees (costs an atomic per op) */
  int verbose; /* 1: print stats to stderr at exit */
  /* Most bytes per magazine (2..64 blocks). Magazines start smaller
   * (capacity falling with the cube root of the block size: 5 blocks at
   * 64 KiB) and grow to this where a thread's blocks only flow out. */
  size_t magazine_bytes;
  /* Hard cap on device memory reserved per device: limit bytes, or
   * limit_percent of the device's total memory (MAGPIE_CONF limit=8g or
   * limit=50%). 0: no cap beyond the device. */
  size_t limit;
  unsigned limit_percent;
  /* Cached memory above this many bytes is given back to the driver in the
   * background (like cudaMemPoolAttrReleaseThreshold). SIZE_MAX: keep all. */
  size_t release_threshold;
  int check_streams; /* 1: simulated device checks stream order of reuse */
  /* 1 (default): a large block freed on another stream may be reused by
   * making the allocating stream wait on the free's event once magpie's
   * cache passes its reserve (cudaMallocAsync's internal dependencies);
   * 0: only under memory pressure. */
  int reuse_wait;
  /* N > 0: time every device call and report on stderr those taking N ms
   * or more (diagnostics; costs two clock reads per call). */
  unsigned slow_call_ms;
  /* 1 (default): device memory is created exportable, so any block can be
   * shared with other processes (magpie_ipc_export); 0: not (a block then
   * cannot be exported). Costs nothing on the allocation paths: only
   * mapping a new 2 MiB granule asks the driver for an exportable handle
   * type (bench/results: the measured cost). */
  int ipc;
} magpie_config;

MAGPIE_API void magpie_config_default(magpie_config *cfg);
/* The backend in use (MAGPIE_BACKEND_CUDA or MAGPIE_BACKEND_SIM),
 * initialising from the environment if needed; -1 with the error set if
 * initialisation failed. */
MAGPIE_API int magpie_active_backend(void);
/* Initialise explicitly. Returns MAGPIE_ERR_ALREADY_INITIALIZED if the
 * library is already running (it configures itself lazily on first use). */
MAGPIE_API int magpie_init(const magpie_config *cfg);

/* Allocation. size 0 returns a unique, freeable minimum block (256 bytes),
 * as malloc(0) does in glibc. Every pointer is 256-byte aligned. */
MAGPIE_API void *magpie_malloc_async(size_t size, cudaStream_t stream);
MAGPIE_API int magpie_free_async(void *ptr, cudaStream_t stream);
/* The same on the legacy default stream (stream 0) of the current device. */
MAGPIE_API void *magpie_malloc(size_t size);
MAGPIE_API int magpie_free(void *ptr);
/* Bytes usable at ptr (the block's size); 0 if ptr is not a magpie block. */
MAGPIE_API size_t magpie_usable_size(const void *ptr);

/* Devices magpie can serve (device ordinals 0 .. MAGPIE_MAX_DEVICES - 1). */
#define MAGPIE_MAX_DEVICES 64

/* What magpie knows of the device address ptr, without side effects:
 *   MAGPIE_OK: ptr is the start of a magpie block; *size is its usable
 *     size and *device its device. For a small block this says the slot is
 *     a block's (a freed small block still answers MAGPIE_OK until reused;
 *     MAGPIE_CONF=check=1 tracks each block's state for the frees);
 *     a large block answers MAGPIE_OK only while handed out.
 *   MAGPIE_ERR_INVALID_POINTER: not the start of a block. *device is the
 *     device whose magpie memory contains ptr (inside a block, or a freed
 *     large block), or -1 if magpie holds no memory at ptr.
 * Either out pointer may be NULL. Sets no error state, takes no lock for a
 * small block (two loads) and the large cache's lock for a large one. */
MAGPIE_API int magpie_block_info(const void *ptr, size_t *size, int *device);

/* Statistics of one device (figures in bytes unless named *_count).
 *
 * Where the reserved bytes are. When no thread is inside magpie:
 *   reserved = in_use + thread_cached + depot + epoch_pending
 *              + large_free + overhead
 * (in_use counts block sizes: a request rounded up to its size class or to
 * the large-block quantum). cached = reserved - in_use. */
#define MAGPIE_STATS_CLASSES 64 /* room for every size class */
#define MAGPIE_STATS_LADDER 8   /* out-of-memory ladder steps */
typedef struct magpie_stats {
  size_t in_use_bytes;      /* handed out and not yet freed (block sizes) */
  size_t reserved_bytes;    /* device memory mapped by magpie */
  size_t peak_in_use_bytes; /* see docs/configuration.md: sampled on slow paths */
  size_t peak_reserved_bytes;
  size_t cached_bytes;              /* reserved but not in use */
  size_t large_in_use_bytes;        /* part of in_use served by the large path */
  uint64_t slab_count;              /* slabs mapped now */
  uint64_t depot_exchanges;         /* magazines taken from / given to the depot */
  uint64_t events_recorded;         /* one per magazine leaving a thread's stream */
  uint64_t cross_stream_migrations; /* sealed magazines released to every stream */
  uint64_t same_stream_reuses;      /* pending magazines reused on their own stream */
  uint64_t limbo_magazines;         /* magazines whose stream died; waited by device sync */
  /* Per layer (the cached bytes split by where they sit). */
  size_t thread_cached_bytes; /* in threads' magazines */
  size_t depot_bytes;         /* in depot magazines ready for any stream */
  size_t epoch_pending_bytes; /* freed, waiting for a stream's work to complete */
  size_t large_free_bytes;    /* mapped large-segment bytes free for any stream */
  size_t overhead_bytes;      /* slab tails no block fits in, alignment */
  size_t large_mapped_bytes;  /* part of reserved in large segments */
  size_t limit_bytes;         /* the cap in force (0: none; below 2 MiB: no mapping) */
  uint64_t large_segment_count;
  uint64_t slabs_released;       /* slabs given back to the driver */
  uint64_t large_bytes_unmapped; /* large-segment bytes given back */
  uint64_t stream_waits;         /* blocks reused by making a stream wait */
  uint64_t threads_flushed;      /* thread caches emptied on request */
  uint64_t threads_stolen;       /* idle threads' caches taken by the depot */
  /* Out-of-memory ladder: how often each step ran. 0 reclaim completed
   * epochs, 1 free depot slabs, 2 thread caches, 3 wait for epochs,
   * 4 unmap free large segments, 5 requests failed. */
  uint64_t ladder_steps[MAGPIE_STATS_LADDER];
  /* Per size class (index = class; magpie_size_class_size(i) gives its
   * size): allocations served by a thread's magazine / by a slow path. */
  uint64_t class_hits[MAGPIE_STATS_CLASSES];
  uint64_t class_misses[MAGPIE_STATS_CLASSES];
  /* Event queries made to decide whether another stream may reuse freed
   * blocks, and how many of them found the freeing stream's work still
   * running (each costs a driver call; see bench/README.md). */
  uint64_t event_queries;
  uint64_t event_queries_pending;
  /* Device-wide synchronisations magpie made (draining limbo: blocks of
   * streams it can no longer order against). None on a steady path. */
  uint64_t device_syncs;
  /* CUDA graphs: bytes held by graph pools (counted in in_use_bytes), and
   * pools alive. */
  size_t graph_pool_bytes;
  uint64_t graph_pools;
} magpie_stats;

MAGPIE_API int magpie_stats_get(int device, magpie_stats *out);
/* Restart peak_in_use_bytes and peak_reserved_bytes at the current figures
 * (like torch.cuda.reset_peak_memory_stats). */
MAGPIE_API int magpie_stats_reset_peaks(int device);
/* Block size of size class i; 0 past the last class. */
MAGPIE_API size_t magpie_size_class_size(unsigned i);

/* Memory held but not in use: give back cached memory now, keeping at most
 * keep_bytes reserved beyond what is in use. Blocks whose stream's work has
 * not completed stay cached. */
MAGPIE_API int magpie_trim(int device, size_t keep_bytes);

/* Change the cap on device memory reserved on device while running (the
 * limit configuration key sets it at start): bytes (at least the mapping
 * unit, 2 MiB on current GPUs), or 0 for none beyond the device. Like
 * PyTorch's memory fraction, it holds where magpie maps memory: memory
 * already mapped may still serve requests, and lowering the cap gives
 * nothing back by itself (magpie_trim does); an allocation that needs more
 * mapped memory gives cached memory back first (the out-of-memory ladder)
 * and fails with MAGPIE_ERR_OUT_OF_MEMORY if it still would pass the cap. */
MAGPIE_API int magpie_set_limit(int device, size_t bytes);
/* The same cap as a fraction of the device's total memory, as PyTorch's
 * set_per_process_memory_fraction sets it: fraction in [0, 1]; 0 refuses
 * every mapping (only memory already mapped serves), 1 is the whole
 * device. A fraction outside [0, 1] changes nothing
 * (MAGPIE_ERR_INVALID_ARGUMENT). */
MAGPIE_API int magpie_set_limit_fraction(int device, double fraction);
/* How many devices the active backend has (initialising from the
 * environment if needed); -1 with the error set if it cannot be asked. */
MAGPIE_API int magpie_device_count(void);

/* Every segment, slab and block of the device with its state, as JSON
 * (format: src/front/snapshot.c and docs/configuration.md). */
MAGPIE_API int magpie_snapshot_json(int device, FILE *out);

/* Like PyTorch's Tensor.record_stream: the block at ptr will not be reused
 * (by any stream, the freeing one included) until the work enqueued on
 * stream before the block is freed has completed, in addition to the
 * freeing stream's. No stream is made to wait and the host never blocks:
 * the block is parked at its free and returns to the pools once events on
 * those streams completed. stream must stay valid until the block is freed,
 * or be retired with magpie_stream_retire before it is destroyed;
 * the per-thread default stream handle and streams of another device are
 * refused (MAGPIE_ERR_INVALID_STREAM); a freed block gives
 * MAGPIE_ERR_INVALID_POINTER: a large block always, a smaller one in
 * checked mode (MAGPIE_CONF=check=1; otherwise a freed block still in a
 * thread's cache cannot be told from a live one). A graph pool's block
 * ("CUDA graphs" below) follows its pool's rules: nothing is recorded for
 * it. */
MAGPIE_API int magpie_record_stream(void *ptr, cudaStream_t stream);

/* Call before destroying a stream magpie has seen (cudaStreamDestroy,
 * cuStreamDestroy; the LD_PRELOAD library does it for both). magpie records
 * one event on it while its handle is still valid: blocks recorded on it
 * with magpie_record_stream and not yet freed wait for that event (which
 * covers all the stream's work, as nothing more can be enqueued), and the
 * calling thread's cached blocks of the stream go back to the shared pools
 * at once. Without it, a recorded block's free asks the driver about the
 * destroyed handle, which crashes the process on a GPU unless a newer
 * stream got the same handle value (then magpie sees the different stream
 * id and waits for a device synchronisation instead); the simulated device
 * answers that query, so the free succeeds there the same way. Other
 * threads' cached blocks of the stream wait for a device synchronisation,
 * as they do without it. MAGPIE_ERR_INVALID_STREAM for a destroyed or
 * special handle. */
MAGPIE_API int magpie_stream_retire(cudaStream_t stream);

/* ---- CUDA graphs ----
 * A captured graph replays its kernels at the addresses it was captured
 * with, for as long as it lives. Memory magpie hands out on a capturing
 * stream therefore belongs to a *graph pool*: it is never handed to work
 * outside the pool while the pool lives, and goes back only after the
 * pool is released and the device finished every replay that may use it.
 * Like torch.cuda.graph's pools:
 *   - several captures may share a pool, one after another or at once;
 *     graphs that share a pool must be replayed in the order they were
 *     captured, one at a time (a block one capture freed may serve a later
 *     capture of the pool);
 *   - a block freed during a capture serves later allocations of the same
 *     capture on the same stream (capture order), and any capture of the
 *     pool once the captures under way at the free ended;
 *   - a block allocated during a capture and freed after it (a graph's
 *     output, freed by its user) returns to its pool, reusable once the
 *     work on its freeing stream completed; keep it while the graph may
 *     still be replayed, as with PyTorch.
 * Announce every capture that allocates through magpie, and every capture
 * at all while magpie is in use: while an announced capture runs, no
 * magpie call anywhere in the process does what CUDA forbids during a
 * capture (synchronising the device, querying or waiting across the
 * capture; memory is mapped in the relaxed capture mode), and allocations
 * and frees check the stream's capture state (one driver query each: the
 * fast paths are left only while a capture is announced). An allocation on
 * a capturing stream of a capture magpie was not told of fails with
 * MAGPIE_ERR_CAPTURE; magpie looks for one on its slow paths only (it
 * records no event on a capturing stream), so a capture it was not told
 * of may also receive blocks from a thread's cache. A block allocated
 * outside a capture and freed on a capturing stream waits for a device
 * synchronisation (made once no announced capture runs) before any
 * reuse: it must not be used by the graph. The simulated device models
 * capture (magpie_sim.h), so all of this can be tested without a GPU. */

/* A new, empty graph pool on device. Pool ids are never reused. */
MAGPIE_API int magpie_graph_pool_create(int device, uint64_t *pool);
/* The capture about to begin on stream allocates into pool: from this
 * call until magpie_capture_end(pool, stream), every magpie allocation on
 * a stream of that capture (stream itself, or a stream that joined its
 * capture) comes from pool. Call it before cudaStreamBeginCapture(stream),
 * as PyTorch calls its allocator's beginAllocateToPool: it returns once no
 * device synchronisation of magpie's is under way (one that began earlier
 * may have to finish), and none starts until magpie_capture_end. Called
 * just after the capture began, it works too, but a synchronisation of
 * magpie's maintenance thread in between would invalidate the capture. stream NULL
 * announces a capture whose allocations the caller routes itself with
 * magpie_graph_pool_malloc_async (as PyTorch's allocator hooks do: they
 * name no stream). The per-thread default stream (cudaStreamPerThread)
 * names the calling thread's stream: its announcement holds for captures
 * of that thread only, and that thread ends it. MAGPIE_ERR_INVALID_ARGUMENT
 * for an unknown or released pool or a stream of another device. */
MAGPIE_API int magpie_capture_begin(uint64_t pool, cudaStream_t stream);
/* The capture announced with (pool, stream) is over (call it after
 * cudaStreamEndCapture). Blocks freed during it become
 * reusable by the pool's later captures once no capture of the pool runs. */
MAGPIE_API int magpie_capture_end(uint64_t pool, cudaStream_t stream);
/* An allocation from pool for work on stream, whether or not stream is
 * capturing (outside a capture, like allocating into a PyTorch MemPool).
 * NULL with the error set (MAGPIE_ERR_OUT_OF_MEMORY, or
 * MAGPIE_ERR_INVALID_ARGUMENT for an unknown or released pool). Free the
 * block with magpie_free_async as any other. */
MAGPIE_API void *magpie_graph_pool_malloc_async(uint64_t pool, size_t size, cudaStream_t stream);
/* Drop the pool: call it once the graphs that used it are destroyed (their
 * replays may still run). Its free blocks, and each of its blocks still in
 * use when it is freed, return to magpie after the next device
 * synchronisation, which magpie makes in the background while no
 * announced capture runs. MAGPIE_ERR_INVALID_ARGUMENT for an unknown or
 * released pool. */
MAGPIE_API int magpie_graph_pool_release(uint64_t pool);
/* Bytes pool holds, in use or free (0 for an unknown pool). */
MAGPIE_API size_t magpie_graph_pool_bytes(uint64_t pool);
/* Give back the pool's free blocks that no capture was ever handed (as
 * PyTorch's empty_cache of a MemPool): they return to magpie as a released
 * pool's do, after a device synchronisation. Blocks a capture was handed
 * stay until the pool is released, for its graphs replay into them.
 * MAGPIE_ERR_INVALID_ARGUMENT for an unknown or released pool. */
MAGPIE_API int magpie_graph_pool_trim(uint64_t pool);
/* Hand out again the pool's free block at ptr, as an allocator checkpoint
 * restores it (PyTorch's cudagraph trees): the block is in use from here,
 * without waiting for the work of its last free, which the caller orders
 * (the graphs of one pool run in order on one stream); free it as any
 * other. *size: its size. MAGPIE_ERR_INVALID_POINTER if the pool has no
 * block at ptr, MAGPIE_ERR_DOUBLE_FREE if it is in use,
 * MAGPIE_ERR_INVALID_ARGUMENT for an unknown or released pool. */
MAGPIE_API int magpie_graph_pool_take(uint64_t pool, void *ptr, cudaStream_t stream, size_t *size);
/* A block a graph pool holds (magpie_graph_pool_blocks). */
typedef struct magpie_pool_block {
  void *ptr;
  size_t size;
  int in_use; /* handed out and not freed */
} magpie_pool_block;
/* Up to cap of the pool's blocks into out; *count: how many it holds (ask
 * with cap 0 first to size out). MAGPIE_ERR_INVALID_ARGUMENT for an unknown
 * pool (one released and emptied is unknown). */
MAGPIE_API int magpie_graph_pool_blocks(uint64_t pool, magpie_pool_block *out, size_t cap, size_t *count);

/* ---- Sharing blocks with other processes (IPC) ----
 * magpie_ipc_export(ptr, flags, &h) makes a handle for the block at ptr (a
 * block start, on a device with virtual memory management, with
 * MAGPIE_CONF=ipc=1, the default): 128 plain bytes, copied to any process of
 * the same user on the machine, by any channel. There
 * magpie_ipc_import(&h, &p, &size) maps the block's memory into that
 * process (on its device with the same UUID, whatever its ordinal there)
 * and gives its address and size; magpie_ipc_close(p, stream) unmaps it
 * once the work enqueued on stream has completed (the calling thread
 * waits). The exporting process serves imports from a thread of its own,
 * started at the first export, over a Unix socket in the abstract
 * namespace (so both processes need the same network namespace); a handle
 * carries a random 128-bit secret, and the memory's file descriptors pass
 * through the socket. The handle names the memory of the whole 2 MiB
 * granules the block lies in: an importer can reach a small block's
 * neighbours, as with cudaIpcGetMemHandle.
 *
 * Lifetime: a block stays out of reuse in the exporting process while any
 * process has it imported, even after the exporter freed it: the free
 * succeeds, and the block waits (as a recorded block does) until the last
 * importer closed it or exited. An import after the exporter freed the
 * block fails (MAGPIE_ERR_IPC), unless the export was made with
 * MAGPIE_IPC_HOLD: then the block is also held from the export until its
 * first import (or magpie_ipc_revoke), for a handle sent to a process that
 * imports it later (torch.multiprocessing does). When the exporting process
 * exits, its importers keep their mappings valid until they close them;
 * importing its handles fails. When an importing process exits, its
 * imports are closed. Ordering between the processes' streams is the
 * application's: finish the work that writes a block before sending its
 * handle, and close an import only after the importer's work on it. */
#define MAGPIE_IPC_HANDLE_SIZE 128
typedef struct magpie_ipc_handle {
  unsigned char bytes[MAGPIE_IPC_HANDLE_SIZE];
} magpie_ipc_handle;
/* magpie_ipc_export's flags. */
#define MAGPIE_IPC_HOLD 1u
/* MAGPIE_ERR_INVALID_POINTER: not the start of an allocated block;
 * MAGPIE_ERR_IPC: the block's memory cannot be exported (ipc=0 when it was
 * mapped, no virtual memory management, a graph pool's block). Exporting
 * a block again gives the same handle (a new hold with MAGPIE_IPC_HOLD). */
MAGPIE_API int magpie_ipc_export(void *ptr, unsigned flags, magpie_ipc_handle *out);
/* Drops h's hold (MAGPIE_IPC_HOLD) if no import took it over, and makes
 * later imports of h fail; imports already made stay valid. Only in the
 * exporting process. */
MAGPIE_API int magpie_ipc_revoke(const magpie_ipc_handle *h);
/* size may be NULL. MAGPIE_ERR_IPC with the reason: the exporting process
 * is gone or refused (block freed, handle revoked, corrupted), or its device
 * is not visible here. Importing the same handle twice maps it twice. */
MAGPIE_API int magpie_ipc_import(const magpie_ipc_handle *h, void **ptr, size_t *size);
/* ptr: an address magpie_ipc_import or magpie_ipc_import_compact
 * returned. MAGPIE_ERR_INVALID_POINTER for any other. */
MAGPIE_API int magpie_ipc_close(void *ptr, cudaStream_t stream);

/* The compact handle: the same export in 64 bytes, the size of CUDA's
 * cudaIpcMemHandle_t and CUipcMemHandle, for channels made for those (the
 * LD_PRELOAD library carries magpie's exports in them: cudaIpcGetMemHandle
 * of a magpie block gives one, and cudaIpcOpenMemHandle tells it from a
 * CUDA handle with magpie_ipc_is_compact). It carries what an import
 * cannot do without (the exporting process and its server, the export,
 * the 128-bit secret); the block's device and size come from the exporter
 * when it is imported. Same guarantees and lifetime as the 128-byte
 * handle: magpie_ipc_export_compact and magpie_ipc_export of one block
 * name one export (revoke it with the 128-byte form), and
 * magpie_ipc_import_compact maps it as magpie_ipc_import does; close it
 * with magpie_ipc_close. */
#define MAGPIE_IPC_COMPACT_SIZE 64
typedef struct magpie_ipc_compact {
  unsigned char bytes[MAGPIE_IPC_COMPACT_SIZE];
} magpie_ipc_compact;
/* As magpie_ipc_export, into the compact form. */
MAGPIE_API int magpie_ipc_export_compact(void *ptr, unsigned flags, magpie_ipc_compact *out);
/* 1 if the MAGPIE_IPC_COMPACT_SIZE bytes at bytes are a compact handle
 * magpie made (its tag, and a check of its other bytes, which a CUDA
 * handle would have to match by chance), 0 if not (NULL included). Reads
 * the bytes only: no set-up, no error state. */
MAGPIE_API int magpie_ipc_is_compact(const void *bytes);
/* As magpie_ipc_import. peer: -1, or a device of this process whose
 * kernels must reach the memory too besides the devices allowed to reach
 * the block's device (magpie_device_enable_peer_access), as
 * cudaIpcOpenMemHandle's cudaIpcMemLazyEnablePeerAccess lets the current
 * device reach memory of another; MAGPIE_ERR_NO_PEER_ACCESS when it cannot.
 * MAGPIE_ERR_INVALID_ARGUMENT for bytes that are not a compact handle. */
MAGPIE_API int magpie_ipc_import_compact(const magpie_ipc_compact *h, int peer, void **ptr, size_t *size);

/* ---- Peer access ----
 * Every mapping of device's memory, present and future, small and large,
 * becomes readable and writable by kernels on peer (like
 * cudaMemPoolSetAccess on a pool), until magpie_device_disable_peer_access.
 * MAGPIE_ERR_NO_PEER_ACCESS when the hardware cannot connect the two;
 * MAGPIE_ERR_INVALID_ARGUMENT for an unknown device or device == peer. */
MAGPIE_API int magpie_device_enable_peer_access(int device, int peer);
/* Takes the rights back (like cudaMemPoolSetAccess to none, or
 * cudaDeviceDisablePeerAccess): every mapping of device's memory stops
 * being accessible from peer, and later mappings are not granted it. The
 * caller makes sure no work of peer still touches device's memory: a
 * kernel that touches it afterwards faults, as with CUDA. Imports already
 * made (magpie_ipc_import) keep the rights they were mapped with, as they
 * do when access is enabled. MAGPIE_OK when access was not enabled. */
MAGPIE_API int magpie_device_disable_peer_access(int device, int peer);
/* *can: 1 if magpie_device_enable_peer_access(device, peer) can succeed. */
MAGPIE_API int magpie_device_can_access_peer(int device, int peer, int *can);

/* Errors. */
MAGPIE_API int magpie_last_error(void);
MAGPIE_API const char *magpie_last_error_message(void); /* detail for this thread */
MAGPIE_API const char *magpie_error_string(int code);

/* PyTorch's pluggable allocator interface
 * (torch.cuda.memory.CUDAPluggableAllocator loads these two by name from
 * libmagpie.so). PyTorch passes the stream the block was allocated on to
 * the free, so a block used on another stream must have been ordered after
 * that use by the application, or recorded with magpie_record_stream
 * (Tensor.record_stream reaches it through the record-stream hook below,
 * which magpie.torch.use() installs). device is implied
 * by the stream and not otherwise used. */
MAGPIE_API void *magpie_torch_malloc(ssize_t size, int device, cudaStream_t stream);
MAGPIE_API void magpie_torch_free(void *ptr, ssize_t size, int device, cudaStream_t stream);
/* The pluggable allocator's other hooks (set_record_stream_fn,
 * set_reset_fn, set_memory_fraction_fn; magpie.torch.use() sets them),
 * adapters over the functions above: Tensor.record_stream ->
 * magpie_record_stream; torch.cuda.empty_cache -> magpie_trim(d, 0) on
 * every device; set_per_process_memory_fraction(f, d) ->
 * magpie_set_limit_fraction(d, f). They return nothing: errors are in
 * magpie_last_error. */
MAGPIE_API void magpie_torch_record_stream(void *ptr, cudaStream_t stream);
MAGPIE_API void magpie_torch_empty_cache(void);
MAGPIE_API void magpie_torch_set_memory_fraction(double fraction, int device);

/* Version. */
MAGPIE_API const char *magpie_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MAGPIE_H */
