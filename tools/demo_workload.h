/* The demo's workload, shared by the demo (tools/demo.c) and the suite's
 * workload 7 (bench/w_demo.c), which replays it under every allocator.
 *
 * A thread owns a few streams and takes them in turn, one step each. A step
 * allocates DEMO_TEMPS temporaries on its stream (sizes below), enqueues
 * work that writes them and frees them on that stream. Every
 * DEMO_HANDOFF_EVERY steps (with two streams or more) a DEMO_HANDOFF_BYTES
 * block written on the step's stream is handed to the next stream (event +
 * stream wait), written there and freed there. */
#ifndef MAGPIE_TOOLS_DEMO_WORKLOAD_H
#define MAGPIE_TOOLS_DEMO_WORKLOAD_H

#include <stddef.h>
#include <stdlib.h>

enum { DEMO_TEMPS = 8, DEMO_HANDOFF_EVERY = 8, DEMO_HANDOFF_BYTES = 4096 };

/* Thread id's seed for demo_pick_size. */
static inline unsigned demo_seed(int id) { return 12345u + (unsigned)id * 7919u; }

/* One temporary's size: one in 64 is 2, 4 or 6 MiB (r is a multiple of 64
 * then, so r % 6 is 0, 2 or 4), the others 256 B-64 KiB, a power of 2
 * picked uniformly over the nine exponents. */
static inline size_t demo_pick_size(unsigned *seed) {
  unsigned r = (unsigned)rand_r(seed);
  if ((r & 63) == 0) return ((size_t)2 << 20) + (r % 6) * ((size_t)1 << 20);
  return 256u << ((r >> 8) % 9);
}

#endif
