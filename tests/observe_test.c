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
#include <time.h>

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

/* Trims in other threads while snapshots are written: a snapshot wrote a
 * slab's fields after dropping the lock that keeps slabs from being given
 * back, and a descriptor released and reused for another class meanwhile
 * (51 blocks where the state array had room for 19) crashed the writer.
 * Each slab in each snapshot must describe one class consistently. */
#define TRIMMERS 3

static void *trimmer(void *arg) {
  uint64_t seed = 0x7A11ull * (uint64_t)((intptr_t)arg + 3);
  cudaStream_t s = magpie_sim_stream_create();
  void *p[64];
  while (!atomic_load(&stop)) {
    for (int i = 0; i < 64; i++) {
      unsigned cls = (unsigned)(rng(&seed) % 40);
      p[i] = magpie_malloc_async(magpie_size_class_size(cls), s);
      assert_non_null(p[i]);
    }
    for (int i = 0; i < 64; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
    magpie_sim_stream_synchronize(s);
    assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  }
  magpie_sim_stream_destroy(s);
  return NULL;
}

static void check_snapshot_slabs(const jm *snap) {
  const jm *segs = jm_get(snap, "segments");
  assert_non_null(segs);
  for (size_t i = 0; i < segs->n; i++) {
    const jm *sg = segs->kids[i];
    if (strcmp(jm_str(sg, "kind"), "slab") != 0) continue;
    unsigned long long bs = jm_num(sg, "block_size"), nb = jm_num(sg, "blocks");
    assert_int_equal(bs, magpie_size_class_size((unsigned)jm_num(sg, "class")));
    assert_true(nb * bs <= jm_num(sg, "size"));
    const jm *runs = jm_get(sg, "runs");
    unsigned long long sum = 0;
    for (size_t r = 0; runs && r < runs->n; r++) sum += runs->kids[r]->kids[1]->num;
    assert_int_equal(sum, nb);
  }
}

static void test_snapshot_while_others_trim(void **state) {
  (void)state;
  atomic_store(&stop, 0);
  pthread_t t[TRIMMERS];
  for (intptr_t i = 0; i < TRIMMERS; i++) assert_int_equal(pthread_create(&t[i], NULL, trimmer, (void *)i), 0);
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int snaps = 0;
  do {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(magpie_snapshot_json(0, f), MAGPIE_OK);
    fclose(f);
    const jm *snap = jm_parse(buf);
    assert_non_null(snap);
    check_snapshot_slabs(snap);
    free(buf);
    snaps++;
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while (now.tv_sec - t0.tv_sec < 2);
  atomic_store(&stop, 1);
  for (int i = 0; i < TRIMMERS; i++) pthread_join(t[i], NULL);
  printf("  %d snapshots taken while %d threads trimmed\n", snaps, TRIMMERS);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_observe_while_running),
      cmocka_unit_test(test_snapshot_while_others_trim),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
