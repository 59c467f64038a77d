/* Part of cuda_abi_test: every function type of the driver loader's table
 * (src/device/cuda_driver.h: CUDRV_REQUIRED_FUNCS, CUDRV_TOOL_FUNCS and
 * CUDRV_OPTIONAL_FUNCS, and cuGetProcAddress itself) must be exactly
 * cuda.h's PFN_<symbol>_v<version> for the version listed beside it, since
 * the loader asks cuGetProcAddress for that variant and everything calls it
 * through that type. Here the cudrv_ types are the real CUDA types, so the
 * comparison is exact (parameter for parameter, not only by size). */
#include <cuda.h>
#include <cudaTypedefs.h>

typedef CUresult cudrv_result;
typedef CUdevice cudrv_device;
typedef CUdeviceptr cudrv_deviceptr;
typedef CUmemGenericAllocationHandle cudrv_mem_handle;
typedef cuuint64_t cudrv_uint64;
typedef CUdevice_attribute cudrv_device_attr;
typedef CUmemAllocationGranularity_flags cudrv_granularity_flags;
typedef CUdriverProcAddressQueryResult cudrv_proc_query_result;
typedef CUjit_option cudrv_jit_option;
typedef CUmemPool_attribute cudrv_mem_pool_attr;
typedef CUstreamCaptureStatus cudrv_capture_status;
typedef CUstreamCaptureMode cudrv_capture_mode;
typedef CUmemLocation cudrv_mem_location;
typedef CUmemAllocationProp cudrv_mem_alloc_prop;
typedef CUmemAccessDesc cudrv_mem_access_desc;
typedef CUuuid cudrv_uuid;
typedef CUmemAllocationHandleType cudrv_mem_handle_type;
#define CUDRV_EXTERNAL_TYPES
#include "device/cuda_driver.h"

#if CUDA_VERSION < 12080
#error "cuda_abi_test needs the headers of CUDA 12.8 or newer (cuStreamGetDevice)"
#endif

#define ABI_SIG_CHECK(field, symbol, version)                                                                  \
  _Static_assert(__builtin_types_compatible_p(cudrv_pfn_##field, PFN_##symbol##_v##version),                   \
                 "cudrv_pfn_" #field " differs from PFN_" #symbol "_v" #version);                              \
  _Static_assert(__builtin_types_compatible_p(__typeof__(((cudrv_api *)0)->field), PFN_##symbol##_v##version), \
                 "cudrv_api." #field " differs from PFN_" #symbol "_v" #version);
CUDRV_ALL_FUNCS(ABI_SIG_CHECK)

_Static_assert(__builtin_types_compatible_p(cudrv_pfn_get_proc_address, PFN_cuGetProcAddress_v12000),
               "cudrv_pfn_get_proc_address differs from PFN_cuGetProcAddress_v12000");
_Static_assert(__builtin_types_compatible_p(__typeof__(((cudrv_api *)0)->get_proc_address),
                                            PFN_cuGetProcAddress_v12000),
               "cudrv_api.get_proc_address differs from PFN_cuGetProcAddress_v12000");

/* The table holds the handle, cuGetProcAddress and the listed entry points,
 * nothing else: no field escapes the checks above. */
#define ABI_SIG_COUNT(field, symbol, version) +1
_Static_assert(sizeof(cudrv_api) == (2 CUDRV_ALL_FUNCS(ABI_SIG_COUNT)) * sizeof(void *),
               "cudrv_api has a field outside the checked lists");

/* Counts the checked entry points (cuGetProcAddress included), for the
 * runtime report. */
int cuda_abi_sig_checked(void) { return 1 CUDRV_ALL_FUNCS(ABI_SIG_COUNT); }
