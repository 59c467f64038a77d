/* The simulated device's stream-order checker (sim/sim_check.c), driven
 * directly through its two allocator hooks with stand-in block addresses
 * (the checker never touches the memory): each case builds one pattern of
 * stream work and says whether handing the block to the next stream must
 * be reported. Every edge CUDA has must clear a use (stream order, stream
 * wait, wait on an event, event query, event / stream / device
 * synchronize, and chains of them), nothing else may (an earlier wait, an
 * event recorded before the use, work that merely finished, a destroyed
 * stream), and partially overlapping blocks are tracked byte-exactly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"
#include "sim/sim_check.h"

static _Alignas(256) char arena[4 << 20]; /* stand-in addresses, never touched */
static _Atomic int ran;

static void mark_ran(void *arg) {
  (void)arg;
  atomic_store_explicit(&ran, 1, memory_order_relaxed);
}

static void *block(int i) { return arena + (size_t)i * 8192; }

/* A use of p on s, then its free on s. */
static void use_and_free(void *p, size_t size, cudaStream_t s) {
  sim_check_handout(p, size, s);
  assert_int_equal(magpie_sim_launch(s, mark_ran, NULL), MAGPIE_OK);
  sim_check_free(p, s);
}

/* How many violations handing p to s adds. */
static uint64_t handout_violations(void *p, size_t size, cudaStream_t s) {
  uint64_t v0 = magpie_sim_check_violations();
  sim_check_handout(p, size, s);
  sim_check_free(p, s); /* leave it freed, with no work after it */
  return magpie_sim_check_violations() - v0;
}

static cudaStream_t mk(void) {
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  return s;
}

static void test_unordered_reuse_is_reported_even_after_the_work_ran(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk();
  atomic_store(&ran, 0);
  use_and_free(block(0), 4096, a);
  /* The work really finished, but nothing told the host or b. */
  while (!atomic_load_explicit(&ran, memory_order_relaxed)) usleep(100);
  usleep(1000);
  assert_int_equal(handout_violations(block(0), 4096, b), 1);
  char msg[512];
  assert_true(magpie_sim_check_message(msg, sizeof msg) > 0);
  assert_non_null(strstr(msg, "stream-order violation"));
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

static void test_same_stream_needs_nothing(void **state) {
  (void)state;
  cudaStream_t a = mk();
  use_and_free(block(1), 4096, a);
  assert_int_equal(handout_violations(block(1), 4096, a), 0);
  magpie_sim_stream_destroy(a);
}

static void test_stream_wait_orders(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk(), c = mk();
  use_and_free(block(2), 4096, a);
  assert_int_equal(magpie_sim_stream_wait(b, a), MAGPIE_OK);
  assert_int_equal(handout_violations(block(2), 4096, b), 0);
  /* Transitive: a -> b -> c. */
  use_and_free(block(3), 4096, a);
  assert_int_equal(magpie_sim_stream_wait(b, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait(c, b), MAGPIE_OK);
  assert_int_equal(handout_violations(block(3), 4096, c), 0);
  /* A wait enqueued before the use covers only the work before it. */
  assert_int_equal(magpie_sim_stream_wait(b, a), MAGPIE_OK);
  use_and_free(block(4), 4096, a);
  assert_int_equal(handout_violations(block(4), 4096, b), 1);
  magpie_sim_device_synchronize();
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(c);
}

static void test_events(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk();
  magpie_sim_event e = magpie_sim_event_create();
  assert_non_null(e);
  /* Wait on an event recorded after the use. */
  use_and_free(block(5), 4096, a);
  assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait_event(b, e), MAGPIE_OK);
  assert_int_equal(handout_violations(block(5), 4096, b), 0);
  /* A query that reports completion. */
  use_and_free(block(6), 4096, a);
  assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
  while (magpie_sim_event_query(e) == MAGPIE_SIM_NOT_READY) usleep(100);
  assert_int_equal(handout_violations(block(6), 4096, b), 0);
  /* Event synchronize. */
  use_and_free(block(7), 4096, a);
  assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(handout_violations(block(7), 4096, b), 0);
  /* An event recorded before the use proves nothing about it. */
  assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
  use_and_free(block(0), 4096, a);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait_event(b, e), MAGPIE_OK);
  assert_int_equal(handout_violations(block(0), 4096, b), 1);
  magpie_sim_event_destroy(e);
  magpie_sim_device_synchronize();
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

static void test_synchronize(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk();
  use_and_free(block(1), 4096, a);
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);
  assert_int_equal(handout_violations(block(1), 4096, b), 0);
  use_and_free(block(2), 4096, a);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(handout_violations(block(2), 4096, b), 0);
  /* Synchronizing another stream does not help. */
  use_and_free(block(3), 4096, a);
  assert_int_equal(magpie_sim_stream_synchronize(b), MAGPIE_OK);
  assert_int_equal(handout_violations(block(3), 4096, b), 1);
  magpie_sim_device_synchronize();
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

/* A stream destroyed with its use pending: its recycled handle names a new
 * stream that is not ordered after it; a device synchronize is. */
static void test_destroyed_stream(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk();
  use_and_free(block(4), 4096, a);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  cudaStream_t a2 = mk();
  assert_ptr_equal(a2, a); /* the handle came back */
  assert_int_equal(handout_violations(block(4), 4096, a2), 1);
  use_and_free(block(5), 4096, b);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(handout_violations(block(5), 4096, a2), 0);
  magpie_sim_stream_destroy(a2);
}

/* Blocks of other shapes over the same bytes: every byte keeps its last
 * use until a later free covers it. */
static void test_overlapping_blocks(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk();
  char *p = block(6);
  use_and_free(p, 8192, a); /* [0, 8192) used on a */
  assert_int_equal(magpie_sim_stream_synchronize(b), MAGPIE_OK);
  /* A smaller block inside, handed to b: reported. */
  assert_int_equal(handout_violations(p + 4096, 256, b), 1);
  /* [4096, 4352) was just freed on b: its use is b's; the rest is still a's. */
  assert_int_equal(handout_violations(p + 4096, 256, b), 0);
  assert_int_equal(handout_violations(p, 256, b), 1);
  assert_int_equal(handout_violations(p + 7936, 256, b), 1);
  /* A block spanning several earlier ones and a 2 MiB chunk boundary. */
  uintptr_t chunk = ((uintptr_t)arena + ((uintptr_t)2 << 20)) & ~(((uintptr_t)2 << 20) - 1);
  char *q = (char *)chunk - 2048;
  use_and_free(q, 4096, a);
  assert_int_equal(handout_violations(q - 512, 8192, b), 1);
  magpie_sim_device_synchronize();
  assert_int_equal(handout_violations(q - 512, 8192, b), 0);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

/* A block recorded on another stream (magpie_record_stream): its free
 * covers that stream's work enqueued before the free too. Handing it to
 * the freeing stream is reported until the recorded stream's work is
 * ordered before it; work recorded streams enqueue after the free does
 * not count; a destroyed recorded stream's last work still does. */
static void test_recorded_streams(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk(), c = mk();
  void *p = block(300);
  sim_check_handout(p, 4096, a);
  assert_int_equal(magpie_sim_launch(b, mark_ran, NULL), MAGPIE_OK); /* b uses p */
  sim_check_record_stream(p, b);
  sim_check_record_stream(p, b); /* twice: one entry */
  sim_check_free(p, a);
  assert_int_equal(magpie_sim_launch(b, mark_ran, NULL), MAGPIE_OK); /* after the free: not a use */
  uint64_t v0 = magpie_sim_check_violations();
  sim_check_handout(p, 4096, a); /* a is ordered after its own use, not b's */
  assert_int_equal(magpie_sim_check_violations() - v0, 1);
  sim_check_free(p, a);
  /* Freed again with no record: only a's work counts now. */
  assert_int_equal(handout_violations(p, 4096, a), 0);

  /* Ordered through a wait on b: no report. */
  void *q = block(302);
  sim_check_handout(q, 4096, a);
  assert_int_equal(magpie_sim_launch(b, mark_ran, NULL), MAGPIE_OK);
  sim_check_record_stream(q, b);
  sim_check_free(q, a);
  assert_int_equal(magpie_sim_stream_wait(c, b), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait(c, a), MAGPIE_OK);
  assert_int_equal(handout_violations(q, 4096, c), 0);

  /* The recorded stream destroyed before the free: its work still counts
   * until the device is synchronised. */
  cudaStream_t d = mk();
  void *r = block(304);
  sim_check_handout(r, 4096, a);
  assert_int_equal(magpie_sim_launch(d, mark_ran, NULL), MAGPIE_OK);
  sim_check_record_stream(r, d);
  assert_int_equal(magpie_sim_stream_destroy(d), MAGPIE_OK);
  sim_check_free(r, a);
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);
  assert_int_equal(handout_violations(r, 4096, c), 1);
  sim_check_free(r, a);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(handout_violations(r, 4096, c), 0);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(c);
}

int main(void) {
  if (magpie_sim_check_enable(1) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_recorded_streams),
      cmocka_unit_test(test_unordered_reuse_is_reported_even_after_the_work_ran),
      cmocka_unit_test(test_same_stream_needs_nothing),
      cmocka_unit_test(test_stream_wait_orders),
      cmocka_unit_test(test_events),
      cmocka_unit_test(test_synchronize),
      cmocka_unit_test(test_destroyed_stream),
      cmocka_unit_test(test_overlapping_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
