/* Private jemalloc arena for host metadata. */
#include "base/meta.h"

#include <pthread.h>

#include <jemalloc/jemalloc.h> /* MALLOCX_* flag macros only */

/* The renamed, private jemalloc entry points. */
void *mpje_mallocx(size_t size, int flags);
void mpje_dallocx(void *ptr, int flags);
int mpje_mallctl(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen);

/* This file's state: written once under meta_st.once; read after
 * pthread_once (which orders it). */
static struct meta_state {
  pthread_once_t once;
  int arena_index;
  int flags;
} meta_st = {
    .once = PTHREAD_ONCE_INIT,
    .arena_index = -1,
};

static void meta_create_arena(void) {
  unsigned ind = 0;
  size_t sz = sizeof ind;
  if (mpje_mallctl("arenas.create", &ind, &sz, NULL, 0) == 0) {
    meta_st.arena_index = (int)ind;
    /* No thread cache: metadata is allocated on slow paths only, and a
     * tcache would keep per-thread state in every thread that touches us. */
    meta_st.flags = MALLOCX_ARENA(ind) | MALLOCX_TCACHE_NONE;
  } else {
    meta_st.flags = MALLOCX_TCACHE_NONE; /* default arenas of the private copy */
  }
}

void *meta_alloc(size_t size) {
  pthread_once(&meta_st.once, meta_create_arena);
  return mpje_mallocx(size ? size : 1, meta_st.flags | MALLOCX_ZERO);
}

void *meta_alloc_aligned(size_t size, size_t align) {
  pthread_once(&meta_st.once, meta_create_arena);
  return mpje_mallocx(size ? size : 1, meta_st.flags | MALLOCX_ZERO | MALLOCX_ALIGN(align));
}

void meta_free(void *p) {
  if (p) mpje_dallocx(p, meta_st.flags);
}

int meta_arena(void) {
  pthread_once(&meta_st.once, meta_create_arena);
  return meta_st.arena_index;
}
