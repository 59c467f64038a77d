/* Limits, trimming and the release threshold on the simulated device. The
 * environment (tests/BUILD) sets MAGPIE_SIM_MEMORY=512m and
 * MAGPIE_CONF=limit=25%,release_threshold=16m: magpie may hold 128 MiB and
 * gives back, in the background, what it caches above 16 MiB. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"

#define MiB ((size_t)1 << 20)
#define LIMIT (128 * MiB)
#define THRESHOLD (16 * MiB)

static void sleep_ms(int ms) {
  struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

static void test_limit_caps_reserved(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create();
  void *held[512];
  int n = 0;
  /* Mixed sizes until the limit (not the 512 MiB device) says no. */
  while (n < 512) {
    size_t sz = n % 3 == 0 ? 3 * MiB : 200 * 1024;
    void *p = magpie_malloc_async(sz, s);
    if (p == NULL) break;
    held[n++] = p;
    magpie_stats st;
    assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
    assert_true(st.reserved_bytes <= LIMIT);
  }
  assert_true(n > 0 && n < 512);
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_OUT_OF_MEMORY);
  const char *msg = magpie_last_error_message();
  if (strstr(msg, "limit 134217728 bytes") == NULL) fail_msg("message: %s", msg);
  assert_non_null(strstr(msg, "in use"));
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.limit_bytes, LIMIT);
  assert_true(st.ladder_steps[5] > 0); /* went down the ladder, then failed */
  size_t dev_free = 0, dev_total = 0;
  assert_int_equal(magpie_sim_mem_info(0, &dev_free, &dev_total), MAGPIE_OK);
  assert_true(dev_total - dev_free <= LIMIT);
  /* Free everything with the stream's work pending: a block of most of the
   * limit still comes (the ladder waits for the epochs). */
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(held[i], s), MAGPIE_OK);
  cudaStream_t t = magpie_sim_stream_create();
  void *big = magpie_malloc_async(LIMIT - 16 * MiB, t);
  if (big == NULL) fail_msg("%s", magpie_last_error_message());
  assert_int_equal(magpie_free_async(big, t), MAGPIE_OK);
  /* Past the limit: a clear failure. */
  assert_null(magpie_malloc_async(LIMIT + 2 * MiB, t));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_OUT_OF_MEMORY);
  magpie_sim_stream_synchronize(s);
  magpie_sim_stream_synchronize(t);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(t);
}

static void test_trim_keeps_what_is_asked(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create();
  void *p[40];
  for (int i = 0; i < 40; i++) assert_non_null(p[i] = magpie_malloc_async(i % 2 ? 2 * MiB + 4096 : 100 * 1024, s));
  for (int i = 0; i < 40; i += 2) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  for (int i = 1; i < 20; i += 2) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  magpie_sim_stream_synchronize(s);
  magpie_stats before, after;
  assert_int_equal(magpie_stats_get(0, &before), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 8 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &after), MAGPIE_OK);
  assert_int_equal(after.in_use_bytes, before.in_use_bytes);
  assert_true(after.reserved_bytes - after.in_use_bytes <= 8 * MiB);
  for (int i = 21; i < 40; i += 2) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  magpie_sim_stream_synchronize(s);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &after), MAGPIE_OK);
  assert_int_equal(after.in_use_bytes, 0);
  assert_int_equal(after.reserved_bytes, 0);
  magpie_sim_stream_destroy(s);
}

static void test_release_threshold_in_background(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create();
  void *p[10];
  for (int i = 0; i < 10; i++) assert_non_null(p[i] = magpie_malloc_async(10 * MiB, s));
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.reserved_bytes >= 100 * MiB);
  for (int i = 0; i < 10; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  magpie_sim_stream_synchronize(s);
  /* No call into magpie from here: the background thread gives back what
   * is cached above the threshold. */
  int ok = 0;
  for (int i = 0; i < 100 && !ok; i++) {
    sleep_ms(50);
    assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
    ok = st.reserved_bytes - st.in_use_bytes <= THRESHOLD;
  }
  if (!ok)
    fail_msg("still %zu bytes cached above the %zu-byte threshold", st.reserved_bytes - st.in_use_bytes, THRESHOLD);
  assert_true(st.large_bytes_unmapped > 0);
  magpie_sim_stream_destroy(s);
}

/* magpie_set_limit changes the cap while running: a request that needs
 * more mapped memory than it allows fails naming it, one that fits comes;
 * a cap below the mapping unit or on a device that does not exist is
 * refused and changes nothing. Then magpie_stats_reset_peaks restarts both
 * peaks at the current figures. */
static void test_set_limit_and_reset_peaks(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create();
  void *p[16];
  for (int i = 0; i < 16; i++) assert_non_null(p[i] = magpie_malloc_async(3 * MiB, s));
  for (int i = 0; i < 16; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.peak_in_use_bytes >= 48 * MiB);

  assert_int_equal(magpie_set_limit(0, 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(magpie_last_error_message(), "MiB"));
  assert_int_equal(magpie_set_limit(7, 64 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.limit_bytes, LIMIT);

  /* Like PyTorch's memory fraction, the cap holds when magpie maps memory:
   * what it has mapped may still serve requests. Start from nothing cached. */
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_set_limit(0, 16 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.limit_bytes, 16 * MiB);
  assert_null(magpie_malloc_async(20 * MiB, s));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_OUT_OF_MEMORY);
  if (strstr(magpie_last_error_message(), "limit 16777216 bytes") == NULL) fail_msg("%s", magpie_last_error_message());
  void *q = magpie_malloc_async(8 * MiB, s);
  if (q == NULL) fail_msg("8 MiB under a 16 MiB limit: %s", magpie_last_error_message());
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.reserved_bytes <= 16 * MiB);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);

  /* The cap as a fraction of the device, as PyTorch's memory fraction sets
   * it through its hook: 0 refuses every mapping (what is mapped still
   * serves), 1 is the whole device, anything else is refused. */
  assert_int_equal(magpie_device_count(), 1);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_set_limit_fraction(0, 1.5), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(magpie_last_error_message(), "[0, 1]"));
  assert_int_equal(magpie_set_limit_fraction(1, 0.5), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.limit_bytes, 16 * MiB);
  magpie_torch_set_memory_fraction(0.0, 0);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.limit_bytes > 0 && st.limit_bytes < MiB);
  assert_null(magpie_malloc_async(20 * MiB, s));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_OUT_OF_MEMORY);
  magpie_torch_set_memory_fraction(-0.5, 0); /* refused: the cap stays */
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.limit_bytes > 0 && st.limit_bytes < MiB);
  assert_int_equal(magpie_set_limit_fraction(0, 0.25), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.limit_bytes, 128 * MiB); /* a quarter of MAGPIE_SIM_MEMORY */
  void *r = magpie_malloc_async(20 * MiB, s);
  if (r == NULL) fail_msg("20 MiB under a quarter of the device: %s", magpie_last_error_message());
  assert_int_equal(magpie_free_async(r, s), MAGPIE_OK);
  magpie_sim_stream_synchronize(s);
  magpie_torch_empty_cache(); /* every device: gives back what is cached */
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  if (st.reserved_bytes >= 20 * MiB) fail_msg("%zu bytes reserved after empty_cache", st.reserved_bytes);

  assert_int_equal(magpie_set_limit(0, 0), MAGPIE_OK); /* none */
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.limit_bytes, 0);
  assert_int_equal(magpie_set_limit(0, LIMIT), MAGPIE_OK);

  assert_int_equal(magpie_stats_reset_peaks(7), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_stats_reset_peaks(0), MAGPIE_OK);
  magpie_stats after;
  assert_int_equal(magpie_stats_get(0, &after), MAGPIE_OK);
  assert_true(after.peak_in_use_bytes < 48 * MiB);
  assert_true(after.peak_in_use_bytes >= after.in_use_bytes);
  assert_true(after.peak_reserved_bytes >= after.reserved_bytes);
  assert_true(after.peak_reserved_bytes <= 16 * MiB); /* what was reserved at the reset */
}

static void test_config_errors(void **state) {
  (void)state;
  magpie_config cfg;
  magpie_config_default(&cfg);
  assert_int_equal(magpie_init(&cfg), MAGPIE_ERR_ALREADY_INITIALIZED);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_limit_caps_reserved),
      cmocka_unit_test(test_trim_keeps_what_is_asked),
      cmocka_unit_test(test_release_threshold_in_background),
      cmocka_unit_test(test_config_errors),
      cmocka_unit_test(test_set_limit_and_reset_peaks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
