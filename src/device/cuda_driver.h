/* The CUDA driver API as magpie loads it: declarations and the one loader
 * (cuda_loader.c) that the library, the demo (tools/devshim.c), the
 * benchmarks (bench/bench_dev.c), the preload library and the GPU tests
 * (tests/gpu/gpu_util.c) all call the driver through. Nothing links
 * libcuda: cudrv_load() opens libcuda.so.1 with dlopen, once per process,
 * and fills the table `cudrv` through cuGetProcAddress_v2, so everything
 * builds without the CUDA toolkit and runs where there is no driver.
 *
 * Every type, constant and layout mirrors cuda.h (CUDA 12.0 ABI and later)
 * under a cudrv_/CUDRV_ prefix, so this header can be included next to the
 * real one. tests/cuda_abi_test.c checks each size, offset and value against
 * cuda.h, that the variant of every entry point the loader asks for is the
 * one listed beside it (against cudaTypedefs.h), and tests/cuda_abi_sig.c
 * checks every function type of the table against the PFN_* typedefs of
 * cudaTypedefs.h for that variant.
 *
 * Handle types use CUDA's own struct tags (CUstream_st, ...): they are
 * incomplete types, so a cudrv_stream, a CUstream and magpie.h's
 * cudaStream_t are the same type and pass between them without casts.
 */
#ifndef MAGPIE_CUDA_DRIVER_H
#define MAGPIE_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

/* Handles: identical to CUDA's. */
typedef struct CUctx_st *cudrv_context;
typedef struct CUstream_st *cudrv_stream;
typedef struct CUevent_st *cudrv_event;
typedef struct CUmod_st *cudrv_module;
typedef struct CUfunc_st *cudrv_function;
typedef struct CUmemPoolHandle_st *cudrv_mem_pool;
typedef struct CUgraph_st *cudrv_graph;
typedef struct CUgraphExec_st *cudrv_graph_exec;
typedef struct CUgraphNode_st *cudrv_graph_node;

/* CUDRV_EXTERNAL_TYPES: the signature check defines these as the real CUDA
 * types first, so that function types compare exactly. */
#ifndef CUDRV_EXTERNAL_TYPES
typedef int cudrv_result;                    /* CUresult (an enum) */
typedef int cudrv_device;                    /* CUdevice */
typedef unsigned long long cudrv_deviceptr;  /* CUdeviceptr */
typedef unsigned long long cudrv_mem_handle; /* CUmemGenericAllocationHandle */
typedef uint64_t cudrv_uint64;               /* cuuint64_t */
typedef int cudrv_device_attr;               /* CUdevice_attribute */
typedef int cudrv_granularity_flags;         /* CUmemAllocationGranularity_flags */
typedef int cudrv_proc_query_result;         /* CUdriverProcAddressQueryResult */
typedef int cudrv_jit_option;                /* CUjit_option */
typedef int cudrv_mem_pool_attr;             /* CUmemPool_attribute */
typedef int cudrv_capture_status;            /* CUstreamCaptureStatus */
typedef int cudrv_capture_mode;              /* CUstreamCaptureMode */
typedef int cudrv_mem_handle_type;           /* CUmemAllocationHandleType */

typedef struct cudrv_mem_location { /* CUmemLocation */
  int type;                         /* CUmemLocationType */
  int id;
} cudrv_mem_location;

typedef struct cudrv_mem_alloc_prop { /* CUmemAllocationProp */
  int type;                           /* CUmemAllocationType */
  int requested_handle_types;         /* CUmemAllocationHandleType */
  cudrv_mem_location location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
} cudrv_mem_alloc_prop;

typedef struct cudrv_mem_access_desc { /* CUmemAccessDesc */
  cudrv_mem_location location;
  int flags; /* CUmemAccess_flags */
} cudrv_mem_access_desc;

typedef struct cudrv_uuid { /* CUuuid */
  char bytes[16];
} cudrv_uuid;
#endif /* CUDRV_EXTERNAL_TYPES */

/* Constants (the names after the colon are cuda.h's). */
enum {
  CUDRV_SUCCESS = 0,                             /* CUDA_SUCCESS */
  CUDRV_ERROR_INVALID_VALUE = 1,                 /* CUDA_ERROR_INVALID_VALUE */
  CUDRV_ERROR_OUT_OF_MEMORY = 2,                 /* CUDA_ERROR_OUT_OF_MEMORY */
  CUDRV_ERROR_NOT_INITIALIZED = 3,               /* CUDA_ERROR_NOT_INITIALIZED */
  CUDRV_ERROR_DEINITIALIZED = 4,                 /* CUDA_ERROR_DEINITIALIZED */
  CUDRV_ERROR_STUB_LIBRARY = 34,                 /* CUDA_ERROR_STUB_LIBRARY */
  CUDRV_ERROR_NO_DEVICE = 100,                   /* CUDA_ERROR_NO_DEVICE */
  CUDRV_ERROR_INVALID_CONTEXT = 201,             /* CUDA_ERROR_INVALID_CONTEXT */
  CUDRV_ERROR_INVALID_HANDLE = 400,              /* CUDA_ERROR_INVALID_HANDLE */
  CUDRV_ERROR_NOT_FOUND = 500,                   /* CUDA_ERROR_NOT_FOUND */
  CUDRV_ERROR_NOT_READY = 600,                   /* CUDA_ERROR_NOT_READY */
  CUDRV_ERROR_PEER_ACCESS_UNSUPPORTED = 217,     /* CUDA_ERROR_PEER_ACCESS_UNSUPPORTED */
  CUDRV_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704, /* CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED */
  CUDRV_ERROR_PEER_ACCESS_NOT_ENABLED = 705,     /* CUDA_ERROR_PEER_ACCESS_NOT_ENABLED */
  CUDRV_ERROR_CONTEXT_IS_DESTROYED = 709,        /* CUDA_ERROR_CONTEXT_IS_DESTROYED */
  CUDRV_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,  /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
  CUDRV_ERROR_STREAM_CAPTURE_INVALIDATED = 901,  /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED */
};

enum {
  CUDRV_DEVICE_ATTRIBUTE_VMM_SUPPORTED = 102,      /* ..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
  CUDRV_MEM_ALLOCATION_TYPE_PINNED = 1,            /* CU_MEM_ALLOCATION_TYPE_PINNED */
  CUDRV_MEM_HANDLE_TYPE_NONE = 0,                  /* CU_MEM_HANDLE_TYPE_NONE */
  CUDRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1, /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
  CUDRV_MEM_LOCATION_TYPE_DEVICE = 1,              /* CU_MEM_LOCATION_TYPE_DEVICE */
  CUDRV_MEM_ACCESS_FLAGS_PROT_NONE = 0,            /* CU_MEM_ACCESS_FLAGS_PROT_NONE */
  CUDRV_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,       /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
  CUDRV_MEM_ALLOC_GRANULARITY_MINIMUM = 0,         /* CU_MEM_ALLOC_GRANULARITY_MINIMUM */
  CUDRV_EVENT_DISABLE_TIMING = 2,                  /* CU_EVENT_DISABLE_TIMING */
  CUDRV_STREAM_NON_BLOCKING = 1,                   /* CU_STREAM_NON_BLOCKING */
  CUDRV_MEMHOSTALLOC_PORTABLE = 1,                 /* CU_MEMHOSTALLOC_PORTABLE */
  CUDRV_MEMHOSTALLOC_DEVICEMAP = 2,                /* CU_MEMHOSTALLOC_DEVICEMAP */
  CUDRV_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4,        /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
  CUDRV_JIT_ERROR_LOG_BUFFER = 5,                  /* CU_JIT_ERROR_LOG_BUFFER */
  CUDRV_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6,       /* CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES */
  CUDRV_GET_PROC_ADDRESS_LEGACY_STREAM = 1,        /* CU_GET_PROC_ADDRESS_LEGACY_STREAM */
  CUDRV_GET_PROC_ADDRESS_SUCCESS = 0,              /* CU_GET_PROC_ADDRESS_SUCCESS */
  CUDRV_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  CUDRV_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
  CUDRV_STREAM_CAPTURE_STATUS_NONE = 0,        /* CU_STREAM_CAPTURE_STATUS_NONE */
  CUDRV_STREAM_CAPTURE_STATUS_ACTIVE = 1,      /* CU_STREAM_CAPTURE_STATUS_ACTIVE */
  CUDRV_STREAM_CAPTURE_STATUS_INVALIDATED = 2, /* CU_STREAM_CAPTURE_STATUS_INVALIDATED */
  CUDRV_STREAM_CAPTURE_MODE_GLOBAL = 0,        /* CU_STREAM_CAPTURE_MODE_GLOBAL */
  CUDRV_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,  /* CU_STREAM_CAPTURE_MODE_THREAD_LOCAL */
  CUDRV_STREAM_CAPTURE_MODE_RELAXED = 2,       /* CU_STREAM_CAPTURE_MODE_RELAXED */
};

/* Special stream handles (cuda.h: 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD).
 * They name a stream of the calling thread's current context. */
#define CUDRV_STREAM_LEGACY ((cudrv_stream)0x1)
#define CUDRV_STREAM_PER_THREAD ((cudrv_stream)0x2)

/* The one entry point found with dlsym; every other one comes from it.
 * cuda.h: PFN_cuGetProcAddress_v12000, exported as "cuGetProcAddress_v2". */
typedef cudrv_result (*cudrv_pfn_get_proc_address)(const char *symbol, void **pfn, int cuda_version, cudrv_uint64 flags,
                                                   cudrv_proc_query_result *status);
#define CUDRV_GET_PROC_ADDRESS_SYMBOL "cuGetProcAddress_v2"

/* The driver version every entry point is requested for. A symbol resolves
 * to its newest variant not newer than this; for each function below that
 * variant is the one named by its PFN version (cudaTypedefs.h of CUDA 13.0
 * has no variant between that version and 12000; later ones, such as
 * cuStreamGetCtx_v12050 or cuCtxSynchronize_v13000, change the signature). */
#define CUDRV_REQUEST_VERSION 12000
#define CUDRV_REQUEST_FOR(pfn_version) ((pfn_version) > CUDRV_REQUEST_VERSION ? (pfn_version) : CUDRV_REQUEST_VERSION)

/* The table's entry points, X(field, symbol, pfn_version) in three lists.
 * The function type of each is cudrv_pfn_<field>, and must equal cuda.h's
 * PFN_<symbol>_v<pfn_version>; the loader requests each at
 * CUDRV_REQUEST_FOR(pfn_version), with the legacy meaning of stream handle
 * 0 (as the runtime API without --default-stream per-thread, and as the
 * plain exported symbols).
 *
 * CUDRV_REQUIRED_FUNCS: what the library needs; no load succeeds without
 *   any of them.
 * CUDRV_TOOL_FUNCS: what the demo, the benchmarks, the preload library and
 *   the GPU tests use besides (every CUDA 12.0 driver has them). A load for
 *   CUDRV_LOAD_ALL fails without any of them; the library's own load
 *   (CUDRV_LOAD_LIBRARY) does not, and a missing one is then NULL.
 * CUDRV_OPTIONAL_FUNCS: NULL where the driver lacks them; test before use. */
#define CUDRV_REQUIRED_FUNCS(X)                                              \
  X(init, cuInit, 2000)                                                      \
  X(driver_get_version, cuDriverGetVersion, 2020)                            \
  X(get_error_name, cuGetErrorName, 6000)                                    \
  X(device_get_count, cuDeviceGetCount, 2000)                                \
  X(device_get, cuDeviceGet, 2000)                                           \
  X(device_get_attribute, cuDeviceGetAttribute, 2000)                        \
  X(primary_ctx_retain, cuDevicePrimaryCtxRetain, 7000)                      \
  X(ctx_push_current, cuCtxPushCurrent, 4000)                                \
  X(ctx_pop_current, cuCtxPopCurrent, 4000)                                  \
  X(ctx_set_current, cuCtxSetCurrent, 4000)                                  \
  X(ctx_get_current, cuCtxGetCurrent, 4000)                                  \
  X(ctx_get_device, cuCtxGetDevice, 2000)                                    \
  X(ctx_synchronize, cuCtxSynchronize, 2000)                                 \
  X(mem_get_info, cuMemGetInfo, 3020)                                        \
  X(mem_alloc, cuMemAlloc, 3020)                                             \
  X(mem_free, cuMemFree, 3020)                                               \
  X(mem_get_granularity, cuMemGetAllocationGranularity, 10020)               \
  X(mem_address_reserve, cuMemAddressReserve, 10020)                         \
  X(mem_address_free, cuMemAddressFree, 10020)                               \
  X(mem_create, cuMemCreate, 10020)                                          \
  X(mem_map, cuMemMap, 10020)                                                \
  X(mem_set_access, cuMemSetAccess, 10020)                                   \
  X(mem_release, cuMemRelease, 10020)                                        \
  X(mem_unmap, cuMemUnmap, 10020)                                            \
  X(mem_retain_allocation_handle, cuMemRetainAllocationHandle, 11000)        \
  X(mem_export_to_shareable_handle, cuMemExportToShareableHandle, 10020)     \
  X(mem_import_from_shareable_handle, cuMemImportFromShareableHandle, 10020) \
  X(device_can_access_peer, cuDeviceCanAccessPeer, 4000)                     \
  X(device_get_uuid, cuDeviceGetUuid, 11040)                                 \
  X(ctx_enable_peer_access, cuCtxEnablePeerAccess, 4000)                     \
  X(ctx_disable_peer_access, cuCtxDisablePeerAccess, 4000)                   \
  X(event_create, cuEventCreate, 2000)                                       \
  X(event_destroy, cuEventDestroy, 4000)                                     \
  X(event_record, cuEventRecord, 2000)                                       \
  X(event_query, cuEventQuery, 2000)                                         \
  X(event_synchronize, cuEventSynchronize, 2000)                             \
  X(stream_wait_event, cuStreamWaitEvent, 3020)                              \
  X(stream_get_id, cuStreamGetId, 12000)                                     \
  X(stream_get_ctx, cuStreamGetCtx, 9020)                                    \
  X(stream_is_capturing, cuStreamIsCapturing, 10000)                         \
  X(stream_get_capture_info, cuStreamGetCaptureInfo, 11030)                  \
  X(thread_exchange_capture_mode, cuThreadExchangeStreamCaptureMode, 10010)

#define CUDRV_TOOL_FUNCS(X)                                        \
  X(device_get_name, cuDeviceGetName, 2000)                        \
  X(stream_create, cuStreamCreate, 2000)                           \
  X(stream_destroy, cuStreamDestroy, 4000)                         \
  X(stream_synchronize, cuStreamSynchronize, 2000)                 \
  X(memset_d32, cuMemsetD32, 3020)                                 \
  X(memset_d32_async, cuMemsetD32Async, 3020)                      \
  X(memcpy_dtoh, cuMemcpyDtoH, 3020)                               \
  X(memcpy_async, cuMemcpyAsync, 4000)                             \
  X(mem_alloc_async, cuMemAllocAsync, 11020)                       \
  X(mem_free_async, cuMemFreeAsync, 11020)                         \
  X(device_get_default_mem_pool, cuDeviceGetDefaultMemPool, 11020) \
  X(mem_pool_set_attribute, cuMemPoolSetAttribute, 11020)          \
  X(mem_host_alloc, cuMemHostAlloc, 2020)                          \
  X(mem_host_get_device_pointer, cuMemHostGetDevicePointer, 3020)  \
  X(mem_free_host, cuMemFreeHost, 2000)                            \
  X(stream_write_value64, cuStreamWriteValue64, 11070)             \
  X(module_load_data, cuModuleLoadData, 2000)                      \
  X(module_load_data_ex, cuModuleLoadDataEx, 2010)                 \
  X(module_get_function, cuModuleGetFunction, 2000)                \
  X(launch_kernel, cuLaunchKernel, 4000)                           \
  X(stream_begin_capture, cuStreamBeginCapture, 10010)             \
  X(stream_end_capture, cuStreamEndCapture, 10000)                 \
  X(graph_instantiate, cuGraphInstantiateWithFlags, 11040)         \
  X(graph_launch, cuGraphLaunch, 10000)                            \
  X(graph_exec_destroy, cuGraphExecDestroy, 10000)                 \
  X(graph_destroy, cuGraphDestroy, 10000)

/* cuStreamGetDevice: drivers 12.8 and later. */
#define CUDRV_OPTIONAL_FUNCS(X) X(stream_get_device, cuStreamGetDevice, 12080)

/* All three lists. */
#define CUDRV_ALL_FUNCS(X) CUDRV_REQUIRED_FUNCS(X) CUDRV_TOOL_FUNCS(X) CUDRV_OPTIONAL_FUNCS(X)

typedef cudrv_result (*cudrv_pfn_init)(unsigned int flags);
typedef cudrv_result (*cudrv_pfn_driver_get_version)(int *version);
typedef cudrv_result (*cudrv_pfn_get_error_name)(cudrv_result error, const char **name);
typedef cudrv_result (*cudrv_pfn_device_get_count)(int *count);
typedef cudrv_result (*cudrv_pfn_device_get)(cudrv_device *device, int ordinal);
typedef cudrv_result (*cudrv_pfn_device_get_attribute)(int *value, cudrv_device_attr attr, cudrv_device device);
typedef cudrv_result (*cudrv_pfn_primary_ctx_retain)(cudrv_context *ctx, cudrv_device device);
typedef cudrv_result (*cudrv_pfn_ctx_push_current)(cudrv_context ctx);
typedef cudrv_result (*cudrv_pfn_ctx_pop_current)(cudrv_context *ctx);
typedef cudrv_result (*cudrv_pfn_ctx_set_current)(cudrv_context ctx);
typedef cudrv_result (*cudrv_pfn_ctx_get_current)(cudrv_context *ctx);
typedef cudrv_result (*cudrv_pfn_ctx_get_device)(cudrv_device *device);
typedef cudrv_result (*cudrv_pfn_ctx_synchronize)(void);
typedef cudrv_result (*cudrv_pfn_mem_get_info)(size_t *free_bytes, size_t *total_bytes);
typedef cudrv_result (*cudrv_pfn_mem_alloc)(cudrv_deviceptr *ptr, size_t size);
typedef cudrv_result (*cudrv_pfn_mem_free)(cudrv_deviceptr ptr);
typedef cudrv_result (*cudrv_pfn_mem_get_granularity)(size_t *granularity, const cudrv_mem_alloc_prop *prop,
                                                      cudrv_granularity_flags option);
typedef cudrv_result (*cudrv_pfn_mem_address_reserve)(cudrv_deviceptr *ptr, size_t size, size_t alignment,
                                                      cudrv_deviceptr addr, unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_address_free)(cudrv_deviceptr ptr, size_t size);
typedef cudrv_result (*cudrv_pfn_mem_create)(cudrv_mem_handle *handle, size_t size, const cudrv_mem_alloc_prop *prop,
                                             unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_map)(cudrv_deviceptr ptr, size_t size, size_t offset, cudrv_mem_handle handle,
                                          unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_set_access)(cudrv_deviceptr ptr, size_t size, const cudrv_mem_access_desc *desc,
                                                 size_t count);
typedef cudrv_result (*cudrv_pfn_mem_release)(cudrv_mem_handle handle);
typedef cudrv_result (*cudrv_pfn_mem_unmap)(cudrv_deviceptr ptr, size_t size);
typedef cudrv_result (*cudrv_pfn_mem_retain_allocation_handle)(cudrv_mem_handle *handle, void *addr);
typedef cudrv_result (*cudrv_pfn_mem_export_to_shareable_handle)(void *shareable, cudrv_mem_handle handle,
                                                                 cudrv_mem_handle_type type, unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_import_from_shareable_handle)(cudrv_mem_handle *handle, void *shareable,
                                                                   cudrv_mem_handle_type type);
typedef cudrv_result (*cudrv_pfn_device_can_access_peer)(int *can, cudrv_device device, cudrv_device peer);
typedef cudrv_result (*cudrv_pfn_device_get_uuid)(cudrv_uuid *uuid, cudrv_device device);
typedef cudrv_result (*cudrv_pfn_ctx_enable_peer_access)(cudrv_context peer, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_ctx_disable_peer_access)(cudrv_context peer);
typedef cudrv_result (*cudrv_pfn_event_create)(cudrv_event *event, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_event_destroy)(cudrv_event event);
typedef cudrv_result (*cudrv_pfn_event_record)(cudrv_event event, cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_event_query)(cudrv_event event);
typedef cudrv_result (*cudrv_pfn_event_synchronize)(cudrv_event event);
typedef cudrv_result (*cudrv_pfn_stream_wait_event)(cudrv_stream stream, cudrv_event event, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_stream_get_id)(cudrv_stream stream, unsigned long long *id);
typedef cudrv_result (*cudrv_pfn_stream_get_ctx)(cudrv_stream stream, cudrv_context *ctx);
typedef cudrv_result (*cudrv_pfn_stream_get_device)(cudrv_stream stream, cudrv_device *device);
typedef cudrv_result (*cudrv_pfn_stream_is_capturing)(cudrv_stream stream, cudrv_capture_status *status);
typedef cudrv_result (*cudrv_pfn_stream_get_capture_info)(cudrv_stream stream, cudrv_capture_status *status,
                                                          cudrv_uint64 *id, cudrv_graph *graph,
                                                          const cudrv_graph_node **deps, size_t *ndeps);
typedef cudrv_result (*cudrv_pfn_thread_exchange_capture_mode)(cudrv_capture_mode *mode);

typedef cudrv_result (*cudrv_pfn_device_get_name)(char *name, int len, cudrv_device device);
typedef cudrv_result (*cudrv_pfn_stream_create)(cudrv_stream *stream, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_stream_destroy)(cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_stream_synchronize)(cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_memset_d32)(cudrv_deviceptr ptr, unsigned int value, size_t n);
typedef cudrv_result (*cudrv_pfn_memset_d32_async)(cudrv_deviceptr ptr, unsigned int value, size_t n,
                                                   cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_memcpy_dtoh)(void *dst, cudrv_deviceptr src, size_t bytes);
typedef cudrv_result (*cudrv_pfn_memcpy_async)(cudrv_deviceptr dst, cudrv_deviceptr src, size_t bytes,
                                               cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_mem_alloc_async)(cudrv_deviceptr *ptr, size_t size, cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_mem_free_async)(cudrv_deviceptr ptr, cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_device_get_default_mem_pool)(cudrv_mem_pool *pool, cudrv_device device);
typedef cudrv_result (*cudrv_pfn_mem_pool_set_attribute)(cudrv_mem_pool pool, cudrv_mem_pool_attr attr, void *value);
typedef cudrv_result (*cudrv_pfn_mem_host_alloc)(void **ptr, size_t size, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_mem_host_get_device_pointer)(cudrv_deviceptr *dptr, void *ptr, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_mem_free_host)(void *ptr);
typedef cudrv_result (*cudrv_pfn_stream_write_value64)(cudrv_stream stream, cudrv_deviceptr addr, cudrv_uint64 value,
                                                       unsigned int flags);
typedef cudrv_result (*cudrv_pfn_module_load_data)(cudrv_module *module, const void *image);
typedef cudrv_result (*cudrv_pfn_module_load_data_ex)(cudrv_module *module, const void *image, unsigned int num_options,
                                                      cudrv_jit_option *options, void **option_values);
typedef cudrv_result (*cudrv_pfn_module_get_function)(cudrv_function *function, cudrv_module module, const char *name);
typedef cudrv_result (*cudrv_pfn_launch_kernel)(cudrv_function f, unsigned int grid_x, unsigned int grid_y,
                                                unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                                unsigned int block_z, unsigned int shared_bytes, cudrv_stream stream,
                                                void **params, void **extra);
typedef cudrv_result (*cudrv_pfn_stream_begin_capture)(cudrv_stream stream, cudrv_capture_mode mode);
typedef cudrv_result (*cudrv_pfn_stream_end_capture)(cudrv_stream stream, cudrv_graph *graph);
typedef cudrv_result (*cudrv_pfn_graph_instantiate)(cudrv_graph_exec *exec, cudrv_graph graph,
                                                    unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_graph_launch)(cudrv_graph_exec exec, cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_graph_exec_destroy)(cudrv_graph_exec exec);
typedef cudrv_result (*cudrv_pfn_graph_destroy)(cudrv_graph graph);

/* --- the loader (cuda_loader.c) ----------------------------------------- */

/* The driver's entry points. */
typedef struct cudrv_api {
  /* libcuda.so.1's dlopen handle, never closed (NULL: not found). Only for
   * looking up an exported symbol by name, which an interposer (the preload
   * library: the next definition of what it replaces) or a probe timing the
   * exported entry point needs; everything else goes through the fields. */
  void *library;
  cudrv_pfn_get_proc_address get_proc_address;
#define CUDRV_API_FIELD(field, symbol, version) cudrv_pfn_##field field;
  CUDRV_ALL_FUNCS(CUDRV_API_FIELD)
#undef CUDRV_API_FIELD
} cudrv_api;

/* The table, filled once by the first cudrv_load (under pthread_once) and
 * never written again. Read it only after a cudrv_load that succeeded for
 * what is used (pthread_once orders the fill before that call's return).
 * Hidden like the rest of magpie's internals (cuda_loader.c is built with
 * -fvisibility=hidden): one table per module (libmagpie.so, a program
 * linking libmagpie.a or magpie's Bazel targets), shared by everything in
 * it that calls the driver. */
extern cudrv_api cudrv;

/* What a load must find. */
enum {
  CUDRV_LOAD_LIBRARY = 0, /* the driver, cuGetProcAddress_v2 and CUDRV_REQUIRED_FUNCS */
  CUDRV_LOAD_ALL = 1,     /* that and CUDRV_TOOL_FUNCS */
};

/* Loads the driver and resolves every entry point, the first time; later
 * calls, from any thread, return the first one's outcome for `what`. 0 on
 * success; -1 with *why (if why is not NULL) set to a sentence saying what
 * is missing (libcuda.so.1 and dlerror's reason, cuGetProcAddress_v2, or the
 * first entry point absent with its ABI version), valid for the process's
 * life. Does not call cuInit: that is the caller's. */
int cudrv_load(int what, const char **why);

#endif /* MAGPIE_CUDA_DRIVER_H */
