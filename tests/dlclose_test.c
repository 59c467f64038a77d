/* libmagpie.so loaded with dlopen, used, unloaded with dlclose, again and
 * again, while its maintenance thread runs (release_threshold starts its
 * timer) and the simulated device's workers hold streams. The first
 * dlclose unmapped code a library thread was still running (SIGSEGV);
 * the libraries are now marked non-unloadable (-z nodelete), so dlclose
 * leaves them mapped and the next dlopen finds them as they were.
 *
 * Arguments: the path of libmagpie.so (libmagpie_sim.so beside it). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static const char *lib_path;

typedef void *(*malloc_fn)(size_t);
typedef int (*free_fn)(void *);
typedef int (*trim_fn)(int, size_t);

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void test_dlopen_dlclose_loop(void **state) {
  (void)state;
  for (int round = 0; round < 8; round++) {
    void *h = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) fail_msg("dlopen(%s): %s", lib_path, dlerror());
    malloc_fn m = (malloc_fn)dlsym(h, "magpie_malloc");
    free_fn f = (free_fn)dlsym(h, "magpie_free");
    trim_fn t = (trim_fn)dlsym(h, "magpie_trim");
    assert_non_null(m);
    assert_non_null(f);
    assert_non_null(t);
    void *p[64];
    for (int i = 0; i < 64; i++) assert_non_null(p[i] = m((size_t)256 << (i % 14)));
    for (int i = 0; i < 64; i++) assert_int_equal(f(p[i]), 0);
    assert_int_equal(t(0, 0), 0);
    assert_int_equal(dlclose(h), 0);
    /* The maintenance thread wakes every 200 ms while a release threshold
     * is set: give it a turn with the library closed. */
    sleep_ms(250);
  }
}

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  lib_path = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dlopen_dlclose_loop),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
