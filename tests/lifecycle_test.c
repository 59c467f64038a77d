/* Regression tests of the process's life through the public API on the
 * simulated device (MAGPIE_BACKEND=sim, set by tests/BUILD): queries
 * answered before set-up, configuration mistakes, a library unloaded and
 * loaded again. Each case failed before its fix. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <string.h>

#include "magpie.h"
#include "magpie_sim.h"

#define MiB ((size_t)1 << 20)

/* Runs first, before anything sets magpie up: the size classes follow from
 * a formula and need no device (it returned 0 for every class). */
static void test_size_class_size_before_init(void **state) {
  (void)state;
  assert_int_equal(magpie_size_class_size(0), 256);
  assert_int_equal(magpie_size_class_size(3), 1024);
  assert_int_equal(magpie_size_class_size(4), 1280);
  assert_int_equal(magpie_size_class_size(43), MiB);
  assert_int_equal(magpie_size_class_size(44), 0);
  assert_int_equal(magpie_size_class_size(UINT32_MAX), 0);
  /* The same as the table set-up fills in. */
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  for (unsigned i = 0; i < 44; i++) {
    void *p = magpie_malloc_async(magpie_size_class_size(i), s);
    assert_non_null(p);
    assert_int_equal(magpie_usable_size(p), magpie_size_class_size(i));
    assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  }
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_size_class_size_before_init),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
