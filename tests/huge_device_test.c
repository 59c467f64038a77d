/* A simulated device of 2^62 bytes (MAGPIE_SIM_MEMORY, set by tests/BUILD):
 * the heap's virtual range is four times the device, at most 1 TiB. The
 * product wrapped: UBSan's unsigned-overflow check aborted the process
 * (--config=asan), and elsewhere the range shrank to the 4 GiB floor, so
 * a 6 GiB block could not be had. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"

static void test_huge_device(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  void *small = magpie_malloc_async(100, s);
  assert_non_null(small);
  /* Address space only: the simulator maps device memory without
   * committing host pages, and nothing here touches the block. */
  void *big = magpie_malloc_async((size_t)6 << 30, s);
  assert_non_null(big);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(small, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_huge_device),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
