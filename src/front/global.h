/* The front layer's view of one-time set-up: is magpie ready, with which
 * device table and configuration, and the layer's state (front_st). Set-up
 * itself is init.c; every public entry point and slow path asks here
 * first. */
#ifndef MAGPIE_GLOBAL_H
#define MAGPIE_GLOBAL_H

#include <pthread.h>

#include "base/atomic.h"
#include "device/backend.h"
#include "magpie.h"

enum global_state { GLOBAL_NONE = 0, GLOBAL_READY = 1, GLOBAL_FAILED = 2 };

/* The front layer's process-wide state (defined in init.c). The fast paths
 * read state (global_ensure) and slow_paths (front/alloc.c) as plain global
 * loads: no call, no pointer to follow. capture.c's registrations and
 * observe.c's observer are those files' own. */
typedef struct front_state {
  /* init.c: state is read (acquire) on every slow path and written
   * (release) once set-up is complete, under init_lock; the fields after
   * it are written under init_lock before that release. */
  _Atomic int state;
  pthread_mutex_t init_lock;
  magpie_config cfg;
  const backend_ops *backend;
  int err;
  char msg[512];
  /* Set once, in a child of fork() (init.c's child handler, the child's
   * only thread); magpie stays unusable there. init_atfork: the handlers
   * are registered (under init_lock). */
  int forked;
  int init_atfork;
  /* The fast paths' one switch (front/alloc.c reads it relaxed: it only
   * decides whether the slow paths are taken): while nonzero, every
   * allocation and free takes its slow path. Bit SLOW_OBSERVE (observe.c
   * attaches the word; device/observer.c sets and clears the bit, RMW)
   * follows the device's observer; bit SLOW_CAPTURE (capture.c, RMW under
   * capture_st.lock) is set while a capture magpie was told of is under
   * way. observe.c's observe_hooks is published (release) before the
   * observer's bit can turn on. */
  _Atomic int slow_paths;
} front_state;

extern front_state front_st;

/* Set up on first use from the environment (init.c); MAGPIE_OK or the
 * (sticky) error, with the thread's error message set. */
int global_init_slow(const magpie_config *cfg, const backend_ops *ops);

static inline int global_ensure(void) {
  if (likely(atomic_load_acquire(&front_st.state) == GLOBAL_READY)) return MAGPIE_OK;
  return global_init_slow(NULL, NULL);
}

/* After global_ensure succeeded: the device table and the configuration. */
const backend_ops *global_ops(void);
const magpie_config *global_config(void);

/* Sets up magpie if needed and checks that device is one the backend has:
 * MAGPIE_OK, or the error (MAGPIE_ERR_INVALID_ARGUMENT naming fn for a
 * device out of range) with the thread's message set. */
int global_device_check(int device, const char *fn);

#endif /* MAGPIE_GLOBAL_H */
