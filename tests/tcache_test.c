/* The thread cache (src/front/tcache.c) against the deterministic fake
 * device (fake_backend.c), through the public API and the calling
 * thread's slots: magazine capacity per slot and class, and the outbox
 * whose full magazines are sealed together. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "base/sizeclass.h"
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
 * together: one event for TCACHE_OUTBOX of them (small blocks, far below
 * TCACHE_OUTBOX_BYTES). Until the freeing stream's work completes,
 * another stream gets none of their blocks. */
enum { OUTBOX_BLOCKS = 4000 };
static void test_outbox_seals_together(void **state) {
  (void)state;
  const size_t size = 700; /* 768 B: a class no other test here uses */
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  void **p = calloc(OUTBOX_BLOCKS, sizeof *p);
  assert_non_null(p);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  magpie_stats st0, st;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  int freed = 0;
  for (; freed < OUTBOX_BLOCKS; freed++) {
    assert_int_equal(magpie_free_async(p[freed], s), MAGPIE_OK);
    assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
    if (st.events_recorded != st0.events_recorded) break;
  }
  assert_true(freed < OUTBOX_BLOCKS);
  freed++;
  /* One seal, and it sent a whole outbox to the depot. */
  assert_int_equal(st.events_recorded, st0.events_recorded + 1);
  assert_int_equal(st.depot_exchanges, st0.depot_exchanges + TCACHE_OUTBOX);
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
}

/* Before a slot takes memory from what threads share (here a refill of
 * another class), its outbox is sealed and goes to the depot, where its
 * slabs can serve others: one event for all of it. */
static void test_outbox_sealed_before_refill(void **state) {
  (void)state;
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
  assert_int_equal(ts->nout, 0);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  for (int i = freed; i < OUTBOX_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  fake_stream_complete(s);
  free(p);
}

int main(void) {
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_magazine_capacity_adapts),
      cmocka_unit_test(test_magazine_capacity_bursts),
      cmocka_unit_test(test_outbox_seals_together),
      cmocka_unit_test(test_outbox_sealed_before_refill),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
