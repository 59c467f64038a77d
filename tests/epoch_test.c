/* Epochs (src/pool/epoch.c) against the deterministic fake device
 * (fake_backend.c), through their internal interface: seals on one
 * stream, their queries, and the references of tickets, records and
 * event nodes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "heap/heap.h"
#include "magpie.h"
#include "pool/epoch.h"
#include "tests/fake_backend.h"

/* Events on one stream complete in order: once one ticket's event is seen
 * complete, earlier tickets of that stream are complete by comparison, with
 * no further query. Same-stream reuse needs no query at all. */
static void test_epoch_ordering(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  uint64_t sid = 0;
  assert_int_equal(fake_backend()->stream_id(s, &sid), MAGPIE_OK);
  heap *h = heap_get(0);
  assert_non_null(h);
  stream_rec *r = epoch_stream_acquire(&h->epochs, sid);
  assert_non_null(r);
  epoch_ticket t[3];
  for (int i = 0; i < 3; i++) assert_int_equal(epoch_seal(r, s, &t[i]), MAGPIE_OK);
  assert_true(t[0].seq < t[1].seq && t[1].seq < t[2].seq);
  fake_counters c0, c1;
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[0], sid), EPOCH_READY_SAME);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries);
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[2], EPOCH_NO_STREAM), EPOCH_PENDING);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries + 1); /* t[2] is the newest seal */
  /* Only t[0]'s work completes: the newest seal is still pending, and the
   * ticket's own event decides. */
  assert_int_equal(fake_backend()->event_synchronize(t[0].ev->ev), MAGPIE_OK);
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[0], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries + 2);
  assert_int_equal(atomic_load(&r->done), t[0].seq);
  assert_int_equal(epoch_ready(&t[1], EPOCH_NO_STREAM), EPOCH_PENDING);
  fake_stream_complete(s);
  /* One query, of the newest seal, vouches for every ticket of the stream. */
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[1], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  assert_int_equal(atomic_load(&r->done), t[2].seq);
  assert_int_equal(epoch_ready(&t[2], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  assert_int_equal(epoch_ready(&t[0], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries + 1);
  /* Event references: each ticket holds its own; the record holds the
   * newest seal's until it goes, and then the pool has them all back. */
  event_node *newest = t[2].ev, *older = t[0].ev;
  assert_int_equal(atomic_load(&newest->refs), 2);
  assert_int_equal(atomic_load(&older->refs), 1);
  assert_int_equal(atomic_load(&r->refs), 4);
  int64_t pooled = stack_count(&h->epochs.free_events);
  for (int i = 0; i < 3; i++) epoch_ticket_release(&t[i]);
  assert_int_equal(atomic_load(&r->refs), 1);
  assert_int_equal(atomic_load(&newest->refs), 1);
  assert_int_equal(stack_count(&h->epochs.free_events), pooled + 2);
  int64_t live = atomic_load(&h->epochs.live_records);
  epoch_stream_release(r);
  assert_int_equal(atomic_load(&h->epochs.live_records), live - 1);
  assert_int_equal(atomic_load(&newest->refs), 0);
  assert_int_equal(stack_count(&h->epochs.free_events), pooled + 3);
}

int main(void) {
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_epoch_ordering),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
