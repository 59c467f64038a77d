/* Monotonic time and short pauses for the slow paths that wait a bounded
 * time for other threads (the heap's ladder, the thread caches' give-back
 * step). Never on a fast path. */
#ifndef MAGPIE_TICKS_H
#define MAGPIE_TICKS_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds of CLOCK_MONOTONIC. */
static inline uint64_t ticks_now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Sleep about ns nanoseconds (less than a second). */
static inline void ticks_sleep_ns(long ns) {
  struct timespec t = {0, ns};
  nanosleep(&t, NULL);
}

#endif
