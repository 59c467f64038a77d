/* cuda_abi_test: src/device/cuda_driver.h against the real cuda.h.
 *
 * The library, the demo, the benchmarks and the GPU tests call the driver
 * through the one loader's declarations; a wrong size, offset or constant
 * there would corrupt memory silently on the GPU machine. Everything is
 * checked at compile time (_Static_assert) and again at run time so the
 * test's output lists what was compared. The function types of every entry
 * of the loader's table are compared in cuda_abi_sig.c; test_variants checks
 * against cudaTypedefs.h (the test's argument) that the variant the loader
 * gets from cuGetProcAddress for each entry is the one whose type was
 * compared. Needs the toolkit's headers, no GPU.
 *
 * Also checks that the loader and the CUDA backend fail cleanly where there
 * is no driver (CI): the load and init answer with a reason, and every other
 * backend operation answers an error instead of crashing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda.h>

#include "device/backend.h"
#include "device/cuda_driver.h"

int cuda_abi_sig_checked(void); /* cuda_abi_sig.c */

#define SAME_TYPE(a, b) __builtin_types_compatible_p(a, b)

/* --- compile time ------------------------------------------------------ */

/* Scalars and enums passed by value or through pointers. */
_Static_assert(sizeof(cudrv_result) == sizeof(CUresult), "CUresult");
_Static_assert(sizeof(cudrv_device) == sizeof(CUdevice), "CUdevice");
_Static_assert(SAME_TYPE(cudrv_device, CUdevice), "CUdevice is int");
_Static_assert(SAME_TYPE(cudrv_deviceptr, CUdeviceptr), "CUdeviceptr");
_Static_assert(SAME_TYPE(cudrv_mem_handle, CUmemGenericAllocationHandle), "mem handle");
_Static_assert(SAME_TYPE(cudrv_uint64, cuuint64_t), "cuuint64_t");
_Static_assert(sizeof(cudrv_device_attr) == sizeof(CUdevice_attribute), "CUdevice_attribute");
_Static_assert(sizeof(cudrv_granularity_flags) == sizeof(CUmemAllocationGranularity_flags),
               "CUmemAllocationGranularity_flags");
_Static_assert(sizeof(cudrv_proc_query_result) == sizeof(CUdriverProcAddressQueryResult),
               "CUdriverProcAddressQueryResult");
_Static_assert(sizeof(cudrv_jit_option) == sizeof(CUjit_option), "CUjit_option");
_Static_assert(sizeof(cudrv_mem_pool_attr) == sizeof(CUmemPool_attribute), "CUmemPool_attribute");
_Static_assert(sizeof(cudrv_capture_status) == sizeof(CUstreamCaptureStatus), "CUstreamCaptureStatus");
_Static_assert(sizeof(cudrv_capture_mode) == sizeof(CUstreamCaptureMode), "CUstreamCaptureMode");
_Static_assert(sizeof(cudrv_mem_handle_type) == sizeof(CUmemAllocationHandleType), "CUmemAllocationHandleType");

/* Handles are CUDA's own types, and magpie.h's cudaStream_t is CUstream. */
_Static_assert(SAME_TYPE(cudrv_context, CUcontext), "CUcontext");
_Static_assert(SAME_TYPE(cudrv_stream, CUstream), "CUstream");
_Static_assert(SAME_TYPE(cudrv_event, CUevent), "CUevent");
_Static_assert(SAME_TYPE(cudrv_module, CUmodule), "CUmodule");
_Static_assert(SAME_TYPE(cudrv_function, CUfunction), "CUfunction");
_Static_assert(SAME_TYPE(cudrv_mem_pool, CUmemoryPool), "CUmemoryPool");
_Static_assert(SAME_TYPE(cudrv_graph, CUgraph), "CUgraph");
_Static_assert(SAME_TYPE(cudrv_graph_exec, CUgraphExec), "CUgraphExec");
_Static_assert(SAME_TYPE(cudrv_graph_node, CUgraphNode), "CUgraphNode");
_Static_assert(SAME_TYPE(cudaStream_t, CUstream), "magpie.h cudaStream_t");

/* Struct layouts. */
#define LAYOUT(ours, theirs)                                         \
  _Static_assert(sizeof(ours) == sizeof(theirs), "sizeof " #theirs); \
  _Static_assert(_Alignof(ours) == _Alignof(theirs), "alignof " #theirs)
#define FIELD(ours, of, theirs, tf)                                                        \
  _Static_assert(offsetof(ours, of) == offsetof(theirs, tf), "offsetof " #theirs "." #tf); \
  _Static_assert(sizeof(((ours *)0)->of) == sizeof(((theirs *)0)->tf), "sizeof " #theirs "." #tf)

LAYOUT(cudrv_mem_location, CUmemLocation);
FIELD(cudrv_mem_location, type, CUmemLocation, type);
FIELD(cudrv_mem_location, id, CUmemLocation, id);

LAYOUT(cudrv_mem_alloc_prop, CUmemAllocationProp);
FIELD(cudrv_mem_alloc_prop, type, CUmemAllocationProp, type);
FIELD(cudrv_mem_alloc_prop, requested_handle_types, CUmemAllocationProp, requestedHandleTypes);
FIELD(cudrv_mem_alloc_prop, location, CUmemAllocationProp, location);
FIELD(cudrv_mem_alloc_prop, location.type, CUmemAllocationProp, location.type);
FIELD(cudrv_mem_alloc_prop, location.id, CUmemAllocationProp, location.id);
FIELD(cudrv_mem_alloc_prop, win32_handle_meta_data, CUmemAllocationProp, win32HandleMetaData);
FIELD(cudrv_mem_alloc_prop, alloc_flags, CUmemAllocationProp, allocFlags);
FIELD(cudrv_mem_alloc_prop, alloc_flags.compression_type, CUmemAllocationProp, allocFlags.compressionType);
FIELD(cudrv_mem_alloc_prop, alloc_flags.gpu_direct_rdma_capable, CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
FIELD(cudrv_mem_alloc_prop, alloc_flags.usage, CUmemAllocationProp, allocFlags.usage);
FIELD(cudrv_mem_alloc_prop, alloc_flags.reserved, CUmemAllocationProp, allocFlags.reserved);

LAYOUT(cudrv_uuid, CUuuid);
FIELD(cudrv_uuid, bytes, CUuuid, bytes);

LAYOUT(cudrv_mem_access_desc, CUmemAccessDesc);
FIELD(cudrv_mem_access_desc, location, CUmemAccessDesc, location);
FIELD(cudrv_mem_access_desc, flags, CUmemAccessDesc, flags);

/* The enum-typed fields are declared int. */
_Static_assert(sizeof(int) == sizeof(CUmemLocationType), "CUmemLocationType");
_Static_assert(sizeof(int) == sizeof(CUmemAllocationType), "CUmemAllocationType");
_Static_assert(sizeof(int) == sizeof(CUmemAllocationHandleType), "CUmemAllocationHandleType");
_Static_assert(sizeof(int) == sizeof(CUmemAccess_flags), "CUmemAccess_flags");

/* Constants: X(ours, theirs). */
#define ABI_CONSTANTS(X)                                                                           \
  X(CUDRV_SUCCESS, CUDA_SUCCESS)                                                                   \
  X(CUDRV_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE)                                           \
  X(CUDRV_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY)                                           \
  X(CUDRV_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_INITIALIZED)                                       \
  X(CUDRV_ERROR_DEINITIALIZED, CUDA_ERROR_DEINITIALIZED)                                           \
  X(CUDRV_ERROR_STUB_LIBRARY, CUDA_ERROR_STUB_LIBRARY)                                             \
  X(CUDRV_ERROR_NO_DEVICE, CUDA_ERROR_NO_DEVICE)                                                   \
  X(CUDRV_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT)                                       \
  X(CUDRV_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_HANDLE)                                         \
  X(CUDRV_ERROR_NOT_FOUND, CUDA_ERROR_NOT_FOUND)                                                   \
  X(CUDRV_ERROR_NOT_READY, CUDA_ERROR_NOT_READY)                                                   \
  X(CUDRV_ERROR_PEER_ACCESS_UNSUPPORTED, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)                       \
  X(CUDRV_ERROR_PEER_ACCESS_ALREADY_ENABLED, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)               \
  X(CUDRV_ERROR_PEER_ACCESS_NOT_ENABLED, CUDA_ERROR_PEER_ACCESS_NOT_ENABLED)                       \
  X(CUDRV_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_CONTEXT_IS_DESTROYED)                             \
  X(CUDRV_ERROR_STREAM_CAPTURE_UNSUPPORTED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)                 \
  X(CUDRV_ERROR_STREAM_CAPTURE_INVALIDATED, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)                 \
  X(CUDRV_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_NONE)                               \
  X(CUDRV_STREAM_CAPTURE_STATUS_ACTIVE, CU_STREAM_CAPTURE_STATUS_ACTIVE)                           \
  X(CUDRV_STREAM_CAPTURE_STATUS_INVALIDATED, CU_STREAM_CAPTURE_STATUS_INVALIDATED)                 \
  X(CUDRV_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_GLOBAL)                               \
  X(CUDRV_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)                   \
  X(CUDRV_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_MODE_RELAXED)                             \
  X(CUDRV_DEVICE_ATTRIBUTE_VMM_SUPPORTED, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) \
  X(CUDRV_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_ALLOCATION_TYPE_PINNED)                               \
  X(CUDRV_MEM_HANDLE_TYPE_NONE, CU_MEM_HANDLE_TYPE_NONE)                                           \
  X(CUDRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)         \
  X(CUDRV_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_DEVICE)                                   \
  X(CUDRV_MEM_ACCESS_FLAGS_PROT_NONE, CU_MEM_ACCESS_FLAGS_PROT_NONE)                               \
  X(CUDRV_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)                     \
  X(CUDRV_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_MINIMUM)                         \
  X(CUDRV_EVENT_DISABLE_TIMING, CU_EVENT_DISABLE_TIMING)                                           \
  X(CUDRV_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING)                                             \
  X(CUDRV_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_PORTABLE)                                         \
  X(CUDRV_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_DEVICEMAP)                                       \
  X(CUDRV_MEMPOOL_ATTR_RELEASE_THRESHOLD, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)                       \
  X(CUDRV_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER)                                           \
  X(CUDRV_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)                     \
  X(CUDRV_GET_PROC_ADDRESS_LEGACY_STREAM, CU_GET_PROC_ADDRESS_LEGACY_STREAM)                       \
  X(CUDRV_GET_PROC_ADDRESS_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS)                                   \
  X(CUDRV_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)                 \
  X(CUDRV_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)

#define ABI_CONSTANT_ASSERT(ours, theirs) \
  _Static_assert((long long)(ours) == (long long)(theirs), #ours " != " #theirs);
ABI_CONSTANTS(ABI_CONSTANT_ASSERT)

/* --- run time ---------------------------------------------------------- */

static void expect_same(const char *what, long long ours, long long theirs) {
  printf("  %-58s %8lld %8lld %s\n", what, ours, theirs, ours == theirs ? "ok" : "MISMATCH");
  assert_int_equal(ours, theirs);
}

static void test_constants(void **state) {
  (void)state;
#define ABI_CONSTANT_EXPECT(ours, theirs) expect_same(#ours, (ours), (theirs));
  ABI_CONSTANTS(ABI_CONSTANT_EXPECT)
  expect_same("CUDRV_STREAM_LEGACY", (long long)(uintptr_t)CUDRV_STREAM_LEGACY, (long long)(uintptr_t)CU_STREAM_LEGACY);
  expect_same("CUDRV_STREAM_PER_THREAD", (long long)(uintptr_t)CUDRV_STREAM_PER_THREAD,
              (long long)(uintptr_t)CU_STREAM_PER_THREAD);
}

static void test_layouts(void **state) {
  (void)state;
#define EXPECT_SIZE(ours, theirs) expect_same("sizeof " #theirs, sizeof(ours), sizeof(theirs));
#define EXPECT_FIELD(ours, of, theirs, tf)                                            \
  expect_same("offsetof " #theirs "." #tf, offsetof(ours, of), offsetof(theirs, tf)); \
  expect_same("sizeof " #theirs "." #tf, sizeof(((ours *)0)->of), sizeof(((theirs *)0)->tf));
  EXPECT_SIZE(cudrv_result, CUresult)
  EXPECT_SIZE(cudrv_device_attr, CUdevice_attribute)
  EXPECT_SIZE(cudrv_granularity_flags, CUmemAllocationGranularity_flags)
  EXPECT_SIZE(cudrv_proc_query_result, CUdriverProcAddressQueryResult)
  EXPECT_SIZE(cudrv_jit_option, CUjit_option)
  EXPECT_SIZE(cudrv_mem_pool_attr, CUmemPool_attribute)
  EXPECT_SIZE(cudrv_capture_status, CUstreamCaptureStatus)
  EXPECT_SIZE(cudrv_capture_mode, CUstreamCaptureMode)
  EXPECT_SIZE(cudrv_mem_location, CUmemLocation)
  EXPECT_FIELD(cudrv_mem_location, type, CUmemLocation, type)
  EXPECT_FIELD(cudrv_mem_location, id, CUmemLocation, id)
  EXPECT_SIZE(cudrv_mem_alloc_prop, CUmemAllocationProp)
  EXPECT_FIELD(cudrv_mem_alloc_prop, type, CUmemAllocationProp, type)
  EXPECT_FIELD(cudrv_mem_alloc_prop, requested_handle_types, CUmemAllocationProp, requestedHandleTypes)
  EXPECT_FIELD(cudrv_mem_alloc_prop, location, CUmemAllocationProp, location)
  EXPECT_FIELD(cudrv_mem_alloc_prop, win32_handle_meta_data, CUmemAllocationProp, win32HandleMetaData)
  EXPECT_FIELD(cudrv_mem_alloc_prop, alloc_flags, CUmemAllocationProp, allocFlags)
  EXPECT_FIELD(cudrv_mem_alloc_prop, alloc_flags.usage, CUmemAllocationProp, allocFlags.usage)
  EXPECT_FIELD(cudrv_mem_alloc_prop, alloc_flags.reserved, CUmemAllocationProp, allocFlags.reserved)
  EXPECT_SIZE(cudrv_mem_access_desc, CUmemAccessDesc)
  EXPECT_FIELD(cudrv_mem_access_desc, location, CUmemAccessDesc, location)
  EXPECT_FIELD(cudrv_mem_access_desc, flags, CUmemAccessDesc, flags)
}

#define ABI_COUNT(field, symbol, version) +1
enum {
  ABI_REQUIRED = 0 CUDRV_REQUIRED_FUNCS(ABI_COUNT),
  ABI_TOOL = 0 CUDRV_TOOL_FUNCS(ABI_COUNT),
  ABI_OPTIONAL = 0 CUDRV_OPTIONAL_FUNCS(ABI_COUNT),
};

static void test_signatures(void **state) {
  (void)state;
  /* The comparison itself happened when cuda_abi_sig.c compiled. */
  int n = cuda_abi_sig_checked();
  printf(
      "  %d driver entry point types equal cudaTypedefs.h's PFN_* types: the loader's "
      "table (%d required, %d for the tools and tests, %d optional) and cuGetProcAddress\n",
      n, ABI_REQUIRED, ABI_TOOL, ABI_OPTIONAL);
  assert_int_equal(n, 1 + ABI_REQUIRED + ABI_TOOL + ABI_OPTIONAL);
  assert_int_equal(sizeof(cudrv_api), (size_t)(n + 1) * sizeof(void *));
}

/* cudaTypedefs.h, read whole (the test's argument). */
static const char *typedefs_path;

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  char *buf = NULL;
  size_t len = 0, cap = 0, got;
  do {
    if (cap - len < 65536) {
      cap = cap * 2 + 65536;
      char *grown = realloc(buf, cap + 1);
      if (grown == NULL) {
        free(buf);
        fclose(f);
        return NULL;
      }
      buf = grown;
    }
    got = fread(buf + len, 1, cap - len, f);
    len += got;
  } while (got > 0);
  fclose(f);
  buf[len] = '\0';
  return buf;
}

/* The newest variant of symbol that cudaTypedefs.h declares (PFN_<symbol>_v<N>,
 * not the _ptds/_ptsz ones) with N <= limit; 0 if none. */
static int newest_variant(const char *text, const char *symbol, int limit) {
  char key[128];
  snprintf(key, sizeof key, "PFN_%s_v", symbol);
  int best = 0;
  for (const char *p = strstr(text, key); p != NULL; p = strstr(p + 1, key)) {
    const char *d = p + strlen(key);
    char *end;
    long v = strtol(d, &end, 10);
    if (end == d || *end != ')') continue;
    if (v <= limit && v > best) best = (int)v;
  }
  return best;
}

/* The loader asks cuGetProcAddress for each entry at
 * CUDRV_REQUEST_FOR(version), which yields the newest variant not newer
 * than that: it must be the listed one (whose type cuda_abi_sig.c checked),
 * not a later one with another signature. */
static void test_variants(void **state) {
  (void)state;
  assert_non_null(typedefs_path);
  char *text = read_file(typedefs_path);
  if (text == NULL) fail_msg("cannot read %s", typedefs_path);
  int checked = 0, wrong = 0;
#define ABI_VARIANT(field, symbol, version)                                                    \
  {                                                                                            \
    int got = newest_variant(text, #symbol, CUDRV_REQUEST_FOR(version));                       \
    printf("  %-30s listed v%-6d requested at %-6d newest there v%-6d %s\n", #symbol, version, \
           CUDRV_REQUEST_FOR(version), got, got == version ? "ok" : "MISMATCH");               \
    checked++;                                                                                 \
    wrong += got != version;                                                                   \
  }
  CUDRV_ALL_FUNCS(ABI_VARIANT)
  ABI_VARIANT(get_proc_address, cuGetProcAddress, 12000)
#undef ABI_VARIANT
  free(text);
  printf("  %d entry points, %d with a newer variant than listed\n", checked, wrong);
  assert_int_equal(wrong, 0);
  assert_int_equal(checked, 1 + ABI_REQUIRED + ABI_TOOL + ABI_OPTIONAL);
}

/* The loader: where the driver is missing (CI) both kinds of load fail with
 * the same reason, every time; where it is present, the table is complete
 * but for optional entries. */
static void test_loader(void **state) {
  (void)state;
  const char *why_lib = NULL, *why_all = NULL;
  int lib = cudrv_load(CUDRV_LOAD_LIBRARY, &why_lib);
  int all = cudrv_load(CUDRV_LOAD_ALL, &why_all);
  if (lib == 0) {
    assert_non_null(cudrv.library);
    assert_non_null(cudrv.get_proc_address);
#define ABI_PRESENT(field, symbol, version) assert_non_null(cudrv.field);
    CUDRV_REQUIRED_FUNCS(ABI_PRESENT)
    if (all == 0) {
      CUDRV_TOOL_FUNCS(ABI_PRESENT)
    } else {
      printf("  driver present, but for the tools: %s\n", why_all);
    }
#undef ABI_PRESENT
    printf("  driver present: cuStreamGetDevice %s\n",
           cudrv.stream_get_device != NULL ? "found" : "absent (driver before 12.8)");
    return;
  }
  printf("  load: %s\n", why_lib);
  assert_int_equal(all, -1);
  assert_non_null(why_lib);
  assert_true(strlen(why_lib) > 0);
  assert_string_equal(why_lib, why_all);
  const char *again = NULL;
  assert_int_equal(cudrv_load(CUDRV_LOAD_LIBRARY, &again), -1);
  assert_string_equal(again, why_lib);
  assert_int_equal(cudrv_load(CUDRV_LOAD_ALL, NULL), -1);
  if (cudrv.library == NULL) assert_non_null(strstr(why_lib, "libcuda.so.1"));
}

/* Where the driver is missing (CI), init must say so and nothing may crash.
 * Where it is present (a GPU machine), init must succeed. */
static void test_backend_without_driver(void **state) {
  (void)state;
  const backend_ops *b = backend_cuda();
  assert_string_equal(b->name, "cuda");
  int rc = b->init();
  if (rc == MAGPIE_OK) {
    int n = 0;
    assert_int_equal(b->device_count(&n), MAGPIE_OK);
    assert_true(n >= 1);
    printf("  driver present: %d device(s)\n", n);
    return;
  }
  char detail[256];
  snprintf(detail, sizeof detail, "%s", backend_error_detail());
  printf("  init: %d (%s): %s\n", rc, magpie_error_string(rc), detail);
  assert_int_equal(rc, MAGPIE_ERR_NO_DEVICE);
  assert_true(strlen(detail) > 0);
  /* A failed load is reported with the loader's reason. */
  const char *why = NULL;
  if (cudrv_load(CUDRV_LOAD_LIBRARY, &why) != 0) assert_string_equal(detail, why);
  /* Idempotent: the same answer and reason again. */
  assert_int_equal(b->init(), MAGPIE_ERR_NO_DEVICE);
  assert_string_equal(backend_error_detail(), detail);

  int n = -1, sup = -1;
  size_t sz = 0, fr = 0;
  uintptr_t p = 0;
  uint64_t id = 0;
  void *ev = NULL;
  assert_int_not_equal(b->device_count(&n), MAGPIE_OK);
  assert_int_not_equal(b->mem_info(0, &fr, &sz), MAGPIE_OK);
  assert_int_not_equal(b->vmm_supported(0, &sup), MAGPIE_OK);
  assert_int_not_equal(b->granularity(0, &sz), MAGPIE_OK);
  assert_int_not_equal(b->reserve(0, 1 << 21, &p), MAGPIE_OK);
  assert_int_not_equal(b->unreserve(0, 1 << 21, 1 << 21), MAGPIE_OK);
  assert_int_not_equal(b->map(0, 1 << 21, 1 << 21, 0, 0), MAGPIE_OK);
  assert_int_not_equal(b->unmap(0, 1 << 21, 1 << 21), MAGPIE_OK);
  assert_int_not_equal(b->mem_alloc(0, 256, &p), MAGPIE_OK);
  assert_int_not_equal(b->mem_free(0, 256, 256), MAGPIE_OK);
  assert_int_not_equal(b->event_create(0, &ev), MAGPIE_OK);
  assert_int_not_equal(b->event_destroy(NULL), MAGPIE_OK);
  assert_int_not_equal(b->event_record(NULL, NULL), MAGPIE_OK);
  assert_int_not_equal(b->event_query(NULL), MAGPIE_OK);
  assert_int_not_equal(b->event_synchronize(NULL), MAGPIE_OK);
  assert_int_not_equal(b->stream_wait_event(NULL, NULL), MAGPIE_OK);
  assert_int_not_equal(b->stream_id(NULL, &id), MAGPIE_OK);
  assert_int_not_equal(b->stream_device(NULL, &n), MAGPIE_OK);
  assert_int_not_equal(b->device_synchronize(0), MAGPIE_OK);
  unsigned char uuid[16];
  int fd = 0;
  assert_int_not_equal(b->can_access_peer(0, 1, &n), MAGPIE_OK);
  assert_int_not_equal(b->set_access(0, 1 << 21, 1 << 21, 2), MAGPIE_OK);
  assert_int_not_equal(b->revoke_access(0, 1 << 21, 1 << 21, 2), MAGPIE_OK);
  assert_int_not_equal(b->peer_enable(0, 1), MAGPIE_OK);
  assert_int_not_equal(b->peer_disable(0, 1), MAGPIE_OK);
  assert_int_not_equal(b->device_uuid(0, uuid), MAGPIE_OK);
  assert_int_not_equal(b->export_fds(0, 1 << 21, 1 << 21, &fd), MAGPIE_OK);
  assert_int_not_equal(b->import_map(0, 1 << 21, 1 << 21, &fd, 0), MAGPIE_OK);
  assert_true(strlen(backend_error_detail()) > 0);
}

int main(int argc, char **argv) {
  typedefs_path = argc > 1 ? argv[1] : NULL;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_constants), cmocka_unit_test(test_layouts), cmocka_unit_test(test_signatures),
      cmocka_unit_test(test_variants),  cmocka_unit_test(test_loader),  cmocka_unit_test(test_backend_without_driver),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
