/* The region (src/pool/region.c), the device memory a heap maps, against
 * the deterministic fake device (fake_backend.c): mapped and held bytes,
 * and the peak, while a map fails or an unmap is in flight. The region is
 * made here, without magpie. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include <cmocka.h>

#include "magpie.h"
#include "pool/region.h"
#include "tests/fake_backend.h"

/* A map that fails (the device is full) counts in the region's mapped
 * bytes while it is in flight, so that concurrent maps cannot pass the
 * limit together; it must not raise the peak of reserved memory that
 * another thread's successful map sets meanwhile, nor count in the
 * reserved bytes the statistics report. On device 1 (24 MiB), a region of
 * its own. */
typedef struct failing_map {
  region *r;
  int rc;
} failing_map;
static void *failing_map_thread(void *arg) {
  failing_map *f = arg;
  uintptr_t a, raw;
  size_t raw_size;
  f->rc = region_map(f->r, (size_t)32 << 20, &a, &raw, &raw_size); /* more than the device */
  return NULL;
}

typedef struct unmapping {
  region *r;
  uintptr_t a;
  size_t size;
  uintptr_t raw;
  size_t raw_size;
} unmapping;
static void *unmap_thread(void *arg) {
  unmapping *u = arg;
  region_unmap(u->r, u->a, u->size, u->raw, u->raw_size);
  return NULL;
}

static void test_failed_map_never_raises_the_peak(void **state) {
  (void)state;
  static region r;
  assert_int_equal(region_init(&r, 1, fake_backend(), (size_t)1 << 30, 0), MAGPIE_OK);
  size_t g = r.gran;
  failing_map f = {&r, MAGPIE_OK};
  pthread_t t;
  fake_set_map_delay_us(200000);
  assert_int_equal(pthread_create(&t, NULL, failing_map_thread, &f), 0);
  while (atomic_load(&r.mapped) < ((size_t)32 << 20)) usleep(100); /* committed, inside the slow map */
  fake_set_map_delay_us(0);
  uintptr_t a, raw;
  size_t raw_size;
  assert_int_equal(region_map(&r, g, &a, &raw, &raw_size), MAGPIE_OK);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(f.rc, MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(atomic_load(&r.mapped), g);
  assert_int_equal(atomic_load(&r.held), g);
  assert_int_equal(atomic_load(&r.peak_held), g);
  /* An unmap stops counting before the driver is asked: the room it makes
   * may be mapped by another thread before it returns. */
  unmapping u = {&r, a, g, raw, raw_size};
  fake_gate_unmap(1);
  assert_int_equal(pthread_create(&t, NULL, unmap_thread, &u), 0);
  while (fake_unmaps_held() == 0) usleep(100);
  assert_int_equal(atomic_load(&r.held), 0);
  assert_int_equal(atomic_load(&r.mapped), g); /* still counted against a limit */
  fake_gate_unmap(0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(atomic_load(&r.mapped), 0);
  assert_int_equal(atomic_load(&r.held), 0);
  assert_int_equal(atomic_load(&r.peak_held), g);
}

int main(void) {
  fake_set_capacity(1, (size_t)24 << 20);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_failed_map_never_raises_the_peak),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
