/* Helpers shared by the GPU tests: the device's primary context, the test
 * kernels (tests/gpu/kernels.cu, embedded as PTX) and their launches.
 *
 * The tests call the driver through magpie's one driver loader
 * (src/device/cuda_driver.h: the table `cudrv`, the same entry points the
 * library calls, loaded by gpu_env_init; nothing links libcuda or its
 * stub), with cuda.h's types and constants, and magpie through its public
 * or backend interface. */
#ifndef MAGPIE_TESTS_GPU_UTIL_H
#define MAGPIE_TESTS_GPU_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda.h>

#include "device/cuda_driver.h"

typedef struct gpu_env {
  CUdevice device;
  CUcontext ctx; /* device 0's primary context, shared with magpie */
  CUmodule module;
  CUfunction fill_u32, check_u32, hold, stamp, check_stamp, delay, batch_stamp, batch_check;
  char name[128];
  int driver_version;
} gpu_env;

/* Loads the driver (cudrv_load, every entry the tests use), initialises it,
 * makes device 0's primary context current on the calling thread and loads
 * the kernels. 0 on success; else prints why. */
int gpu_env_init(gpu_env *env);
/* The same for device ordinal (its primary context made current, the
 * kernels loaded in it); the driver must be loaded and initialised. */
int gpu_env_init_device(gpu_env *env, int ordinal);
/* Makes env's context current on the calling thread (each new thread). */
CUresult gpu_env_bind(const gpu_env *env);

/* "CUDA_ERROR_X (n)" for r, in one of 4 thread-local buffers used in turn. */
const char *gpu_err(CUresult r);

/* Fails the running cmocka test when call does not return CUDA_SUCCESS
 * (main test thread only: cmocka's failures do not cross threads). */
#define GPU_CHECK(call)                                                                 \
  do {                                                                                  \
    CUresult gpu_check_rc = (call);                                                     \
    if (gpu_check_rc != CUDA_SUCCESS) fail_msg("%s: %s", #call, gpu_err(gpu_check_rc)); \
  } while (0)

/* Launches (asynchronous; the result is the launch's). */
CUresult gpu_fill_u32(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, unsigned int seed);
CUresult gpu_check_u32(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, unsigned int seed, CUdeviceptr bad);
/* One block writing tag over the block until *flag != 0 or timeout_ns;
 * flag and status are device pointers of host-mapped memory. */
CUresult gpu_hold(const gpu_env *env, CUstream s, CUdeviceptr flag, CUdeviceptr block, size_t words, uint64_t tag,
                  uint64_t timeout_ns, CUdeviceptr status);
CUresult gpu_stamp(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, uint64_t tag);
/* Counts words != expect into *bad, then writes tag if restamp. */
CUresult gpu_check_stamp(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, uint64_t expect, uint64_t tag,
                         int restamp, CUdeviceptr bad);
CUresult gpu_delay(const gpu_env *env, CUstream s, uint64_t ns);
/* Batches of n blocks: ptrs, tags and words are device pointers of
 * host-mapped arrays (read when the kernel runs). Stamp writes each block's
 * tag over its probe words (up to 64, first and last included); check
 * counts probe words that differ into *bad. */
CUresult gpu_batch_stamp(const gpu_env *env, CUstream s, CUdeviceptr ptrs, CUdeviceptr tags, CUdeviceptr words,
                         unsigned n);
CUresult gpu_batch_check(const gpu_env *env, CUstream s, CUdeviceptr ptrs, CUdeviceptr tags, CUdeviceptr words,
                         unsigned n, CUdeviceptr bad);

/* Words a kernel and the host share through host-mapped pinned memory,
 * each on its own cache line: a flag the host sets, a status the kernel
 * writes, a counter of bad words. */
typedef struct gpu_host_words {
  _Atomic int *flag, *status;
  CUdeviceptr dev_flag, dev_status, dev_bad;
} gpu_host_words;

/* The set-up the allocator's GPU tests share: gpu_env_init, magpie_init on
 * the CUDA backend, and the host-mapped words. 0 on success; else prints
 * why. */
int gpu_magpie_setup(gpu_env *env, gpu_host_words *w);
/* The part after gpu_env_init, with magpie's limit (bytes; 0: none). */
int gpu_magpie_start(gpu_env *env, gpu_host_words *w, size_t limit);

/* Monotonic wall clock, nanoseconds. */
uint64_t gpu_now_ns(void);

/* gpu_hold on the bytes at block (stamped with a fixed tag, for at most
 * timeout_ns) with w's flag cleared and status reset first, then waits (at
 * most 10 s) until the kernel runs (status 3): CUDA_SUCCESS once it runs,
 * the launch's error, or CUDA_ERROR_NOT_READY if it did not start in time.
 * Set *w->flag to let it end. */
CUresult gpu_hold_started(const gpu_env *env, CUstream s, const gpu_host_words *w, void *block, size_t bytes,
                          uint64_t timeout_ns);

#endif /* MAGPIE_TESTS_GPU_UTIL_H */
