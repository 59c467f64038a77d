/* Global state: configuration, the backend in use, one-time set-up. */
#ifndef MAGPIE_INIT_H
#define MAGPIE_INIT_H

#include "base/atomic.h"
#include "device/backend.h"
#include "magpie.h"

enum global_state { GLOBAL_NONE = 0, GLOBAL_READY = 1, GLOBAL_FAILED = 2 };

/* Read (acquire) on every slow path; written (release) once set-up is
 * complete, under the init lock. */
extern _Atomic int global_state_v;

/* Set up on first use from the environment; MAGPIE_OK or the (sticky) error,
 * with the thread's error message set. */
int global_init_slow(const magpie_config *cfg, const backend_ops *ops);

static inline int global_ensure(void) {
  if (likely(atomic_load_acquire(&global_state_v) == GLOBAL_READY)) return MAGPIE_OK;
  return global_init_slow(NULL, NULL);
}

const backend_ops *global_ops(void);
const magpie_config *global_config(void);

/* Parse MAGPIE_CONF / MAGPIE_BACKEND over cfg (options.c). */
int options_from_env(magpie_config *cfg);
/* Parse one "key=value,key=value" string over cfg (options.c). */
int options_parse(magpie_config *cfg, const char *conf);

#endif /* MAGPIE_INIT_H */
