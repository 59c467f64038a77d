/* The thread cache (src/front/tcache.c) against the deterministic fake
 * device (fake_backend.c), through the public API and the calling
 * thread's slots: magazine capacity per slot and class, the outbox whose
 * full magazines are sealed together, and what a slot caches going back
 * before an allocation would map. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "base/sizeclass.h"
#include "heap/heap.h"
#include "magpie.h"
#include "tcache/tcache.h"
#include "tests/fake_backend.h"
#include "tests/tcache_util.h"

/* Magazine capacity per slot and class: it starts at mag_cap; a slot whose
 * blocks only flow out (frees, no allocations in between) grows it to
 * mag_max; a random walk brings it back. */
static void test_magazine_capacity_adapts(void **state) {
  (void)state;
  unsigned cls = sizeclass_of(30000); /* 32 KiB class, the largest with slabs */
  const sizeclass_info *ci = &sizeclass_table[cls];
  assert_int_equal(ci->mag_cap, 6); /* cbrt(2^23 / 32 KiB) */
  assert_true(ci->mag_max > ci->mag_cap);
  cudaStream_t s = fake_stream_create(0);
  enum { N = 256 };
  void *p[N];
  for (int i = 0; i < N; i++) assert_non_null(p[i] = magpie_malloc_async(30000, s));
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_int_equal(ts->cap[cls], ci->mag_cap);
  for (int i = 0; i < N; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  /* Only frees since the last exchange: the flow grew the capacity. */
  assert_int_equal(ts->cap[cls], ci->mag_max);
  assert_int_equal(ts->cl[cls].loaded->cap, ci->mag_max);
  /* A random walk (many allocations between two exchanges) shrinks it. */
  int live = 0;
  uint64_t r = 12345;
  for (int step = 0; step < 20000; step++) {
    r ^= r << 13; /* xorshift: no wrapping arithmetic (UBSan checks it) */
    r ^= r >> 7;
    r ^= r << 17;
    if ((live < N && (r >> 33) % 2 == 0) || live == 0) {
      assert_non_null(p[live++] = magpie_malloc_async(30000, s));
    } else {
      assert_int_equal(magpie_free_async(p[--live], s), MAGPIE_OK);
    }
  }
  assert_true(ts->cap[cls] < ci->mag_max);
  assert_true(ts->cap[cls] >= ci->mag_cap);
  while (live > 0) assert_int_equal(magpie_free_async(p[--live], s), MAGPIE_OK);
  fake_stream_complete(s);
}

/* Blocks that come and go in bursts shorter than a run of outflow keep
 * the starting capacity, though each burst of frees fills magazines with
 * no allocation between (a rule that grew on that held a slab per thread
 * and class in workload 2). */
static void test_magazine_capacity_bursts(void **state) {
  (void)state;
  /* A class no other test here uses: its magazines all start at mag_cap
   * (a magazine keeps the capacity it was made with). */
  unsigned cls = sizeclass_of(45000); /* 48 KiB */
  const sizeclass_info *ci = &sizeclass_table[cls];
  assert_int_equal(ci->mag_cap, 5);
  cudaStream_t s = fake_stream_create(0);
  enum { BURST = 4 * 5 }; /* four magazines of 5, under a run of 32 */
  void *p[BURST];
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  for (int round = 0; round < 50; round++) {
    for (int i = 0; i < BURST; i++) assert_non_null(p[i] = magpie_malloc_async(45000, s));
    for (int i = 0; i < BURST; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  }
  /* The bursts did overflow both magazines: full ones left them, into the
   * outbox (the allocations of the next burst took them back) or sealed. */
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_true(ts->nout > 0 || st1.events_recorded > st0.events_recorded);
  assert_int_equal(ts->cap[cls], ci->mag_cap);
  fake_stream_complete(s);
}

/* Full magazines leaving a thread wait in its outbox and are sealed
 * together: one event for TCACHE_OUTBOX_FEW of them on a thread that
 * allocates on several streams (small blocks, far below
 * TCACHE_OUTBOX_FEW_BYTES), TCACHE_OUTBOX on a thread on one stream.
 * Until the freeing stream's work completes, another stream gets none of
 * their blocks. */
enum { OUTBOX_BLOCKS = 8000 };
static void *outbox_seals_together_main(void *arg) {
  int several = arg != NULL;
  const size_t size = several ? 700 : 1000; /* 768 B, 1 KiB: classes no other test here uses */
  unsigned per_seal = several ? TCACHE_OUTBOX_FEW : TCACHE_OUTBOX;
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  if (several) {
    void *first = magpie_malloc_async(size, t);
    assert_non_null(first);
    assert_int_equal(magpie_free_async(first, t), MAGPIE_OK);
  }
  void **p = calloc(OUTBOX_BLOCKS, sizeof *p);
  assert_non_null(p);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  magpie_stats st0, st;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  /* The class's own depot: the maintenance thread may move other threads'
   * magazines out of limbo into the depots meanwhile (the first run's
   * thread exited just before the second run). */
  depot *d = &heap_get(0)->depots[sizeclass_of(size)];
  uint64_t exchanges0 = atomic_load_relaxed(&d->exchanges);
  int freed = 0;
  for (; freed < OUTBOX_BLOCKS; freed++) {
    assert_int_equal(magpie_free_async(p[freed], s), MAGPIE_OK);
    assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
    if (st.events_recorded != st0.events_recorded) break;
  }
  assert_true(freed < OUTBOX_BLOCKS);
  freed++;
  /* One seal, and it sent a whole outbox to the class's depot. */
  assert_int_equal(st.events_recorded, st0.events_recorded + 1);
  assert_int_equal(atomic_load_relaxed(&d->exchanges), exchanges0 + per_seal);
  assert_true((size_t)freed * sizeclass_table[sizeclass_of(size)].size < TCACHE_OUTBOX_FEW_BYTES * (several ? 1 : 8));
  /* s is still running: t must not reuse what s freed. */
  for (int k = 0; k < 256; k++) {
    void *q = magpie_malloc_async(size, t);
    assert_non_null(q);
    for (int i = 0; i < freed; i++) assert_ptr_not_equal(q, p[i]);
    assert_int_equal(magpie_free_async(q, t), MAGPIE_OK);
  }
  for (int i = freed; i < OUTBOX_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
  free(p);
  return NULL;
}

static void test_outbox_seals_together(void **state) {
  (void)state;
  run_in_thread(outbox_seals_together_main, (void *)1); /* several streams */
  run_in_thread(outbox_seals_together_main, NULL);      /* one */
}

/* A refill (here of another class) takes from what threads share and
 * leaves the outbox as it was, with no event; the outbox's own class takes
 * its magazine back. */
static void *outbox_kept_across_refills_main(void *arg) {
  (void)arg;
  const size_t a = 1400, b = 2900; /* classes no other test here uses */
  cudaStream_t s = fake_stream_create(0);
  void **p = calloc(OUTBOX_BLOCKS, sizeof *p);
  assert_non_null(p);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(a, s));
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  int freed = 0;
  while (freed < OUTBOX_BLOCKS && ts->nout == 0) assert_int_equal(magpie_free_async(p[freed++], s), MAGPIE_OK);
  assert_int_equal(ts->nout, 1);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *q = magpie_malloc_async(b, s);
  assert_non_null(q);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(ts->nout, 1);
  assert_int_equal(st1.events_recorded, st0.events_recorded);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  /* The outbox's magazine comes back once loaded and prev ran out. */
  for (int i = 0; i < freed; i++) assert_non_null(p[i] = magpie_malloc_async(a, s));
  assert_int_equal(ts->nout, 0);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  fake_stream_complete(s);
  free(p);
  return NULL;
}

static void test_outbox_kept_across_refills(void **state) {
  (void)state;
  run_in_thread(outbox_kept_across_refills_main, NULL);
}

/* Before an allocation of a slot would map device memory, what the slot
 * caches goes back under one seal (tcache_own_out): here three kept large
 * blocks (fewer than TCACHE_KEEP_MISS, so a request none fits leaves them
 * kept), which coalesce and serve the request that none of them fits, with
 * no memory mapped. */
static void *caches_go_before_map_main(void *arg) {
  (void)arg;
  const size_t MiB = (size_t)1 << 20;
  cudaStream_t s = fake_stream_create(0);
  char *p[3];
  for (int i = 0; i < 3; i++) assert_non_null(p[i] = magpie_malloc_async(2 * MiB, s));
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  for (int i = 0; i < 3; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded);
  assert_int_equal(st1.thread_cached_bytes - st0.thread_cached_bytes, 6 * MiB);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_int_equal(ts->nkeep, 3);
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  char *q = magpie_malloc_async(6 * MiB, s);
  assert_non_null(q);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(ts->nkeep, 0);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  assert_int_equal(st1.reserved_bytes, st0.reserved_bytes);
  assert_true(q >= p[0] && q < p[0] + 6 * MiB);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  fake_stream_complete(s);
  return NULL;
}

static void test_caches_go_before_map(void **state) {
  (void)state;
  run_in_thread(caches_go_before_map_main, NULL);
}

/* The peak in use never passes what was in use: a thread's fall below
 * TCACHE_PUBLISH_DOWN is not published yet, so the heap's count stays
 * above what is in use; another thread's rise that takes the count past
 * the peak raises the peak to the threads' own counts, not to the count. */
static pthread_barrier_t peak_barrier;

static void *peak_faller_main(void *arg) {
  (void)arg;
  const size_t MiB = (size_t)1 << 20;
  cudaStream_t s = fake_stream_create(0);
  void *p = magpie_malloc_async(3 * MiB + MiB / 2, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK); /* kept: a fall of 3.5 MiB, not published */
  pthread_barrier_wait(&peak_barrier);                  /* the riser runs */
  pthread_barrier_wait(&peak_barrier);                  /* it is done: this thread may exit */
  fake_stream_complete(s);
  return NULL;
}

static void test_peak_never_passes_in_use(void **state) {
  (void)state;
  const size_t MiB = (size_t)1 << 20;
  magpie_stats st;
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  size_t base = st.in_use_bytes;
  assert_int_equal(magpie_stats_reset_peaks(0), MAGPIE_OK);
  assert_int_equal(pthread_barrier_init(&peak_barrier, NULL, 2), 0);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, peak_faller_main, NULL), 0);
  pthread_barrier_wait(&peak_barrier);
  cudaStream_t s = fake_stream_create(0);
  void *q = magpie_malloc_async(3 * MiB, s); /* the count: 6.5 MiB above base; in use: 3 MiB */
  assert_non_null(q);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.peak_in_use_bytes <= base + 3 * MiB + MiB / 2);
  assert_true(st.peak_in_use_bytes >= base + 3 * MiB);
  pthread_barrier_wait(&peak_barrier);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(pthread_barrier_destroy(&peak_barrier), 0);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  fake_stream_complete(s);
}

int main(void) {
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_magazine_capacity_adapts), cmocka_unit_test(test_magazine_capacity_bursts),
      cmocka_unit_test(test_outbox_seals_together),    cmocka_unit_test(test_outbox_kept_across_refills),
      cmocka_unit_test(test_caches_go_before_map),     cmocka_unit_test(test_peak_never_passes_in_use),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
