/* CUDA graphs at the front: announced captures, routing of allocations on
 * capturing streams into graph pools (pool/gpool.h), and the frees of
 * graph pools' blocks (public API in magpie.h, "CUDA graphs").
 *
 * What it costs: nothing on the fast paths while no capture is announced
 * (they read front_st.slow_paths, which they read anyway). While one is,
 * every allocation and free of every thread takes its slow path and asks
 * the device once for its stream's capture state (cuStreamIsCapturing
 * costs about as much as cuStreamGetId; bench/DECISIONS.md, "Announced
 * captures send every call to the slow path"); captures are short and
 * replays allocate nothing.
 *
 * Lock order: capture_st.lock (capture.c) is taken alone; it is held across
 * stream capture queries (never a wait) while finding a capture's pool. */
#ifndef MAGPIE_CAPTURE_H
#define MAGPIE_CAPTURE_H

#include <stddef.h>

#include "magpie.h"

struct slab;

/* The free of graph pool block p (segment descriptor sl) on stream: during
 * a capture, tagged with it; outside, sealed on the stream. The thread
 * caches call it through their upcalls (front/init.c). */
int capture_graph_free(void *p, struct slab *sl, cudaStream_t stream);

/* An allocation's slow path while a capture is announced: if stream is
 * capturing, the allocation is served (or refused) here: returns 1 with
 * *out the block or NULL (error set). 0: stream is not capturing. */
int capture_alloc(size_t size, cudaStream_t stream, void **out);

/* A free while a capture is announced: a graph pool's block, or a block
 * freed on a capturing stream (to limbo), is freed here: returns 1 with
 * *rc the result. 0: the ordinary paths serve. */
int capture_free(void *p, cudaStream_t stream, int *rc);

#endif /* MAGPIE_CAPTURE_H */
