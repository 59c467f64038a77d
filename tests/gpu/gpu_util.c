/* Helpers shared by the GPU tests (see gpu_util.h). */
#include "tests/gpu/gpu_util.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "magpie.h"
#include "tests/gpu/kernels_ptx.h"

const char *gpu_err(CUresult r) {
  /* A few buffers in turn, so that one printf may show several. */
  static _Thread_local char bufs[4][96];
  static _Thread_local unsigned int next;
  char *buf = bufs[next++ % 4];
  const char *name = NULL;
  if (cudrv.get_error_name == NULL || cudrv.get_error_name(r, &name) != CUDA_SUCCESS || name == NULL)
    name = "unknown CUDA error";
  snprintf(buf, sizeof bufs[0], "%s (%d)", name, (int)r);
  return buf;
}

uint64_t gpu_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#define GPU_UTIL_TRY(call)                                               \
  do {                                                                   \
    CUresult try_rc = (call);                                            \
    if (try_rc != CUDA_SUCCESS) {                                        \
      fprintf(stderr, "gpu_env_init: %s: %s\n", #call, gpu_err(try_rc)); \
      return -1;                                                         \
    }                                                                    \
  } while (0)

int gpu_env_init(gpu_env *env) {
  const char *why = NULL;
  if (cudrv_load(CUDRV_LOAD_ALL, &why) != 0) {
    fprintf(stderr, "gpu_env_init: %s\n", why);
    return -1;
  }
  GPU_UTIL_TRY(cudrv.init(0));
  return gpu_env_init_device(env, 0);
}

int gpu_env_init_device(gpu_env *env, int ordinal) {
  memset(env, 0, sizeof *env);
  GPU_UTIL_TRY(cudrv.driver_get_version(&env->driver_version));
  GPU_UTIL_TRY(cudrv.device_get(&env->device, ordinal));
  GPU_UTIL_TRY(cudrv.device_get_name(env->name, (int)sizeof env->name, env->device));
  GPU_UTIL_TRY(cudrv.primary_ctx_retain(&env->ctx, env->device));
  GPU_UTIL_TRY(cudrv.ctx_set_current(env->ctx));
  /* Keep the JIT's log: a PTX the driver rejects should say why. */
  char log[4096] = "";
  cudrv_jit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *vals[] = {log, (void *)(uintptr_t)sizeof log};
  CUresult r = cudrv.module_load_data_ex(&env->module, gpu_kernels_ptx, 2, opts, vals);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "gpu_env_init: cuModuleLoadDataEx: %s\n%s\n", gpu_err(r), log);
    return -1;
  }
  GPU_UTIL_TRY(cudrv.module_get_function(&env->fill_u32, env->module, "gpu_fill_u32"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->check_u32, env->module, "gpu_check_u32"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->hold, env->module, "gpu_hold"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->stamp, env->module, "gpu_stamp"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->check_stamp, env->module, "gpu_check_stamp"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->delay, env->module, "gpu_delay"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->batch_stamp, env->module, "gpu_batch_stamp"));
  GPU_UTIL_TRY(cudrv.module_get_function(&env->batch_check, env->module, "gpu_batch_check"));
  return 0;
}

CUresult gpu_env_bind(const gpu_env *env) { return cudrv.ctx_set_current(env->ctx); }

/* Enough blocks to cover words with 256 threads each, at most 1024 (the
 * kernels stride over the rest). */
static unsigned int gpu_blocks(size_t words) {
  size_t b = (words + 255) / 256;
  return b == 0 ? 1 : b > 1024 ? 1024 : (unsigned int)b;
}

CUresult gpu_fill_u32(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, unsigned int seed) {
  unsigned long long n = words;
  void *args[] = {&p, &n, &seed};
  return cudrv.launch_kernel(env->fill_u32, gpu_blocks(words), 1, 1, 256, 1, 1, 0, s, args, NULL);
}

CUresult gpu_check_u32(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, unsigned int seed,
                       CUdeviceptr bad) {
  unsigned long long n = words;
  void *args[] = {&p, &n, &seed, &bad};
  return cudrv.launch_kernel(env->check_u32, gpu_blocks(words), 1, 1, 256, 1, 1, 0, s, args, NULL);
}

CUresult gpu_hold(const gpu_env *env, CUstream s, CUdeviceptr flag, CUdeviceptr block, size_t words, uint64_t tag,
                  uint64_t timeout_ns, CUdeviceptr status) {
  unsigned long long n = words, t = tag, to = timeout_ns;
  void *args[] = {&flag, &block, &n, &t, &to, &status};
  return cudrv.launch_kernel(env->hold, 1, 1, 1, 256, 1, 1, 0, s, args, NULL);
}

CUresult gpu_stamp(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, uint64_t tag) {
  unsigned long long n = words, t = tag;
  void *args[] = {&p, &n, &t};
  return cudrv.launch_kernel(env->stamp, gpu_blocks(words), 1, 1, 256, 1, 1, 0, s, args, NULL);
}

CUresult gpu_check_stamp(const gpu_env *env, CUstream s, CUdeviceptr p, size_t words, uint64_t expect, uint64_t tag,
                         int restamp, CUdeviceptr bad) {
  unsigned long long n = words, e = expect, t = tag;
  void *args[] = {&p, &n, &e, &t, &restamp, &bad};
  return cudrv.launch_kernel(env->check_stamp, gpu_blocks(words), 1, 1, 256, 1, 1, 0, s, args, NULL);
}

CUresult gpu_delay(const gpu_env *env, CUstream s, uint64_t ns) {
  unsigned long long t = ns;
  void *args[] = {&t};
  return cudrv.launch_kernel(env->delay, 1, 1, 1, 1, 1, 1, 0, s, args, NULL);
}

CUresult gpu_batch_stamp(const gpu_env *env, CUstream s, CUdeviceptr ptrs, CUdeviceptr tags, CUdeviceptr words,
                         unsigned n) {
  if (n == 0) return CUDA_SUCCESS;
  void *args[] = {&ptrs, &tags, &words, &n};
  return cudrv.launch_kernel(env->batch_stamp, n, 1, 1, 64, 1, 1, 0, s, args, NULL);
}

CUresult gpu_batch_check(const gpu_env *env, CUstream s, CUdeviceptr ptrs, CUdeviceptr tags, CUdeviceptr words,
                         unsigned n, CUdeviceptr bad) {
  if (n == 0) return CUDA_SUCCESS;
  void *args[] = {&ptrs, &tags, &words, &n, &bad};
  return cudrv.launch_kernel(env->batch_check, n, 1, 1, 64, 1, 1, 0, s, args, NULL);
}

int gpu_magpie_setup(gpu_env *env, gpu_host_words *w) {
  if (gpu_env_init(env) != 0) return -1;
  return gpu_magpie_start(env, w, 0);
}

int gpu_magpie_start(gpu_env *env, gpu_host_words *w, size_t limit) {
  (void)env;
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_CUDA;
  if (limit != 0) cfg.limit = limit;
  int rc = magpie_init(&cfg);
  if (rc != MAGPIE_OK) {
    fprintf(stderr, "magpie_init(cuda): %d: %s\n", rc, magpie_last_error_message());
    return -1;
  }
  void *h = NULL;
  CUresult r = cudrv.mem_host_alloc(&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
  if (r == CUDA_SUCCESS) r = cudrv.mem_host_get_device_pointer(&w->dev_flag, h, 0);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuMemHostAlloc(DEVICEMAP): %s\n", gpu_err(r));
    return -1;
  }
  w->flag = h;
  w->status = (_Atomic int *)((char *)h + 256);
  w->dev_status = w->dev_flag + 256;
  w->dev_bad = w->dev_flag + 512;
  return 0;
}

CUresult gpu_hold_started(const gpu_env *env, CUstream s, const gpu_host_words *w, void *block, size_t bytes,
                          uint64_t timeout_ns) {
  atomic_store(w->flag, 0);
  atomic_store(w->status, 0);
  CUresult r =
      gpu_hold(env, s, w->dev_flag, (CUdeviceptr)(uintptr_t)block, bytes / 8, 0x5eedull, timeout_ns, w->dev_status);
  if (r != CUDA_SUCCESS) return r;
  uint64_t deadline = gpu_now_ns() + 10ull * 1000 * 1000 * 1000;
  while (atomic_load(w->status) != 3)
    if (gpu_now_ns() > deadline) return CUDA_ERROR_NOT_READY;
  return CUDA_SUCCESS;
}
