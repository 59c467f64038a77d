/* Steps that several threads take in a fixed order, for tests that need
 * one interleaving exactly (two captures on per-thread streams, say):
 * turn_wait(t, k) blocks until step k is reached; turn_next(t) ends the
 * current step. Header-only, for the simulated-device tests, the fuzzer and
 * the GPU tests alike. */
#ifndef MAGPIE_TESTS_TURNS_H
#define MAGPIE_TESTS_TURNS_H

#include <pthread.h>

typedef struct turns {
  pthread_mutex_t m;
  pthread_cond_t c;
  int step;
} turns;

#define TURNS_INIT \
  { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0 }

static inline void turn_wait(turns *t, int step) {
  pthread_mutex_lock(&t->m);
  while (t->step != step) pthread_cond_wait(&t->c, &t->m);
  pthread_mutex_unlock(&t->m);
}

static inline void turn_next(turns *t) {
  pthread_mutex_lock(&t->m);
  t->step++;
  pthread_cond_broadcast(&t->c);
  pthread_mutex_unlock(&t->m);
}

/* Back to step 0, with no thread waiting. */
static inline void turn_reset(turns *t) {
  pthread_mutex_lock(&t->m);
  t->step = 0;
  pthread_mutex_unlock(&t->m);
}

#endif /* MAGPIE_TESTS_TURNS_H */
