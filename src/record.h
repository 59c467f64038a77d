/* record_stream: blocks used on more streams than the one they are freed on
 * (magpie_record_stream, like PyTorch's Tensor.record_stream).
 *
 * magpie_record_stream(p, S) remembers S for the block at p. When p is
 * freed on stream F, one event is sealed on F and one on every recorded
 * stream (epoch tickets), and the block is parked in its heap's deferred
 * list instead of a magazine: nobody, F included, gets it back until every
 * ticket has completed. The deferred list is polled (event queries, never a
 * wait) from the heap's refill slow paths, and ready blocks go back to the
 * normal pools: small blocks in magazines to the depot's full stack, large
 * blocks to the large cache with no ticket. No stream is made to wait and
 * nothing synchronises the host.
 *
 * The free fast path sees recorded blocks through slab.recorded (a count of
 * entries for the slab's blocks) and leaves them to the slow path, which
 * calls record_free.
 *
 * Lock order: record_lock is a leaf. No driver call is made while it is
 * held (seals and event queries happen outside). */
#ifndef MAGPIE_RECORD_H
#define MAGPIE_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "epoch.h"
#include "heap.h"
#include "slab.h"

/* Remember that the block at p (start of a handed-out block of sl, bytes
 * long) is used on stream `handle` (stream_rec of the block's heap). Takes
 * its own reference to rec. MAGPIE_ERR_INVALID_POINTER if the block is
 * parked (freed). */
int record_add(slab *sl, uintptr_t p, size_t bytes, stream_rec *rec, cudaStream_t handle);

/* Free of a block of sl whose slab has recorded blocks (slab.recorded != 0).
 * If p has recorded streams, seals the freeing stream (frec, handle, id
 * matched by the caller) and every recorded stream, parks the block and
 * sets *parked to its size; the caller then only adjusts its live bytes.
 * *parked = 0: not recorded, free normally. A nonzero return is an error
 * already reported with error_set; the block then stays allocated. */
int record_free(slab *sl, uintptr_t p, stream_rec *frec, cudaStream_t handle, size_t *parked);

/* Return parked blocks whose tickets have all completed to the normal
 * pools. Never blocks; at most one event query per pending ticket. Called
 * from the heap's refill slow paths; a relaxed check when nothing is
 * parked. */
void record_poll(heap *h);

/* Bytes parked (freed, waiting for recorded streams) on h's device. */
size_t record_pending_bytes(const heap *h);
/* The same split: small blocks (out of the threads' magazines) and large
 * blocks (still counted in use by the large cache). For statistics. */
void record_pending(const heap *h, size_t *small, size_t *large);

#endif /* MAGPIE_RECORD_H */
