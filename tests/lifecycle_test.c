/* Regression tests of the process's life through the public API on the
 * simulated device (MAGPIE_BACKEND=sim, set by tests/BUILD): queries
 * answered before set-up, configuration mistakes, a library unloaded and
 * loaded again. Each case failed before its fix. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "magpie.h"
#include "magpie_sim.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* Runs first, before anything sets magpie up: the size classes follow from
 * a formula and need no device (it returned 0 for every class). */
static void test_size_class_size_before_init(void **state) {
  (void)state;
  assert_int_equal(magpie_size_class_size(0), 256);
  assert_int_equal(magpie_size_class_size(3), 1024);
  assert_int_equal(magpie_size_class_size(4), 1280);
  assert_int_equal(magpie_size_class_size(23), 32 * KiB);
  assert_int_equal(magpie_size_class_size(24), 48 * KiB); /* two per power of two above 32 KiB */
  assert_int_equal(magpie_size_class_size(25), 64 * KiB);
  assert_int_equal(magpie_size_class_size(33), MiB);
  assert_int_equal(magpie_size_class_size(34), 0);
  assert_int_equal(magpie_size_class_size(UINT32_MAX), 0);
  /* The same as the table set-up fills in. */
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  for (unsigned i = 0; i < 34; i++) {
    void *p = magpie_malloc_async(magpie_size_class_size(i), s);
    assert_non_null(p);
    assert_int_equal(magpie_usable_size(p), magpie_size_class_size(i));
    assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  }
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
}

/* The statistics identity holds as soon as exiting threads are joined
 * (their caches go to limbo in their exit destructor), with their streams'
 * work still pending and before the maintenance thread drained anything,
 * and at every moment after. */
static void slow(void *arg) {
  (void)arg;
  struct timespec t = {0, 50 * 1000 * 1000};
  nanosleep(&t, NULL);
}

static void *churn(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg;
  cudaStream_t s = magpie_sim_stream_create();
  void *p[64];
  for (int r = 0; r < 20; r++) {
    for (int i = 0; i < 64; i++) {
      size_t n = r % 5 == 0 ? MiB + (size_t)(rand_r(&seed) % (2 * MiB)) : 256 + (size_t)(rand_r(&seed) % 100000);
      p[i] = magpie_malloc_async(n, s);
      assert_non_null(p[i]);
    }
    for (int i = 0; i < 64; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  }
  magpie_sim_launch(s, slow, NULL);
  magpie_sim_stream_destroy(s);
  return NULL;
}

static void assert_identity(void) {
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  size_t sum = st.in_use_bytes + st.thread_cached_bytes + st.depot_bytes + st.epoch_pending_bytes +
               st.large_free_bytes + st.overhead_bytes;
  if (sum != st.reserved_bytes)
    fail_msg("reserved %zu != in_use %zu + thread %zu + depot %zu + pending %zu + large free %zu + overhead %zu",
             st.reserved_bytes, st.in_use_bytes, st.thread_cached_bytes, st.depot_bytes, st.epoch_pending_bytes,
             st.large_free_bytes, st.overhead_bytes);
  assert_int_equal(st.in_use_bytes, 0);
}

static void test_stats_exact_after_threads_joined(void **state) {
  (void)state;
  pthread_t t[6];
  for (uintptr_t i = 0; i < 6; i++) assert_int_equal(pthread_create(&t[i], NULL, churn, (void *)(i + 1)), 0);
  for (int i = 0; i < 6; i++) pthread_join(t[i], NULL);
  for (int k = 0; k < 10; k++) {
    assert_identity();
    struct timespec d = {0, 15 * 1000 * 1000};
    nanosleep(&d, NULL);
  }
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_identity();
}

/* A free on a destroyed stream (docs/configuration.md, "Decisions where CUDA leaves
 * room"): reported where magpie asks the driver (a thread with no slot for
 * the handle, a large block), not where a thread's slot matches the handle
 * without a driver call; either way the block is neither lost nor reused
 * while its stream could still use it, and nothing stays in use. */
struct foreign_free {
  void *p;
  cudaStream_t s;
  int rc;
};

static void *free_elsewhere(void *arg) {
  struct foreign_free *f = arg;
  f->rc = magpie_free_async(f->p, f->s);
  return NULL;
}

static int free_in_new_thread(void *p, cudaStream_t s) {
  struct foreign_free f = {p, s, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, free_elsewhere, &f), 0);
  pthread_join(t, NULL);
  return f.rc;
}

static void test_free_on_destroyed_stream(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  void *small = magpie_malloc_async(1000, a), *small2 = magpie_malloc_async(1000, a);
  void *big = magpie_malloc_async(3 * MiB, a);
  assert_non_null(small);
  assert_non_null(small2);
  assert_non_null(big);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  /* Asked: a thread with no slot for the handle (this thread's slot for
   * a matches the handle by value, for small and large blocks alike). */
  assert_int_equal(free_in_new_thread(small, a), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(free_in_new_thread(big, a), MAGPIE_ERR_INVALID_STREAM);
  /* Still allocated: freeable on a valid stream. */
  assert_int_equal(magpie_free_async(small, b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(big, b), MAGPIE_OK);
  /* Not asked: this thread's slot for a matches by handle. */
  assert_int_equal(magpie_free_async(small2, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_size_class_size_before_init),
      cmocka_unit_test(test_stats_exact_after_threads_joined),
      cmocka_unit_test(test_free_on_destroyed_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
