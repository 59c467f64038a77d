/* Threads that take turns on many streams: slots drained when a visit
 * gives back what it took, blocks carried from stream to stream, drained
 * magazines waiting for their seals (tdrain.h).
 *
 * Lock order: takes no lock of its own; a seal takes the stream's
 * seal_lock (a leaf, pool/epoch.c), a query may too. Everything here is
 * the calling thread's (or a reclaimer's while the owner is out). */
#include "tcache/tdrain.h"

#include <string.h>

#include "base/assert.h"
#include "pool/depot.h"
#include "pool/epoch.h"

/* Arm slot ts as its thread moves to it to allocate: when the thread has
 * TDRAIN_SLOTS streams or more, the free that brings the slot back
 * to its present level drains it. Checked mode keeps no last slot (every
 * call is a move) and drains nothing. */
static void tdrain_arm(tcache *tc, tslot *ts) {
  ts->drain_at = !tc->check && tc->nalloc >= TDRAIN_SLOTS ? ts->held : INT64_MIN;
}

static void tdrain_carry_install(tcache *tc, tslot *ts);

/* The thread moves to slot ts to allocate: arm it, and while it drains
 * its slots, hand it the carried blocks. */
void tdrain_enter(tcache *tc, tslot *ts) {
  tdrain_arm(tc, ts);
  if (ts->drain_at == INT64_MIN) return;
  if (tc->sealed_n > 0) tdrain_promote(tc);
  tdrain_carry_install(tc, ts);
}

/* Drained magazines (tcache.sealed). A magazine of heap h leaves the
 * thread for h's depot (its ticket released first if `ready`). */
static void tdrain_leave(heap *h, magazine *m, int ready) {
  depot *d = &h->depots[m->cls];
  depot_note_thread_out(d, m);
  if (ready) epoch_ticket_release(&m->ticket);
  depot_put(d, m);
}

/* The carried blocks leave for their heap's depot, ready. Returns their
 * bytes. */
static size_t tdrain_carry_flush(tcache *tc) {
  size_t bytes = 0;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    magazine *m = tc->carry[c];
    if (m == NULL) continue;
    bytes += depot_magazine_bytes(m);
    tdrain_leave(tc->carry_heap, m, 0);
    tc->carry[c] = NULL;
  }
  tc->carry_heap = NULL;
  return bytes;
}

static tsealed *tdrain_at(tcache *tc, uint32_t i) { return &tc->sealed[(tc->sealed_head + i) % TCACHE_SEALED]; }

/* Entries i+1.. that share entry i's seal get tickets of their own (before
 * entry i leaves the thread without them). */
static void tdrain_split(tcache *tc, uint32_t i) {
  const epoch_ticket *t = &tdrain_at(tc, i)->m->ticket;
  for (uint32_t j = i + 1; j < tc->sealed_n; j++) {
    tsealed *e = tdrain_at(tc, j);
    if (!e->same) break;
    epoch_ticket_copy(t, &e->m->ticket);
    e->same = 0;
  }
}

/* The oldest entry leaves the ring. */
static void tdrain_pop(tcache *tc) {
  tc->sealed_head = (tc->sealed_head + 1) % TCACHE_SEALED;
  tc->sealed_n--;
}

/* A sealed magazine joins the ring: holding its ticket, or (same) sealed
 * by the newest entry's seal, with no ticket. A full ring sends its oldest
 * entry to the depot, pending. */
static void tdrain_push(tcache *tc, heap *h, magazine *m, int same) {
  MAGPIE_ASSERT(m->count > 0 && (same ? m->ticket.rec == NULL && tc->sealed_n > 0 : m->ticket.rec != NULL));
  if (tc->sealed_n == TCACHE_SEALED) {
    tsealed *old = tdrain_at(tc, 0);
    tdrain_split(tc, 0);
    tdrain_leave(old->h, old->m, 0);
    tdrain_pop(tc);
  }
  *tdrain_at(tc, tc->sealed_n) = (tsealed){m, h, same};
  tc->sealed_n++;
}

/* A ready magazine m (no ticket) of heap h joins the thread's carried
 * blocks: as carry[c] if there is none (or none of h's: those leave
 * first), appended to it if they fit (m becomes a spare), else to the
 * depot. */
static void tdrain_carry_add(tcache *tc, heap *h, magazine *m) {
  MAGPIE_ASSERT(m->ticket.rec == NULL && m->count > 0);
  unsigned c = m->cls;
  if (tc->carry_heap != h) tdrain_carry_flush(tc);
  tc->carry_heap = h;
  magazine *k = tc->carry[c];
  if (k == NULL) {
    tc->carry[c] = m;
  } else if (k->count + m->count <= k->cap) {
    memcpy(&k->slots[k->count], m->slots, m->count * sizeof m->slots[0]);
    k->count += m->count;
    tcache_spare_give(tc, m);
  } else {
    depot *d = &h->depots[c];
    depot_note_thread_out(d, m);
    depot_put(d, m);
  }
}

/* Before a refill or a move to another stream: the oldest drained
 * magazines whose seals completed are ready for every stream and join the
 * carried blocks. Stops at the first still pending; asks about it once per
 * drain (one query answers for every magazine of a drain). Seals on
 * different streams complete in any order, but those of one thread's
 * drains were made in turn, so the oldest is the likeliest done. */
void tdrain_promote(tcache *tc) {
  while (tc->sealed_n > 0 && tc->head_pending != tc->drains) {
    tsealed *e = tdrain_at(tc, 0);
    MAGPIE_ASSERT(!e->same);
    if (epoch_ready(&e->m->ticket, EPOCH_NO_STREAM) != EPOCH_READY_DONE) {
      tc->head_pending = tc->drains;
      return;
    }
    epoch_ticket_release(&e->m->ticket);
    do {
      tdrain_carry_add(tc, e->h, e->m);
      tdrain_pop(tc);
    } while (tc->sealed_n > 0 && (e = tdrain_at(tc, 0))->same);
  }
}

/* Every drained magazine of heap h (any heap with h NULL) leaves for its
 * depot, pending, each with its ticket (the magazines of one drain are of
 * one heap). Returns their bytes, the carried blocks' included. */
size_t tdrain_flush(tcache *tc, heap *h) {
  size_t bytes = 0;
  uint32_t n = tc->sealed_n, keep = 0;
  for (uint32_t i = 0; i < n; i++) {
    tsealed *e = tdrain_at(tc, i);
    if (h == NULL || e->h == h) tdrain_split(tc, i);
  }
  for (uint32_t i = 0; i < n; i++) {
    tsealed e = *tdrain_at(tc, i);
    if (h != NULL && e.h != h) {
      *tdrain_at(tc, keep++) = e;
      continue;
    }
    bytes += depot_magazine_bytes(e.m);
    tdrain_leave(e.h, e.m, 0);
  }
  tc->sealed_n = keep;
  if (tc->carry_heap != NULL && (h == NULL || tc->carry_heap == h)) bytes += tdrain_carry_flush(tc);
  return bytes;
}

/* One magazine of a drain sealed by *t: the first takes the ticket over
 * (*given set), the others share it. */
static void tdrain_seal_one(tcache *tc, heap *h, magazine *m, const epoch_ticket *t, int *given) {
  if (!*given) m->ticket = *t;
  tdrain_push(tc, h, m, *given);
  *given = 1;
}

/* The free that brought an armed slot back to its level: the thread gave
 * back all it took on this visit to the stream, and is likely to move on.
 * What the slot holds that was freed on s (the caller's handle, whose id
 * matched) is sealed there and waits in the thread; the untouched carried
 * blocks go on unsealed; nothing in the slot needs a seal when it is taken
 * for another stream (bench/DECISIONS.md, "Threads on many streams drain
 * their slots"). The empty magazines stay, in prev, for the slot's next
 * frees; every loaded one becomes the sentinel, so the slot's next
 * allocation or free of any class takes a slow path, which clears
 * `drained`. */
int tdrain_slot(tcache *tc, tslot *ts, cudaStream_t s) {
  MAGPIE_ASSERT(ts->nkeep == 0); /* the caller sealed it out first */
  ts->drain_at = INT64_MIN;
  epoch_ticket t;
  int rc = epoch_seal(ts->rec, s, &t);
  if (rc != MAGPIE_OK) return rc;
  tc->drains++;
  /* What needs the seal joins tcache.sealed, the first magazine holding
   * the ticket and the others marked as sharing it: the outbox, the
   * previous magazines, and the part of each loaded one above its
   * untouched bottom, which the thread carries on unsealed. */
  int given = 0;
  for (uint32_t i = 0; i < ts->nout; i++) tdrain_seal_one(tc, ts->heap, ts->outbox[i], &t, &given);
  ts->nout = 0;
  ts->out_bytes = 0;
  uint64_t used = ts->used, still = 0;
  while (used != 0) {
    unsigned c = (unsigned)__builtin_ctzll(used);
    used &= used - 1;
    magazine *pv = ts->prev[c];
    if (magazine_is_real(pv) && pv->count > 0) {
      tdrain_seal_one(tc, ts->heap, pv, &t, &given);
      ts->prev[c] = &magazine_sentinel;
    }
    magazine *m = ts->cl[c].loaded;
    if (magazine_is_real(m)) {
      ts->cl[c].loaded = &magazine_sentinel;
      uint32_t keep = 0;
      if (ts->clean[c] > 0) { /* else clean_mark is stale (a cleared slot's counters start over) */
        uint64_t took = tslot_allocs(ts, c) - ts->clean_mark[c];
        keep = ts->clean[c] > took ? ts->clean[c] - (uint32_t)took : 0;
      }
      if (keep > m->count) keep = m->count;
#ifdef MAGPIE_TEST_BREAK_DRAIN_SEAL /* deliberately broken build: tests/BUILD expects its test to fail */
      keep = m->count;
#endif
      ts->clean[c] = 0;
      if (keep > 0 && (tc->carry[c] != NULL || (tc->carry_heap != NULL && tc->carry_heap != ts->heap))) keep = 0;
      if (keep < m->count) {
        /* The blocks above the untouched ones were freed on s, or handed
         * out since: sealed, in a magazine of their own if some stay. */
        magazine *top = keep > 0 ? tcache_spare_take(tc, c) : m;
        if (top == NULL) {
          top = m; /* out of host memory for a magazine: all of it sealed */
          keep = 0;
        } else if (top != m) {
          top->count = m->count - keep;
          memcpy(top->slots, &m->slots[keep], top->count * sizeof m->slots[0]);
          m->count = keep;
        }
        tdrain_seal_one(tc, ts->heap, top, &t, &given);
        if (keep == 0) m = NULL;
      }
      if (m != NULL && m->count > 0) {
        tc->carry_heap = ts->heap;
        tc->carry[c] = m;
      } else if (m != NULL) {
        /* Empty: kept in prev for the slot's next frees. */
        if (!magazine_is_real(ts->prev[c])) ts->prev[c] = m;
        else tcache_spare_give(tc, m);
      }
    }
    if (magazine_is_real(ts->prev[c])) still |= (uint64_t)1 << c;
  }
  ts->used = still;
  if (!given) epoch_ticket_release(&t);
  heap_note_cached(ts->heap);
  ts->drained = 1;
  return MAGPIE_OK;
}

/* An armed slot of the carried blocks' heap takes them as the loaded
 * magazines of the classes it has none of (every class, after a drain),
 * each noted as untouched. */
/* Carried magazine m of class c becomes slot ts's loaded one: all its
 * blocks are untouched from now (INVARIANT, tslot.h). `counted`: the
 * allocation being served is counted already and pops after, so the mark
 * goes before it. */
static void tdrain_note_carried(tslot *ts, unsigned c, const magazine *m, int counted) {
  ts->clean[c] = (uint8_t)m->count;
  ts->clean_mark[c] = tslot_allocs(ts, c) - (uint64_t)counted;
  ts->used |= (uint64_t)1 << c;
}

static void tdrain_carry_install(tcache *tc, tslot *ts) {
  if (tc->carry_heap != ts->heap) return;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    magazine *m = tc->carry[c];
    if (m == NULL || magazine_is_real(ts->cl[c].loaded)) continue;
    tc->carry[c] = NULL;
    ts->cl[c].loaded = m;
    tdrain_note_carried(ts, c, m, 0);
    ts->drained = 0;
  }
}

magazine *tdrain_carry_take(tcache *tc, tslot *ts, unsigned c) {
  if (ts->drain_at == INT64_MIN) return NULL;
  if (tc->sealed_n > 0) tdrain_promote(tc);
  magazine *m = tc->carry_heap == ts->heap ? tc->carry[c] : NULL;
  if (m == NULL) return NULL;
  tc->carry[c] = NULL;
  tdrain_note_carried(ts, c, m, 1);
  return m;
}

void tdrain_inspect(tcache *tc, heap *h, void (*fn)(void *ctx, const magazine *m, int loaded), void *ctx) {
  for (uint32_t j = 0; j < tc->sealed_n; j++) {
    const tsealed *e = tdrain_at(tc, j);
    if (e->h == h) fn(ctx, e->m, 0);
  }
  if (tc->carry_heap != h) return;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++)
    if (tc->carry[c] != NULL) fn(ctx, tc->carry[c], 0);
}
