/* The simulated device's stream-order checker, as the allocator's public
 * layer (alloc.c) sees it: two hooks, called only while sim_check_on is set
 * (MAGPIE_CONF=check_streams=1 with the simulated backend, or
 * magpie_sim_check_enable). The checker itself is sim_check.c. */
#ifndef MAGPIE_SIM_CHECK_H
#define MAGPIE_SIM_CHECK_H

#include <stdatomic.h>
#include <stddef.h>

#include "magpie.h"

/* Read-mostly switch. Written (relaxed) by magpie_init / the public enable
 * call, before the allocations it should cover; read (relaxed) by the
 * allocation and free paths: it only decides whether to call the hooks,
 * which synchronise on their own. */
extern _Atomic int sim_check_on;

/* Block p (at least size bytes) was handed out for work on stream s:
 * report a violation if a use recorded by an earlier free of any of its
 * bytes is not ordered before s. */
void sim_check_handout(void *p, size_t size, cudaStream_t s);
/* Block p is about to be freed on stream s: its last use is everything
 * enqueued on s so far. Called before the allocator may hand it out again. */
void sim_check_free(void *p, cudaStream_t s);

#endif /* MAGPIE_SIM_CHECK_H */
