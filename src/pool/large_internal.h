/* Large blocks: what the large*.c files share among themselves. Private to
 * them: not part of the pool layer's interface (that is pool/large.h), and
 * no file outside src/pool/large*.c includes it.
 *
 * The large blocks' files, one concept each:
 *   large.c         the entry points (init, alloc, lookup, free), the best
 *                   fit over the bins and the hand-out
 *   large_desc.c    ticket and block descriptors, their spares, ticket
 *                   references, large_unlock
 *   large_seg.c     segments, their granules' state, the address hash
 *   large_bins.c    free blocks in bins by size, split (carve), merge
 *                   (coalesce)
 *   large_settle.c  pending free blocks queried, waited for and settled
 *   large_run.c     runs of adjacent free blocks of different streams
 *   large_map.c     mapping and unmapping granules, shrink, release
 *   large_class.c   class blocks
 *   large_lend.c    memory lent to the span set
 *   large_kept.c    kept blocks and graph marks
 *   large_view.c    statistics and snapshots (pool/large.h alone)
 *
 * It names the large types by their struct tags and includes no header of
 * the large blocks: large.c includes it, and its including pool/large.h
 * would be an include cycle (tests/layering_test.py). Each function's
 * comment is at its definition. Lock held by the caller unless the
 * definition says otherwise. */
#ifndef MAGPIE_LARGE_INTERNAL_H
#define MAGPIE_LARGE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "device/backend.h"

struct epoch_ticket;
struct large_cache;
struct lblock;
struct lseg;
struct lticket;

/* large.c */
int large_block_ready_for(const struct lblock *b, uint64_t stream_id);
int large_hand_out(struct large_cache *c, struct lblock *u, struct lticket **deferred);
int large_alloc_locked(struct large_cache *c, size_t need, uint64_t stream_id, cudaStream_t stream, int flags,
                       struct lblock **out, struct lticket **deferred);

/* large_desc.c */
void large_ticket_ref(struct lticket *lt);
void large_ticket_unref(struct lticket *lt, struct lticket **deferred);
struct lblock *large_block_new(struct large_cache *c);
void large_block_drop(struct large_cache *c, struct lblock *b);
struct lticket *large_ticket_new(struct large_cache *c, const struct epoch_ticket *t);
void large_ticket_drop(struct large_cache *c, struct lticket *lt);
void large_unlock(struct large_cache *c, struct lticket *deferred);

/* large_seg.c */
int large_hash_insert(struct large_cache *c, struct lblock *b);
struct lblock *large_hash_find(struct large_cache *c, uintptr_t p, int unlink);
size_t large_gran(struct large_cache *c);
int large_wholly_mapped(const struct lseg *sg, size_t g, uintptr_t a, size_t n);
int large_seg_tiles(const struct lseg *sg);
void large_seg_destroy(struct lseg *sg);
int large_seg_new(struct large_cache *c, size_t need, struct lseg **out);
void large_seg_link(struct large_cache *c, struct lseg *sg);

/* large_bins.c */
void large_free_link(struct large_cache *c, struct lblock *b);
void large_free_unlink(struct large_cache *c, struct lblock *b);
void large_link_after(struct lblock *a, struct lblock *r);
struct lblock *large_carve(struct large_cache *c, struct lblock *b, size_t need, int at_end);
struct lblock *large_carve_at(struct large_cache *c, struct lblock *b, size_t need, size_t off);
size_t large_granule_free(const struct lblock *b, uintptr_t p, size_t g);
void large_uncarve(struct large_cache *c, struct lblock *u, struct lticket **deferred);
struct lblock *large_coalesce_dead(struct large_cache *c, struct lblock *b, struct lticket **deferred,
                                   struct lblock **dead);
struct lblock *large_coalesce(struct large_cache *c, struct lblock *b, struct lticket **deferred);
void large_release_block(struct large_cache *c, struct lblock *b, struct lticket *lt, struct lticket **deferred);

/* large_settle.c */
int large_query_pending_locked(struct large_cache *c, uint64_t skip_stream, struct lticket **deferred);
size_t large_settle_locked(struct large_cache *c, struct lticket **deferred);

/* large_run.c */
#define LARGE_NO_RUN (-1) /* large_run_take: no run serves */
int large_run_take(struct large_cache *c, size_t need, uint64_t stream_id, cudaStream_t stream, struct lblock **out,
                   struct lticket **deferred);

/* large_map.c */
int large_map_under(struct large_cache *c, struct lblock *u);
int large_whole_granules(const struct lblock *b, size_t g, size_t *i, size_t *end);
int large_first_mapped_whole(const struct lblock *b, size_t g, size_t *i, size_t *end);
size_t large_keep(struct large_cache *c);
void large_shrink_before_grow(struct large_cache *c, size_t growing);

#endif /* MAGPIE_LARGE_INTERNAL_H */
