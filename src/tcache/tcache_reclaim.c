/* Giving back other threads' caches under pressure (the heap's ladder,
 * heap_set_threads_reclaim): idle threads' magazines are taken, busy ones
 * are asked and waited for (bounded); a retired stream's slots are sealed;
 * a thread's own magazines are flushed.
 *
 * Lock order: tcache_st.list_lock alone (tcache.c). */
#include "tcache/tcache.h"

#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/error.h"
#include "base/meta.h"
#include "base/ticks.h"
#include "pool/record.h"
#include "tcache/tcache_internal.h"
#include "tcache/tdrain.h"

/* Caches other than the caller's, each claimed (TCACHE_CLAIMED) under the
 * list lock; *n set. The array comes from host metadata (NULL if none). */
tcache **tcache_claim_others(int *n) {
  tcache *self = tcache_tls;
  *n = 0;
  pthread_mutex_lock(&tcache_st.list_lock);
  int count = 0;
  for (tcache *tc = tcache_st.list; tc; tc = tc->lnext) count++;
  tcache **all = count ? meta_alloc((size_t)count * sizeof *all) : NULL;
  if (all != NULL) {
    for (tcache *tc = tcache_st.list; tc; tc = tc->lnext) {
      if (tc == self || (atomic_load_relaxed(&tc->steal) & TCACHE_CLAIMED) != 0) continue;
      /* A read-modify-write that acquires: it reads the last reclaimer's
       * release of the claim (and the owner's of TCACHE_ASKED), so what
       * those did to this cache happens before what this one does, and
       * before the owner's next acquire of the clear this one releases (a
       * plain store would start a new release sequence and cut that chain:
       * ThreadSanitizer saw the owner's read race with an earlier
       * reclaimer's write). */
      atomic_or_acq_rel(&tc->steal, TCACHE_CLAIMED);
      all[(*n)++] = tc;
    }
  }
  pthread_mutex_unlock(&tcache_st.list_lock);
  return all;
}

/* Is tc's owner outside magpie, so that its caches may be read or taken?
 * Only after the barrier (tcache_barrier) that followed claiming tc; the
 * acquire pairs with the owner's release store of busy = 0. */
int tcache_owner_out(tcache *tc, int barrier) { return barrier && atomic_load_acquire(&tc->busy) == 0; }

/* Hand tc's magazines of heap h to limbo; returns their bytes. The caller
 * owns tc: it is the calling thread's, or its owner is out. */
static size_t tcache_empty_heap(tcache *tc, heap *h) {
  size_t got = tdrain_flush(tc, h);
  for (int k = 0; k < TCACHE_SLOTS; k++)
    if (tc->slots[k].heap == h) got += tcache_slot_empty(tc, &tc->slots[k]);
  return got;
}

/* One pass of the give-back step: take idle threads' magazines of h; ask
 * busy ones to give theirs back (ask: only on the first pass). Returns the
 * bytes taken; *waiting counts the busy threads asked that have not given
 * back yet and are not themselves down the ladder. */
static size_t tcache_reclaim_pass(heap *h, int ask, int *waiting) {
  int n = 0;
  tcache **all = tcache_claim_others(&n);
  *waiting = 0;
  if (all == NULL) return 0;
  int barrier = tcache_barrier();
  size_t bytes = 0;
  for (int i = 0; i < n; i++) {
    tcache *tc = all[i];
    uint32_t clear = TCACHE_CLAIMED;
    if (tcache_owner_out(tc, barrier)) {
      size_t got = tcache_empty_heap(tc, h);
      if (got) atomic_add_relaxed(&h->stat_threads_stolen, 1);
      bytes += got;
      clear |= TCACHE_ASKED; /* nothing left to give back */
    } else {
      if (ask) atomic_or_relaxed(&tc->steal, TCACHE_ASKED);
      if ((atomic_load_relaxed(&tc->steal) & TCACHE_ASKED) != 0 && !atomic_load_relaxed(&tc->relieving)) (*waiting)++;
    }
    atomic_and_release(&tc->steal, ~clear);
  }
  meta_free(all);
  return bytes;
}

/* How long a reclaimer waits for busy threads to give back: they do at
 * their next operation, within microseconds unless the owner is descheduled
 * or inside a long call of its own; the bound keeps a thread stuck inside
 * magpie (a device synchronisation) from stalling the allocation for
 * longer. */
#define TCACHE_ASK_WAIT_NS (50 * 1000 * 1000)

/* The heap's give-back step: take idle threads' magazines of h, ask busy
 * threads to give theirs back at their next operation, and wait (bounded)
 * until they have, taking those that went idle meanwhile. An allocation
 * that fails after this step then fails with every thread's magazines
 * given back, as docs/design.md promises: before the wait, one allocation of
 * stream_rotation_test's four threads under a 24 MiB limit failed in about
 * one run in twenty, with 16 MiB in busy threads' magazines and 0.4 MiB in
 * use. */
size_t tcache_reclaim_threads(heap *h) {
  tcache *self = tcache_tls;
  size_t bytes = 0;
  if (self != NULL && self->relief_slot != NULL) {
    /* Inside an allocation (so marked busy: no reclaimer takes this cache
     * meanwhile). Its own magazines first, as after the heap's call (the
     * state is the same), and any other thread's request to give back is
     * met. Others then need not wait for this thread. magpie_trim's caller
     * gave back before, and is not marked busy: it is left alone. */
    if (self->relief_slot->heap == h) bytes += tcache_give_back_own(self, self->relief_slot, self->relief_stream);
    tcache_honour_ask(self);
    atomic_store_relaxed(&self->relieving, 1);
  }
  int waiting = 0;
  bytes += tcache_reclaim_pass(h, 1, &waiting);
  uint64_t deadline = waiting ? ticks_now_ns() + TCACHE_ASK_WAIT_NS : 0;
  for (unsigned round = 0; waiting > 0 && ticks_now_ns() < deadline; round++) {
    if (round < 16) sched_yield();
    else ticks_sleep_ns(100 * 1000);
    bytes += tcache_reclaim_pass(h, 0, &waiting);
  }
  return bytes;
}

void tcache_stream_retire(cudaStream_t s, uint64_t id) {
  tcache *tc = tcache_tls;
  if (tc == NULL) return;
  tcache_enter_slow(tc);
  for (int k = 0; k < TCACHE_SLOTS; k++) {
    tslot *ts = &tc->slots[k];
    if (ts->heap == NULL || ts->id != id) continue;
    /* Sealed on s (still valid: the caller retires it before destroying
     * it) to the depot, so retiring the slot sends nothing to limbo. */
    tcache_slot_out(tc, ts, &s);
    tcache_slot_retire(tc, ts);
  }
  tcache_leave(tc);
}

void tcache_flush_self(heap *h) {
  tcache *tc = tcache_tls;
  if (tc == NULL) return;
  tcache_enter_slow(tc);
  tcache_empty_heap(tc, h);
  tcache_publish_exact(tc, h); /* a trim sees this thread's bytes in use as they are */
  tcache_leave(tc);
}
