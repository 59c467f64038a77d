/* Threads that take turns on many streams.
 *
 * A thread keeps TCACHE_SLOTS stream slots (tcache/tslot.h). When it takes
 * turns on more streams than that, a slot must be taken for another
 * stream while it still holds blocks freed on its own; its handle may be
 * gone by then (a stored handle is never passed to the driver again), so
 * those blocks went to limbo and waited for a device synchronisation, and
 * a thread taking turns on 33 streams held gigabytes where one stream
 * needed megabytes (bench/DECISIONS.md, "Threads on many streams drain
 * their slots").
 *
 * So a thread with TDRAIN_SLOTS streams or more arms each slot it moves to
 * (tdrain_enter), and the free that brings the slot back to its level at
 * that moment -- the visit gave back what it took -- drains it
 * (tdrain_slot) with one seal on the handle that free passed: the slot
 * keeps nothing that needs a seal, and is taken for the next stream as it
 * is. The thread carries the blocks ready for every stream (tcache.carry)
 * from slot to slot; what a visit freed waits, sealed, in the thread
 * (tcache.sealed) until its seal completes (one query per drain), then
 * joins the carried blocks. */
#ifndef MAGPIE_TDRAIN_H
#define MAGPIE_TDRAIN_H

#include <string.h>

#include "tcache/tslot.h"

/* From this many alloc-capable slots in use (of TCACHE_SLOTS), a thread
 * drains each slot: below it, a slot's blocks stay for its stream's next
 * visit. Short of the full 32, so that a thread reaching its 33rd stream
 * finds drained slots to take. */
#ifdef MAGPIE_TEST_TDRAIN_SLOTS /* test builds that drain from fewer streams (tests/fuzz/BUILD) */
#define TDRAIN_SLOTS MAGPIE_TEST_TDRAIN_SLOTS
#else
#define TDRAIN_SLOTS 24
#endif

/* The thread moves to slot ts to allocate: arm it, and while the thread
 * drains, hand the slot the carried blocks. */
void tdrain_enter(tcache *tc, tslot *ts);
/* The free (on s, whose id matched ts's) that brought an armed slot back
 * to its level: seal what ts holds (ts keeps no large block: the caller
 * sent it out first). MAGPIE_OK, or the seal's error with ts unchanged. */
int tdrain_slot(tcache *tc, tslot *ts, cudaStream_t s);
/* An armed slot's allocation of class c found nothing of its own: the
 * carried magazine of the class, installed as the slot's (or NULL). */
magazine *tdrain_carry_take(tcache *tc, tslot *ts, unsigned c);
/* Drained magazines whose seals completed join the carried blocks. */
void tdrain_promote(tcache *tc);
/* Every drained magazine of heap h (any heap: NULL) goes to its depot
 * with its ticket, and the carried blocks of h as ready. Their bytes. */
size_t tdrain_flush(tcache *tc, heap *h);
/* Snapshots (tcache_inspect): fn on every drained magazine of heap h and
 * every carried one of h, as not loaded. */
void tdrain_inspect(tcache *tc, heap *h, void (*fn)(void *ctx, const magazine *m, int loaded), void *ctx);

/* A slot taken for another stream starts unarmed, with nothing counted
  * and nothing noted as carried (tcache_slots.c: clear and recycle). */
static inline void tdrain_slot_reset(tslot *ts) {
  ts->held = 0;
  ts->drain_at = INT64_MIN;
  memset(ts->clean, 0, sizeof ts->clean);
}

/* Is slot ts drained, with nothing that would need a seal to leave it? */
static inline int tdrain_clean(const tslot *ts) { return ts->drained && ts->nout == 0 && ts->nkeep == 0; }

#endif /* MAGPIE_TDRAIN_H */
