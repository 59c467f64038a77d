/* The allocated block a public entry point is handed (record_api.c). */
#ifndef MAGPIE_FRONT_BLOCK_H
#define MAGPIE_FRONT_BLOCK_H

#include <stddef.h>

#include "pool/slab.h"

/* Sets magpie up if needed and finds the block starting at ptr for the
 * entry point fn: its slab and size. A graph pool's block sets *graph and
 * nothing else. Otherwise MAGPIE_OK, or the error (NULL, not magpie's, not
 * a block start, free in checked mode) already set with fn's name. */
int block_resolve(const char *fn, void *ptr, slab **sl, size_t *bytes, int *graph);

#endif /* MAGPIE_FRONT_BLOCK_H */
