/* Statistics: gathered from the heap's relaxed counters and the threads'
 * in-use counters.
 *
 * Invariants (exact when no thread is between a fast-path update and its
 * next slow path; see docs/configuration.md):
 *   in_use_bytes + cached_bytes == reserved_bytes
 *   in_use_bytes <= peak_in_use_bytes, reserved_bytes <= peak_reserved_bytes
 * peak_in_use_bytes is sampled on slow paths: it may miss a peak by at most
 * what threads handed out from their magazines since their last slow path
 * and their rises not yet published (below 1 MiB each, tcache_publish);
 * it is raised to the threads' own counts, never to the published sum. */
#ifndef MAGPIE_STATS_H
#define MAGPIE_STATS_H

#include <stddef.h>
#include <stdio.h>

#include "heap/heap.h"

void stats_collect(heap *h, magpie_stats *out);
/* One line for error messages: device free/total, reserved, in use, cached
 * per layer. */
void stats_describe(heap *h, char *buf, size_t n);
void stats_print(int device, FILE *out);

#endif /* MAGPIE_STATS_H */
