/* A thread taking turns on more streams than it has stream slots (32), on
 * the simulated device with the stream-order checker on. Per visit it
 * allocates blocks of 4-64 KiB on the stream, enqueues work there (which,
 * for the checker, uses everything allocated on the stream before it) and
 * frees the blocks on the stream. magpie must:
 *   - reuse no block on another stream before the freeing stream's work is
 *     known complete (the checker's vector clocks; no violation);
 *   - send nothing to limbo and make no device synchronisation: each slot
 *     is drained with one seal when its visit gives back what it took, so
 *     a slot taken for another stream holds nothing that needs one;
 *   - hold a bounded amount of memory: before the drain, 33 streams made
 *     reserved memory jump to gigabytes.
 * Four threads do the same at once under a limit that makes the heap
 * take idle threads' caches and ask busy ones for theirs.
 * tests/BUILD also builds it against a deliberately broken library that
 * carries the freed blocks on unsealed, and expects the checker to fail. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"
#include "tests/checker_util.h"

#define MiB ((size_t)1 << 20)
#define BLOCKS 8

static uint64_t next_rand(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* 4-64 KiB: 2^e + U[0, 2^e) for e in 12..15. */
static size_t spread_size(uint64_t *s) {
  size_t b = (size_t)1 << (12 + next_rand(s) % 4);
  return b + next_rand(s) % b;
}

static void work(void *arg) { (void)arg; }

#define MAX_USE 32

/* n (at most MAX_USE) blocks of sizes[0..n) allocated on stream s, work
 * enqueued, the blocks freed there. Returns the calls that failed (any
 * thread may call it: no cmocka assertion inside). */
static int use_blocks(cudaStream_t s, const size_t *sizes, int n) {
  void *p[MAX_USE];
  int failed = 0;
  for (int k = 0; k < n; k++) {
    if ((p[k] = magpie_malloc_async(sizes[k], s)) != NULL) continue;
    if (!failed++) fprintf(stderr, "allocation failed: %s\n", magpie_last_error_message());
  }
  failed += magpie_sim_launch(s, work, NULL) != MAGPIE_OK;
  for (int k = 0; k < n; k++) failed += p[k] != NULL && magpie_free_async(p[k], s) != MAGPIE_OK;
  return failed;
}

/* One visit to stream s: BLOCKS blocks of spread sizes. */
static int visit(cudaStream_t s, uint64_t *r) {
  size_t sz[BLOCKS];
  for (int k = 0; k < BLOCKS; k++) sz[k] = spread_size(r);
  return use_blocks(s, sz, BLOCKS);
}

static void rotate(int nstreams, int rounds) {
  uint64_t v0 = magpie_sim_check_violations();
  cudaStream_t *st = test_malloc((size_t)nstreams * sizeof *st);
  for (int i = 0; i < nstreams; i++) assert_non_null(st[i] = magpie_sim_stream_create());
  magpie_stats s0, s1;
  assert_int_equal(magpie_stats_get(0, &s0), MAGPIE_OK);
  uint64_t r = 0x9E3779B97F4A7C15ull + (uint64_t)nstreams;
  size_t peak = 0;
  for (int round = 0; round < rounds; round++) {
    for (int i = 0; i < nstreams; i++) {
      assert_int_equal(visit(st[i], &r), 0);
      if (i % 8 == 0) {
        magpie_stats now;
        assert_int_equal(magpie_stats_get(0, &now), MAGPIE_OK);
        if (now.reserved_bytes > peak) peak = now.reserved_bytes;
      }
    }
  }
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  print_message("%d streams x %d rounds: peak reserved %.1f MiB, limbo %llu, device syncs %llu, events %llu\n",
                nstreams, rounds, (double)peak / MiB, (unsigned long long)(s1.limbo_magazines - s0.limbo_magazines),
                (unsigned long long)(s1.device_syncs - s0.device_syncs),
                (unsigned long long)(s1.events_recorded - s0.events_recorded));
  checker_expect_none(v0);
  assert_int_equal(s1.limbo_magazines - s0.limbo_magazines, 0);
  assert_int_equal(s1.device_syncs - s0.device_syncs, 0);
  /* Before the drain: 1.9-3.4 GB for 33 streams. The bound leaves room
   * for the simulated device's slow event completion under the checker. */
  assert_true(peak <= 256 * MiB);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  for (int i = 0; i < nstreams; i++) {
    magpie_stream_retire(st[i]);
    assert_int_equal(magpie_sim_stream_destroy(st[i]), MAGPIE_OK);
  }
  test_free(st);
}

/* Threads rotating over their own streams at once, under a limit that
 * makes the heap take idle threads' caches (their carried and sealed
 * magazines included) and ask busy ones to give theirs back. */
enum { THREADS = 4, THREAD_STREAMS = 30, THREAD_ROUNDS = 12 };

static void *rotate_thread(void *arg) {
  uint64_t r = 0x9E3779B97F4A7C15ull ^ ((uint64_t)(uintptr_t)arg << 40); /* xorshift: never 0 */
  cudaStream_t st[THREAD_STREAMS];
  intptr_t failed = 0;
  for (int i = 0; i < THREAD_STREAMS; i++)
    if ((st[i] = magpie_sim_stream_create()) == NULL) return (void *)1;
  for (int round = 0; round < THREAD_ROUNDS; round++) {
    for (int i = 0; i < THREAD_STREAMS; i++) failed += visit(st[i], &r);
  }
  for (int i = 0; i < THREAD_STREAMS; i++) {
    magpie_stream_retire(st[i]);
    failed += magpie_sim_stream_destroy(st[i]) != MAGPIE_OK;
  }
  return (void *)failed;
}

static void test_threads_under_limit(void **state) {
  (void)state;
  uint64_t v0 = magpie_sim_check_violations();
  assert_int_equal(magpie_set_limit(0, 24 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_stats_reset_peaks(0), MAGPIE_OK); /* the peak printed below is this test's */
  pthread_t t[THREADS];
  for (intptr_t i = 0; i < THREADS; i++) assert_int_equal(pthread_create(&t[i], NULL, rotate_thread, (void *)i), 0);
  intptr_t failed = 0;
  for (int i = 0; i < THREADS; i++) {
    void *rv;
    assert_int_equal(pthread_join(t[i], &rv), 0);
    failed += (intptr_t)rv;
  }
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  print_message(
      "%d threads x %d streams under a 24 MiB limit: %ld failed calls, peak reserved %.1f MiB, %llu threads "
      "flushed, %llu stolen\n",
      THREADS, THREAD_STREAMS, (long)failed, (double)st.peak_reserved_bytes / MiB,
      (unsigned long long)st.threads_flushed, (unsigned long long)st.threads_stolen);
  assert_int_equal(magpie_set_limit(0, 0), MAGPIE_OK);
  checker_expect_none(v0);
  assert_int_equal(failed, 0);
}

static void test_33_streams(void **state) {
  (void)state;
  rotate(33, 30);
}

static void test_300_streams(void **state) {
  (void)state;
  rotate(300, 4);
}

/* A thread taking turns on two streams, each turn using two blocks of two
 * classes (64 KiB and 32 KiB) on its stream after a burst of sixteen of
 * each there: the thread keeps what the burst left in its magazines on
 * both streams however few it then uses, unless its slots decay (tcache.c,
 * tcache_slot_decay): the blocks a slot never touched go back to the
 * depot, sealed on their stream (the checker sees no violation). A thread
 * of its own, whose exit gives back what it holds, and the first test:
 * the statistics count every thread's magazines. */
typedef struct decay_run {
  cudaStream_t st[2];
  size_t thread_cached;
  int failed;
} decay_run;

static void *decay_thread(void *arg) {
  decay_run *d = arg;
  /* Two blocks of 64 KiB and two of 32 KiB a turn; a burst of sixteen of
   * each on each stream first, freed there, fills the slot's magazines. */
  size_t sizes[MAX_USE];
  for (int k = 0; k < MAX_USE; k++) sizes[k] = k % 4 < 2 ? 64 << 10 : 32 << 10;
  for (int i = 0; i < 2; i++) d->failed += use_blocks(d->st[i], sizes, MAX_USE);
  for (int step = 0; step < 2000; step++) d->failed += use_blocks(d->st[step % 2], sizes, 4);
  magpie_stats st;
  d->failed += magpie_stats_get(0, &st) != MAGPIE_OK;
  d->thread_cached = st.thread_cached_bytes;
  /* Sealed on their streams: this thread's exit leaves nothing for limbo. */
  for (int i = 0; i < 2; i++) magpie_stream_retire(d->st[i]);
  return NULL;
}

static void test_two_streams_decay(void **state) {
  (void)state;
  uint64_t v0 = magpie_sim_check_violations();
  decay_run d = {0};
  for (int i = 0; i < 2; i++) assert_non_null(d.st[i] = magpie_sim_stream_create());
  magpie_stats s0, s1;
  assert_int_equal(magpie_stats_get(0, &s0), MAGPIE_OK);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, decay_thread, &d), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  print_message("two streams, two blocks of 64 and 32 KiB a turn: %zu bytes in the thread's magazines\n",
                d.thread_cached);
  assert_int_equal(d.failed, 0);
  checker_expect_none(v0);
  assert_int_equal(s1.device_syncs - s0.device_syncs, 0);
  /* Without the decay the burst's blocks stay: 2 x 16 x (64 + 32 KiB) =
   * 3 MiB; what the turns use is 2 x 192 KiB. */
  assert_true(d.thread_cached <= 2 * 4 * (96 << 10));
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  for (int i = 0; i < 2; i++) assert_int_equal(magpie_sim_stream_destroy(d.st[i]), MAGPIE_OK);
}

int main(void) {
  if (checker_init() != 0) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_streams_decay), /* first: no other thread has cached anything */
      cmocka_unit_test(test_33_streams),
      cmocka_unit_test(test_300_streams),
      cmocka_unit_test(test_threads_under_limit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
