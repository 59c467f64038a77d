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
  MAGPIE_ERR_BACKEND = 8,         /* the CUDA driver (or sim) reported an error */
  MAGPIE_ERR_NO_DEVICE = 9,       /* requested backend has no device */
  MAGPIE_ERR_CONFIG = 10,         /* bad MAGPIE_CONF / config value */
  MAGPIE_ERR_ALREADY_INITIALIZED = 11,
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
  int backend;            /* enum magpie_backend_kind */
  int check;              /* 1: detect double frees (costs an atomic per op) */
  int verbose;            /* 1: print stats to stderr at exit */
  size_t magazine_bytes;  /* target bytes per magazine (capacity by class) */
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

/* Statistics of one device (figures in bytes unless named *_count). */
typedef struct magpie_stats {
  size_t in_use_bytes;        /* handed out and not yet freed (block sizes) */
  size_t reserved_bytes;      /* device memory mapped by magpie */
  size_t peak_in_use_bytes;   /* see README: sampled on slow paths */
  size_t peak_reserved_bytes;
  size_t cached_bytes;        /* reserved but not in use */
  size_t large_in_use_bytes;  /* part of in_use served by the large path */
  uint64_t slab_count;
  uint64_t depot_exchanges;   /* magazines taken from / given to the depot */
  uint64_t events_recorded;   /* one per magazine leaving a thread's stream */
  uint64_t cross_stream_migrations; /* sealed magazines released to every stream */
  uint64_t same_stream_reuses;      /* pending magazines reused on their own stream */
  uint64_t limbo_magazines;   /* magazines whose stream died; waited by device sync */
} magpie_stats;

MAGPIE_API int magpie_stats_get(int device, magpie_stats *out);

/* Errors. */
MAGPIE_API int magpie_last_error(void);
MAGPIE_API const char *magpie_last_error_message(void); /* detail for this thread */
MAGPIE_API const char *magpie_error_string(int code);

/* PyTorch's pluggable allocator interface
 * (torch.cuda.memory.CUDAPluggableAllocator loads these two by name from
 * libmagpie.so). PyTorch passes the stream the block was allocated on to
 * the free, so a block used on another stream must have been ordered after
 * that use by the application (as with PyTorch's own allocator without
 * record_stream). device is implied by the stream and not otherwise used. */
MAGPIE_API void *magpie_torch_malloc(ssize_t size, int device, cudaStream_t stream);
MAGPIE_API void magpie_torch_free(void *ptr, ssize_t size, int device, cudaStream_t stream);

/* Version. */
MAGPIE_API const char *magpie_version(void);

#ifdef __cplusplus
}
#endif

#endif /* MAGPIE_H */
