/* The heap's limbo on the simulated device with two devices: blocks that
 * wait there for a device synchronisation (a thread's magazines given back
 * by magpie_trim or at thread exit, kept large blocks, blocks freed on a
 * capturing stream) come back only after the work of the stream that
 * freed them, on that stream's own device, has completed. A device-0
 * block freed on a device-1 stream is covered by synchronising device 1,
 * not device 0.
 *
 * Each case launches gated work (tests/sim_test_util.h) that uses the
 * block on a device-1 stream, frees the block there, gives the thread's
 * cache back (magpie_trim, or the freeing thread's exit), then allocates
 * on device 0: the stream-order checker must find no hand-out of the
 * block's bytes that is not ordered after the gated work. */
#include "tests/sim_test_util.h"

#include "magpie.h"

#define KiB ((size_t)1 << 10)
#define ROUNDS 2000

static void set_device(int d) { assert_int_equal(magpie_sim_set_device(d), MAGPIE_OK); }

/* A stream on each device (*s0 on device 0, *s1 on device 1); device 0
 * current after. */
static void streams_create(cudaStream_t *s0, cudaStream_t *s1) {
  set_device(0);
  assert_non_null(*s0 = magpie_sim_stream_create());
  set_device(1);
  assert_non_null(*s1 = magpie_sim_stream_create());
  set_device(0);
}

static void streams_destroy(cudaStream_t s0, cudaStream_t s1) {
  set_device(1);
  assert_int_equal(magpie_sim_stream_destroy(s1), MAGPIE_OK);
  set_device(0);
  assert_int_equal(magpie_sim_stream_destroy(s0), MAGPIE_OK);
}

/* The free on s1, in a thread of its own that then exits (its cache goes
 * to limbo at exit), or in the calling thread followed by magpie_trim. */
struct xfree {
  void *p;
  cudaStream_t s;
};

static void *xfree_main(void *arg) {
  struct xfree *x = arg;
  assert_int_equal(magpie_free_async(x->p, x->s), MAGPIE_OK);
  return NULL;
}

enum give_back { GIVE_TRIM, GIVE_THREAD_EXIT };

/* A block of size on device 0, used by gated work on s1 (device 1) and
 * freed there, then given back as `how` says, then device-0 allocations. */
static void run_cross_device_case(size_t size, enum give_back how) {
  uint64_t v0 = magpie_sim_check_violations();
  cudaStream_t s0, s1;
  streams_create(&s0, &s1);
  void *p = magpie_malloc_async(size, s0);
  assert_non_null(p);
  assert_int_equal(magpie_sim_stream_synchronize(s0), MAGPIE_OK);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch_access(s1, gated_run, &g, p, size), MAGPIE_OK);
  struct opener o;
  if (how == GIVE_TRIM) {
    /* The trim's wait step synchronises device 1 for the block: the gate
     * opens meanwhile, from another thread. */
    assert_int_equal(magpie_free_async(p, s1), MAGPIE_OK);
    opener_start(&o, &g.gate, 1);
    assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  } else {
    struct xfree x = {p, s1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, xfree_main, &x), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
  }
  /* The checker judges every hand-out: a reuse of the block's bytes not
   * ordered after the gated work is a violation, whenever it runs. */
  static void *v[ROUNDS];
  int n = size > 1 * MiB ? 8 : ROUNDS;
  for (int i = 0; i < n; i++) {
    v[i] = magpie_malloc_async(size, s0);
    assert_non_null(v[i]);
  }
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(v[i], s0), MAGPIE_OK);
  if (how == GIVE_TRIM) opener_join(&o);
  else assert_false(g.done); /* all of it while the work was pending */
  assert_int_equal(magpie_sim_check_violations(), v0);
  if (how != GIVE_TRIM) sem_post(&g.gate);
  assert_int_equal(sem_wait_ms(&g.finished, WAIT_MS), 0);
  assert_true(g.opened);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  gated_fini(&g);
  assert_int_equal(magpie_sim_check_violations(), v0);
  streams_destroy(s0, s1);
}

static void test_small_block_cross_device_free_then_trim(void **state) {
  (void)state;
  run_cross_device_case(4 * KiB, GIVE_TRIM);
}

static void test_class_block_cross_device_free_then_trim(void **state) {
  (void)state;
  run_cross_device_case(96 * KiB, GIVE_TRIM);
}

static void test_small_block_cross_device_free_then_exit(void **state) {
  (void)state;
  run_cross_device_case(4 * KiB, GIVE_THREAD_EXIT);
}

static void test_class_block_cross_device_free_then_exit(void **state) {
  (void)state;
  run_cross_device_case(96 * KiB, GIVE_THREAD_EXIT);
}

static void test_large_block_cross_device_free_then_exit(void **state) {
  (void)state;
  run_cross_device_case(8 * MiB, GIVE_THREAD_EXIT);
}

/* The sibling in graph pools: a device-0 pool's block, freed outside any
 * capture on a device-1 stream behind gated work, then the pool released:
 * the block leaves for limbo, which must wait for device 1 too. */
static void test_graph_pool_block_freed_on_other_device_then_released(void **state) {
  (void)state;
  uint64_t v0 = magpie_sim_check_violations();
  cudaStream_t s0, s1;
  streams_create(&s0, &s1);
  uint64_t pool = 0;
  assert_int_equal(magpie_graph_pool_create(0, &pool), MAGPIE_OK);
  size_t size = 3 * MiB;
  void *p = magpie_graph_pool_malloc_async(pool, size, s0);
  assert_non_null(p);
  assert_int_equal(magpie_sim_stream_synchronize(s0), MAGPIE_OK);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch_access(s1, gated_run, &g, p, size), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, s1), MAGPIE_OK);
  assert_int_equal(magpie_graph_pool_release(pool), MAGPIE_OK);
  /* Until p's bytes come back (bounded): each hand-out is judged. */
  static void *v[64];
  int n = 0, back = 0;
  while (n < 64 && !back) {
    assert_non_null(v[n] = magpie_malloc_async(size, s0));
    back = (char *)v[n] < (char *)p + size && (char *)p < (char *)v[n] + size;
    n++;
    if (!back && n % 8 == 0) sleep_ms(5); /* the maintenance thread drains limbo meanwhile */
  }
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(v[i], s0), MAGPIE_OK);
  assert_false(g.done);
  assert_int_equal(magpie_sim_check_violations(), v0);
  sem_post(&g.gate);
  assert_int_equal(sem_wait_ms(&g.finished, WAIT_MS), 0);
  assert_true(g.opened);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  gated_fini(&g);
  streams_destroy(s0, s1);
}

int main(void) {
  setenv("MAGPIE_SIM_DEVICES", "2", 1);
  unsetenv("MAGPIE_SIM_MEMORY");
  unsetenv("MAGPIE_SIM_VMM");
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  cfg.check_streams = 1;
  if (magpie_init(&cfg) != MAGPIE_OK) {
    fprintf(stderr, "magpie_init: %s\n", magpie_last_error_message());
    return 1;
  }
  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_small_block_cross_device_free_then_trim),
      cmocka_unit_test(test_class_block_cross_device_free_then_trim),
      cmocka_unit_test(test_small_block_cross_device_free_then_exit),
      cmocka_unit_test(test_class_block_cross_device_free_then_exit),
      cmocka_unit_test(test_large_block_cross_device_free_then_exit),
      cmocka_unit_test(test_graph_pool_block_freed_on_other_device_then_released),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
