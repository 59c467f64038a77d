/* Helpers shared by the simulator tests (sim_test.c, sim_memory_test.c). */
#ifndef MAGPIE_TESTS_SIM_TEST_UTIL_H
#define MAGPIE_TESTS_SIM_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "device/backend.h"
#include "magpie_sim.h"
#include "sim/sim_internal.h"

#define MiB ((size_t)1 << 20)
#define TEST_DEVICES 3
#define WAIT_MS 10000 /* bound on every wait that a correct simulator ends */

/* ---------------------------------------------------------------- helpers */

/* 0 if s was posted within ms, -1 on timeout. */
static inline int sem_wait_ms(sem_t *s, int ms) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  t.tv_sec += ms / 1000;
  t.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec++;
    t.tv_nsec -= 1000000000L;
  }
  int rc;
  while ((rc = sem_timedwait(s, &t)) != 0 && errno == EINTR) {
  }
  return rc == 0 ? 0 : -1;
}

static inline void sleep_ms(int ms) {
  struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* Closures that append their index to a log, to check the order in which
 * a stream (or a graph's replay) ran them. */
struct order_log {
  int next;
  int seen[1000];
};
struct order_item {
  struct order_log *log;
  int index;
};

static inline void order_append(void *arg) {
  struct order_item *it = arg;
  it->log->seen[it->log->next++] = it->index;
}

/* A closure that waits for a gate (bounded), then sets a flag and posts a
 * completion semaphore. The flag is plain memory: reading it is correct only
 * after an edge from the stream (synchronize, event, device synchronize). */
struct gated {
  sem_t gate;
  sem_t finished;
  int opened; /* 1 if the gate opened in time (written by the closure) */
  int done;   /* written by the closure */
  atomic_int started;
};

static inline void gated_init(struct gated *g) {
  memset(g, 0, sizeof *g);
  sem_init(&g->gate, 0, 0);
  sem_init(&g->finished, 0, 0);
}

static inline void gated_fini(struct gated *g) {
  sem_destroy(&g->gate);
  sem_destroy(&g->finished);
}

static inline void gated_run(void *arg) {
  struct gated *g = arg;
  atomic_store(&g->started, 1);
  g->opened = sem_wait_ms(&g->gate, WAIT_MS) == 0;
  g->done = 1;
  sem_post(&g->finished);
}

/* Opens a gate from another thread after a delay, so that the main thread is
 * already blocked in the call under test when the work completes. */
struct opener {
  pthread_t thread;
  sem_t *gate;
  int posts;
};

static inline void *opener_main(void *arg) {
  struct opener *o = arg;
  sleep_ms(20);
  for (int i = 0; i < o->posts; i++) sem_post(o->gate);
  return NULL;
}

static inline void opener_start(struct opener *o, sem_t *gate, int posts) {
  o->gate = gate;
  o->posts = posts;
  assert_int_equal(pthread_create(&o->thread, NULL, opener_main, o), 0);
}

static inline void opener_join(struct opener *o) { pthread_join(o->thread, NULL); }

static inline void set_flag(void *arg) { *(int *)arg = 1; }

/* Two closures on two streams: the reader reads what the writer wrote once
 * its gate opened; correct only when a wait orders them. */
struct ordered {
  struct gated g;
  int x;    /* written on the first stream after its gate */
  int seen; /* the value the second stream read */
  atomic_int b_ran;
};

static inline void ordered_writer(void *arg) {
  struct ordered *o = arg;
  gated_run(&o->g);
  o->x = 1;
}

static inline void ordered_reader(void *arg) {
  struct ordered *o = arg;
  o->seen = o->x;
  atomic_store(&o->b_ran, 1);
}

#endif
