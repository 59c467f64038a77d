/* Bad input on the simulated device, one case per test: each asserts the
 * exact error code, a message that says what to do, and that nothing changed
 * (bytes in use, reserved bytes equal to device memory in use, no
 * stream-order violation) and the next valid operation succeeds. Runs with
 * check=1 (double frees of small blocks detected) and check_streams=1. */
#include <fcntl.h>
#include <setjmp.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"

extern char **environ;

static cudaStream_t s;
static magpie_stats before;

static void snap(void) { assert_int_equal(magpie_stats_get(0, &before), MAGPIE_OK); }

/* Nothing changed, and the allocator still works on s. */
static void consistent(void) {
  magpie_stats now;
  size_t dev_free, dev_total;
  assert_int_equal(magpie_stats_get(0, &now), MAGPIE_OK);
  assert_int_equal(now.in_use_bytes, before.in_use_bytes);
  assert_int_equal(magpie_sim_mem_info(0, &dev_free, &dev_total), MAGPIE_OK);
  assert_int_equal(now.reserved_bytes, dev_total - dev_free);
  void *p = magpie_malloc_async(1000, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_check_violations(), 0);
}

static void expect_error(int rc, int code, const char *text) {
  assert_int_equal(rc, code);
  assert_int_equal(magpie_last_error(), code);
  const char *m = magpie_last_error_message();
  if (strstr(m, text) == NULL) print_error("message \"%s\" lacks \"%s\"\n", m, text);
  assert_non_null(strstr(m, text));
}

static void test_free_foreign_pointer(void **state) {
  (void)state;
  snap();
  int local;
  expect_error(magpie_free_async(&local, s), MAGPIE_ERR_INVALID_POINTER, "not a pointer returned by magpie");
  assert_int_equal(magpie_usable_size(&local), 0);
  consistent();
}

static void test_free_interior_pointer(void **state) {
  (void)state;
  char *p = magpie_malloc_async(4096, s);
  assert_non_null(p);
  snap();
  expect_error(magpie_free_async(p + 512, s), MAGPIE_ERR_INVALID_POINTER, "points 512 bytes into a block");
  assert_int_equal(magpie_usable_size(p + 512), 0);
  consistent();
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK); /* the block itself is still valid */
}

static void test_double_free_small(void **state) {
  (void)state;
  void *p = magpie_malloc_async(700, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  snap();
  expect_error(magpie_free_async(p, s), MAGPIE_ERR_DOUBLE_FREE, "double free");
  consistent();
  /* Not cached twice: two allocations never return the same block. */
  void *a = magpie_malloc_async(700, s), *b = magpie_malloc_async(700, s);
  assert_ptr_not_equal(a, b);
  magpie_free_async(a, s);
  magpie_free_async(b, s);
}

static void test_double_free_large(void **state) {
  (void)state;
  void *p = magpie_malloc_async((size_t)5 << 20, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  snap();
  expect_error(magpie_free_async(p, s), MAGPIE_ERR_DOUBLE_FREE, "double free");
  consistent();
}

static void test_size_overflow(void **state) {
  (void)state;
  snap();
  assert_null(magpie_malloc_async(SIZE_MAX, s));
  expect_error(MAGPIE_ERR_SIZE_OVERFLOW, MAGPIE_ERR_SIZE_OVERFLOW, "cannot be rounded up");
  assert_null(magpie_malloc_async(SIZE_MAX - 4096, s));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_SIZE_OVERFLOW);
  consistent();
}

static void test_too_large(void **state) {
  (void)state;
  snap();
  assert_null(magpie_malloc_async((size_t)64 << 30, s)); /* the device has 4 GiB */
  expect_error(MAGPIE_ERR_TOO_LARGE, MAGPIE_ERR_TOO_LARGE, "in total");
  consistent();
}

static void test_alloc_on_destroyed_stream(void **state) {
  (void)state;
  cudaStream_t d = magpie_sim_stream_create();
  assert_non_null(d);
  assert_int_equal(magpie_sim_stream_destroy(d), MAGPIE_OK);
  snap();
  assert_null(magpie_malloc_async(100, d));
  expect_error(MAGPIE_ERR_INVALID_STREAM, MAGPIE_ERR_INVALID_STREAM, "is not valid");
  consistent();
}

static void test_free_on_destroyed_stream_keeps_block(void **state) {
  (void)state;
  cudaStream_t d = magpie_sim_stream_create();
  assert_non_null(d);
  void *p = magpie_malloc_async(3000, s);
  assert_non_null(p);
  assert_int_equal(magpie_sim_stream_destroy(d), MAGPIE_OK);
  snap();
  expect_error(magpie_free_async(p, d), MAGPIE_ERR_INVALID_STREAM, "the block stays allocated");
  consistent();
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
}

static void test_garbage_stream_handle(void **state) {
  (void)state;
  snap();
  assert_null(magpie_malloc_async(100, (cudaStream_t)(uintptr_t)0xdead0));
  expect_error(MAGPIE_ERR_INVALID_STREAM, MAGPIE_ERR_INVALID_STREAM, "is not valid");
  void *p = magpie_malloc_async(100, s);
  assert_non_null(p);
  expect_error(magpie_free_async(p, (cudaStream_t)(uintptr_t)0xdead0), MAGPIE_ERR_INVALID_STREAM, "is not valid");
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  consistent();
}

static void test_null_and_zero(void **state) {
  (void)state;
  snap();
  assert_int_equal(magpie_free_async(NULL, s), MAGPIE_OK);
  void *a = magpie_malloc_async(0, s), *b = magpie_malloc_async(0, s);
  assert_non_null(a);
  assert_non_null(b);
  assert_ptr_not_equal(a, b);
  assert_int_equal(magpie_usable_size(a), 256);
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(b, s), MAGPIE_OK);
  consistent();
}

static void test_stats_bad_arguments(void **state) {
  (void)state;
  magpie_stats st;
  expect_error(magpie_stats_get(-1, &st), MAGPIE_ERR_INVALID_ARGUMENT, "no device -1");
  expect_error(magpie_stats_get(99, &st), MAGPIE_ERR_INVALID_ARGUMENT, "no device 99");
  expect_error(magpie_stats_get(0, NULL), MAGPIE_ERR_INVALID_ARGUMENT, "out is NULL");
}

static void test_init_twice(void **state) {
  (void)state;
  magpie_config cfg;
  magpie_config_default(&cfg);
  expect_error(magpie_init(&cfg), MAGPIE_ERR_ALREADY_INITIALIZED, "before the first allocation");
  snap();
  consistent();
}

static void test_torch_negative_size(void **state) {
  (void)state;
  snap();
  assert_null(magpie_torch_malloc(-5, 0, s));
  expect_error(MAGPIE_ERR_INVALID_ARGUMENT, MAGPIE_ERR_INVALID_ARGUMENT, "negative size");
  consistent();
}

static void test_error_strings(void **state) {
  (void)state;
  for (int c = 0; c < MAGPIE_ERR_COUNT_; c++) {
    assert_non_null(magpie_error_string(c));
    assert_string_not_equal(magpie_error_string(c), "unknown magpie error code");
  }
  assert_string_equal(magpie_error_string(MAGPIE_ERR_COUNT_), "unknown magpie error code");
  assert_string_equal(magpie_error_string(-1), "unknown magpie error code");
}

/* Configuration errors, each in a fresh process (set-up happens once). */
static const char *self;

static int child_config(void) {
  void *p = magpie_malloc(100);
  if (p != NULL) return 100;
  int e = magpie_last_error();
  const char *want = getenv("EXPECT_TEXT");
  if (want && strstr(magpie_last_error_message(), want) == NULL) {
    fprintf(stderr, "message: %s\n", magpie_last_error_message());
    return 101;
  }
  /* The failure is sticky and does not abort: the same answer again. */
  if (magpie_malloc(100) != NULL || magpie_last_error() != e) return 102;
  return e;
}

static int spawn_with(const char *conf, const char *backend, const char *text) {
  char e1[256], e2[256], e3[256];
  snprintf(e1, sizeof e1, "MAGPIE_CONF=%s", conf);
  snprintf(e2, sizeof e2, "MAGPIE_BACKEND=%s", backend);
  snprintf(e3, sizeof e3, "EXPECT_TEXT=%s", text);
  /* The parent's environment (sanitizer options), then ours. */
  char *env[256];
  int n = 0;
  for (char **e = environ; *e != NULL && n < 250; e++)
    if (strncmp(*e, "MAGPIE_", 7) != 0) env[n++] = *e;
  env[n++] = e1;
  env[n++] = e2;
  env[n++] = e3;
  env[n] = NULL;
  char *argv[] = {(char *)self, "--config-child", NULL};
  pid_t pid;
  if (posix_spawn(&pid, self, NULL, NULL, argv, env) != 0) return -1;
  int status;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -2;
  return WEXITSTATUS(status);
}

static void test_config_errors(void **state) {
  (void)state;
  assert_int_equal(spawn_with("bogus=1", "sim", "bogus"), MAGPIE_ERR_CONFIG);
  assert_int_equal(spawn_with("check=maybe", "sim", "check"), MAGPIE_ERR_CONFIG);
  assert_int_equal(spawn_with("magazine_bytes=12q", "sim", "magazine_bytes"), MAGPIE_ERR_CONFIG);
  assert_int_equal(spawn_with("check=1", "quantum", "quantum"), MAGPIE_ERR_CONFIG);
}

/* A use of a freed (cached) block by stream work: under AddressSanitizer
 * the simulated device poisons cached blocks, so the write is reported. */
#if defined(__SANITIZE_ADDRESS__)
#define ASAN_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ASAN_BUILD 1
#endif
#endif

static void write_block(void *p) { *(volatile uint64_t *)p = 42; }

static int child_use_after_free(void) {
  uint64_t *p = magpie_malloc_async(4096, s);
  if (p == NULL || magpie_free_async(p, s) != MAGPIE_OK) return 2;
  magpie_sim_launch(s, write_block, p); /* the bug */
  magpie_sim_stream_synchronize(s);
  return 0;
}

static void test_cached_block_poisoned(void **state) {
  (void)state;
#ifndef ASAN_BUILD
  skip(); /* poisoning exists in AddressSanitizer builds only */
#else
  char out[512];
  const char *tmp = getenv("TEST_TMPDIR");
  snprintf(out, sizeof out, "%s/uaf.log", tmp ? tmp : "/tmp");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  char *argv[] = {(char *)self, "--uaf-child", NULL};
  pid_t pid;
  assert_int_equal(posix_spawn(&pid, self, &fa, NULL, argv, environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  int status;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_false(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  FILE *f = fopen(out, "r");
  assert_non_null(f);
  static char text[1 << 16];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = 0;
  assert_non_null(strstr(text, "use-after-poison"));
#endif
}

int main(int argc, char **argv) {
  self = argv[0];
  if (argc > 1 && strcmp(argv[1], "--config-child") == 0) return child_config();
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  cfg.check = 1;
  cfg.check_streams = 1;
  if (magpie_init(&cfg) != MAGPIE_OK) return 1;
  s = magpie_sim_stream_create();
  if (s == NULL) return 1;
  if (argc > 1 && strcmp(argv[1], "--uaf-child") == 0) return child_use_after_free();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_free_foreign_pointer),
      cmocka_unit_test(test_free_interior_pointer),
      cmocka_unit_test(test_double_free_small),
      cmocka_unit_test(test_double_free_large),
      cmocka_unit_test(test_size_overflow),
      cmocka_unit_test(test_too_large),
      cmocka_unit_test(test_alloc_on_destroyed_stream),
      cmocka_unit_test(test_free_on_destroyed_stream_keeps_block),
      cmocka_unit_test(test_garbage_stream_handle),
      cmocka_unit_test(test_null_and_zero),
      cmocka_unit_test(test_stats_bad_arguments),
      cmocka_unit_test(test_init_twice),
      cmocka_unit_test(test_torch_negative_size),
      cmocka_unit_test(test_error_strings),
      cmocka_unit_test(test_config_errors),
      cmocka_unit_test(test_cached_block_poisoned),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
