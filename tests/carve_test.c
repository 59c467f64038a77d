/* Slab carves (heap_refill's carve in src/heap/heap.c, src/pool/slab.c)
 * against the deterministic fake device (fake_backend.c): threads that
 * run dry of a class together share one carve. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "magpie.h"
#include "tests/fake_backend.h"

/* Threads that run dry of a class together share one slab: the first maps
 * it (slowly here) while the others wait for its magazines instead of
 * each mapping a slab of its own. On device 2, which no other test here
 * uses: slabs share granules, so on a device with spans already mapped a
 * carve may map nothing at all. */
enum { CARVE_THREADS = 8 };
static pthread_barrier_t carve_start;
static void *carve_thread(void *arg) {
  cudaStream_t s = arg;
  pthread_barrier_wait(&carve_start);
  void *p = magpie_malloc_async(12000, s); /* a class no other test uses */
  if (p != NULL && magpie_free_async(p, s) != MAGPIE_OK) p = NULL;
  return p;
}

static void test_concurrent_refills_share_a_carve(void **state) {
  (void)state;
  cudaStream_t s[CARVE_THREADS];
  pthread_t t[CARVE_THREADS];
  for (int i = 0; i < CARVE_THREADS; i++) s[i] = fake_stream_create(2);
  fake_counters before, after;
  fake_get_counters(&before);
  fake_set_map_delay_us(20000);
  pthread_barrier_init(&carve_start, NULL, CARVE_THREADS);
  for (int i = 0; i < CARVE_THREADS; i++) assert_int_equal(pthread_create(&t[i], NULL, carve_thread, s[i]), 0);
  for (int i = 0; i < CARVE_THREADS; i++) {
    void *p = NULL;
    assert_int_equal(pthread_join(t[i], &p), 0);
    assert_non_null(p);
  }
  pthread_barrier_destroy(&carve_start);
  fake_set_map_delay_us(0);
  fake_get_counters(&after);
  assert_int_equal(after.maps - before.maps, 1);
  for (int i = 0; i < CARVE_THREADS; i++) fake_stream_complete(s[i]);
}

int main(void) {
  fake_set_devices(3); /* the carve runs on device 2 */
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_concurrent_refills_share_a_carve),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
