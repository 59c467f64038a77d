/* Thread caches: their life (a thread's cache made on its first slow path,
 * given back at thread exit and in a forked child), the published in-use
 * bytes, the slow paths' entry (the give-back handshake's ask), the
 * statistics and snapshot views of every thread's caches. The stream
 * slots are tcache_slots.c, the slow paths tcache_alloc.c and
 * tcache_free.c, the give-back of other threads' caches tcache_reclaim.c.
 *
 * Lock order: tcache_st.list_lock is taken alone (never while calling into the
 * heap, depot or backend). Everything else here is thread-owned, or taken
 * over from an idle owner through the steal handshake (tcache.h). */
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

static void tcache_destroy(void *arg);

__thread tcache *tcache_tls;

tcache_state tcache_st = {
    .key_once = PTHREAD_ONCE_INIT,
    .list_lock = PTHREAD_MUTEX_INITIALIZER,
};

void tcache_set_upcalls(const tcache_upcalls *up) { tcache_st.up = *up; }

void tcache_module_init(const backend_ops *ops, int check) {
  tcache_st.ops = ops;
  tcache_st.check = check;
  tcache_st.can_steal = syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  heap_set_threads_reclaim(tcache_reclaim_threads);
}

int tcache_barrier(void) {
  return tcache_st.can_steal && syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
}

static void tcache_key_create(void) { tcache_st.key_made = pthread_key_create(&tcache_st.key, tcache_destroy) == 0; }

void tcache_after_fork_child(void) {
  tcache_tls = NULL;
  if (tcache_st.key_made) pthread_setspecific(tcache_st.key, NULL);
}

tcache *tcache_create(void) {
  if (tcache_st.up.ensure == NULL) { /* a call from another library's constructor, before ours ran */
    error_set(MAGPIE_ERR_NO_DEVICE, "magpie was called before its library finished loading");
    return NULL;
  }
  if (tcache_st.up.ensure() != MAGPIE_OK) return NULL; /* error already set */
  pthread_once(&tcache_st.key_once, tcache_key_create);
  tcache *tc = meta_alloc(sizeof *tc);
  if (tc == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a thread cache");
    return NULL;
  }
  tc->ops = tcache_st.ops;
  tc->check = tcache_st.check;
  tcache_slot_clear(&tc->dummy);
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tcache_slot_clear(&tc->slots[i]);
    tcache_slot_index(tc, &tc->slots[i]);
  }
  tc->last = &tc->dummy;
  atomic_store_relaxed(&tc->busy, 1); /* created inside a slow path */
  pthread_mutex_lock(&tcache_st.list_lock);
  tc->lnext = tcache_st.list;
  if (tcache_st.list) tcache_st.list->lprev = tc;
  tcache_st.list = tc;
  atomic_add_relaxed(&tcache_st.ncaches, 1);
  pthread_mutex_unlock(&tcache_st.list_lock);
  pthread_setspecific(tcache_st.key, tc);
  tcache_tls = tc;
  return tc;
}

/* A thread publishes its bytes in use once they rose TCACHE_PUBLISH_UP or
 * fell TCACHE_PUBLISH_DOWN since it last did: the heap's count is one word
 * all threads add to, and threads publishing every change at every slow
 * path contended on it (bench/DECISIONS.md, "In-use bytes published past a
 * band"). The count so runs up to TCACHE_PUBLISH_DOWN per thread above
 * what is in use, and raising the peak to it overstated the peak: a rise
 * that takes the count past the peak raises it to the sum of the threads'
 * own counts instead (tcache_raise_peak), which misses a peak by at most
 * what threads have not published yet and never passes one. */
#define TCACHE_PUBLISH_UP ((int64_t)1 << 20)
#define TCACHE_PUBLISH_DOWN ((int64_t)4 << 20)

/* Under tcache_st.list_lock: the live bytes of every thread, past and
 * present, for device, and (kept non-NULL) the bytes of the large blocks
 * they keep. */
static int64_t tcache_live_sum_locked(int device, int64_t *kept) {
  int64_t sum = tcache_st.retired_live[device], k = tcache_st.retired_kept[device];
  for (tcache *tc = tcache_st.list; tc; tc = tc->lnext) {
    sum += atomic_load_relaxed(&tc->live[device]);
    if (kept != NULL) k += atomic_load_relaxed(&tc->kept_bytes[device]);
  }
  if (kept != NULL) *kept = k;
  return sum;
}

/* The heap's peak in use raised to what is in use now: the threads' counts
 * (as statistics read them) and graph pools' blocks. Only tries the list's
 * lock: a thread that finds it held leaves the raise to a later one. */
static void tcache_raise_peak(heap *h) {
  if (pthread_mutex_trylock(&tcache_st.list_lock) != 0) return;
  int64_t sum = tcache_live_sum_locked(h->device, NULL);
  pthread_mutex_unlock(&tcache_st.list_lock);
  sum += (int64_t)atomic_load_relaxed(&h->graphs.bytes);
  if (sum > 0) heap_raise_peak(h, (size_t)sum);
}

static void tcache_publish_delta(tcache *tc, heap *h, int64_t live) {
  int64_t delta = live - tc->published[h->device];
  tc->published[h->device] = live;
  int64_t now = heap_count_in_use(h, delta);
  if (delta > 0 && now > 0 && (size_t)now > atomic_load_relaxed(&h->stat_peak_in_use)) tcache_raise_peak(h);
}

void tcache_publish(tcache *tc, heap *h) {
  int64_t live = atomic_load_relaxed(&tc->live[h->device]), delta = live - tc->published[h->device];
  if (delta >= TCACHE_PUBLISH_UP || delta <= -TCACHE_PUBLISH_DOWN) tcache_publish_delta(tc, h, live);
}

void tcache_publish_exact(tcache *tc, heap *h) {
  int64_t live = atomic_load_relaxed(&tc->live[h->device]);
  if (live != tc->published[h->device]) tcache_publish_delta(tc, h, live);
}

/* A reclaimer asked this thread (the owner) to give back: every
 * magazine goes to limbo, and the request is cleared only once that is
 * done (the reclaimer may be waiting to find them there). */
void tcache_honour_ask(tcache *tc) {
  if (likely((atomic_load_relaxed(&tc->steal) & TCACHE_ASKED) == 0)) return;
  tdrain_flush(tc, NULL);
  int flushed = 0;
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tslot *ts = &tc->slots[i];
    if (ts->heap == NULL || tcache_slot_empty(tc, ts) == 0) continue;
    if (!flushed++) atomic_add_relaxed(&ts->heap->stat_threads_flushed, 1);
  }
  atomic_and_release(&tc->steal, ~TCACHE_ASKED);
}

/* Entry to a slow path: wait out a reclaimer at work on this cache, then
 * give back if one asked. */
void tcache_enter_slow(tcache *tc) {
  tcache_enter(tc);
  while ((atomic_load_acquire(&tc->steal) & TCACHE_CLAIMED) != 0) sched_yield();
  tcache_relief_end(tc);
  tcache_honour_ask(tc);
}

static void tcache_destroy(void *arg) {
  tcache *tc = arg;
  /* Leave the list first, so no new reclaimer can pick this cache, then
   * wait out one that already did (it set steal under the list lock). */
  atomic_store_relaxed(&tc->busy, 1);
  atomic_thread_fence(memory_order_seq_cst);
  pthread_mutex_lock(&tcache_st.list_lock);
  if (tc->lprev) tc->lprev->lnext = tc->lnext;
  else tcache_st.list = tc->lnext;
  if (tc->lnext) tc->lnext->lprev = tc->lprev;
  atomic_sub_relaxed(&tcache_st.ncaches, 1);
  pthread_mutex_unlock(&tcache_st.list_lock);
  while ((atomic_load_acquire(&tc->steal) & TCACHE_CLAIMED) != 0) sched_yield();
  tdrain_flush(tc, NULL);
  tcache_spare_release(tc);
  for (int i = 0; i < TCACHE_SLOTS; i++)
    if (tc->slots[i].heap != NULL) tcache_slot_retire(tc, &tc->slots[i]);
  pthread_mutex_lock(&tcache_st.list_lock);
  for (int d = 0; d < HEAP_MAX_DEVICES; d++) {
    tcache_st.retired_live[d] += atomic_load_relaxed(&tc->live[d]);
    tcache_st.retired_kept[d] += atomic_load_relaxed(&tc->kept_bytes[d]);
  }
  pthread_mutex_unlock(&tcache_st.list_lock);
  tcache_tls = NULL;
  meta_free(tc);
}

int64_t tcache_live_bytes(int device, int64_t *kept) {
  *kept = 0;
  if (device < 0 || device >= HEAP_MAX_DEVICES) return 0;
  pthread_mutex_lock(&tcache_st.list_lock);
  int64_t sum = tcache_live_sum_locked(device, kept);
  pthread_mutex_unlock(&tcache_st.list_lock);
  return sum;
}

void tcache_class_counts(heap *h, uint64_t *hits, uint64_t *misses) {
  pthread_mutex_lock(&tcache_st.list_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    hits[c] += atomic_load_relaxed(&h->stat_class_hits[c]);
    misses[c] += atomic_load_relaxed(&h->stat_class_misses[c]);
  }
  for (tcache *tc = tcache_st.list; tc; tc = tc->lnext) {
    for (int i = 0; i < TCACHE_SLOTS; i++) {
      tslot *ts = &tc->slots[i];
      if (atomic_load_relaxed(&ts->stats_heap) != h) continue;
      for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
        hits[c] += atomic_load_relaxed(&ts->cl[c].hits);
        misses[c] += atomic_load_relaxed(&ts->cl[c].misses);
      }
    }
  }
  pthread_mutex_unlock(&tcache_st.list_lock);
}

int tcache_inspect(heap *h, void (*fn)(void *ctx, const magazine *m, int loaded), void *ctx) {
  tcache *self = tcache_tls;
  int n = 0, skipped = 0;
  tcache **all = tcache_claim_others(&n);
  int barrier = tcache_barrier();
  if (self) tcache_enter_slow(self);
  for (int i = 0; i <= n; i++) {
    tcache *tc = i < n ? all[i] : self;
    if (tc == NULL) continue;
    if (tc != self && !tcache_owner_out(tc, barrier)) {
      skipped++;
    } else {
      for (int k = 0; k < TCACHE_SLOTS; k++) {
        tslot *ts = &tc->slots[k];
        if (ts->heap != h) continue;
        for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
          if (magazine_is_real(ts->cl[c].loaded)) fn(ctx, ts->cl[c].loaded, 1);
          if (magazine_is_real(ts->prev[c])) fn(ctx, ts->prev[c], 0);
        }
        for (uint32_t j = 0; j < ts->nout; j++) fn(ctx, ts->outbox[j], 0);
      }
      tdrain_inspect(tc, h, fn, ctx);
    }
    if (tc != self) atomic_and_release(&tc->steal, ~TCACHE_CLAIMED);
  }
  if (self) tcache_leave(self);
  meta_free(all);
  return skipped;
}
