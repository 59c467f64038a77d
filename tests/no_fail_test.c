/* No allocation fails while cached memory could serve it (docs/design.md, "When an
 * allocation fails"). tests/BUILD runs this file three times on the
 * simulated device, under MAGPIE_CONF=limit=16m, 32m and 64m, and once on
 * a device of 64 MiB with no limit (MAGPIE_SIM_MEMORY=64m):
 *   - one thread keeping 64 live blocks of 256 B-256 KiB (2^e + U[0, 2^e))
 *     and replacing a random one 200,000 times never fails;
 *   - threads that churn, then grow together until the limit says no, fail
 *     only once magpie has reached the limit, and leave nothing cached in
 *     their magazines;
 *   - without a limit, blocks of the classes from 64 KiB to 1 MiB allocated
 *     in turn take at least 70 % of the device before the first failure. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"

#define MiB ((size_t)1 << 20)

static uint64_t next_rand(uint64_t *s) {
  *s ^= *s << 13; /* xorshift: no wrapping arithmetic (UBSan checks it) */
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* 2^e + U[0, 2^e) for e in [lo, hi]. */
static size_t spread_size(uint64_t *s, unsigned lo, unsigned hi) {
  size_t b = (size_t)1 << (lo + next_rand(s) % (hi - lo + 1));
  return b + next_rand(s) % b;
}

static size_t limit_bytes(void) {
  magpie_stats st;
  void *p = magpie_malloc_async(1, 0); /* sets the heap up */
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  return st.limit_bytes;
}

static void test_window_never_fails(void **state) {
  (void)state;
  if (limit_bytes() == 0) skip();
  cudaStream_t s = magpie_sim_stream_create();
  enum { W = 64, STEPS = 200000 };
  void *w[W];
  uint64_t r = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < W; i++) assert_non_null(w[i] = magpie_malloc_async(spread_size(&r, 8, 17), s));
  for (int k = 0; k < STEPS; k++) {
    int i = (int)(next_rand(&r) % W);
    assert_int_equal(magpie_free_async(w[i], s), MAGPIE_OK);
    size_t n = spread_size(&r, 8, 17);
    w[i] = magpie_malloc_async(n, s);
    if (w[i] == NULL) fail_msg("step %d: %zu bytes failed: %s", k, n, magpie_last_error_message());
  }
  for (int i = 0; i < W; i++) assert_int_equal(magpie_free_async(w[i], s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
}

/* ---- threads exhausting a limit together ---- */

enum { T = 4, HELD_MAX = 4096 };
typedef struct worker {
  int id;
  size_t limit;
  int failed;
  size_t reserved_at_failure, request;
  char message[512];
  void *held[HELD_MAX];
  int n;
  cudaStream_t s;
} worker;

static pthread_barrier_t grow_barrier;

static void *exhaust_main(void *arg) {
  worker *wk = arg;
  uint64_t r = 0x2545F4914F6CDD1Dull * (uint64_t)(wk->id + 1);
  /* Churn first, so that every thread's magazines and the depot hold
   * blocks of many classes, then grow together until the limit. */
  for (int k = 0; k < 5000; k++) {
    if (wk->n < 32) {
      void *p = magpie_malloc_async(spread_size(&r, 8, 17), wk->s);
      if (p != NULL) wk->held[wk->n++] = p;
    } else {
      int i = (int)(next_rand(&r) % (uint64_t)wk->n);
      magpie_free_async(wk->held[i], wk->s);
      wk->held[i] = wk->held[--wk->n];
    }
  }
  pthread_barrier_wait(&grow_barrier);
  while (wk->n < HELD_MAX) {
    size_t n = spread_size(&r, 8, 17);
    void *p = magpie_malloc_async(n, wk->s);
    if (p == NULL) {
      magpie_stats st;
      magpie_stats_get(0, &st);
      wk->failed = 1;
      wk->reserved_at_failure = st.reserved_bytes;
      wk->request = n;
      snprintf(wk->message, sizeof wk->message, "%s", magpie_last_error_message());
      break;
    }
    wk->held[wk->n++] = p;
  }
  return NULL;
}

static void test_threads_exhaust_limit_together(void **state) {
  (void)state;
  size_t limit = limit_bytes();
  if (limit == 0) skip();
  static worker w[T];
  pthread_t th[T];
  pthread_barrier_init(&grow_barrier, NULL, T);
  for (int i = 0; i < T; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].id = i;
    w[i].limit = limit;
    w[i].s = magpie_sim_stream_create();
    pthread_create(&th[i], NULL, exhaust_main, &w[i]);
  }
  for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&grow_barrier);
  for (int i = 0; i < T; i++) {
    if (!w[i].failed) fail_msg("thread %d held %d blocks without reaching the limit", i, w[i].n);
    /* A failure only where mapping the request's memory would pass the
     * limit: magpie had mapped to within a granule of it. */
    if (w[i].reserved_at_failure + 2 * MiB < limit)
      fail_msg("thread %d failed at %zu bytes reserved of a %zu-byte limit: %s", i, w[i].reserved_at_failure, limit,
               w[i].message);
    assert_non_null(strstr(w[i].message, "limit"));
  }
  /* Every failure gave back the failing thread's magazines, and took the
   * others' (idle) ones: nothing stays cached in threads. */
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.thread_cached_bytes, 0);
  assert_true(st.reserved_bytes <= limit);
  for (int i = 0; i < T; i++) {
    for (int k = 0; k < w[i].n; k++) assert_int_equal(magpie_free_async(w[i].held[k], w[i].s), MAGPIE_OK);
    assert_int_equal(magpie_sim_stream_destroy(w[i].s), MAGPIE_OK);
  }
}

/* ---- classes in turn on a small device ---- */

static void test_classes_in_turn_fill_the_device(void **state) {
  (void)state;
  if (limit_bytes() != 0) skip();
  size_t dev_free = 0, dev_total = 0;
  assert_int_equal(magpie_sim_mem_info(0, &dev_free, &dev_total), MAGPIE_OK);
  assert_int_equal(dev_total, 64 * MiB);
  cudaStream_t s = magpie_sim_stream_create();
  enum { MAXB = 1024 };
  static void *held[MAXB];
  int n = 0;
  size_t got = 0, failed_at = 0;
  while (n < MAXB && failed_at == 0) {
    for (size_t sz = 64 * 1024; sz <= MiB && n < MAXB; sz += sz / 4) {
      void *p = magpie_malloc_async(sz, s);
      if (p == NULL) {
        failed_at = sz;
        break;
      }
      held[n++] = p;
      got += sz;
    }
  }
  assert_true(failed_at != 0);
  if (got * 10 < dev_total * 7)
    fail_msg("%zu bytes (%.1f %% of the device) before a %zu-byte request failed: %s", got, 100.0 * got / dev_total,
             failed_at, magpie_last_error_message());
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(held[i], s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_window_never_fails),
      cmocka_unit_test(test_threads_exhaust_limit_together),
      cmocka_unit_test(test_classes_in_turn_fill_the_device),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
