/* The allocator's observer hook: a device's watcher of hand-outs and frees
 * (backend_observer, device/backend.h; the simulated device's stream-order
 * checker offers one), attached at set-up. The allocation and free paths
 * read front_st.slow_paths (front/global.h) alone and call out of line only
 * while it is set. */
#ifndef MAGPIE_OBSERVE_H
#define MAGPIE_OBSERVE_H

#include <stddef.h>

#include "device/backend.h"
#include "magpie.h"

/* The bits of front_st.slow_paths. */
#define SLOW_OBSERVE BACKEND_OBSERVER_BIT /* the device's observer is on */
#define SLOW_CAPTURE 2                    /* a capture magpie was told of runs */

/* The observer's switch is front_st.slow_paths' SLOW_OBSERVE bit:
 * read-mostly, following the attached
 * observer's (written through backend_observer_set: at set-up with
 * check_streams=1, or by the device's own switch, such as
 * magpie_sim_check_enable). Read relaxed: it only decides whether the
 * hooks are called; they synchronise on their own. */

/* At set-up, under the init lock: attaches ops's observer if it offers
 * one, and switches it on when on is set. */
void observe_install(const backend_ops *ops, int on);

/* The hooks (no-ops while no observer is attached). */
void observe_handout(void *p, size_t size, cudaStream_t stream);
void observe_free(void *p, cudaStream_t stream);
void observe_record(void *p, cudaStream_t stream);

#endif /* MAGPIE_OBSERVE_H */
