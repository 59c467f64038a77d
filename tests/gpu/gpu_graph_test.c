/* CUDA graphs through magpie's C API on a GPU (magpie.h, "CUDA graphs").
 *
 * A step is captured on a stream announced with magpie_capture_begin: six
 * blocks of 512 B to 5 MiB allocated from magpie inside the capture and
 * filled by kernels, a temporary freed and allocated again (the capture
 * reuses it), while another thread allocates, fills and frees on its own
 * stream (nothing it does may invalidate the capture). The graph is then
 * replayed 500 times on two streams in turn, each replay's blocks checked
 * by a kernel, while two threads allocate blocks on their own streams,
 * fill them and check them: a block of theirs that overlapped the graph's
 * would be overwritten by a replay and counted. Then the blocks are freed,
 * the graph destroyed and the pool released: magpie's statistics show the
 * pool's memory going back. Capture and replay costs are printed. A
 * capture magpie was not told of is refused.
 *
 * The adversarial findings' cases: two threads capturing at once on the
 * per-thread default stream (CU_STREAM_PER_THREAD), each into its own
 * pool, get their own pool's blocks, and each graph replays its own
 * values; a block recorded on a stream that then captures, freed on
 * another stream (and another recorded block freed on the capturing
 * stream), leaves the capture valid and is handed out by nobody while the
 * recorded stream's kernel still writes it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>

#include "gpu_util.h"
#include "magpie.h"
#include "tests/turns.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define NBLK 6

static gpu_env env;
static gpu_host_words hw;
static const size_t sizes[NBLK] = {512, 4 * KiB, 64 * KiB, 300 * KiB, 2 * MiB, 5 * MiB};

static void sleep_ms(int ms) {
  struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

struct neighbour {
  atomic_int stop;
  atomic_long rounds, failures;
  void *const *graph_blocks;
};

/* Another thread's eager traffic: blocks filled and checked on its own
 * stream (bad words counted on the device), never one of the graph's. */
static void *neighbour_main(void *arg) {
  struct neighbour *n = arg;
  if (gpu_env_bind(&env) != CUDA_SUCCESS) {
    atomic_fetch_add(&n->failures, 1);
    return NULL;
  }
  CUstream s;
  if (cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    atomic_fetch_add(&n->failures, 1);
    return NULL;
  }
  unsigned seed = 0x51ed0000u;
  while (!atomic_load(&n->stop)) {
    void *p[8];
    for (int i = 0; i < 8; i++) {
      size_t sz = i % 4 == 3 ? 3 * MiB : (size_t)4096 << (i % 6);
      p[i] = magpie_malloc_async(sz, s);
      if (p[i] == NULL) {
        atomic_fetch_add(&n->failures, 1);
        continue;
      }
      if (n->graph_blocks != NULL)
        for (int k = 0; k < NBLK; k++)
          if (p[i] == n->graph_blocks[k]) atomic_fetch_add(&n->failures, 1);
      gpu_fill_u32(&env, s, (CUdeviceptr)p[i], sz / 4, seed + (unsigned)i);
      gpu_delay(&env, s, 20000); /* a replay on another stream may run meanwhile */
      gpu_check_u32(&env, s, (CUdeviceptr)p[i], sz / 4, seed + (unsigned)i, hw.dev_bad);
    }
    for (int i = 0; i < 8; i++)
      if (p[i] != NULL && magpie_free_async(p[i], s) != MAGPIE_OK) atomic_fetch_add(&n->failures, 1);
    seed += 8;
    atomic_fetch_add(&n->rounds, 1);
  }
  cudrv.stream_synchronize(s);
  cudrv.stream_destroy(s);
  return NULL;
}

static magpie_stats stats(void) {
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  return st;
}

static void test_graph_pool(void **state) {
  (void)state;
  uint64_t pool = 0;
  assert_int_equal(magpie_graph_pool_create(0, &pool), MAGPIE_OK);
  CUstream cs, rs;
  GPU_CHECK(cudrv.stream_create(&cs, CU_STREAM_NON_BLOCKING));
  GPU_CHECK(cudrv.stream_create(&rs, CU_STREAM_NON_BLOCKING));
  /* The thread's cache holds this stream's blocks: the capture must not. */
  void *warm[NBLK];
  for (int i = 0; i < NBLK; i++) warm[i] = magpie_malloc_async(sizes[i], cs);
  for (int i = 0; i < NBLK; i++) assert_int_equal(magpie_free_async(warm[i], cs), MAGPIE_OK);

  struct neighbour during = {0};
  pthread_t nt;
  assert_int_equal(pthread_create(&nt, NULL, neighbour_main, &during), 0);
  sleep_ms(20);
  uint64_t t0 = gpu_now_ns();
  assert_int_equal(magpie_capture_begin(pool, cs), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_begin_capture(cs, CU_STREAM_CAPTURE_MODE_GLOBAL));
  void *blk[NBLK];
  for (int i = 0; i < NBLK; i++) {
    blk[i] = magpie_malloc_async(sizes[i], cs);
    if (blk[i] == NULL) fail_msg("%s", magpie_last_error_message());
    GPU_CHECK(gpu_fill_u32(&env, cs, (CUdeviceptr)blk[i], sizes[i] / 4, 0xC0DE0000u + (unsigned)i));
  }
  void *tmp = magpie_malloc_async(64 * KiB, cs);
  GPU_CHECK(gpu_fill_u32(&env, cs, (CUdeviceptr)tmp, 16 * KiB, 7));
  assert_int_equal(magpie_free_async(tmp, cs), MAGPIE_OK);
  void *again = magpie_malloc_async(64 * KiB, cs);
  assert_ptr_equal(again, tmp);
  assert_int_equal(magpie_free_async(again, cs), MAGPIE_OK);
  sleep_ms(50); /* the neighbour allocates and frees meanwhile */
  CUgraph graph;
  CUresult er = cudrv.stream_end_capture(cs, &graph);
  assert_int_equal(magpie_capture_end(pool, cs), MAGPIE_OK);
  if (er != CUDA_SUCCESS) fail_msg("the capture failed: %s", gpu_err(er));
  CUgraphExec exec;
  GPU_CHECK(cudrv.graph_instantiate(&exec, graph, 0));
  uint64_t t_capture = gpu_now_ns() - t0;
  atomic_store(&during.stop, 1);
  pthread_join(nt, NULL);
  /* The thread cache's blocks of the stream never serve the capture (a
   * large one freed before may, once its stream's work completed). */
  for (int i = 0; i < NBLK; i++)
    for (int k = 0; k < NBLK; k++)
      if (sizes[k] <= 300 * KiB) assert_true(blk[i] != warm[k]);
  magpie_stats during_capture = stats();
  printf(
      "gpu_graph_test: captured %d blocks (%zu bytes in the pool), neighbour rounds during the capture %ld, "
      "capture + instantiate %.1f us\n",
      NBLK, magpie_graph_pool_bytes(pool), atomic_load(&during.rounds), t_capture / 1e3);
  assert_int_equal(atomic_load(&during.failures), 0);

  /* Replays next to two threads allocating. */
  struct neighbour nb[2];
  pthread_t th[2];
  for (int t = 0; t < 2; t++) {
    memset(&nb[t], 0, sizeof nb[t]);
    nb[t].graph_blocks = blk;
    assert_int_equal(pthread_create(&th[t], NULL, neighbour_main, &nb[t]), 0);
  }
  CUstream streams[2] = {cs, rs};
  uint64_t t1 = gpu_now_ns();
  for (int r = 0; r < 500; r++) {
    CUstream s = streams[r % 2];
    GPU_CHECK(cudrv.graph_launch(exec, s));
    for (int i = 0; i < NBLK; i++)
      GPU_CHECK(gpu_check_u32(&env, s, (CUdeviceptr)blk[i], sizes[i] / 4, 0xC0DE0000u + (unsigned)i, hw.dev_bad));
    if (r % 2 == 1) GPU_CHECK(cudrv.stream_synchronize(streams[0]));
  }
  GPU_CHECK(cudrv.stream_synchronize(cs));
  GPU_CHECK(cudrv.stream_synchronize(rs));
  uint64_t t_replays = gpu_now_ns() - t1;
  for (int t = 0; t < 2; t++) {
    atomic_store(&nb[t].stop, 1);
    pthread_join(th[t], NULL);
    assert_true(atomic_load(&nb[t].rounds) > 0);
    assert_int_equal(atomic_load(&nb[t].failures), 0);
  }
  GPU_CHECK(cudrv.ctx_synchronize());
  uint64_t bad = *(volatile uint64_t *)(uintptr_t)hw.dev_bad;
  printf("gpu_graph_test: 500 replays (+ checks) in %.1f ms, neighbours' rounds %ld + %ld, bad words %llu\n",
         t_replays / 1e6, atomic_load(&nb[0].rounds), atomic_load(&nb[1].rounds), (unsigned long long)bad);
  assert_int_equal(bad, 0);

  /* Destroy and release: the pool's memory goes back. */
  for (int i = 0; i < NBLK; i++) assert_int_equal(magpie_free_async(blk[i], cs), MAGPIE_OK);
  GPU_CHECK(cudrv.graph_exec_destroy(exec));
  GPU_CHECK(cudrv.graph_destroy(graph));
  magpie_stats before = stats();
  assert_int_equal(magpie_graph_pool_release(pool), MAGPIE_OK);
  for (int i = 0; i < 500 && stats().graph_pool_bytes != 0; i++) sleep_ms(10);
  magpie_stats after = stats();
  printf(
      "gpu_graph_test: graph pools %llu -> %llu, pool bytes %zu (during the capture %zu) -> %zu, in use %zu -> %zu, "
      "device syncs %llu -> %llu\n",
      (unsigned long long)before.graph_pools, (unsigned long long)after.graph_pools, before.graph_pool_bytes,
      during_capture.graph_pool_bytes, after.graph_pool_bytes, before.in_use_bytes, after.in_use_bytes,
      (unsigned long long)before.device_syncs, (unsigned long long)after.device_syncs);
  assert_int_equal(after.graph_pool_bytes, 0);
  assert_true(after.in_use_bytes + before.graph_pool_bytes <= before.in_use_bytes + 1);
  GPU_CHECK(cudrv.stream_destroy(cs));
  GPU_CHECK(cudrv.stream_destroy(rs));
}

/* A capture magpie was not told of: the allocation fails with
 * MAGPIE_ERR_CAPTURE and a message naming magpie_capture_begin. CUDA itself
 * refuses the capturing stream's id, which every allocation asks, and
 * invalidates the capture (CUDA 13.0, driver 580): the capture's end
 * reports it. In every capture mode, for a large block and a small one:
 * for ordinary streams the allocation paths rely on that refusal instead
 * of asking the capture state as well (tcache_capture_refused). */
static void test_unannounced(void **state) {
  (void)state;
  static const struct {
    int mode;
    const char *name;
  } modes[] = {{CU_STREAM_CAPTURE_MODE_GLOBAL, "global"},
               {CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, "thread-local"},
               {CU_STREAM_CAPTURE_MODE_RELAXED, "relaxed"}};
  static const size_t asks[] = {3 * MiB, 24 * KiB + 1};
  for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
    for (size_t a = 0; a < sizeof asks / sizeof asks[0]; a++) {
      CUstream cs;
      GPU_CHECK(cudrv.stream_create(&cs, CU_STREAM_NON_BLOCKING));
      GPU_CHECK(cudrv.stream_begin_capture(cs, modes[m].mode));
      assert_null(magpie_malloc_async(asks[a], cs));
      assert_int_equal(magpie_last_error(), MAGPIE_ERR_CAPTURE);
      printf("gpu_graph_test: unannounced %s capture, %zu bytes: %s\n", modes[m].name, asks[a],
             magpie_last_error_message());
      CUgraph g = NULL;
      CUresult r = cudrv.stream_end_capture(cs, &g);
      printf("gpu_graph_test: its end: %s\n", gpu_err(r));
      assert_int_equal(r, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
      if (g != NULL) GPU_CHECK(cudrv.graph_destroy(g));
      GPU_CHECK(cudrv.stream_destroy(cs));
    }
  }
}

/* ---- two threads capturing on their per-thread streams at once ---- */

struct pt_side {
  uint64_t pool;
  size_t size;
  int first; /* 0: A (turns 0, 2, 4); 1: B (turns 1, 3, 5) */
  unsigned seed;
  void *p;
  size_t pool_bytes;
  CUresult end;
  CUgraph graph;
  int failed;
};

static turns pt_turns = TURNS_INIT;

/* In turn: A announces and begins, B does, A allocates and fills, B does,
 * A ends, B ends (a registration resolved by the wrong thread would give
 * A's block to B's pool). */
static void *pt_side_main(void *arg) {
  struct pt_side *x = arg;
  CUstream pt = CU_STREAM_PER_THREAD;
  x->failed = gpu_env_bind(&env) != CUDA_SUCCESS;
  turn_wait(&pt_turns, x->first);
  x->failed |= magpie_capture_begin(x->pool, (cudaStream_t)pt) != MAGPIE_OK;
  x->failed |= cudrv.stream_begin_capture(pt, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) != CUDA_SUCCESS;
  turn_next(&pt_turns);
  turn_wait(&pt_turns, 2 + x->first);
  x->p = magpie_malloc_async(x->size, (cudaStream_t)pt);
  x->failed |= x->p == NULL;
  if (x->p != NULL) x->failed |= gpu_fill_u32(&env, pt, (CUdeviceptr)x->p, x->size / 4, x->seed) != CUDA_SUCCESS;
  turn_next(&pt_turns);
  turn_wait(&pt_turns, 4 + x->first);
  x->end = cudrv.stream_end_capture(pt, &x->graph);
  x->failed |= magpie_capture_end(x->pool, (cudaStream_t)pt) != MAGPIE_OK;
  x->pool_bytes = magpie_graph_pool_bytes(x->pool);
  turn_next(&pt_turns);
  return NULL;
}

static void test_per_thread_stream_captures(void **state) {
  (void)state;
  struct pt_side x[2] = {{.size = 3 * MiB, .first = 0, .seed = 0xA0000000u},
                         {.size = 5 * MiB, .first = 1, .seed = 0xB0000000u}};
  turn_reset(&pt_turns);
  pthread_t th[2];
  for (int t = 0; t < 2; t++) {
    assert_int_equal(magpie_graph_pool_create(0, &x[t].pool), MAGPIE_OK);
    assert_int_equal(pthread_create(&th[t], NULL, pt_side_main, &x[t]), 0);
  }
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < 2; t++) {
    printf("gpu_graph_test: per-thread capture %c: %zu bytes asked, its pool holds %zu, capture end: %s\n", 'A' + t,
           x[t].size, x[t].pool_bytes, gpu_err(x[t].end));
    assert_int_equal(x[t].failed, 0);
    assert_int_equal(x[t].end, CUDA_SUCCESS);
    assert_true(x[t].pool_bytes >= x[t].size && x[t].pool_bytes < x[t].size + 2 * MiB);
  }
  /* Each graph replays on its own pool's block: launched one after the
   * other, each block keeps its own values. */
  CUstream s;
  GPU_CHECK(cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING));
  *(volatile uint64_t *)(uintptr_t)hw.dev_bad = 0;
  for (int t = 0; t < 2; t++) {
    CUgraphExec exec;
    GPU_CHECK(cudrv.graph_instantiate(&exec, x[t].graph, 0));
    GPU_CHECK(cudrv.graph_launch(exec, s));
    GPU_CHECK(cudrv.stream_synchronize(s));
    GPU_CHECK(cudrv.graph_exec_destroy(exec));
    GPU_CHECK(cudrv.graph_destroy(x[t].graph));
  }
  for (int t = 0; t < 2; t++)
    GPU_CHECK(gpu_check_u32(&env, s, (CUdeviceptr)x[t].p, x[t].size / 4, x[t].seed, hw.dev_bad));
  GPU_CHECK(cudrv.stream_synchronize(s));
  uint64_t bad = *(volatile uint64_t *)(uintptr_t)hw.dev_bad;
  printf("gpu_graph_test: per-thread captures replayed: bad words %llu\n", (unsigned long long)bad);
  assert_int_equal(bad, 0);
  for (int t = 0; t < 2; t++) {
    assert_int_equal(magpie_free_async(x[t].p, (cudaStream_t)s), MAGPIE_OK);
    assert_int_equal(magpie_graph_pool_release(x[t].pool), MAGPIE_OK);
  }
  GPU_CHECK(cudrv.stream_synchronize(s));
  GPU_CHECK(cudrv.stream_destroy(s));
}

/* ---- record_stream against a capture ---- */

static int overlaps(const void *q, const void *p, size_t size) {
  return (const char *)q < (const char *)p + size && (const char *)p < (const char *)q + size;
}

/* Allocations of size on s: how many lay over p while the hold kernel
 * still ran after they returned (status 3). */
static long early_hits(CUstream s, size_t size, int n, void *p) {
  void **v = calloc((size_t)n, sizeof *v);
  long hits = 0;
  assert_non_null(v);
  for (int i = 0; i < n; i++) {
    v[i] = magpie_malloc_async(size, (cudaStream_t)s);
    if (v[i] == NULL) fail_msg("magpie_malloc_async: %s", magpie_last_error_message());
    hits += overlaps(v[i], p, size) && atomic_load(hw.status) == 3;
  }
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(v[i], (cudaStream_t)s), MAGPIE_OK);
  free(v);
  return hits;
}

/* p allocated on A, written by a hold kernel on O and recorded on O; O
 * then captures (announced, global mode) while p is freed: on_capturing 0
 * frees it on A (O is only recorded), 1 on O itself. The capture stays
 * valid, and while the kernel runs neither A nor C gets p's bytes. */
static void run_recorded_capture_case(size_t size, int on_capturing) {
  CUstream a, o, c;
  GPU_CHECK(cudrv.stream_create(&a, CU_STREAM_NON_BLOCKING));
  GPU_CHECK(cudrv.stream_create(&o, CU_STREAM_NON_BLOCKING));
  GPU_CHECK(cudrv.stream_create(&c, CU_STREAM_NON_BLOCKING));
  void *p = magpie_malloc_async(size, (cudaStream_t)a);
  assert_non_null(p);
  GPU_CHECK(cudrv.stream_synchronize(a));
  uint64_t pool = 0;
  assert_int_equal(magpie_graph_pool_create(0, &pool), MAGPIE_OK);
  /* Announced before the kernel: an announcement waits for a device
   * synchronisation of the maintenance thread under way. */
  assert_int_equal(magpie_capture_begin(pool, (cudaStream_t)o), MAGPIE_OK);
  GPU_CHECK(gpu_hold_started(&env, o, &hw, p, size, 20ull * 1000000000ull));
  assert_int_equal(magpie_record_stream(p, (cudaStream_t)o), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_begin_capture(o, CU_STREAM_CAPTURE_MODE_GLOBAL));
  int rc = magpie_free_async(p, (cudaStream_t)(on_capturing ? o : a));
  CUgraph g = NULL;
  CUresult er = cudrv.stream_end_capture(o, &g);
  assert_int_equal(magpie_capture_end(pool, (cudaStream_t)o), MAGPIE_OK);
  long hits = early_hits(a, size, size > MiB ? 8 : 4000, p) + early_hits(c, size, size > MiB ? 8 : 4000, p);
  int still = atomic_load(hw.status) == 3;
  atomic_store(hw.flag, 1);
  GPU_CHECK(cudrv.stream_synchronize(o));
  printf(
      "gpu_graph_test: %zu-byte block recorded on a stream that then captured, freed on %s: free %s, capture end "
      "%s, handed out %ld times while the kernel ran (still running at the end of the checks: %s)\n",
      size, on_capturing ? "the capturing stream" : "another stream", magpie_error_string(rc), gpu_err(er), hits,
      still ? "yes" : "no");
  assert_int_equal(rc, MAGPIE_OK);
  assert_int_equal(er, CUDA_SUCCESS);
  assert_int_equal(hits, 0);
  assert_true(still);
  if (g != NULL) GPU_CHECK(cudrv.graph_destroy(g));
  assert_int_equal(magpie_graph_pool_release(pool), MAGPIE_OK);
  GPU_CHECK(cudrv.ctx_synchronize());
  GPU_CHECK(cudrv.stream_destroy(a));
  GPU_CHECK(cudrv.stream_destroy(o));
  GPU_CHECK(cudrv.stream_destroy(c));
}

static void test_recorded_stream_captures(void **state) {
  (void)state;
  run_recorded_capture_case(4 * KiB, 0);
  run_recorded_capture_case(4 * MiB, 0);
  run_recorded_capture_case(4 * KiB, 1);
}

int main(void) {
  if (gpu_magpie_setup(&env, &hw) != 0) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_graph_pool),
      cmocka_unit_test(test_unannounced),
      cmocka_unit_test(test_per_thread_stream_captures),
      cmocka_unit_test(test_recorded_stream_captures),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
