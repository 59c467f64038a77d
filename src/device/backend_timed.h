/* Timing wrapper over a backend table (MAGPIE_CONF=slow_call_ms=N): see
 * backend_timed.c. */
#ifndef MAGPIE_BACKEND_TIMED_H
#define MAGPIE_BACKEND_TIMED_H

#include <stdio.h>

#include "device/backend.h"

/* The wrapper table over inner, reporting calls of threshold_ms or more. */
const backend_ops *backend_timed(const backend_ops *inner, unsigned threshold_ms);
int backend_timed_active(void);
/* The slowest call of each kind so far, and the count and total time of
 * each kind (for verbose statistics). */
void backend_timed_print(FILE *out);

#endif /* MAGPIE_BACKEND_TIMED_H */
