/* The one definition of every process-wide variable (globals.h). Fields
 * not named here start zeroed. */
#include "base/globals.h"

global_vars globals = {
    .meta_once = PTHREAD_ONCE_INIT,
    .meta_arena_index = -1,
    .cuda_lock = PTHREAD_MUTEX_INITIALIZER,
    .slab_desc_lock = PTHREAD_MUTEX_INITIALIZER,
    .heap_create_lock = PTHREAD_MUTEX_INITIALIZER,
    .reaper_lock = PTHREAD_MUTEX_INITIALIZER,
    .reaper_cv = PTHREAD_COND_INITIALIZER,
    .reaper_idle_cv = PTHREAD_COND_INITIALIZER,
    .init_lock = PTHREAD_MUTEX_INITIALIZER,
    .capture_lock = PTHREAD_MUTEX_INITIALIZER,
};
