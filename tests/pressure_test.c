/* Memory pressure on the simulated device (MAGPIE_SIM_MEMORY is small, set
 * in tests/BUILD): many threads and streams fill the device, free
 * everything on several streams (some with slow work still pending), some
 * threads exit and some stay alive and idle with full caches; then one
 * block as large as most of the device must be allocated. Also: the
 * out-of-memory message, and stamped blocks staying intact throughout. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"

#define MiB ((size_t)1 << 20)
#define THREADS 8
#define MAX_BLOCKS 4096

static pthread_barrier_t filled, freed, released;
static size_t device_total;

struct worker {
  int id;
  int stay_idle; /* 1: stays alive (caches full) until released */
  size_t got_bytes;
  int saw_oom_message;
};

static void slow_work(void *arg) {
  (void)arg;
  struct timespec t = {0, 150 * 1000 * 1000};
  nanosleep(&t, NULL);
}

/* Stream work: stamp a block's first words, or check the stamp (device
 * memory is written by work on a stream, ordered after the allocation). */
struct stamp {
  unsigned char *p;
  size_t n;
  unsigned char v;
  _Atomic int *bad;
};

static void stamp_write(void *arg) {
  struct stamp *st = arg;
  memset(st->p, st->v, st->n);
  free(st);
}

static void stamp_check(void *arg) {
  struct stamp *st = arg;
  for (size_t i = 0; i < st->n; i++)
    if (st->p[i] != st->v) {
      atomic_fetch_add(st->bad, 1);
      break;
    }
  free(st);
}

static _Atomic int stamp_errors;

static void launch_stamp(cudaStream_t s, void *p, size_t n, unsigned char v, int check) {
  struct stamp *st = malloc(sizeof *st);
  *st = (struct stamp){p, n, v, &stamp_errors};
  assert_int_equal(magpie_sim_launch(s, check ? stamp_check : stamp_write, st), MAGPIE_OK);
}

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void *worker_main(void *arg) {
  struct worker *w = arg;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  static __thread void *blocks[MAX_BLOCKS];
  uint64_t seed = 0x1234567ull * (uint64_t)(w->id + 1);
  int n = 0;
  /* Fill: mixed small and large blocks until the device says no. */
  while (n < MAX_BLOCKS) {
    size_t sz = rng_next(&seed) % 5 == 0 ? MiB + rng_next(&seed) % (12 * MiB) : 256 + rng_next(&seed) % (512 * 1024);
    cudaStream_t s = n % 2 ? a : b;
    void *p = magpie_malloc_async(sz, s);
    if (p == NULL) {
      if (magpie_last_error() == MAGPIE_ERR_OUT_OF_MEMORY &&
          strstr(magpie_last_error_message(), "out of memory on device 0") != NULL &&
          strstr(magpie_last_error_message(), "magpie reserved") != NULL)
        w->saw_oom_message = 1;
      break;
    }
    launch_stamp(s, p, 64, (unsigned char)(w->id + 1), 0);
    blocks[n++] = p;
    w->got_bytes += sz;
  }
  pthread_barrier_wait(&filled);
  /* Slow work on a, then free everything: half on a (pending behind the
   * slow work), half on b. */
  magpie_sim_launch(a, slow_work, NULL);
  for (int i = 0; i < n; i++) {
    launch_stamp(i % 2 ? a : b, blocks[i], 64, (unsigned char)(w->id + 1), 1);
    assert_int_equal(magpie_free_async(blocks[i], i % 2 ? a : b), MAGPIE_OK);
  }
  pthread_barrier_wait(&freed);
  if (w->stay_idle) pthread_barrier_wait(&released);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  return NULL;
}

static void test_large_block_after_fill(void **state) {
  (void)state;
  size_t free_b = 0;
  assert_int_equal(magpie_sim_mem_info(0, &free_b, &device_total), MAGPIE_OK);
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
  /* Threads that exit leave their caches to limbo; the idle half keep
   * theirs until the ladder takes them. */
  for (int i = 0; i < THREADS; i++)
    if (!w[i].stay_idle) pthread_join(t[i], NULL);
  size_t total_filled = 0;
  int saw = 0;
  for (int i = 0; i < THREADS; i++) {
    total_filled += w[i].got_bytes;
    saw |= w[i].saw_oom_message;
  }
  assert_true(total_filled > device_total / 2);
  assert_true(saw);
  magpie_stats s0, s1;
  assert_int_equal(magpie_stats_get(0, &s0), MAGPIE_OK);
  assert_true(s0.cached_bytes > device_total / 2);

  cudaStream_t s = magpie_sim_stream_create();
  size_t big = device_total / 8 * 7;
  char *p = magpie_malloc_async(big, s);
  if (p == NULL) fail_msg("%s", magpie_last_error_message());
  launch_stamp(s, p, big, 0x5a, 0);
  launch_stamp(s, p, big, 0x5a, 1);
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  assert_true(s1.ladder_steps[0] + s1.ladder_steps[1] + s1.ladder_steps[3] > 0);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  magpie_sim_stream_synchronize(s);
  magpie_sim_stream_destroy(s);
  pthread_barrier_wait(&released);
  for (int i = 0; i < THREADS; i++)
    if (w[i].stay_idle) pthread_join(t[i], NULL);
  /* Everything free: trimming gives it all back. */
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  assert_int_equal(s1.in_use_bytes, 0);
  assert_int_equal(s1.reserved_bytes, 0);
  size_t free_after = 0, total = 0;
  assert_int_equal(magpie_sim_mem_info(0, &free_after, &total), MAGPIE_OK);
  assert_int_equal(free_after, total);
  assert_int_equal(atomic_load(&stamp_errors), 0);
  /* The simulated device's stream-order checker (check_streams=1 in
   * tests/BUILD) saw every hand-out ordered after the last use. */
  assert_int_equal(magpie_sim_check_violations(), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_large_block_after_fill),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
