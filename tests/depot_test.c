/* Magazines and the depot (src/pool/magazine.c, src/pool/depot.c)
 * against the deterministic fake device (fake_backend.c), through their
 * internal interface: sealed magazines pending until their epoch, taken
 * back by their own stream at once, by another after the epoch or through
 * a stream wait. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "base/sizeclass.h"
#include "heap/heap.h"
#include "magpie.h"
#include "pool/depot.h"
#include "pool/epoch.h"
#include "pool/magazine.h"
#include "tests/fake_backend.h"

/* Two fake streams of device 0 with their ids, and A's stream record
 * (the caller releases it). */
static stream_rec *two_streams(heap *h, cudaStream_t *a, cudaStream_t *b, uint64_t *ida, uint64_t *idb) {
  *a = fake_stream_create(0);
  *b = fake_stream_create(0);
  assert_int_equal(fake_backend()->stream_id(*a, ida), MAGPIE_OK);
  assert_int_equal(fake_backend()->stream_id(*b, idb), MAGPIE_OK);
  return epoch_stream_acquire(&h->epochs, *ida);
}

/* A magazine of class cls holding n fake blocks at addr (never
 * dereferenced; n at most its capacity), sealed on stream s (record r) and
 * put in the depot, where it is pending. */
static magazine *put_pending(heap *h, unsigned cls, stream_rec *r, cudaStream_t s, uint32_t n, uintptr_t addr) {
  magazine *m = magazine_get_empty(cls);
  assert_non_null(m);
  while (m->count < n && m->count < m->cap) m->slots[m->count++] = (void *)addr;
  assert_int_equal(epoch_seal(r, s, &m->ticket), MAGPIE_OK);
  depot_put(&h->depots[m->cls], m);
  return m;
}

/* Magazines: capacity by class, empties recycled. The depot: a magazine
 * sealed by stream A is pending; A takes it back at once, another stream
 * only after A's epoch completed; an unsealed one goes to anyone. */
static void test_magazine_and_depot(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  unsigned cls = sizeclass_of(200000); /* a class no other test uses */
  magazine *m = magazine_get_empty(cls);
  assert_non_null(m);
  assert_int_equal(m->count, 0);
  assert_int_equal(m->cap, sizeclass_table[cls].mag_cap);
  assert_int_equal(m->cls, cls);
  magazine_put_empty(m);
  magazine *again = magazine_get_empty(cls);
  assert_ptr_equal(again, m); /* LIFO reuse of empties */

  cudaStream_t a, b;
  uint64_t ida, idb;
  stream_rec *ra = two_streams(h, &a, &b, &ida, &idb);
  m->slots[m->count++] = (void *)0x1000; /* never dereferenced */
  assert_int_equal(epoch_seal(ra, a, &m->ticket), MAGPIE_OK);
  depot_put(&h->depots[m->cls], m);
  assert_null(depot_take(&h->depots[cls], idb));         /* A's work may be running */
  assert_ptr_equal(depot_take(&h->depots[cls], ida), m); /* A itself: at once */
  assert_null(m->ticket.rec);                            /* handed over without a ticket */

  assert_int_equal(epoch_seal(ra, a, &m->ticket), MAGPIE_OK);
  depot_put(&h->depots[m->cls], m);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  fake_stream_complete(a);
  assert_ptr_equal(depot_take(&h->depots[cls], idb), m); /* A completed: B may */
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.cross_stream_migrations, st0.cross_stream_migrations + 1);

  depot_put(&h->depots[m->cls], m); /* no ticket: ready for anyone */
  assert_ptr_equal(depot_take(&h->depots[cls], EPOCH_NO_STREAM), m);
  assert_null(depot_take(&h->depots[cls], idb));
  m->count = 0;
  magazine_put_empty(m);
  epoch_stream_release(ra);
}

/* The depot's pending list is a LIFO: a taker looks at the newest few
 * magazines one at a time, then sweeps the whole list, so an older
 * magazine whose epoch completed is found under newer pending ones. */
static void test_depot_finds_old_ready_magazine(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  unsigned cls = sizeclass_of(180000); /* a class no other test uses */
  cudaStream_t a, b;
  uint64_t ida, idb;
  stream_rec *ra = two_streams(h, &a, &b, &ida, &idb);
  enum { NEWER = 12 };
  magazine *old = put_pending(h, cls, ra, a, 1, 0x1000);
  fake_stream_complete(a); /* old's epoch is over */
  for (int i = 0; i < NEWER; i++) put_pending(h, cls, ra, a, 1, 0x2000);
  assert_ptr_equal(depot_take(&h->depots[cls], idb), old); /* under 12 pending ones */
  assert_null(old->ticket.rec);
  assert_null(depot_take(&h->depots[cls], idb)); /* the rest still run on A */
  /* Every newer one is still there, and A takes each back at once. */
  int back = 0;
  for (magazine *m; (m = depot_take(&h->depots[cls], ida)) != NULL; back++) {
    assert_null(m->ticket.rec);
    m->count = 0;
    magazine_put_empty(m);
  }
  assert_int_equal(back, NEWER);
  old->count = 0;
  magazine_put_empty(old);
  epoch_stream_release(ra);
}

/* Small blocks still running on another stream: depot_take_waiting hands
 * one over by making the allocating stream wait on its event (no host
 * wait); a refill does so only under pressure. */
static void test_depot_reuse_through_stream_wait(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  assert_int_equal(h->reuse_wait, 1); /* the default */
  unsigned cls = sizeclass_of(20000); /* a slab class no other test uses */
  cudaStream_t a, b;
  uint64_t ida, idb;
  stream_rec *ra = two_streams(h, &a, &b, &ida, &idb);

  /* Direct: one pending magazine, taken by B through a wait. */
  magazine *m = put_pending(h, cls, ra, a, 1, 0x1000);
  fake_counters c0, c1;
  magpie_stats st0, st1;
  fake_get_counters(&c0);
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_null(depot_take(&h->depots[cls], idb));
  assert_ptr_equal(depot_take_waiting(&h->depots[cls], h->ops, idb, b), m);
  assert_null(m->ticket.rec);
  fake_get_counters(&c1);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(c1.stream_waits, c0.stream_waits + 1);
  assert_int_equal(c1.event_syncs, c0.event_syncs); /* no host wait */
  assert_int_equal(st1.stream_waits, st0.stream_waits + 1);
  assert_null(depot_take_waiting(&h->depots[cls], h->ops, idb, b)); /* nothing pending */
  m->count = 0;
  magazine_put_empty(m);

  /* A refill with room on the device maps rather than tie B to A (the
   * pressure case is test_memory_pressure's). */
  m = put_pending(h, cls, ra, a, UINT32_MAX, 0x2000); /* full */
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  magazine *fresh = NULL;
  assert_int_equal(heap_refill(h, cls, 0, idb, b, 0, &fresh), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.slab_count, st0.slab_count + 1);
  assert_int_equal(st1.stream_waits, st0.stream_waits);
  assert_ptr_not_equal(fresh, m);
  depot_put(&h->depots[fresh->cls], fresh);
  fake_stream_complete(a);
  /* Take the fake blocks back out; the slab's own magazines stay. */
  enum { MAX = 64 };
  magazine *keep[MAX];
  int nkeep = 0, fakes = 0;
  for (magazine *r; (r = depot_take(&h->depots[cls], idb)) != NULL;) {
    if (r->slots[0] == (void *)0x2000) {
      fakes++;
      r->count = 0;
      magazine_put_empty(r);
    } else {
      assert_true(nkeep < MAX);
      keep[nkeep++] = r;
    }
  }
  assert_int_equal(fakes, 1);
  for (int i = 0; i < nkeep; i++) depot_put(&h->depots[keep[i]->cls], keep[i]);
  epoch_stream_release(ra);
}

int main(void) {
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_magazine_and_depot),
      cmocka_unit_test(test_depot_finds_old_ready_magazine),
      cmocka_unit_test(test_depot_reuse_through_stream_wait),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
