/* The thread caches' calls up into the public-API layer: the table that
 * layer hands down (tcache.h says when), on its own so that the layer's
 * files can share it without including tcache.h. */
#ifndef MAGPIE_TCACHE_UPCALLS_H
#define MAGPIE_TCACHE_UPCALLS_H

#include <stddef.h>

#include "device/backend.h"
#include "heap/heap.h"
#include "pool/slab.h"

/* The calls the thread caches make up into the public-API layer (front/),
 * which lies above them and so cannot be named here: one table, handed
 * down by that layer when the library is loaded (front/init.c), before
 * anything can reach a slow path. Every field is set. */
typedef struct tcache_upcalls {
  /* Sets magpie up if it is not yet (a thread's first slow path may be the
   * process's first call): MAGPIE_OK, or the error with its message set. */
  int (*ensure)(void);
  /* The free of a graph pool's block p (front/capture.c). */
  int (*graph_free)(void *p, struct slab *sl, cudaStream_t s);
  /* The out-of-memory message's account of where heap h's bytes are
   * (front/stats.c). */
  void (*describe)(heap *h, char *buf, size_t n);
  /* Is a capture magpie was told of under way (front/capture.c)? */
  int (*capture_announced)(void);
} tcache_upcalls;
void tcache_set_upcalls(const tcache_upcalls *up);

#endif /* MAGPIE_TCACHE_UPCALLS_H */
