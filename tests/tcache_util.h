/* Helpers for the tests that look into the calling thread's cache
 * (src/tcache/): tcache_test.c, class_blocks_test.c, large_test.c. Included
 * after cmocka.h. */
#ifndef MAGPIE_TESTS_TCACHE_UTIL_H
#define MAGPIE_TESTS_TCACHE_UTIL_H

#include <pthread.h>
#include <stddef.h>

#include "tcache/tcache.h"

/* The calling thread's slot of stream s. */
static inline tslot *own_slot(cudaStream_t s) {
  for (int i = 0; i < TCACHE_SLOTS; i++)
    if (tcache_tls->slots[i].heap != NULL && tcache_tls->slots[i].handle == s) return &tcache_tls->slots[i];
  return NULL;
}

/* fn(arg) in a thread of its own, joined: the thread allocates on the
 * streams fn chooses alone (a thread on one stream caches more: tslot.h). */
static inline void run_in_thread(void *(*fn)(void *), void *arg) {
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, fn, arg), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
}

#endif
