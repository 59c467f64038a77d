/* Observing a running allocator: while worker threads allocate and free
 * small and large blocks on their streams, another thread takes snapshots,
 * statistics and trims, and takes idle threads' magazines (magpie_trim
 * runs the give-back step). Under ThreadSanitizer this checks the
 * busy/steal handshake and the snapshot's reads of other threads' caches;
 * every snapshot must parse, and at the end everything is accounted for. */
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
#include "magpie_sim.h"
#include "tests/json_mini.h"

#define WORKERS 4
#define OPS 20000

static atomic_int stop;

static uint64_t rng(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void *worker(void *arg) {
  uint64_t seed = 0x51ED270Bull * (uint64_t)((intptr_t)arg + 1);
  cudaStream_t s = magpie_sim_stream_create();
  void *live[32] = {0};
  for (int i = 0; i < OPS; i++) {
    int k = (int)(rng(&seed) % 32);
    if (live[k]) {
      assert_int_equal(magpie_free_async(live[k], s), MAGPIE_OK);
      live[k] = NULL;
    } else {
      size_t sz = rng(&seed) % 16 == 0 ? ((size_t)1 << 20) + rng(&seed) % ((size_t)3 << 20) : 1 + rng(&seed) % 65536;
      live[k] = magpie_malloc_async(sz, s);
      assert_non_null(live[k]);
    }
    /* Now and then go idle for a moment, so the observer finds this cache
     * idle and may take it. */
    if (i % 4096 == 0) {
      struct timespec t = {0, 2 * 1000 * 1000};
      nanosleep(&t, NULL);
    }
  }
  for (int k = 0; k < 32; k++)
    if (live[k]) assert_int_equal(magpie_free_async(live[k], s), MAGPIE_OK);
  magpie_sim_stream_synchronize(s);
  magpie_sim_stream_destroy(s);
  return NULL;
}

static void *observer(void *arg) {
  (void)arg;
  int n = 0;
  while (!atomic_load(&stop)) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (magpie_snapshot_json(0, f) != MAGPIE_OK) abort();
    fclose(f);
    if (jm_parse(buf) == NULL) abort(); /* leaked on success: a test */
    free(buf);
    magpie_stats st;
    if (magpie_stats_get(0, &st) != MAGPIE_OK) abort();
    if (++n % 4 == 0 && magpie_trim(0, (size_t)4 << 20) != MAGPIE_OK) abort();
  }
  return (void *)(intptr_t)n;
}

static void test_observe_while_running(void **state) {
  (void)state;
  pthread_t w[WORKERS], o;
  for (intptr_t i = 0; i < WORKERS; i++) assert_int_equal(pthread_create(&w[i], NULL, worker, (void *)i), 0);
  assert_int_equal(pthread_create(&o, NULL, observer, NULL), 0);
  for (int i = 0; i < WORKERS; i++) pthread_join(w[i], NULL);
  atomic_store(&stop, 1);
  void *snaps = NULL;
  pthread_join(o, &snaps);
  assert_true((intptr_t)snaps > 0);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
  assert_int_equal(st.reserved_bytes, 0);
  printf("  %ld snapshots taken while running; threads robbed %llu, asked %llu\n", (long)(intptr_t)snaps,
         (unsigned long long)st.threads_stolen, (unsigned long long)st.threads_flushed);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_observe_while_running),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
