/* Checked mode (MAGPIE_CONF=check=1): double frees are detected and leave
 * the allocator consistent. Runs against the fake device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "front/init.h"
#include "magpie.h"
#include "tests/fake_backend.h"

static void test_double_free_small(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  void *p = magpie_malloc_async(777, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_ERR_DOUBLE_FREE);
  assert_non_null(strstr(magpie_last_error_message(), "double free"));
  /* The block was cached once, so it comes back once. */
  void *q = magpie_malloc_async(777, s);
  void *r = magpie_malloc_async(777, s);
  assert_ptr_equal(q, p);
  assert_ptr_not_equal(r, p);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(r, s), MAGPIE_OK);
}

static void test_double_free_other_thread_stream(void **state) {
  (void)state;
  cudaStream_t a = fake_stream_create(0), b = fake_stream_create(0);
  void *p = magpie_malloc_async(5000, a);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, b), MAGPIE_ERR_DOUBLE_FREE);
}

static void test_many_blocks_round_trip(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  static void *p[2000];
  for (int i = 0; i < 2000; i++) assert_non_null(p[i] = magpie_malloc_async(256 + (size_t)(i % 7) * 300, s));
  for (int i = 0; i < 2000; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  for (int i = 0; i < 2000; i += 3) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_ERR_DOUBLE_FREE);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
}

/* record_stream on a block already freed is refused: small, and a class
 * block of a segment (issue: it returned 0, and a later owner of the block
 * inherited the record). */
static void test_record_stream_on_freed_block(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  size_t sizes[] = {900, 100 * 1024};
  for (int k = 0; k < 2; k++) {
    void *p = magpie_malloc_async(sizes[k], s);
    assert_non_null(p);
    assert_int_equal(magpie_record_stream(p, t), MAGPIE_OK);
    assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
    fake_stream_complete(s);
    fake_stream_complete(t);
    void *q = magpie_malloc_async(sizes[k] + 1, s);
    assert_non_null(q);
    assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
    assert_int_equal(magpie_record_stream(q, t), MAGPIE_ERR_INVALID_POINTER);
    assert_non_null(strstr(magpie_last_error_message(), "free"));
  }
}

int main(void) {
  if (fake_magpie_init(1) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_double_free_small),
      cmocka_unit_test(test_double_free_other_thread_stream),
      cmocka_unit_test(test_many_blocks_round_trip),
      cmocka_unit_test(test_record_stream_on_freed_block),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
