/* magpie_record_stream under trims and memory pressure, on the simulated
 * device with limit=64m (tests/BUILD):
 *   - a recorded block freed, its streams done: magpie_trim(0, 0) gives
 *     everything back (trim never polled parked blocks: 18 MiB stayed);
 *   - 60 MiB recorded on a stream busy for 300 ms and freed: a 32 MiB
 *     allocation waits for that stream instead of failing at once (the
 *     ladder did not wait for parked blocks). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <time.h>

#include "magpie.h"
#include "magpie_sim.h"

#define MiB ((size_t)1 << 20)

static void busy_300ms(void *arg) {
  (void)arg;
  struct timespec t = {0, 300 * 1000 * 1000};
  nanosleep(&t, NULL);
}

static void test_trim_gives_back_parked_blocks(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create(), o = magpie_sim_stream_create();
  void *p[12];
  for (int i = 0; i < 12; i++) {
    p[i] = magpie_malloc_async(i % 3 == 0 ? 3 * MiB : (size_t)4096 << (i % 6), s);
    assert_non_null(p[i]);
    assert_int_equal(magpie_record_stream(p[i], o), MAGPIE_OK);
  }
  for (int i = 0; i < 12; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
  assert_int_equal(st.reserved_bytes, 0);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(o), MAGPIE_OK);
}

static void test_pressure_waits_for_parked_blocks(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create(), o = magpie_sim_stream_create();
  void *p[15];
  for (int i = 0; i < 15; i++) {
    p[i] = magpie_malloc_async(4 * MiB, s);
    assert_non_null(p[i]);
    assert_int_equal(magpie_record_stream(p[i], o), MAGPIE_OK);
  }
  assert_int_equal(magpie_sim_launch(o, busy_300ms, NULL), MAGPIE_OK);
  for (int i = 0; i < 15; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  void *big = magpie_malloc_async(32 * MiB, s);
  if (big == NULL) fail_msg("32 MiB failed while 60 MiB waited on a stream: %s", magpie_last_error_message());
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(o), MAGPIE_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_trim_gives_back_parked_blocks),
      cmocka_unit_test(test_pressure_waits_for_parked_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
