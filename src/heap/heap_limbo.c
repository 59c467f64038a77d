/* The heap's limbo and the maintenance thread: blocks waiting for a device
 * synchronisation (heap.h, "Limbo"), the one background thread per process
 * that drains them, gives back memory above a release threshold and
 * refills event pools, the hold captures put on it, graph pools' blocks
 * leaving for limbo.
 *
 * Lock order: heap_st.reaper_lock, klimbo_lock and gpool_set.lock are
 * leaves. None is held across a device synchronisation (the exit handler
 * waits on heap_st.reaper_idle_cv, which releases heap_st.reaper_lock). */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "base/meta.h"
#include "base/ticks.h"
#include "heap/heap.h"
#include "heap/heap_internal.h"

/* ---- limbo and the maintenance thread ----
 *
 * One background thread per process: it drains limbo (a device
 * synchronisation, never on an allocation path), for heaps with a release
 * threshold gives cached memory above it back to the driver, and refills
 * event pools that run low, so that no driver call of those kinds lands on
 * an allocation path. */

/* Its state is heap_st.reaper_* (above). Process exit: the
 * thread must not call the driver once the CUDA runtime's exit handlers
 * tear it down. heap_reaper_atexit (registered when the thread starts, so
 * after CUDA's own handlers and run before them) sets reaper_stop and
 * waits while reaper_busy (a round of driver calls is under way). */

/* Move everything in h's limbo to the depot once the device has drained.
 * The chain is taken before the synchronisation, so every magazine in it
 * was put there (and its stream's work enqueued) before the wait began. */
typedef struct heap_kept {
  lblock *b;
  uint64_t sync_devs; /* as magazine.sync_devs */
  struct heap_kept *next;
} heap_kept;

/* The devices an entry of h's limbo freed on a stream of device sdev
 * waits for (heap.h, "Limbo"). */
static uint64_t heap_sync_devs(const heap *h, int sdev) {
  uint64_t own = (uint64_t)1 << h->device;
  if (sdev == HEAP_SYNC_EVERY_DEVICE) return ~(uint64_t)0;
  return sdev >= 0 && sdev < HEAP_MAX_DEVICES ? own | (uint64_t)1 << sdev : own;
}

/* Synchronise every device of devs that exists; 1 if all succeeded. */
static int heap_sync_devices(heap *h, uint64_t devs) {
  int n = 0;
  if (h->ops->device_count(&n) != MAGPIE_OK || n <= h->device) n = h->device + 1;
  int ok = 1;
  for (int d = 0; d < n && d < HEAP_MAX_DEVICES; d++)
    if ((devs >> d) & 1) ok &= h->ops->device_synchronize(d) == MAGPIE_OK;
  return ok;
}

static void heap_klimbo_push(heap *h, heap_kept *n) {
  pthread_mutex_lock(&h->klimbo_lock);
  n->next = h->klimbo;
  h->klimbo = n;
  pthread_mutex_unlock(&h->klimbo_lock);
}

/* Free the kept large blocks of chain (ready: the device drained), or with
 * ok 0 put them back in limbo. */
static void heap_reap_kept(heap *h, heap_kept *chain, int ok) {
  for (heap_kept *n = chain, *next; n; n = next) {
    next = n->next;
    if (!ok) {
      heap_klimbo_push(h, n);
      continue;
    }
    lblock *b = n->b;
    size_t bsize = 0;
    uintptr_t p = b->base;
    atomic_sub_relaxed(&h->stat_limbo_bytes, (int64_t)b->size);
    atomic_sub_relaxed(&h->stat_kept_limbo_bytes, (int64_t)b->size);
    large_unkeep(b);
    large_free(&h->large, p, &(epoch_ticket){0}, &bsize);
    meta_free(n);
  }
}

/* Partial magazines of blocks freed on capturing streams go to limbo.
 * Under klimbo_lock. */
static void heap_lpart_flush_locked(heap *h) {
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    magazine *m = h->lpart[c];
    if (m == NULL) continue;
    h->lpart[c] = NULL;
    atomic_add_relaxed(&h->stat_limbo_bytes, (int64_t)depot_magazine_bytes(m));
    atomic_add_relaxed(&h->stat_limbo, 1);
    stack_push(&h->limbo, &magazine_st.registry, &m->link);
  }
}

static void heap_reap(heap *h) {
  /* Announced, then looked at (seq_cst both, against heap_capture_hold's
   * "hold, then look at reaping"): either this reap sees the capture and
   * makes no synchronisation, or the capture's announcement waits for this
   * reap to end before it returns. */
  atomic_fetch_add_explicit(&h->reaping, 1, memory_order_seq_cst);
  if (atomic_load_explicit(&heap_st.captures, memory_order_seq_cst) > 0) {
    atomic_sub_acq_rel(&h->reaping, 1);
    return;
  }
  pthread_mutex_lock(&h->klimbo_lock);
  heap_lpart_flush_locked(h);
  heap_kept *kchain = h->klimbo;
  h->klimbo = NULL;
  pthread_mutex_unlock(&h->klimbo_lock);
  registry_link *chain = stack_take_all(&h->limbo, &magazine_st.registry);
  struct record_entry *rchain = record_sync_take(&h->records);
  if (chain != NULL || kchain != NULL || rchain != NULL) {
    /* The devices every entry taken waits for (heap.h, "Limbo"). */
    uint64_t devs = ((uint64_t)1 << h->device) | record_sync_devs(rchain);
    for (registry_link *n = chain; n; n = stack_next(&magazine_st.registry, n)) devs |= ((magazine *)n)->sync_devs;
    for (heap_kept *n = kchain; n; n = n->next) devs |= n->sync_devs;
    atomic_add_relaxed(&h->stat_device_syncs, 1);
    int ok = heap_sync_devices(h, devs);
    atomic_fetch_add_explicit(&h->reap_moving, 1, memory_order_seq_cst);
    heap_reap_kept(h, kchain, ok);
    record_sync_done(&h->records, rchain, ok);
    if (ok && rchain != NULL) record_poll(&h->records, h->depots, &h->large);
    for (registry_link *n = chain, *next; n; n = next) {
      next = stack_next(&magazine_st.registry, n);
      magazine *m = (magazine *)n;
      if (ok) {
        atomic_sub_relaxed(&h->stat_limbo_bytes, (int64_t)depot_magazine_bytes(m));
        depot_put(&h->depots[m->cls], m);
      } else {
        stack_push(&h->limbo, &magazine_st.registry, &m->link);
      }
    }
    atomic_fetch_add_explicit(&h->reap_moves, 1, memory_order_release);
    atomic_fetch_sub_explicit(&h->reap_moving, 1, memory_order_release);
  }
  /* Release pairs with the acquire in heap_reap_wait: what this reap moved
   * to the depot is visible to a thread that saw the count drop. */
  atomic_sub_acq_rel(&h->reaping, 1);
}

/* Reap here, then wait out a reap another thread has in progress. */
void heap_reap_wait(heap *h) {
  heap_reap(h);
  while (atomic_load_acquire(&h->reaping) > 0) sched_yield();
}

/* Cached bytes above the release threshold (0 if none). */
static size_t heap_excess(heap *h) {
  size_t cached = heap_cached_bytes(h);
  return cached > h->release_threshold ? cached - h->release_threshold : 0;
}

/* Release threshold: give back what is cached above it, cheapest first.
 * Thread caches are left alone (emptying them needs a device
 * synchronisation; they are bounded by the magazine size). */
static void heap_release_above_threshold(heap *h) {
  if (h->release_threshold == SIZE_MAX || heap_excess(h) == 0) return;
  heap_relieve(h, HEAP_STEP_RECLAIM);
  if (heap_excess(h) > 0) large_release(&h->large, heap_excess(h));
  /* Slabs of spans the segments lent go back to them, still mapped: the
   * second release unmaps those. */
  if (heap_excess(h) > 0 && slab_release_free(&h->slabs, heap_excess(h)) > 0 && heap_excess(h) > 0)
    large_release(&h->large, heap_excess(h));
}

static void *heap_reaper_main(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&heap_st.reaper_lock);
    while (!heap_st.reaper_work && !heap_st.reaper_stop) {
      if (!heap_st.reaper_timed) {
        pthread_cond_wait(&heap_st.reaper_cv, &heap_st.reaper_lock);
        continue;
      }
      /* Threshold checks also run on a timer: memory cached by a program
       * that went quiet is given back too. */
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 200 * 1000 * 1000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      if (pthread_cond_timedwait(&heap_st.reaper_cv, &heap_st.reaper_lock, &ts) != 0) break;
    }
    heap_st.reaper_work = 0;
    if (heap_st.reaper_stop) break;
    heap_st.reaper_busy = 1;
    pthread_mutex_unlock(&heap_st.reaper_lock);
    for (int d = 0; d < HEAP_MAX_DEVICES; d++) {
      heap *h = heap_peek(d);
      if (h == NULL) continue;
      heap_reap(h);
      heap_release_above_threshold(h);
      if (atomic_load_acquire(&h->epochs.refill_asked)) epoch_pool_fill(&h->epochs, h->ops->event_prefill);
    }
    pthread_mutex_lock(&heap_st.reaper_lock);
    heap_st.reaper_busy = 0;
    pthread_cond_broadcast(&heap_st.reaper_idle_cv);
    pthread_mutex_unlock(&heap_st.reaper_lock);
  }
  pthread_mutex_unlock(&heap_st.reaper_lock); /* stopping: the loop broke with it held */
  return NULL;
}

void heap_after_fork_child(void) {
  /* The child has no maintenance thread: the parent's may have held its
   * lock or been busy at the fork. Fresh lock and conditions; stopped, so
   * the exit handler returns at once; reaper_started stays as inherited,
   * so nothing starts another. */
  pthread_mutex_init(&heap_st.reaper_lock, NULL);
  pthread_cond_init(&heap_st.reaper_cv, NULL);
  pthread_cond_init(&heap_st.reaper_idle_cv, NULL);
  heap_st.reaper_busy = 0;
  heap_st.reaper_work = 0;
  heap_st.reaper_stop = 1;
}

/* At exit: let a round under way finish, then keep the thread off the
 * driver for good (what limbo still holds is the process's last memory). */
static void heap_reaper_atexit(void) {
  pthread_mutex_lock(&heap_st.reaper_lock);
  heap_st.reaper_stop = 1;
  pthread_cond_broadcast(&heap_st.reaper_cv);
  while (heap_st.reaper_busy) pthread_cond_wait(&heap_st.reaper_idle_cv, &heap_st.reaper_lock);
  pthread_mutex_unlock(&heap_st.reaper_lock);
}

/* Signal the thread, starting it if needed; returns 0 if none could be
 * started. reaper_lock is held by the caller. */
static int heap_reaper_signal_locked(void) {
  heap_st.reaper_work = 1;
  if (!heap_st.reaper_started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, heap_reaper_main, NULL) == 0) {
      heap_st.reaper_started = 1;
      atexit(heap_reaper_atexit);
    }
    pthread_attr_destroy(&attr);
  }
  pthread_cond_signal(&heap_st.reaper_cv);
  return heap_st.reaper_started;
}

/* The event pool of some heap runs low (epoch.c's hook): refill it in the
 * background thread. */
void heap_events_low(void) {
  pthread_mutex_lock(&heap_st.reaper_lock);
  heap_reaper_signal_locked();
  pthread_mutex_unlock(&heap_st.reaper_lock);
}

void heap_wake_maintenance(void) {
  pthread_mutex_lock(&heap_st.reaper_lock);
  heap_st.reaper_timed = 1;
  heap_reaper_signal_locked();
  pthread_mutex_unlock(&heap_st.reaper_lock);
}

/* Wake the maintenance thread to drain h's limbo; if none could be started,
 * drain here (a slow path: a slot being retired) rather than strand the
 * memory. */
static void heap_limbo_wake(heap *h) {
  pthread_mutex_lock(&heap_st.reaper_lock);
  int started = heap_reaper_signal_locked();
  pthread_mutex_unlock(&heap_st.reaper_lock);
  if (!started) heap_reap(h);
}

/* A recorded block's stream was gone at its free (pool/record.h): the same
 * synchronisation as limbo's covers it. */
void heap_records_sync(void *arg) { heap_limbo_wake(arg); }

int heap_limbo_put_large(heap *h, lblock *b, int sdev) {
  heap_kept *n = meta_alloc(sizeof *n);
  if (n == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  n->b = b;
  n->sync_devs = heap_sync_devs(h, sdev);
  large_kept_set(b, LARGE_KEPT_LIMBO);
  atomic_add_relaxed(&h->stat_limbo_bytes, (int64_t)b->size);
  atomic_add_relaxed(&h->stat_kept_limbo_bytes, (int64_t)b->size);
  atomic_add_relaxed(&h->stat_limbo, 1);
  heap_klimbo_push(h, n);
  heap_limbo_wake(h);
  return MAGPIE_OK;
}

int heap_limbo_block(heap *h, unsigned cls, void *p, int sdev) {
  pthread_mutex_lock(&h->klimbo_lock);
  magazine *m = h->lpart[cls];
  if (m == NULL) {
    if ((m = magazine_get_empty(cls)) == NULL) {
      pthread_mutex_unlock(&h->klimbo_lock);
      return MAGPIE_ERR_OUT_OF_MEMORY;
    }
    m->cap = MAGAZINE_MAX;
    m->ticket = (epoch_ticket){0};
    m->sync_devs = 0;
    h->lpart[cls] = m;
  }
  m->sync_devs |= heap_sync_devs(h, sdev);
  m->slots[m->count++] = p;
  int full = m->count == m->cap;
  if (full) heap_lpart_flush_locked(h);
  pthread_mutex_unlock(&h->klimbo_lock);
  heap_limbo_wake(h);
  return MAGPIE_OK;
}

void heap_capture_hold(int delta) {
  int now = atomic_fetch_add_explicit(&heap_st.captures, delta, memory_order_seq_cst) + delta;
  if (delta > 0) {
    /* A reap that began before the hold may be synchronising the device:
     * wait for it (see heap_reap), so that none runs once this returns. */
    for (int d = 0; d < HEAP_MAX_DEVICES; d++) {
      heap *h = heap_peek(d);
      while (h != NULL && atomic_load_explicit(&h->reaping, memory_order_seq_cst) > 0) sched_yield();
    }
  } else if (now == 0) {
    pthread_mutex_lock(&heap_st.reaper_lock);
    heap_reaper_signal_locked();
    pthread_mutex_unlock(&heap_st.reaper_lock);
  }
}

int heap_graph_alloc(heap *h, size_t size, uintptr_t *out, size_t *bsize) {
  /* EPOCH_NO_STREAM: only blocks ready for every stream; LARGE_READY_ONLY:
   * no stream is made to wait (a wait on a capturing stream from outside
   * its capture would invalidate it; found by tests/fuzz/alloc_fuzz.c,
   * where the large cache's reserve rule had one made on the legacy
   * stream). Cheapest relief first, none that waits on the host. */
  static const enum heap_step steps[] = {HEAP_STEP_RECLAIM, HEAP_STEP_SLABS, HEAP_STEP_UNMAP};
  int rc = large_alloc(&h->large, size, EPOCH_NO_STREAM, NULL, LARGE_READY_ONLY, out, bsize);
  for (unsigned i = 0; rc == MAGPIE_ERR_OUT_OF_MEMORY && i < sizeof steps / sizeof steps[0]; i++)
    if (heap_relieve(h, steps[i]))
      rc = large_alloc(&h->large, size, EPOCH_NO_STREAM, NULL, LARGE_READY_ONLY, out, bsize);
  if (rc != MAGPIE_OK) return rc;
  large_graph_mark(&h->large, *out, 1);
  heap_publish_in_use(h, (int64_t)*bsize);
  return MAGPIE_OK;
}

void heap_graph_retire(heap *h, uintptr_t p, size_t size, int sdev) {
  lblock *b = NULL;
  large_graph_mark(&h->large, p, 0);
  heap_publish_in_use(h, -(int64_t)size);
  if (large_keep_block(&h->large, p, SIZE_MAX, &b) && heap_limbo_put_large(h, b, sdev) == MAGPIE_OK) return;
  /* Host metadata ran out: the block stays handed out (lost to reuse, never
   * to another user while a replay may touch it). */
  if (b != NULL) large_unkeep(b);
}

void heap_limbo_put(heap *h, magazine *m, int sdev) {
  MAGAZINE_ASSERT_VALID(m);
  MAGPIE_ASSERT(m->count > 0);
  m->ticket = (epoch_ticket){0};
  m->sync_devs = heap_sync_devs(h, sdev);
  atomic_add_relaxed(&h->stat_limbo_bytes, (int64_t)depot_magazine_bytes(m));
  stack_push(&h->limbo, &magazine_st.registry, &m->link);
  atomic_add_relaxed(&h->stat_limbo, 1);
  heap_limbo_wake(h);
}
