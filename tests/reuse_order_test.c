/* The allocator on the simulated device with the stream-order checker on:
 * two deterministic scenarios where a block freed on one stream is wanted
 * by another, each of which a broken allocator gets wrong on every run.
 *   - cross-stream reuse: blocks used and freed on A leave the thread in
 *     sealed magazines; B then allocates the same size. Reuse is correct
 *     only after magpie has seen A's event complete. A's work has already
 *     run when B allocates (the test spins on a flag the work sets, which
 *     is no CUDA edge), so only the checker's vector clocks can tell an
 *     allocator that queried the event from one that did not.
 *   - handle reuse: blocks used and freed on stream A, A destroyed with its
 *     work pending, a new stream gets A's handle value and allocates. Its
 *     id differs, so it must not receive A's cached blocks.
 * tests/BUILD also builds this test against deliberately broken libraries
 * (epoch check disabled; stream identity ignored on handle reuse) and
 * expects it to fail there. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"
#include "tests/checker_util.h"

#define N 400
#define SIZE 4096

static _Atomic int ran;
static _Atomic int gate_open;

static void set_ran(void *arg) {
  (void)arg;
  atomic_store_explicit(&ran, 1, memory_order_relaxed);
}

/* Holds its stream until the test opens the gate. */
static void gate(void *arg) {
  (void)arg;
  while (!atomic_load_explicit(&gate_open, memory_order_relaxed)) usleep(200);
}

static void test_cross_stream_reuse(void **state) {
  (void)state;
  uint64_t v0 = magpie_sim_check_violations();
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  assert_non_null(a);
  assert_non_null(b);
  /* The thread allocates on both streams from the start: on A alone its
   * outbox would keep A's blocks in the thread (src/tcache/tslot.h). */
  void *first = magpie_malloc_async(SIZE, b);
  assert_non_null(first);
  assert_int_equal(magpie_free_async(first, b), MAGPIE_OK);
  void *p[N];
  for (int i = 0; i < N; i++) assert_non_null(p[i] = magpie_malloc_async(SIZE, a));
  atomic_store(&ran, 0);
  assert_int_equal(magpie_sim_launch(a, set_ran, NULL), MAGPIE_OK); /* "uses" every block */
  for (int i = 0; i < N; i++) assert_int_equal(magpie_free_async(p[i], a), MAGPIE_OK);
  while (!atomic_load_explicit(&ran, memory_order_relaxed)) usleep(100);
  void *q[N];
  int from_a = 0;
  for (int i = 0; i < N; i++) {
    assert_non_null(q[i] = magpie_malloc_async(SIZE, b));
    for (int k = 0; k < N; k++) from_a += q[i] == p[k];
  }
  print_message("blocks of A reused by B: %d of %d\n", from_a, N);
  for (int i = 0; i < N; i++) assert_int_equal(magpie_free_async(q[i], b), MAGPIE_OK);
  checker_expect_none(v0);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

static void test_handle_reuse(void **state) {
  (void)state;
  uint64_t v0 = magpie_sim_check_violations();
  cudaStream_t a = magpie_sim_stream_create();
  assert_non_null(a);
  void *p[16];
  for (int i = 0; i < 16; i++) assert_non_null(p[i] = magpie_malloc_async(SIZE, a));
  atomic_store(&gate_open, 0);
  assert_int_equal(magpie_sim_launch(a, gate, NULL), MAGPIE_OK);
  for (int i = 0; i < 16; i++) assert_int_equal(magpie_free_async(p[i], a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK); /* work still pending */
  cudaStream_t a2 = magpie_sim_stream_create();
  assert_ptr_equal(a2, a); /* same handle value, new stream */
  void *q[16];
  int old = 0;
  for (int i = 0; i < 16; i++) {
    assert_non_null(q[i] = magpie_malloc_async(SIZE, a2));
    for (int k = 0; k < 16; k++) old += q[i] == p[k];
  }
  print_message("blocks of the destroyed stream handed to the new one: %d\n", old);
  atomic_store(&gate_open, 1);
  for (int i = 0; i < 16; i++) assert_int_equal(magpie_free_async(q[i], a2), MAGPIE_OK);
  checker_expect_none(v0);
  assert_int_equal(old, 0);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a2);
}

int main(void) {
  if (checker_init() != 0) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cross_stream_reuse),
      cmocka_unit_test(test_handle_reuse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
