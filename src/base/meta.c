/* Private jemalloc arena for host metadata. */
#include "base/meta.h"

#include "base/globals.h"

#include <pthread.h>

#include <jemalloc/jemalloc.h> /* MALLOCX_* flag macros only */

/* The renamed, private jemalloc entry points. */
void *mpje_mallocx(size_t size, int flags);
void mpje_dallocx(void *ptr, int flags);
int mpje_mallctl(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen);

static void meta_create_arena(void) {
  unsigned ind = 0;
  size_t sz = sizeof ind;
  if (mpje_mallctl("arenas.create", &ind, &sz, NULL, 0) == 0) {
    globals.meta_arena_index = (int)ind;
    /* No thread cache: metadata is allocated on slow paths only, and a
     * tcache would keep per-thread state in every thread that touches us. */
    globals.meta_flags = MALLOCX_ARENA(ind) | MALLOCX_TCACHE_NONE;
  } else {
    globals.meta_flags = MALLOCX_TCACHE_NONE; /* default arenas of the private copy */
  }
}

void *meta_alloc(size_t size) {
  pthread_once(&globals.meta_once, meta_create_arena);
  return mpje_mallocx(size ? size : 1, globals.meta_flags | MALLOCX_ZERO);
}

void *meta_alloc_aligned(size_t size, size_t align) {
  pthread_once(&globals.meta_once, meta_create_arena);
  return mpje_mallocx(size ? size : 1, globals.meta_flags | MALLOCX_ZERO | MALLOCX_ALIGN(align));
}

void meta_free(void *p) {
  if (p) mpje_dallocx(p, globals.meta_flags);
}

int meta_arena(void) {
  pthread_once(&globals.meta_once, meta_create_arena);
  return globals.meta_arena_index;
}
