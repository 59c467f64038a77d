/* The part of the CUDA driver API that backend_cuda.c uses, declared here so
 * that the library builds without the CUDA toolkit and links without libcuda
 * (the driver is loaded with dlopen at run time).
 *
 * Every type, constant and layout mirrors cuda.h (CUDA 12.0 ABI and later)
 * under a cudrv_/CUDRV_ prefix, so this header can be included next to the
 * real one. tests/cuda_abi_test.c checks each size, offset and value against
 * cuda.h, and tests/cuda_abi_sig.c checks every function type against the
 * PFN_* typedefs of cudaTypedefs.h for the version the backend requests.
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

/* CUDRV_EXTERNAL_TYPES: the signature check defines these as the real CUDA
 * types first, so that function types compare exactly. */
#ifndef CUDRV_EXTERNAL_TYPES
typedef int cudrv_result;               /* CUresult (an enum) */
typedef int cudrv_device;               /* CUdevice */
typedef unsigned long long cudrv_deviceptr;   /* CUdeviceptr */
typedef unsigned long long cudrv_mem_handle;  /* CUmemGenericAllocationHandle */
typedef uint64_t cudrv_uint64;          /* cuuint64_t */
typedef int cudrv_device_attr;          /* CUdevice_attribute */
typedef int cudrv_granularity_flags;    /* CUmemAllocationGranularity_flags */
typedef int cudrv_proc_query_result;    /* CUdriverProcAddressQueryResult */

typedef struct cudrv_mem_location {     /* CUmemLocation */
  int type;                             /* CUmemLocationType */
  int id;
} cudrv_mem_location;

typedef struct cudrv_mem_alloc_prop {   /* CUmemAllocationProp */
  int type;                             /* CUmemAllocationType */
  int requested_handle_types;           /* CUmemAllocationHandleType */
  cudrv_mem_location location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
} cudrv_mem_alloc_prop;

typedef struct cudrv_mem_access_desc {  /* CUmemAccessDesc */
  cudrv_mem_location location;
  int flags;                            /* CUmemAccess_flags */
} cudrv_mem_access_desc;
#endif /* CUDRV_EXTERNAL_TYPES */

/* Constants (the names after the colon are cuda.h's). */
enum {
  CUDRV_SUCCESS = 0,                    /* CUDA_SUCCESS */
  CUDRV_ERROR_INVALID_VALUE = 1,        /* CUDA_ERROR_INVALID_VALUE */
  CUDRV_ERROR_OUT_OF_MEMORY = 2,        /* CUDA_ERROR_OUT_OF_MEMORY */
  CUDRV_ERROR_NOT_INITIALIZED = 3,      /* CUDA_ERROR_NOT_INITIALIZED */
  CUDRV_ERROR_DEINITIALIZED = 4,        /* CUDA_ERROR_DEINITIALIZED */
  CUDRV_ERROR_STUB_LIBRARY = 34,        /* CUDA_ERROR_STUB_LIBRARY */
  CUDRV_ERROR_NO_DEVICE = 100,          /* CUDA_ERROR_NO_DEVICE */
  CUDRV_ERROR_INVALID_CONTEXT = 201,    /* CUDA_ERROR_INVALID_CONTEXT */
  CUDRV_ERROR_INVALID_HANDLE = 400,     /* CUDA_ERROR_INVALID_HANDLE */
  CUDRV_ERROR_NOT_FOUND = 500,          /* CUDA_ERROR_NOT_FOUND */
  CUDRV_ERROR_NOT_READY = 600,          /* CUDA_ERROR_NOT_READY */
  CUDRV_ERROR_CONTEXT_IS_DESTROYED = 709, /* CUDA_ERROR_CONTEXT_IS_DESTROYED */
};

enum {
  CUDRV_DEVICE_ATTRIBUTE_VMM_SUPPORTED = 102, /* ..._VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
  CUDRV_MEM_ALLOCATION_TYPE_PINNED = 1,       /* CU_MEM_ALLOCATION_TYPE_PINNED */
  CUDRV_MEM_HANDLE_TYPE_NONE = 0,             /* CU_MEM_HANDLE_TYPE_NONE */
  CUDRV_MEM_LOCATION_TYPE_DEVICE = 1,         /* CU_MEM_LOCATION_TYPE_DEVICE */
  CUDRV_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,  /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
  CUDRV_MEM_ALLOC_GRANULARITY_MINIMUM = 0,    /* CU_MEM_ALLOC_GRANULARITY_MINIMUM */
  CUDRV_EVENT_DISABLE_TIMING = 2,             /* CU_EVENT_DISABLE_TIMING */
  CUDRV_GET_PROC_ADDRESS_LEGACY_STREAM = 1,   /* CU_GET_PROC_ADDRESS_LEGACY_STREAM */
  CUDRV_GET_PROC_ADDRESS_SUCCESS = 0,         /* CU_GET_PROC_ADDRESS_SUCCESS */
  CUDRV_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  CUDRV_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
};

/* Special stream handles (cuda.h: 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD).
 * They name a stream of the calling thread's current context. */
#define CUDRV_STREAM_LEGACY ((cudrv_stream)0x1)
#define CUDRV_STREAM_PER_THREAD ((cudrv_stream)0x2)

/* The one entry point found with dlsym; every other one comes from it.
 * cuda.h: PFN_cuGetProcAddress_v12000, exported as "cuGetProcAddress_v2". */
typedef cudrv_result (*cudrv_pfn_get_proc_address)(const char *symbol, void **pfn,
                                                   int cuda_version, cudrv_uint64 flags,
                                                   cudrv_proc_query_result *status);
#define CUDRV_GET_PROC_ADDRESS_SYMBOL "cuGetProcAddress_v2"

/* The driver version every entry point is requested for. A symbol resolves
 * to its newest variant not newer than this; for each function below that
 * variant is the one named by its PFN version (cudaTypedefs.h of CUDA 13.0
 * has no variant between that version and 12000; later ones, such as
 * cuStreamGetCtx_v12050 or cuCtxSynchronize_v13000, change the signature). */
#define CUDRV_REQUEST_VERSION 12000
#define CUDRV_REQUEST_FOR(pfn_version) \
  ((pfn_version) > CUDRV_REQUEST_VERSION ? (pfn_version) : CUDRV_REQUEST_VERSION)

/* X(field, symbol, pfn_version): the entry points the backend needs. The
 * function type of each is cudrv_pfn_<field>, and must equal cuda.h's
 * PFN_<symbol>_v<pfn_version>. */
#define CUDRV_REQUIRED_FUNCS(X)                                         \
  X(init, cuInit, 2000)                                                 \
  X(driver_get_version, cuDriverGetVersion, 2020)                       \
  X(get_error_name, cuGetErrorName, 6000)                               \
  X(device_get_count, cuDeviceGetCount, 2000)                           \
  X(device_get, cuDeviceGet, 2000)                                      \
  X(device_get_attribute, cuDeviceGetAttribute, 2000)                   \
  X(primary_ctx_retain, cuDevicePrimaryCtxRetain, 7000)                 \
  X(ctx_push_current, cuCtxPushCurrent, 4000)                           \
  X(ctx_pop_current, cuCtxPopCurrent, 4000)                             \
  X(ctx_set_current, cuCtxSetCurrent, 4000)                             \
  X(ctx_get_current, cuCtxGetCurrent, 4000)                             \
  X(ctx_get_device, cuCtxGetDevice, 2000)                               \
  X(ctx_synchronize, cuCtxSynchronize, 2000)                            \
  X(mem_get_info, cuMemGetInfo, 3020)                                   \
  X(mem_alloc, cuMemAlloc, 3020)                                        \
  X(mem_free, cuMemFree, 3020)                                          \
  X(mem_get_granularity, cuMemGetAllocationGranularity, 10020)          \
  X(mem_address_reserve, cuMemAddressReserve, 10020)                    \
  X(mem_address_free, cuMemAddressFree, 10020)                          \
  X(mem_create, cuMemCreate, 10020)                                     \
  X(mem_map, cuMemMap, 10020)                                           \
  X(mem_set_access, cuMemSetAccess, 10020)                              \
  X(mem_release, cuMemRelease, 10020)                                   \
  X(mem_unmap, cuMemUnmap, 10020)                                       \
  X(event_create, cuEventCreate, 2000)                                  \
  X(event_destroy, cuEventDestroy, 4000)                                \
  X(event_record, cuEventRecord, 2000)                                  \
  X(event_query, cuEventQuery, 2000)                                    \
  X(event_synchronize, cuEventSynchronize, 2000)                        \
  X(stream_wait_event, cuStreamWaitEvent, 3020)                         \
  X(stream_get_id, cuStreamGetId, 12000)                                \
  X(stream_get_ctx, cuStreamGetCtx, 9020)

/* Entry points used when the driver has them (cuStreamGetDevice: 12.8+). */
#define CUDRV_OPTIONAL_FUNCS(X) \
  X(stream_get_device, cuStreamGetDevice, 12080)

typedef cudrv_result (*cudrv_pfn_init)(unsigned int flags);
typedef cudrv_result (*cudrv_pfn_driver_get_version)(int *version);
typedef cudrv_result (*cudrv_pfn_get_error_name)(cudrv_result error, const char **name);
typedef cudrv_result (*cudrv_pfn_device_get_count)(int *count);
typedef cudrv_result (*cudrv_pfn_device_get)(cudrv_device *device, int ordinal);
typedef cudrv_result (*cudrv_pfn_device_get_attribute)(int *value, cudrv_device_attr attr,
                                                       cudrv_device device);
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
typedef cudrv_result (*cudrv_pfn_mem_get_granularity)(size_t *granularity,
                                                      const cudrv_mem_alloc_prop *prop,
                                                      cudrv_granularity_flags option);
typedef cudrv_result (*cudrv_pfn_mem_address_reserve)(cudrv_deviceptr *ptr, size_t size,
                                                      size_t alignment, cudrv_deviceptr addr,
                                                      unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_address_free)(cudrv_deviceptr ptr, size_t size);
typedef cudrv_result (*cudrv_pfn_mem_create)(cudrv_mem_handle *handle, size_t size,
                                             const cudrv_mem_alloc_prop *prop,
                                             unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_map)(cudrv_deviceptr ptr, size_t size, size_t offset,
                                          cudrv_mem_handle handle, unsigned long long flags);
typedef cudrv_result (*cudrv_pfn_mem_set_access)(cudrv_deviceptr ptr, size_t size,
                                                 const cudrv_mem_access_desc *desc,
                                                 size_t count);
typedef cudrv_result (*cudrv_pfn_mem_release)(cudrv_mem_handle handle);
typedef cudrv_result (*cudrv_pfn_mem_unmap)(cudrv_deviceptr ptr, size_t size);
typedef cudrv_result (*cudrv_pfn_event_create)(cudrv_event *event, unsigned int flags);
typedef cudrv_result (*cudrv_pfn_event_destroy)(cudrv_event event);
typedef cudrv_result (*cudrv_pfn_event_record)(cudrv_event event, cudrv_stream stream);
typedef cudrv_result (*cudrv_pfn_event_query)(cudrv_event event);
typedef cudrv_result (*cudrv_pfn_event_synchronize)(cudrv_event event);
typedef cudrv_result (*cudrv_pfn_stream_wait_event)(cudrv_stream stream, cudrv_event event,
                                                    unsigned int flags);
typedef cudrv_result (*cudrv_pfn_stream_get_id)(cudrv_stream stream, unsigned long long *id);
typedef cudrv_result (*cudrv_pfn_stream_get_ctx)(cudrv_stream stream, cudrv_context *ctx);
typedef cudrv_result (*cudrv_pfn_stream_get_device)(cudrv_stream stream, cudrv_device *device);

#endif /* MAGPIE_CUDA_DRIVER_H */
