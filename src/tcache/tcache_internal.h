/* Declarations shared by the thread cache's files (tcache.c,
 * tcache_slots.c, tcache_alloc.c, tcache_free.c, tcache_reclaim.c); not the
 * layer's interface, which is tcache.h. Included by those files only. */
#ifndef MAGPIE_TCACHE_INTERNAL_H
#define MAGPIE_TCACHE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <pthread.h>

#include "pool/large.h"
#include "pool/slab.h"
#include "tcache/tcache_upcalls.h"
#include "tcache/tslot.h"

/* The thread caches' process-wide state, owned by this layer (defined in
 * tcache.c). */
typedef struct tcache_state {
  /* Set once: the upcalls when the library is loaded, ops and check by
   * tcache_module_init at set-up (the public layer's set-up publishes them
   * with its release of the ready state; readers are past its acquire). */
  tcache_upcalls up;
  const backend_ops *ops;
  int check;
  int can_steal; /* idle threads' magazines may be taken (membarrier works) */
  /* The thread-exit key (made once). */
  pthread_once_t key_once;
  pthread_key_t key;
  int key_made;
  /* The live caches and the live bytes of retired ones, under list_lock
   * (taken alone: never while calling into the heap, depot or backend). */
  pthread_mutex_t list_lock;
  struct tcache *list;
  /* The caches on the list (threads that allocated and have not exited):
   * written (relaxed) under list_lock as a cache joins and leaves it; read
   * (relaxed) by owners' slow paths for the outbox's bound
   * (tcache_outbox_full), a heuristic that publishes nothing. */
  _Atomic uint32_t ncaches;
  int64_t retired_live[MAGPIE_MAX_DEVICES];
  int64_t retired_kept[MAGPIE_MAX_DEVICES]; /* as retired_live: threads gone */
} tcache_state;

extern tcache_state tcache_st;

/* tcache.c */
int tcache_barrier(void);
tcache *tcache_create(void);
/* The thread's bytes in use for h's device, into the heap's count: past
 * a band (tcache.c), or exactly (a slot retired or recycled, a trim). */
void tcache_publish(tcache *tc, heap *h);
void tcache_publish_exact(tcache *tc, heap *h);
void tcache_honour_ask(tcache *tc);
void tcache_enter_slow(tcache *tc);

/* tcache_slots.c */
void tcache_slot_clear(tslot *ts);
void tcache_slot_index(tcache *tc, const tslot *ts);
uint32_t tcache_next_cap(tslot *ts, unsigned c);
void tcache_outbox_seal(tslot *ts, cudaStream_t handle);
void tcache_outbox_add(tcache *tc, tslot *ts, magazine *m, cudaStream_t handle);
magazine *tcache_outbox_take(tslot *ts, unsigned c);
int tcache_large_release(tslot *ts, void *p, cudaStream_t s, size_t *bsize, int *sealed);
void tcache_kept_attach(tcache *tc, tslot *ts, lblock *b);
/* Does tc keep large blocks for slot ts (tcache_keep_large), and so take
 * them lent (tcache_alloc_large)? Not in checked mode, only while it
 * allocates on ts's stream alone and keeps for no other slot. */
static inline int tcache_keeps_for(const tcache *tc, const tslot *ts) {
  return !tc->check && tc->nalloc == 1 && (tc->kept == NULL || tc->kept == ts);
}
/* Has slot ts's outbox reached its bounds: TCACHE_OUTBOX_* for a thread
 * on its stream alone (as tcache_keeps_for) that gave back through the
 * slot no more than it took there (TCACHE_OUTBOX_CONTENDED_BYTES while
 * threads contend and TCACHE_OUTBOX_CONTENDED_THREADS or more have
 * caches), TCACHE_OUTBOX_FEW* else (a thread freeing another's blocks
 * would hold what only that one uses)? */
static inline int tcache_outbox_full(const tcache *tc, const tslot *ts) {
  if (tcache_keeps_for(tc, ts) && ts->held >= 0) {
    int more = ts->seg_two && atomic_load_relaxed(&tcache_st.ncaches) >= TCACHE_OUTBOX_CONTENDED_THREADS;
    return ts->nout >= TCACHE_OUTBOX || ts->out_bytes >= (more ? TCACHE_OUTBOX_CONTENDED_BYTES : TCACHE_OUTBOX_BYTES);
  }
  return ts->nout >= TCACHE_OUTBOX_FEW || ts->out_bytes >= TCACHE_OUTBOX_FEW_BYTES;
}
/* Blocks a magazine of class blocks of class c holds for slot ts: more for
 * a thread on its stream alone, as its outbox (sizeclass.c). */
static inline uint32_t tcache_seg_cap(const tcache *tc, const tslot *ts, unsigned c) {
  return tcache_keeps_for(tc, ts) ? sizeclass_table[c].mag_max : sizeclass_table[c].mag_cap;
}
/* Remember a large block the slot handed out lent (tslot.lent), in place
 * of the oldest; lent_next stays below TCACHE_LENT. */
static inline void tcache_lent_add(tslot *ts, lblock *b, uintptr_t base, size_t size, uint64_t word) {
  ts->lent_base[ts->lent_next] = base;
  ts->lent[ts->lent_next] = (struct tslot_lent){b, size, word};
  ts->lent_next = (ts->lent_next + 1) % TCACHE_LENT;
}
void tcache_kept_detach(tcache *tc, tslot *ts, uint32_t i);
size_t tcache_kept_out(tcache *tc, tslot *ts, const cudaStream_t *seal_on);
size_t tcache_slot_out(tcache *tc, tslot *ts, const cudaStream_t *seal_on);
/* Does slot ts cache what it could let go before its allocation maps
 * device memory: an outbox, kept large blocks, magazines of class blocks?
 * Then tcache_own_out lets them go under one seal on s (the slot's
 * stream's handle, just passed): class blocks and the outbox to the depot
 * or, past the depot's budget, their segments (heap_put), kept blocks to
 * the large cache. */
int tcache_own_cached(const tslot *ts);
void tcache_own_out(tcache *tc, tslot *ts, cudaStream_t s);
size_t tcache_slot_empty(tcache *tc, tslot *ts);
void tcache_slot_retire(tcache *tc, tslot *ts);
tslot *tcache_slot_for_alloc(tcache *tc, cudaStream_t s, uint64_t id);
tslot *tcache_slot_for_free(tcache *tc, cudaStream_t s, uint64_t id, heap *h);

/* tcache_alloc.c */
size_t tcache_give_back_own(tcache *tc, tslot *cur, cudaStream_t s);
void tcache_relief_end(tcache *tc);
/* record_stream: blocks the thread freed with recorded streams, parked
 * until those completed, back to ts's class c magazine for stream id (take
 * 1), or only counted (take 0); clears TCACHE_RECORDED once none is left
 * (tcache_alloc.c). */
void tcache_claim_recorded(tcache *tc, tslot *ts, unsigned c, uint64_t id, int take);
int tcache_mark_used(slab *sl, uintptr_t p, uint32_t bi);
int tcache_mark_free(slab *sl, uintptr_t p, uint32_t bi);
void tcache_note_held(tslot *ts, unsigned c);

/* tcache_reclaim.c */
tcache **tcache_claim_others(int *n);
int tcache_owner_out(tcache *tc, int barrier);
size_t tcache_reclaim_threads(heap *h);

#endif /* MAGPIE_TCACHE_INTERNAL_H */
