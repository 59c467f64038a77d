/* Helpers for the tests that look into the calling thread's cache
 * (src/front/tcache.c): tcache_test.c, class_blocks_test.c. */
#ifndef MAGPIE_TESTS_TCACHE_UTIL_H
#define MAGPIE_TESTS_TCACHE_UTIL_H

#include <stddef.h>

#include "tcache/tcache.h"

/* The calling thread's slot of stream s. */
static inline tslot *own_slot(cudaStream_t s) {
  for (int i = 0; i < TCACHE_SLOTS; i++)
    if (tcache_tls->slots[i].heap != NULL && tcache_tls->slots[i].handle == s) return &tcache_tls->slots[i];
  return NULL;
}

#endif
