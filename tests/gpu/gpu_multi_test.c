/* magpie on two GPUs: one heap per device, peer access, hand-offs between
 * the devices through the copy engines. Skipped (passes, saying so) on a
 * machine with one GPU.
 *
 *   - Heaps per device: threads on both devices at once, each on streams of
 *     its own device; every block is on its stream's device; the legacy and
 *     per-thread default streams follow the current context; statistics,
 *     limits and trim per device.
 *   - Peer access: kernels on device 1 check and rewrite device 0's blocks
 *     (small and large, mapped before and after
 *     magpie_device_enable_peer_access), kernels on device 0 check the
 *     result; without it, a kernel on device 1 touching device 0's block
 *     faults (in a child process, as a fault spoils its context). A block
 *     of device 0 freed on device 1's stream behind a kernel of device 1
 *     is not handed to device 0's streams before that kernel ends.
 *   - Hand-offs: threads on both devices stamp blocks; the other device's
 *     stream waits for the stamp (an event), copies each into a block of its
 *     own device (cuMemcpyAsync: a copy engine) and checks it there, and
 *     frees both, the source block on a stream of the other device; zero
 *     wrong words, nothing in use at the end.
 *
 * Kernels are tests/gpu/kernels.cu's, loaded in each device's primary
 * context; counters of bad words live in host-mapped pinned memory,
 * readable by kernels on both devices. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "magpie.h"
#include "tests/gpu/gpu_util.h"

#define SMALL ((size_t)4096)
#define LARGE ((size_t)64 << 20)
#define COUNTERS 64

static gpu_env env[2];
static gpu_host_words words;
static unsigned *counters; /* COUNTERS words, 64 bytes apart, host-mapped */
static CUdeviceptr dev_counters;
static int two_gpus;

static int setup_env(void) {
  int n = 0;
  if (gpu_env_init(&env[0]) != 0 || cudrv.device_get_count(&n) != CUDA_SUCCESS) return -1;
  two_gpus = n >= 2;
  if (!two_gpus) return 0;
  if (gpu_env_init_device(&env[1], 1) != 0 || gpu_env_bind(&env[0]) != CUDA_SUCCESS) return -1;
  if (gpu_magpie_start(&env[0], &words, 0) != 0) return -1;
  void *h = NULL;
  if (cudrv.mem_host_alloc(&h, COUNTERS * 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE) != CUDA_SUCCESS ||
      cudrv.mem_host_get_device_pointer(&dev_counters, h, 0) != CUDA_SUCCESS)
    return -1;
  counters = h;
  return 0;
}

static volatile unsigned *counter(int i) { return (volatile unsigned *)((char *)counters + 64 * i); }
static CUdeviceptr dev_counter(int i) { return dev_counters + 64 * (CUdeviceptr)i; }

#define SKIP_ONE_GPU()                               \
  do {                                               \
    if (!two_gpus) {                                 \
      printf("skipped: this machine has one GPU\n"); \
      return;                                        \
    }                                                \
  } while (0)

/* A stream of device d (its context made current on this thread). */
static CUstream stream_on(int d) {
  CUstream s = NULL;
  GPU_CHECK(gpu_env_bind(&env[d]));
  GPU_CHECK(cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING));
  return s;
}

/* Words of p that differ from seed's stamp, by a kernel of device d on s
 * (d's context current), counted in counter c. */
static unsigned check_on(int d, CUstream s, void *p, size_t bytes, unsigned seed, int c) {
  *counter(c) = 0;
  GPU_CHECK(gpu_env_bind(&env[d]));
  GPU_CHECK(gpu_check_u32(&env[d], s, (CUdeviceptr)(uintptr_t)p, bytes / 4, seed, dev_counter(c)));
  GPU_CHECK(cudrv.stream_synchronize(s));
  return *counter(c);
}

static void fill_on(int d, CUstream s, void *p, size_t bytes, unsigned seed) {
  GPU_CHECK(gpu_env_bind(&env[d]));
  GPU_CHECK(gpu_fill_u32(&env[d], s, (CUdeviceptr)(uintptr_t)p, bytes / 4, seed));
  GPU_CHECK(cudrv.stream_synchronize(s));
}

static int device_of(const void *p) {
  int d = -1;
  return magpie_block_info(p, NULL, &d) == MAGPIE_OK ? d : -1;
}

static size_t in_use(int d) {
  magpie_stats st;
  return magpie_stats_get(d, &st) == MAGPIE_OK ? st.in_use_bytes : (size_t)-1;
}

/* ---- heaps per device ---- */

typedef struct worker {
  int device, id, iters;
  int wrong_device, failed;
  unsigned bad;
} worker;

static void *alloc_worker(void *arg) {
  worker *w = arg;
  CUstream s = NULL;
  if (gpu_env_bind(&env[w->device]) != CUDA_SUCCESS || cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING) != 0) {
    w->failed++;
    return NULL;
  }
  void *live[32] = {0};
  uint64_t r = 0x9E3779B97F4A7C15ull * (uint64_t)(w->id + 1);
  for (int i = 0; i < w->iters; i++) {
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    int k = (int)(r % 32);
    if (live[k] != NULL) {
      if (magpie_free_async(live[k], s) != MAGPIE_OK) w->failed++;
      live[k] = NULL;
    }
    size_t size = (size_t)256 << (r >> 32) % 14; /* 256 B .. 2 MiB */
    live[k] = magpie_malloc_async(size, s);
    if (live[k] == NULL) {
      w->failed++;
      continue;
    }
    if (device_of(live[k]) != w->device) w->wrong_device++;
    if (i % 64 == 0) { /* a kernel of this device stamps it, another checks */
      int c = w->id;
      *counter(c) = 0;
      if (gpu_fill_u32(&env[w->device], s, (CUdeviceptr)(uintptr_t)live[k], size / 4, (unsigned)i) != 0 ||
          gpu_check_u32(&env[w->device], s, (CUdeviceptr)(uintptr_t)live[k], size / 4, (unsigned)i, dev_counter(c)) !=
              0 ||
          cudrv.stream_synchronize(s) != 0)
        w->failed++;
      w->bad += *counter(c);
    }
  }
  for (int k = 0; k < 32; k++)
    if (live[k] != NULL && magpie_free_async(live[k], s) != MAGPIE_OK) w->failed++;
  cudrv.stream_synchronize(s);
  cudrv.stream_destroy(s);
  return NULL;
}

static void test_heaps_per_device(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  enum { PER_DEVICE = 4 };
  worker w[2 * PER_DEVICE];
  pthread_t t[2 * PER_DEVICE];
  for (int i = 0; i < 2 * PER_DEVICE; i++) {
    w[i] = (worker){.device = i % 2, .id = i, .iters = 20000};
    assert_int_equal(pthread_create(&t[i], NULL, alloc_worker, &w[i]), 0);
  }
  unsigned bad = 0;
  int wrong = 0, failed = 0;
  for (int i = 0; i < 2 * PER_DEVICE; i++) {
    pthread_join(t[i], NULL);
    bad += w[i].bad;
    wrong += w[i].wrong_device;
    failed += w[i].failed;
  }
  printf(
      "%d threads on 2 devices, 20000 allocations each: %d on the wrong device, %d failed calls, %u bad words; "
      "in use after: %zu on device 0, %zu on device 1\n",
      2 * PER_DEVICE, wrong, failed, bad, in_use(0), in_use(1));
  assert_int_equal(wrong, 0);
  assert_int_equal(failed, 0);
  assert_int_equal(bad, 0);
  assert_int_equal(in_use(0), 0);
  assert_int_equal(in_use(1), 0);

  /* The special handles follow the calling thread's current context. */
  for (int d = 0; d < 2; d++) {
    GPU_CHECK(gpu_env_bind(&env[d]));
    void *a = magpie_malloc_async(SMALL, (cudaStream_t)0), *b = magpie_malloc_async(SMALL, (cudaStream_t)2);
    assert_non_null(a);
    assert_non_null(b);
    printf("current device %d: legacy stream's block on device %d, per-thread stream's on device %d\n", d, device_of(a),
           device_of(b));
    assert_int_equal(device_of(a), d);
    assert_int_equal(device_of(b), d);
    assert_int_equal(magpie_free_async(a, (cudaStream_t)0), MAGPIE_OK);
    assert_int_equal(magpie_free_async(b, (cudaStream_t)2), MAGPIE_OK);
  }
  GPU_CHECK(gpu_env_bind(&env[0]));
}

static void test_limits_and_trim_per_device(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  CUstream s0 = stream_on(0), s1 = stream_on(1);
  magpie_stats a0, a1;
  assert_int_equal(magpie_set_limit(1, (size_t)64 << 20), MAGPIE_OK);
  void *big1 = magpie_malloc_async((size_t)128 << 20, s1);
  int rc1 = magpie_last_error();
  void *big0 = magpie_malloc_async((size_t)128 << 20, s0);
  printf("limit 64 MiB on device 1: 128 MiB there %s (%d); on device 0 %s\n", big1 ? "served" : "refused", rc1,
         big0 ? "served" : "refused");
  assert_null(big1);
  assert_int_equal(rc1, MAGPIE_ERR_OUT_OF_MEMORY);
  assert_non_null(big0);
  void *small1 = magpie_malloc_async((size_t)32 << 20, s1); /* within the limit */
  assert_non_null(small1);
  assert_int_equal(device_of(small1), 1);
  assert_int_equal(magpie_free_async(small1, s1), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_synchronize(s1));
  assert_int_equal(magpie_trim(1, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &a0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(1, &a1), MAGPIE_OK);
  printf(
      "after magpie_trim(1, 0): device 0 reserved %zu (a 128 MiB block in use), device 1 reserved %zu, "
      "limits %zu / %zu\n",
      a0.reserved_bytes, a1.reserved_bytes, a0.limit_bytes, a1.limit_bytes);
  assert_true(a0.reserved_bytes >= ((size_t)128 << 20));
  assert_int_equal(a1.reserved_bytes, 0);
  assert_int_equal(a1.limit_bytes, (size_t)64 << 20);
  assert_int_equal(a0.limit_bytes, 0);
  assert_int_equal(magpie_set_limit(1, 0), MAGPIE_OK);
  assert_int_equal(magpie_free_async(big0, s0), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_synchronize(s0));
  GPU_CHECK(cudrv.stream_destroy(s0));
  GPU_CHECK(cudrv.stream_destroy(s1));
  GPU_CHECK(gpu_env_bind(&env[0]));
}

/* ---- peer access ---- */

static void test_peer_access(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  int can = -1;
  assert_int_equal(magpie_device_can_access_peer(0, 1, &can), MAGPIE_OK);
  printf("device 1 can access device 0's memory: %d\n", can);
  if (!can) {
    assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_ERR_NO_PEER_ACCESS);
    printf("the documented refusal: %s\n", magpie_last_error_message());
    return;
  }
  CUstream s0 = stream_on(0), s1 = stream_on(1);
  void *before[2] = {magpie_malloc_async(SMALL, s0), magpie_malloc_async(LARGE, s0)};
  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
  void *after[2] = {magpie_malloc_async(SMALL * 3, s0), magpie_malloc_async(2 * LARGE, s0)};
  void *all[4] = {before[0], before[1], after[0], after[1]};
  size_t size[4] = {SMALL, LARGE, SMALL * 3, 2 * LARGE};
  for (int i = 0; i < 4; i++) {
    assert_non_null(all[i]);
    assert_int_equal(device_of(all[i]), 0);
    fill_on(0, s0, all[i], size[i], 40 + i);
    unsigned b1 = check_on(1, s1, all[i], size[i], 40 + i, 1);
    fill_on(1, s1, all[i], size[i], 50 + i);
    unsigned b0 = check_on(0, s0, all[i], size[i], 50 + i, 0);
    printf(
        "device 0's %s block of %zu bytes (mapped %s enabling): device 1's kernel %u bad words, device 0's "
        "check of device 1's writes %u\n",
        i % 2 ? "large" : "small", size[i], i < 2 ? "before" : "after", b1, b0);
    assert_int_equal(b1, 0);
    assert_int_equal(b0, 0);
  }
  for (int i = 0; i < 4; i++) assert_int_equal(magpie_free_async(all[i], s0), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_synchronize(s0));
  GPU_CHECK(cudrv.stream_destroy(s0));
  GPU_CHECK(cudrv.stream_destroy(s1));
  GPU_CHECK(gpu_env_bind(&env[0]));
  assert_int_equal(magpie_device_enable_peer_access(1, 0), MAGPIE_OK);
}

/* In a fresh process without peer access: device 1's kernel reading a block
 * of device 0. Exit 0 if the access failed (the fault), 1 if it went
 * through, 2 if the set-up failed. */
static int no_access_child(void) {
  if (setup_env() != 0 || !two_gpus) return 2;
  CUstream s0 = NULL, s1 = NULL;
  if (gpu_env_bind(&env[0]) != 0 || cudrv.stream_create(&s0, CU_STREAM_NON_BLOCKING) != 0) return 2;
  void *p = magpie_malloc_async(LARGE, s0);
  if (p == NULL || gpu_fill_u32(&env[0], s0, (CUdeviceptr)(uintptr_t)p, LARGE / 4, 7) != 0 ||
      cudrv.stream_synchronize(s0) != 0)
    return 2;
  if (gpu_env_bind(&env[1]) != 0 || cudrv.stream_create(&s1, CU_STREAM_NON_BLOCKING) != 0) return 2;
  CUresult r = gpu_check_u32(&env[1], s1, (CUdeviceptr)(uintptr_t)p, LARGE / 4, 7, dev_counter(0));
  if (r == CUDA_SUCCESS) r = cudrv.stream_synchronize(s1);
  printf("without peer access, device 1's kernel on device 0's block: %s\n", gpu_err(r));
  fflush(stdout);
  return r == CUDA_SUCCESS ? 1 : 0;
}

static void test_no_peer_access_faults(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  char *argv[] = {"/proc/self/exe", "--no-access-child", NULL};
  pid_t pid;
  extern char **environ;
  assert_int_equal(posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ), 0);
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
}

/* A block of device 0 used by a kernel on device 1 and freed on device 1's
 * stream (as cudaFreeAsync allows: the stream gives the order, whatever its
 * device): device 0's streams do not get it back while that kernel runs. */
static void test_free_on_other_device_stream(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  CUstream s0 = stream_on(0), s1 = stream_on(1);
  void *p = magpie_malloc_async(SMALL, s0);
  assert_non_null(p);
  GPU_CHECK(cudrv.stream_synchronize(s0));
  GPU_CHECK(gpu_env_bind(&env[1]));
  GPU_CHECK(gpu_hold_started(&env[1], s1, &words, p, SMALL, 20ull * 1000 * 1000 * 1000));
  int rc = magpie_free_async(p, s1);
  printf("free of a device-0 block on a device-1 stream: %d (%s)\n", rc, magpie_error_string(rc));
  assert_int_equal(rc, MAGPIE_OK);
  int overlaps = 0;
  void *v[4096];
  for (int i = 0; i < 4096; i++) {
    v[i] = magpie_malloc_async(SMALL, s0);
    assert_non_null(v[i]);
    overlaps += v[i] == p;
  }
  int status = atomic_load(words.status);
  atomic_store(words.flag, 1);
  GPU_CHECK(cudrv.stream_synchronize(s1));
  printf(
      "while device 1's kernel held it: %d of 4096 device-0 allocations got the block (0 expected); kernel "
      "status %d (3: still running)\n",
      overlaps, status);
  assert_int_equal(overlaps, 0);
  assert_int_equal(status, 3);
  for (int i = 0; i < 4096; i++) assert_int_equal(magpie_free_async(v[i], s0), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_synchronize(s0));
  assert_int_equal(in_use(0), 0);
  GPU_CHECK(cudrv.stream_destroy(s0));
  GPU_CHECK(cudrv.stream_destroy(s1));
  GPU_CHECK(gpu_env_bind(&env[0]));
}

/* The same free, then the block's way back through limbo: magpie_trim(0, 0)
 * right after it (give_back 0), or the freeing thread's exit (1). Either
 * sends the thread's magazine with the block to device 0's limbo, which
 * must wait for device 1's work, not device 0's. The kernel is released
 * from another thread after 500 ms (the trim's wait step waits for it);
 * no device-0 allocation may return a block over p while the kernel still
 * runs after it returned. 4 KiB and 96 KiB (a class block) blocks. */
struct xfree1 {
  void *p;
  CUstream s;
  int rc;
};

static void *xfree1_main(void *arg) {
  struct xfree1 *x = arg;
  x->rc = gpu_env_bind(&env[1]) == CUDA_SUCCESS ? magpie_free_async(x->p, x->s) : -1;
  return NULL;
}

static void *release_later(void *arg) {
  (void)arg;
  struct timespec t = {0, 500 * 1000 * 1000};
  nanosleep(&t, NULL);
  atomic_store(words.flag, 1);
  return NULL;
}

static void run_cross_device_give_back(size_t size, int give_back) {
  CUstream s0 = stream_on(0), s1 = stream_on(1);
  GPU_CHECK(gpu_env_bind(&env[0]));
  void *p = magpie_malloc_async(size, s0);
  assert_non_null(p);
  GPU_CHECK(cudrv.stream_synchronize(s0));
  GPU_CHECK(gpu_env_bind(&env[1]));
  GPU_CHECK(gpu_hold_started(&env[1], s1, &words, p, size, 20ull * 1000 * 1000 * 1000));
  pthread_t rel;
  assert_int_equal(pthread_create(&rel, NULL, release_later, NULL), 0);
  uint64_t t0 = gpu_now_ns();
  if (give_back == 0) {
    assert_int_equal(magpie_free_async(p, s1), MAGPIE_OK);
    GPU_CHECK(gpu_env_bind(&env[0]));
    assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  } else {
    struct xfree1 x = {p, s1, -1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, xfree1_main, &x), 0);
    pthread_join(t, NULL);
    assert_int_equal(x.rc, MAGPIE_OK);
  }
  double give_ms = (gpu_now_ns() - t0) / 1e6;
  GPU_CHECK(gpu_env_bind(&env[0]));
  int n = 4096, early = 0, got = 0;
  void **v = calloc((size_t)n, sizeof *v);
  assert_non_null(v);
  for (int i = 0; i < n; i++) {
    v[i] = magpie_malloc_async(size, s0);
    assert_non_null(v[i]);
    int over = (char *)v[i] < (char *)p + size && (char *)p < (char *)v[i] + size;
    got += over;
    early += over && atomic_load(words.status) == 3;
  }
  pthread_join(rel, NULL);
  GPU_CHECK(gpu_env_bind(&env[1]));
  GPU_CHECK(cudrv.stream_synchronize(s1));
  printf(
      "%zu-byte device-0 block freed on a device-1 stream behind a running kernel, then %s (%.1f ms): %d of %d "
      "device-0 allocations got its bytes while the kernel still ran (0 expected), %d in all\n",
      size, give_back == 0 ? "magpie_trim(0, 0)" : "the freeing thread's exit", give_ms, early, n, got);
  assert_int_equal(early, 0);
  GPU_CHECK(gpu_env_bind(&env[0]));
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(v[i], s0), MAGPIE_OK);
  free(v);
  GPU_CHECK(cudrv.stream_synchronize(s0));
  GPU_CHECK(cudrv.stream_destroy(s0));
  GPU_CHECK(gpu_env_bind(&env[1]));
  GPU_CHECK(cudrv.stream_destroy(s1));
  GPU_CHECK(gpu_env_bind(&env[0]));
}

static void test_cross_device_free_then_give_back(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  run_cross_device_give_back(SMALL, 0);
  run_cross_device_give_back(96 << 10, 0);
  run_cross_device_give_back(SMALL, 1);
  run_cross_device_give_back(96 << 10, 1);
}

/* ---- hand-offs between the devices ---- */

typedef struct mover {
  int from, id, iters;
  /* Written by its thread, read by the main thread's progress lines
   * (relaxed: figures; the join orders the rest). */
  _Atomic long moved;
  _Atomic int finished;
  unsigned bad;
  int failed;
} mover;

static void *move_worker(void *arg) {
  mover *m = arg;
  int to = 1 - m->from;
  CUstream src = NULL, dst = NULL;
  CUevent ev = NULL;
  if (gpu_env_bind(&env[to]) != 0 || cudrv.stream_create(&dst, CU_STREAM_NON_BLOCKING) != 0 ||
      gpu_env_bind(&env[m->from]) != 0 || cudrv.stream_create(&src, CU_STREAM_NON_BLOCKING) != 0 ||
      cudrv.event_create(&ev, CU_EVENT_DISABLE_TIMING) != 0) {
    m->failed++;
    atomic_store_explicit(&m->finished, 1, memory_order_relaxed);
    return NULL;
  }
  uint64_t r = 0xD1B54A32D192ED03ull * (uint64_t)(m->id + 1);
  for (int i = 0; i < m->iters; i++) {
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    size_t size = (size_t)256 << (r >> 40) % 15; /* 256 B .. 4 MiB */
    unsigned seed = (unsigned)(r >> 8);
    void *a = magpie_malloc_async(size, src), *b = magpie_malloc_async(size, dst);
    if (a == NULL || b == NULL) {
      m->failed++;
      break;
    }
    /* Stamp on the source device; the destination stream waits for it,
     * copies (its device's copy engine, reading a through peer access)
     * into b, which it was handed for, and its device checks b. */
    if (gpu_env_bind(&env[m->from]) != 0 ||
        gpu_fill_u32(&env[m->from], src, (CUdeviceptr)(uintptr_t)a, size / 4, seed) != 0 ||
        cudrv.event_record(ev, src) != 0 || cudrv.stream_wait_event(dst, ev, 0) != 0 || gpu_env_bind(&env[to]) != 0 ||
        cudrv.memcpy_async((CUdeviceptr)(uintptr_t)b, (CUdeviceptr)(uintptr_t)a, size, dst) != 0 ||
        gpu_check_u32(&env[to], dst, (CUdeviceptr)(uintptr_t)b, size / 4, seed, dev_counter(m->id)) != 0) {
      m->failed++;
      break;
    }
    /* Both last used on dst: a (the other device's block) is freed there
     * too, a free on another device's stream. */
    if (magpie_free_async(a, dst) != MAGPIE_OK || magpie_free_async(b, dst) != MAGPIE_OK) m->failed++;
    atomic_store_explicit(&m->moved, m->moved + 1, memory_order_relaxed);
    /* Keep the host within a few batches of the devices, as a real
     * pipeline does (and as the soak does per batch). */
    if (i % 64 == 63 && (cudrv.stream_synchronize(dst) != 0 || cudrv.stream_synchronize(src) != 0)) {
      m->failed++;
      break;
    }
  }
  cudrv.stream_synchronize(src);
  cudrv.stream_synchronize(dst);
  m->bad = *counter(m->id);
  cudrv.event_destroy(ev);
  cudrv.stream_destroy(src);
  cudrv.stream_destroy(dst);
  atomic_store_explicit(&m->finished, 1, memory_order_relaxed);
  return NULL;
}

static void test_handoffs_between_devices(void **state) {
  (void)state;
  SKIP_ONE_GPU();
  enum { MOVERS = 8 };
  const char *v = getenv("MAGPIE_MULTI_ITERS");
  int iters = v ? atoi(v) : 20000;
  mover m[MOVERS];
  pthread_t t[MOVERS];
  for (int i = 0; i < MOVERS; i++) *counter(10 + i) = 0;
  uint64_t t0 = gpu_now_ns();
  for (int i = 0; i < MOVERS; i++) {
    m[i] = (mover){.from = i % 2, .id = 10 + i, .iters = iters, .moved = 0, .finished = 0};
    assert_int_equal(pthread_create(&t[i], NULL, move_worker, &m[i]), 0);
  }
  /* Progress every 5 s, so that a stall shows where it is. */
  for (long last = -1;;) {
    long now = 0;
    for (int i = 0; i < MOVERS; i++) now += atomic_load_explicit(&m[i].moved, memory_order_relaxed);
    if (now == last) {
      printf("hand-offs: no progress in 5 s at %ld of %ld; in use %zu / %zu\n", now, (long)MOVERS * iters, in_use(0),
             in_use(1));
      fflush(stdout);
      if (gpu_now_ns() - t0 > 120ull * 1000 * 1000 * 1000) fail_msg("hand-offs stalled");
    } else if (last >= 0) {
      printf("hand-offs: %ld of %ld\n", now, (long)MOVERS * iters);
      fflush(stdout);
    }
    last = now;
    int done = 1;
    for (int i = 0; i < MOVERS; i++) done &= atomic_load_explicit(&m[i].finished, memory_order_relaxed);
    if (done) break;
    struct timespec ts = {5, 0};
    nanosleep(&ts, NULL);
  }
  long moved = 0;
  unsigned bad = 0;
  int failed = 0;
  for (int i = 0; i < MOVERS; i++) {
    pthread_join(t[i], NULL);
    moved += m[i].moved;
    bad += m[i].bad;
    failed += m[i].failed;
  }
  double s = (double)(gpu_now_ns() - t0) / 1e9;
  GPU_CHECK(gpu_env_bind(&env[0]));
  printf(
      "hand-offs: %d threads, %ld blocks stamped on one device and checked on the other after a copy (%.1f s, "
      "%.0f a second; %ld allocator operations); wrong words %u, failed calls %d; in use after: %zu / %zu\n",
      MOVERS, moved, s, moved / s, 4 * moved, bad, failed, in_use(0), in_use(1));
  assert_int_equal(failed, 0);
  assert_int_equal(bad, 0);
  assert_int_equal(moved, (long)MOVERS * iters);
  assert_int_equal(in_use(0), 0);
  assert_int_equal(in_use(1), 0);
}

static int group_setup(void **state) {
  (void)state;
  return setup_env();
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--no-access-child") == 0) return no_access_child();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_heaps_per_device),
      cmocka_unit_test(test_limits_and_trim_per_device),
      cmocka_unit_test(test_no_peer_access_faults),
      cmocka_unit_test(test_peer_access),
      cmocka_unit_test(test_free_on_other_device_stream),
      cmocka_unit_test(test_cross_device_free_then_give_back),
      cmocka_unit_test(test_handoffs_between_devices),
  };
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
