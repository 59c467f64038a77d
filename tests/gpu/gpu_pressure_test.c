/* gpu_pressure_test: memory pressure on a real GPU. Another allocation
 * (cuMemAlloc, outside magpie) takes all but a few GiB of the device, so
 * the driver itself runs out:
 *   - fill_then_one_big_block: threads on their own streams fill the rest
 *     with mixed small and large blocks until the driver says no; each
 *     frees everything (half of it behind a 200 ms kernel still running);
 *     half the threads exit, half stay alive and idle with full caches.
 *     One block of 85 % of what magpie had must then be allocated; a kernel
 *     fills and checks it. magpie_trim(0, 0) then gives everything back.
 *   - stream_wait_reuse: with the device full, a large block freed on A
 *     while a kernel on A still writes it is reused by B through a stream
 *     wait on the free's event (magpie_stats.stream_waits), not a host
 *     wait: B's fill, enqueued while A's kernel runs, must land after it.
 * MAGPIE_GPU_PRESSURE_FREE_GIB (default 6) sets what the hog leaves. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "magpie.h"
#include "tests/gpu/gpu_util.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)
#define THREADS 8
#define MAX_BLOCKS 8192

static gpu_env env;
static CUdeviceptr hog[256];
static int nhog;
static _Atomic int *host_flag, *host_status;
static CUdeviceptr dev_flag, dev_status, dev_bad;

static void print_stats(const char *when) {
  magpie_stats st;
  if (magpie_stats_get(0, &st) != MAGPIE_OK) return;
  printf(
      "  [%s] in use %zu, reserved %zu (thread %zu, depot %zu, pending %zu, large free %zu, overhead %zu); "
      "ladder reclaim %llu slabs %llu threads %llu wait %llu unmap %llu failed %llu; stolen %llu flushed %llu; "
      "stream waits %llu; slabs released %llu; large unmapped %llu\n",
      when, st.in_use_bytes, st.reserved_bytes, st.thread_cached_bytes, st.depot_bytes, st.epoch_pending_bytes,
      st.large_free_bytes, st.overhead_bytes, (unsigned long long)st.ladder_steps[0],
      (unsigned long long)st.ladder_steps[1], (unsigned long long)st.ladder_steps[2],
      (unsigned long long)st.ladder_steps[3], (unsigned long long)st.ladder_steps[4],
      (unsigned long long)st.ladder_steps[5], (unsigned long long)st.threads_stolen,
      (unsigned long long)st.threads_flushed, (unsigned long long)st.stream_waits,
      (unsigned long long)st.slabs_released, (unsigned long long)st.large_bytes_unmapped);
  fflush(stdout);
}

static int group_setup(void **state) {
  (void)state;
  gpu_host_words w;
  if (gpu_env_init(&env) != 0) return -1;
  /* The hog: everything but a few GiB. */
  const char *v = getenv("MAGPIE_GPU_PRESSURE_FREE_GIB");
  size_t leave = (size_t)(v ? atol(v) : 6) * GiB;
  size_t free_b = 0, total = 0;
  cudrv.mem_get_info(&free_b, &total);
  while (free_b > leave + GiB && nhog < 256) {
    size_t chunk = free_b - leave > 8 * GiB ? 8 * GiB : free_b - leave;
    if (cudrv.mem_alloc(&hog[nhog], chunk) != CUDA_SUCCESS) break;
    nhog++;
    cudrv.mem_get_info(&free_b, &total);
  }
  printf("device 0: %s; hog leaves %zu MiB of %zu MiB free\n", env.name, free_b / MiB, total / MiB);
  /* compute-sanitizer allocates device memory for every launch it tracks:
   * under it, magpie's limit keeps 512 MiB of what the hog left for it
   * (the ladder runs the same on the limit as on the driver's refusal). */
  size_t limit = 0;
  if (getenv("MAGPIE_GPU_UNDER_SANITIZER") != NULL && free_b > GiB) {
    limit = free_b - 512 * MiB;
    printf("under compute-sanitizer: magpie limited to %zu MiB\n", limit / MiB);
  }
  if (gpu_magpie_start(&env, &w, limit) != 0) return -1;
  host_flag = w.flag;
  host_status = w.status;
  dev_flag = w.dev_flag;
  dev_status = w.dev_status;
  dev_bad = w.dev_bad;
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  for (int i = 0; i < nhog; i++) cudrv.mem_free(hog[i]);
  return 0;
}

/* ---- fill, free with work pending, idle threads, one big block ---- */

static pthread_barrier_t filled, freed, released;

struct worker {
  int id, stay_idle, failed;
  size_t got;
  char why[256];
};

static uint64_t rng(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void *worker_main(void *arg) {
  struct worker *w = arg;
  gpu_env_bind(&env);
  CUstream a, b;
  cudrv.stream_create(&a, CU_STREAM_NON_BLOCKING);
  cudrv.stream_create(&b, CU_STREAM_NON_BLOCKING);
  void **blocks = calloc(MAX_BLOCKS, sizeof *blocks);
  uint64_t seed = 0x9E3779B97F4A7C15ull * (uint64_t)(w->id + 1);
  int n = 0;
  while (n < MAX_BLOCKS) {
    size_t sz = rng(&seed) % 6 == 0 ? MiB + rng(&seed) % (64 * MiB) : 256 + rng(&seed) % (512 * 1024);
    CUstream s = n % 2 ? a : b;
    void *p = magpie_malloc_async(sz, (cudaStream_t)s);
    if (p == NULL) {
      if (magpie_last_error() != MAGPIE_ERR_OUT_OF_MEMORY) {
        w->failed = 1;
        snprintf(w->why, sizeof w->why, "%s", magpie_last_error_message());
      }
      break;
    }
    if (gpu_fill_u32(&env, s, (CUdeviceptr)(uintptr_t)p, 64, (unsigned)n) != CUDA_SUCCESS) w->failed = 1;
    blocks[n++] = p;
    w->got += sz;
  }
  pthread_barrier_wait(&filled);
  gpu_delay(&env, a, 200ull * 1000 * 1000); /* a's frees stay pending */
  for (int i = 0; i < n; i++)
    if (magpie_free_async(blocks[i], (cudaStream_t)(i % 2 ? a : b)) != MAGPIE_OK) w->failed = 1;
  free(blocks);
  pthread_barrier_wait(&freed);
  if (w->stay_idle) pthread_barrier_wait(&released);
  cudrv.stream_synchronize(a);
  cudrv.stream_synchronize(b);
  cudrv.stream_destroy(a);
  cudrv.stream_destroy(b);
  return NULL;
}

static void test_fill_then_one_big_block(void **state) {
  (void)state;
  pthread_barrier_init(&filled, NULL, THREADS);
  pthread_barrier_init(&freed, NULL, THREADS + 1);
  pthread_barrier_init(&released, NULL, THREADS / 2 + 1);
  struct worker w[THREADS];
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) {
    w[i] = (struct worker){.id = i, .stay_idle = i % 2 == 0};
    assert_int_equal(pthread_create(&t[i], NULL, worker_main, &w[i]), 0);
  }
  pthread_barrier_wait(&freed);
  for (int i = 0; i < THREADS; i++)
    if (!w[i].stay_idle) pthread_join(t[i], NULL);
  size_t got = 0;
  for (int i = 0; i < THREADS; i++) {
    if (w[i].failed) fail_msg("worker %d: %s", i, w[i].why);
    got += w[i].got;
  }
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  printf("  filled %zu MiB through %d threads x 2 streams; magpie reserved %zu MiB\n", got / MiB, THREADS,
         st.reserved_bytes / MiB);
  print_stats("all freed, 200 ms kernels pending, 4 threads idle");
  size_t big = st.reserved_bytes / 100 * 85;
  CUstream s;
  GPU_CHECK(cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING));
  uint64_t t0 = gpu_now_ns();
  void *p = magpie_malloc_async(big, (cudaStream_t)s);
  uint64_t t1 = gpu_now_ns();
  if (p == NULL) fail_msg("one block of %zu MiB: %s", big / MiB, magpie_last_error_message());
  printf("  one block of %zu MiB (85%% of what magpie held) in %.1f ms\n", big / MiB, (t1 - t0) / 1e6);
  print_stats("after the big block");
  GPU_CHECK(gpu_fill_u32(&env, s, (CUdeviceptr)(uintptr_t)p, big / 4, 77));
  GPU_CHECK(cudrv.memset_d32_async(dev_bad, 0, 1, s));
  GPU_CHECK(gpu_check_u32(&env, s, (CUdeviceptr)(uintptr_t)p, big / 4, 77, dev_bad));
  GPU_CHECK(cudrv.stream_synchronize(s));
  unsigned bad = 0;
  GPU_CHECK(cudrv.memcpy_dtoh(&bad, dev_bad, sizeof bad));
  assert_int_equal(bad, 0);
  assert_int_equal(magpie_free_async(p, (cudaStream_t)s), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_synchronize(s));
  GPU_CHECK(cudrv.stream_destroy(s));
  pthread_barrier_wait(&released);
  for (int i = 0; i < THREADS; i++)
    if (w[i].stay_idle) pthread_join(t[i], NULL);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  print_stats("after magpie_trim(0, 0)");
  assert_int_equal(st.in_use_bytes, 0);
  assert_int_equal(st.reserved_bytes, 0);
}

/* ---- reuse across streams by a stream wait, under pressure ---- */

static void test_stream_wait_reuse(void **state) {
  (void)state;
  CUstream a, b;
  GPU_CHECK(cudrv.stream_create(&a, CU_STREAM_NON_BLOCKING));
  GPU_CHECK(cudrv.stream_create(&b, CU_STREAM_NON_BLOCKING));
  /* Fill the device with large blocks on b. */
  void *held[4096];
  int n = 0;
  size_t bs = 256 * MiB;
  while (n < 4096 && (held[n] = magpie_malloc_async(bs, (cudaStream_t)b)) != NULL) n++;
  assert_true(n >= 4);
  /* One of them moves to a: a kernel on a writes it until released. */
  void *p = held[--n];
  GPU_CHECK(cudrv.stream_synchronize(b));
  atomic_store(host_flag, 0);
  atomic_store(host_status, 0);
  GPU_CHECK(gpu_hold(&env, a, dev_flag, (CUdeviceptr)(uintptr_t)p, bs / 8, 0xA0A0, 20ull * 1000000000ull, dev_status));
  while (atomic_load(host_status) != 3) {
  }
  assert_int_equal(magpie_free_async(p, (cudaStream_t)a), MAGPIE_OK);
  magpie_stats s0, s1;
  assert_int_equal(magpie_stats_get(0, &s0), MAGPIE_OK);
  void *q = magpie_malloc_async(bs, (cudaStream_t)b);
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  print_stats("after reuse under pressure");
  assert_ptr_equal(q, p);
  assert_int_equal(s1.stream_waits - s0.stream_waits, 1);
  /* b's fill is enqueued now, while a's kernel still writes the block. */
  GPU_CHECK(gpu_fill_u32(&env, b, (CUdeviceptr)(uintptr_t)q, bs / 4, 5));
  assert_int_equal(atomic_load(host_status), 3); /* still holding */
  atomic_store(host_flag, 1);
  GPU_CHECK(cudrv.memset_d32_async(dev_bad, 0, 1, b));
  GPU_CHECK(gpu_check_u32(&env, b, (CUdeviceptr)(uintptr_t)q, bs / 4, 5, dev_bad));
  GPU_CHECK(cudrv.stream_synchronize(b));
  unsigned bad = 0;
  GPU_CHECK(cudrv.memcpy_dtoh(&bad, dev_bad, sizeof bad));
  assert_int_equal(bad, 0); /* b ran after a's kernel: nothing of a's tag left */
  assert_int_equal(magpie_free_async(q, (cudaStream_t)b), MAGPIE_OK);
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(held[i], (cudaStream_t)b), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_synchronize(a));
  GPU_CHECK(cudrv.stream_synchronize(b));
  GPU_CHECK(cudrv.stream_destroy(a));
  GPU_CHECK(cudrv.stream_destroy(b));
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fill_then_one_big_block),
      cmocka_unit_test(test_stream_wait_reuse),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
