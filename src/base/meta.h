/* Host metadata (slab descriptors, magazines, thread caches) comes from a
 * private jemalloc arena. jemalloc is linked in with every symbol but the
 * renamed mpje_* entry points made local (third_party/local_libs.bzl), so
 * the application's malloc is never replaced or touched. */
#ifndef MAGPIE_META_H
#define MAGPIE_META_H

#include <stddef.h>

/* Zeroed memory, or NULL. */
void *meta_alloc(size_t size);
/* The same, aligned to align (a power of two): for structures with
 * members on cache lines of their own. */
void *meta_alloc_aligned(size_t size, size_t align);
void meta_free(void *p);
/* The jemalloc arena index in use (for tests); -1 before first use. */
int meta_arena(void);

#endif /* MAGPIE_META_H */
