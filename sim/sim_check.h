/* The simulated device's stream-order checker, as the allocator sees it:
 * an observer of hand-outs and frees (backend_observer, device/backend.h)
 * that the simulated device's table offers. The allocator calls its two
 * hooks only while it is on (MAGPIE_CONF=check_streams=1 on the simulated
 * device, or magpie_sim_check_enable). The checker itself is sim_check.c. */
#ifndef MAGPIE_SIM_CHECK_H
#define MAGPIE_SIM_CHECK_H

#include <stddef.h>

#include "device/backend.h"
#include "magpie.h"

/* The checker as an observer: its hooks and its switch (enabled: written
 * by magpie_sim_check_enable and by magpie's set-up through
 * backend_observer_set, read relaxed: it only decides whether the hooks
 * are called, and they synchronise on their own). */
extern backend_observer sim_check_observer;

/* Block p (at least size bytes) was handed out for work on stream s:
 * report a violation if a use recorded by an earlier free of any of its
 * bytes is not ordered before s. */
void sim_check_handout(void *p, size_t size, cudaStream_t s);
/* Block p is about to be freed on stream s: its last use is everything
 * enqueued on s so far. Called before the allocator may hand it out again. */
void sim_check_free(void *p, cudaStream_t s);
/* magpie_record_stream(p, s) succeeded: the block's free covers s's work
 * enqueued before it too (up to SIM_CHECK_RECORDED streams). */
void sim_check_record_stream(void *p, cudaStream_t s);

#endif /* MAGPIE_SIM_CHECK_H */
