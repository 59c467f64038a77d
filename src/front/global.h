/* The front layer's view of one-time set-up: is magpie ready, with which
 * device table and configuration. Set-up itself is init.c; every public
 * entry point and slow path asks here first. */
#ifndef MAGPIE_GLOBAL_H
#define MAGPIE_GLOBAL_H

#include "base/atomic.h"
#include "base/globals.h"
#include "device/backend.h"
#include "magpie.h"

enum global_state { GLOBAL_NONE = 0, GLOBAL_READY = 1, GLOBAL_FAILED = 2 };

/* Set up on first use from the environment (init.c); MAGPIE_OK or the
 * (sticky) error, with the thread's error message set. */
int global_init_slow(const magpie_config *cfg, const backend_ops *ops);

static inline int global_ensure(void) {
  if (likely(atomic_load_acquire(&globals.global_state_v) == GLOBAL_READY)) return MAGPIE_OK;
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
