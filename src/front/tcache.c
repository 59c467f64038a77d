/* Thread caches: slow paths, stream slots, thread exit, give-back.
 *
 * Lock order: tcache_list_lock is taken alone (never while calling into the
 * heap, depot or backend). Everything else here is thread-owned, or taken
 * over from an idle owner through the steal handshake (tcache.h). */
#include "front/tcache.h"

#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/error.h"
#include "base/globals.h"
#include "base/meta.h"
#include "base/ticks.h"
#include "front/global.h"
#include "front/observe.h"
#include "front/tdrain.h"
#include "pool/record.h"

__thread tcache *tcache_tls;

static void tcache_destroy(void *arg);
static size_t tcache_reclaim_threads(heap *h);

void tcache_module_init(void) {
  globals.tcache_can_steal = syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  heap_set_threads_reclaim(tcache_reclaim_threads);
}

static int tcache_barrier(void) {
  return globals.tcache_can_steal && syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
}

static void tcache_key_create(void) {
  globals.tcache_key_made = pthread_key_create(&globals.tcache_key, tcache_destroy) == 0;
}

static void tcache_slot_clear(tslot *ts) {
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    atomic_store_relaxed(&ts->cl[c].hits, 0);
    atomic_store_relaxed(&ts->cl[c].misses, 0);
  }
  ts->id = 0;
  ts->handle = (cudaStream_t)UINTPTR_MAX;
  ts->heap = NULL;
  atomic_store_relaxed(&ts->stats_heap, NULL);
  ts->rec = NULL;
  ts->alloc_ok = 0;
  tdrain_slot_reset(ts);
  ts->drained = 1;
  ts->used = 0;
  ts->round_trip = 0;
  memset(ts->out_blocks, 0, sizeof ts->out_blocks);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    ts->cl[c].loaded = ts->prev[c] = &magazine_sentinel;
    ts->cl[c].low = ts->pcount[c] = ts->lows[c] = 0;
    ts->fill[c] = 0;
  }
  ts->entries = 0;
  ts->emptied = 0;
  MAGPIE_ASSERT(ts->nout == 0 && ts->lkeep == NULL); /* emptied before (tcache_slot_out) or never used */
  ts->nout = 0;
  ts->out_bytes = 0;
  ts->lkeep = NULL;
  ts->lout = NULL;
}

/* Bring the slot's entries of tc->alloc_id / alloc_handle up to date. */
static void tcache_slot_index(tcache *tc, const tslot *ts) {
  size_t i = (size_t)(ts - tc->slots);
  int ok = ts->heap != NULL && ts->alloc_ok;
  int was = tc->alloc_id[i] != 0;
  if (ok && !was) tc->nalloc++;
  else if (!ok && was) tc->nalloc--;
  tc->alloc_id[i] = ok ? ts->id : 0;
  tc->alloc_handle[i] = ok ? ts->handle : (cudaStream_t)UINTPTR_MAX;
}

/* Frees of one class in a row, with no allocation of it between, that
 * show blocks flowing out of a slot rather than coming and going. */
#define TCACHE_GROW_RUN 32

/* A free found both magazines of class c full: size the next empty one.
 * A run of TCACHE_GROW_RUN frees without an allocation means blocks only
 * flow out of this slot (another thread or stream allocates them): one
 * exchange per magazine whatever its size, so a larger one costs no more
 * memory per block in flight and saves exchanges. A slot whose blocks come
 * and go (a random walk) frees no more in a row than it holds; doubling on
 * any magazine's worth of frees in a row grew small magazines there too,
 * and every thread then held a slab's worth of a class (bench/DECISIONS.md,
 * "Magazines grow only after a run of frees"). Many allocations since the
 * last exchange bring it back toward the start. */
static uint32_t tcache_next_cap(tslot *ts, unsigned c) {
  const sizeclass_info *ci = &globals.sizeclass_table[c];
  uint64_t now = tslot_allocs(ts, c);
  uint32_t cap = ts->cap[c];
  if (now == ts->mark[c]) {
    uint32_t run = ts->run[c] + cap;
    if (run >= TCACHE_GROW_RUN) {
      cap = cap * 2 < ci->mag_max ? cap * 2 : ci->mag_max;
      run = 0;
    }
    ts->run[c] = (uint8_t)run;
  } else {
    ts->run[c] = 0;
    if (now - ts->mark[c] > 4 * (uint64_t)cap) cap = cap / 2 > ci->mag_cap ? cap / 2 : ci->mag_cap;
  }
  ts->cap[c] = (uint8_t)cap;
  ts->mark[c] = now;
  return cap;
}

void tcache_after_fork_child(void) {
  tcache_tls = NULL;
  if (globals.tcache_key_made) pthread_setspecific(globals.tcache_key, NULL);
}

static tcache *tcache_create(void) {
  if (global_ensure() != MAGPIE_OK) return NULL; /* error already set */
  pthread_once(&globals.tcache_key_once, tcache_key_create);
  tcache *tc = meta_alloc(sizeof *tc);
  if (tc == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a thread cache");
    return NULL;
  }
  tc->ops = global_ops();
  tc->check = global_config()->check;
  tcache_slot_clear(&tc->dummy);
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tcache_slot_clear(&tc->slots[i]);
    tcache_slot_index(tc, &tc->slots[i]);
  }
  tc->last = &tc->dummy;
  atomic_store_relaxed(&tc->busy, 1); /* created inside a slow path */
  pthread_mutex_lock(&globals.tcache_list_lock);
  tc->lnext = globals.tcache_list;
  if (globals.tcache_list) globals.tcache_list->lprev = tc;
  globals.tcache_list = tc;
  pthread_mutex_unlock(&globals.tcache_list_lock);
  pthread_setspecific(globals.tcache_key, tc);
  tcache_tls = tc;
  return tc;
}

static void tcache_publish(tcache *tc, heap *h) {
  int d = h->device;
  int64_t live = atomic_load_relaxed(&tc->live[d]);
  if (live != tc->published[d]) {
    heap_publish_in_use(h, live - tc->published[d]);
    tc->published[d] = live;
  }
}

/* The outbox goes to the depot under ticket t (taken over: each magazine
 * gets a copy, the last one t itself), or to limbo with t NULL (no seal). */
static void tcache_outbox_give(tslot *ts, epoch_ticket *t) {
  for (uint32_t i = 0; i < ts->nout; i++) {
    magazine *m = ts->outbox[i];
    depot *d = &ts->heap->depots[m->cls];
    depot_note_thread_out(d, m);
    if (t == NULL) {
      heap_limbo_put(ts->heap, m, ts->sdev);
      continue;
    }
    if (i + 1 < ts->nout) epoch_ticket_copy(t, &m->ticket);
    else m->ticket = *t;
    heap_put(ts->heap, m, (int)((ts->round_trip >> m->cls) & 1));
  }
  ts->nout = 0;
  ts->out_bytes = 0;
  heap_note_cached(ts->heap);
}

/* Seal the slot's outbox with one event on `handle`, which the caller just
 * passed and which names the slot's stream (its id matched), and give its
 * magazines to the depot; limbo if the seal fails. */
static void tcache_outbox_seal(tslot *ts, cudaStream_t handle) {
  if (ts->nout == 0) return;
  epoch_ticket t;
  tcache_outbox_give(ts, epoch_seal(ts->rec, handle, &t) == MAGPIE_OK ? &t : NULL);
}

/* A full magazine leaves loaded/prev on a free on `handle` (as above): into
 * the outbox, sealed with the others once it is full. */
static void tcache_outbox_add(tslot *ts, magazine *m, cudaStream_t handle) {
  MAGPIE_ASSERT(ts->nout < TCACHE_OUTBOX && m->count > 0);
  ts->outbox[ts->nout++] = m;
  ts->out_bytes += depot_magazine_bytes(m);
  if (ts->nout == TCACHE_OUTBOX || ts->out_bytes >= TCACHE_OUTBOX_BYTES) tcache_outbox_seal(ts, handle);
}

/* An outbox magazine of class c, taken back (NULL if none). */
static magazine *tcache_outbox_take(tslot *ts, unsigned c) {
  for (uint32_t i = ts->nout; i > 0; i--) {
    magazine *m = ts->outbox[i - 1];
    if (m->cls != c) continue;
    ts->out_bytes -= depot_magazine_bytes(m);
    ts->outbox[i - 1] = ts->outbox[--ts->nout];
    return m;
  }
  return NULL;
}

/* Seal on s (naming ts's stream: its id matched) and free the large block
 * at p, the outbox under the same seal (filled on this stream before this
 * free). *sealed: whether the seal was made (else rc is its error). */
static int tcache_large_release(tslot *ts, void *p, cudaStream_t s, size_t *bsize, int *sealed) {
  epoch_ticket t = {0};
  int rc = epoch_seal(ts->rec, s, &t);
  *sealed = rc == MAGPIE_OK;
  if (rc != MAGPIE_OK) return rc;
  epoch_ticket u = {0};
  if (ts->nout > 0) epoch_ticket_copy(&t, &u); /* large_free takes t over */
  rc = large_free(&ts->heap->large, (uintptr_t)p, &t, bsize);
  if (rc == MAGPIE_OK && u.rec != NULL) tcache_outbox_give(ts, &u);
  else if (u.rec != NULL) epoch_ticket_release(&u);
  if (rc != MAGPIE_OK) epoch_ticket_release(&t);
  return rc;
}

/* ts keeps b (LARGE_KEPT) for its stream: the slot, the thread and the
 * statistics say so together; detach undoes it. */
static void tcache_kept_attach(tcache *tc, tslot *ts, lblock *b) {
  ts->lkeep = b;
  tc->kept = ts;
  atomic_owner_add_i64(&tc->kept_bytes[ts->heap->device], (int64_t)b->size);
}

static void tcache_kept_detach(tcache *tc, tslot *ts) {
  atomic_owner_add_i64(&tc->kept_bytes[ts->heap->device], -(int64_t)ts->lkeep->size);
  ts->lkeep = NULL;
  tc->kept = NULL;
}

/* The slot's kept large block leaves: sealed on *seal_on to the large
 * layer, or with seal_on NULL (or a failed seal) to limbo. Returns its
 * bytes (0 if none, or if not even limbo could take it: it stays). */
static size_t tcache_kept_out(tcache *tc, tslot *ts, const cudaStream_t *seal_on) {
  lblock *b = ts->lkeep;
  if (b == NULL) return 0;
  uintptr_t p = b->base;
  size_t size = b->size, bsize = 0;
  int sealed = 0;
  tcache_kept_detach(tc, ts);
  if (seal_on != NULL) {
    large_unkeep(b);
    if (tcache_large_release(ts, (void *)p, *seal_on, &bsize, &sealed) == MAGPIE_OK) {
      heap_note_cached(ts->heap);
      return size;
    }
    large_kept_set(b, LARGE_KEPT); /* ours still: to limbo */
  }
  if (heap_limbo_put_large(ts->heap, b, ts->sdev) != MAGPIE_OK) {
    tcache_kept_attach(tc, ts, b);
    return 0;
  }
  return size;
}

/* The outbox leaves the slot: sealed on *seal_on (as tcache_outbox_seal)
 * to the depot, or with seal_on NULL to limbo. */
static void tcache_outbox_leave(tslot *ts, const cudaStream_t *seal_on) {
  if (seal_on != NULL) tcache_outbox_seal(ts, *seal_on);
  else tcache_outbox_give(ts, NULL);
}

/* Class c's non-empty magazines of slot ts (loaded and previous) into its
 * outbox, which leaves whenever it is full (tcache_outbox_leave, seal_on
 * as there). Returns their bytes. */
static size_t tcache_class_to_outbox(tslot *ts, unsigned c, const cudaStream_t *seal_on) {
  size_t bytes = 0;
  magazine **pair[2] = {&ts->cl[c].loaded, &ts->prev[c]};
  for (int k = 0; k < 2; k++) {
    magazine *m = *pair[k];
    if (!magazine_is_real(m) || m->count == 0) continue;
    bytes += depot_magazine_bytes(m);
    if (ts->nout == TCACHE_OUTBOX) tcache_outbox_leave(ts, seal_on);
    ts->outbox[ts->nout++] = m;
    ts->out_bytes += depot_magazine_bytes(m);
    *pair[k] = &magazine_sentinel;
  }
  return bytes;
}

/* Hand a slot's non-empty magazines out, the outbox's included (the slot
 * stays): sealed on *seal_on (a handle the caller just passed, naming the
 * slot's stream) to the depot, one seal per outbox's worth, or with seal_on
 * NULL to limbo. Returns their bytes. */
static size_t tcache_slot_out(tcache *tc, tslot *ts, const cudaStream_t *seal_on) {
  size_t bytes = ts->out_bytes + tcache_kept_out(tc, ts, seal_on);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) bytes += tcache_class_to_outbox(ts, c, seal_on);
  tcache_outbox_leave(ts, seal_on);
  return bytes;
}

/* Before a large allocation, the slot's magazines of class blocks (the
 * classes without slabs) join the outbox, to go back to their segments
 * with it (heap_put, as the slot's own: their classes are marked round
 * trips in ts->round_trip, which the caller restores after its seal). Cached
 * in the thread they sit between the segments' free holes and keep them
 * apart, so the segments grew beside them. Sent back, they hold less
 * memory; the price is that class blocks come from the segments' lock more
 * often, which slows a single thread, and doing it only where the segments
 * were about to grow held more (bench/DECISIONS.md, "Class blocks go back
 * before a large allocation"). The outbox is sealed before every large
 * allocation anyway, so this adds no event. */
static void tcache_class_blocks_out(tslot *ts, cudaStream_t s) {
  for (unsigned c = SIZECLASS_FINE_COUNT; c < SIZECLASS_COUNT; c++) {
    if (!globals.sizeclass_table[c].seg) continue;
    uint64_t round_trip = ts->round_trip;
    ts->round_trip |= (uint64_t)1 << c; /* for a seal of a full outbox too */
    if (tcache_class_to_outbox(ts, c, &s) == 0) ts->round_trip = round_trip;
  }
}

/* Hand a slot's non-empty magazines to limbo (the slot stays). */
static size_t tcache_slot_empty(tcache *tc, tslot *ts) { return tcache_slot_out(tc, ts, NULL); }

/* Under pressure (an allocation on cur's stream reached the heap's
 * give-back step, tcache_reclaim_threads), the
 * calling thread gives back what it caches for cur's heap, so that slabs
 * its magazines of other classes kept partly free can empty and serve the
 * request: one thread of the 64-block window under limit=16m failed 431
 * allocations in 200,000 with 7.7 of its 13.6 cached MB in its own
 * magazines. cur's magazines are sealed on s (the caller's handle, whose
 * id matched) and go to the depot, where cur's stream takes them back at
 * once and other streams after the event; other slots' go to limbo (their
 * handles are not passed to the driver again). Returns the bytes. */
static size_t tcache_give_back_own(tcache *tc, tslot *cur, cudaStream_t s) {
  size_t bytes = tdrain_flush(tc, cur->heap);
  for (int k = 0; k < TCACHE_SLOTS; k++) {
    tslot *ts = &tc->slots[k];
    if (ts->heap == cur->heap) bytes += tcache_slot_out(tc, ts, ts == cur ? &s : NULL);
  }
  return bytes;
}

/* Before a heap call that may go down the ladder of relief: the slot and
 * stream its give-back step hands this thread's own magazines back for
 * (tcache_reclaim_threads). */
static void tcache_relief_context(tcache *tc, tslot *ts, cudaStream_t s) {
  tc->relief_slot = ts;
  tc->relief_stream = s;
}

/* Out of the ladder (the allocation returns, or the next slow path). */
static void tcache_relief_end(tcache *tc) {
  tc->relief_slot = NULL;
  if (unlikely(atomic_load_relaxed(&tc->relieving))) atomic_store_relaxed(&tc->relieving, 0);
}

/* Fold a retiring slot's class counters into its heap. */
static void tcache_slot_fold(tslot *ts) {
  pthread_mutex_lock(&globals.tcache_list_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    atomic_add_relaxed(&ts->heap->stat_class_hits[c], atomic_load_relaxed(&ts->cl[c].hits));
    atomic_add_relaxed(&ts->heap->stat_class_misses[c], atomic_load_relaxed(&ts->cl[c].misses));
    atomic_store_relaxed(&ts->cl[c].hits, 0);
    atomic_store_relaxed(&ts->cl[c].misses, 0);
  }
  pthread_mutex_unlock(&globals.tcache_list_lock);
}

/* Give back everything a slot holds. Its non-empty magazines go to limbo,
 * which waits for a device synchronisation: the slot's handle may name a
 * destroyed stream by now, and a stored handle is never passed to the
 * driver again (cuStreamGetId on a destroyed stream crashes the process,
 * and an event recorded on a recycled handle would follow the wrong
 * stream). Retiring happens at thread exit, on slot eviction and when a
 * handle is found recycled; seals on live streams happen in the free path,
 * where the caller's handle is known to be valid. */
static void tcache_slot_retire(tcache *tc, tslot *ts) {
  tcache_slot_empty(tc, ts);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    if (magazine_is_real(ts->cl[c].loaded)) magazine_put_empty(ts->cl[c].loaded);
    if (magazine_is_real(ts->prev[c])) magazine_put_empty(ts->prev[c]);
  }
  tcache_slot_fold(ts);
  tcache_publish(tc, ts->heap);
  epoch_stream_release(ts->rec);
  if (tc->last == ts) tc->last = &tc->dummy;
  tcache_slot_clear(ts);
  tcache_slot_index(tc, ts);
}

/* A drained slot (tdrain_clean) taken for another stream of its
 * heap lets go of its stream only: its empty magazines stay for the new
 * stream's frees, and its class counters, which count for the heap, go on
 * (retiring it instead, for every visit of a thread taking turns on more
 * streams than it has slots, cost a lock and 88 atomic additions to fold
 * the counters, and every empty magazine back to the shared stacks and
 * out again: a large share of a visit; bench/DECISIONS.md, "A drained
 * slot is recycled, not retired"). */
static void tcache_slot_recycle(tcache *tc, tslot *ts) {
  MAGPIE_ASSERT(tdrain_clean(ts));
  tcache_publish(tc, ts->heap);
  epoch_stream_release(ts->rec);
  if (tc->last == ts) tc->last = &tc->dummy;
  ts->rec = NULL;
  tdrain_slot_reset(ts);
}

static tslot *tcache_slot_new(tcache *tc, cudaStream_t s, uint64_t id, heap *h) {
  int dev = -1;
  int rc = tc->ops->stream_device(s, &dev);
  if (rc != MAGPIE_OK) {
    error_set(MAGPIE_ERR_INVALID_STREAM, "stream %p has no device: %s", (void *)s, backend_error_detail());
    return NULL;
  }
  heap *sh = heap_get(dev);
  if (sh == NULL) return NULL;
  if (h == NULL) h = sh;
  tslot *ts = NULL;
  int recycled = 0;
  for (int i = 0; i < TCACHE_SLOTS && ts == NULL; i++)
    if (tc->slots[i].heap == NULL) ts = &tc->slots[i];
  if (ts == NULL) {
    /* Every slot is in use: a drained one goes first (nothing of it to
     * limbo), the next in turn else. */
    for (int k = 0; k < TCACHE_SLOTS && ts == NULL; k++) {
      tslot *v = &tc->slots[(tc->next_evict + (unsigned)k) % TCACHE_SLOTS];
      if (tdrain_clean(v)) {
        ts = v;
        tc->next_evict += (unsigned)k;
      }
    }
    if (ts == NULL) ts = &tc->slots[tc->next_evict % TCACHE_SLOTS];
    tc->next_evict++;
    recycled = tdrain_clean(ts) && ts->heap == h;
    if (recycled) tcache_slot_recycle(tc, ts);
    else tcache_slot_retire(tc, ts);
  }
  stream_rec *rec = epoch_stream_acquire(&sh->epochs, id);
  if (rec == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a stream record");
    return NULL;
  }
  ts->id = id;
  ts->handle = s;
  ts->heap = h;
  ts->sdev = dev;
  atomic_store_relaxed(&ts->stats_heap, h);
  ts->rec = rec;
  ts->live = &tc->live[h->device];
  ts->alloc_ok = (h == sh);
  tcache_slot_index(tc, ts);
  /* Magazine capacity starts over with the slot: every class of a new
   * one (its counters are 0), the classes a recycled one used (the others
   * are as they were set, their counters unchanged since). */
  uint64_t reset = recycled ? ts->used : ~(uint64_t)0 >> (64 - SIZECLASS_COUNT);
  while (reset != 0) {
    unsigned c = (unsigned)__builtin_ctzll(reset);
    reset &= reset - 1;
    ts->cap[c] = (uint8_t)globals.sizeclass_table[c].mag_cap;
    ts->mark[c] = tslot_allocs(ts, c);
    ts->run[c] = 0;
  }
  return ts;
}

/* The alloc-capable slot of stream id (handle s), created if needed. */
static tslot *tcache_slot_for_alloc(tcache *tc, cudaStream_t s, uint64_t id) {
  if (tc->last->heap != NULL && tc->last->id == id) return tc->last; /* alloc-capable (tcache.h) */
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    if (tc->alloc_id[i] == id) return &tc->slots[i];
#ifdef MAGPIE_TEST_IGNORE_STREAM_ID /* deliberately broken build: tests/BUILD expects its tests to fail */
    if (tc->alloc_handle[i] == s) {
      tc->slots[i].id = id;
      tcache_slot_index(tc, &tc->slots[i]);
      return &tc->slots[i];
    }
#endif
  }
  /* A slot that has this (non-special) handle but another id belonged to a
   * stream that was destroyed and its handle value reused. */
  if (!tcache_special_handle(s)) {
    for (int i = 0; i < TCACHE_SLOTS; i++) {
      tslot *ts = &tc->slots[i];
      if (ts->heap != NULL && ts->handle == s && ts->id != id) tcache_slot_retire(tc, ts);
    }
  }
  return tcache_slot_new(tc, s, id, NULL);
}

static tslot *tcache_slot_for_free(tcache *tc, cudaStream_t s, uint64_t id, heap *h) {
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tslot *ts = &tc->slots[i];
    if (ts->heap == h && ts->id == id) return ts;
  }
  return tcache_slot_new(tc, s, id, h);
}

void tcache_set_describe(tcache_describe_fn fn) { globals.tcache_describe = fn; }

static void tcache_oom_error(heap *h, size_t size, int rc) {
  if (rc != MAGPIE_ERR_OUT_OF_MEMORY) {
    error_set(rc, "allocating %zu bytes on device %d failed: %s", size, h->device, backend_error_detail());
    return;
  }
  char detail[512] = "";
  if (globals.tcache_describe != NULL) globals.tcache_describe(h, detail, sizeof detail);
  error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of memory on device %d allocating %zu bytes: %s", h->device, size, detail);
}

static void *tcache_alloc_large(tcache *tc, tslot *ts, size_t size, uint64_t id, cudaStream_t s) {
  heap *h = ts->heap;
  if (size > SIZE_MAX - h->region.gran + 1) {
    error_set(MAGPIE_ERR_SIZE_OVERFLOW, "requested size %zu cannot be rounded up to the %zu-byte granularity", size,
              h->region.gran);
    return NULL;
  }
  if (size > h->total_mem) {
    error_set(MAGPIE_ERR_TOO_LARGE, "requested %zu bytes but device %d has %zu bytes in total", size, h->device,
              h->total_mem);
    return NULL;
  }
  lblock *k = ts->lkeep;
  if (k != NULL) {
    /* The block kept for this stream, if the request fits it within an
     * eighth; else it goes back to the large layer first. */
    size_t need = large_round(size);
    if (k->size >= need && k->size - need <= need / 8) {
      uintptr_t kp = k->base;
      size_t ks = k->size;
      tcache_kept_detach(tc, ts);
      ts->lout_word = large_lend(k);
      ts->lout = k;
      ts->lout_base = kp;
      /* Published at the next exchange, as the fast paths do. */
      tslot_count(ts, (int64_t)ks);
      if (!tc->check) tc->last = ts;
      return (void *)kp;
    }
    tcache_kept_out(tc, ts, &s);
  }
  uintptr_t p = 0;
  size_t bsize = 0;
  /* As before a refill, and the slot's class blocks with the outbox, to
   * their segments (tcache_class_blocks_out). */
  uint64_t round_trip = ts->round_trip;
  tcache_class_blocks_out(ts, s);
  tcache_outbox_seal(ts, s);
  ts->round_trip = round_trip;
  tcache_relief_context(tc, ts, s);
  int rc = heap_large_alloc(h, size, id, s, &p, &bsize);
  if (rc != MAGPIE_OK) {
    tcache_oom_error(h, size, rc);
    return NULL;
  }
  tslot_count(ts, (int64_t)bsize);
  tcache_publish(tc, h);
  if (!tc->check) tc->last = ts;
  return (void *)p;
}

/* A reclaimer asked this thread (the owner) to give back: every
 * magazine goes to limbo, and the request is cleared only once that is
 * done (the reclaimer may be waiting to find them there). */
static void tcache_honour_ask(tcache *tc) {
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
static void tcache_enter_slow(tcache *tc) {
  tcache_enter(tc);
  while ((atomic_load_acquire(&tc->steal) & TCACHE_CLAIMED) != 0) sched_yield();
  tcache_relief_end(tc);
  tcache_honour_ask(tc);
}

/* Checked mode: a block of slab sl (index bi) or a class block of sl's
 * segment marked handed out or free (0: it already was). */
static int tcache_mark_used(slab *sl, uintptr_t p, uint32_t bi) {
  return sl->cls == SLAB_LARGE ? large_class_mark(sl->seg, p, 1) : slab_mark_used(sl, bi);
}

static int tcache_mark_free(slab *sl, uintptr_t p, uint32_t bi) {
  return sl->cls == SLAB_LARGE ? large_class_mark(sl->seg, p, 0) : slab_mark_free(sl, bi);
}

static void *tcache_alloc_slow_in(tcache *tc, size_t size, cudaStream_t s, uint64_t id);

void tcache_capture_error(cudaStream_t s, size_t size) {
  error_set(MAGPIE_ERR_CAPTURE,
            "magpie_malloc_async(%zu bytes): stream %p is capturing a CUDA graph that magpie was not told of (on a "
            "GPU, CUDA also refuses the stream's id there and invalidates the capture): call "
            "magpie_capture_begin(pool, stream) when the capture begins (magpie.h, \"CUDA graphs\")",
            size, (void *)s);
}

/* Before an allocation takes what threads share (a refill, a large
 * block): is s capturing a graph magpie was not told of? Its blocks would
 * belong to the graph and be reused outside it. With a capture announced,
 * front/capture.c has routed capturing streams already. An ordinary
 * handle was asked its id by this allocation (tcache_alloc_fast, or
 * tcache_alloc_slow_in when that could not), and CUDA refuses the id of a
 * capturing stream in every capture mode (global, thread-local, relaxed,
 * and a relaxed thread in a global capture; CUDA 13.0, driver 580, and the
 * simulated device alike; bench/DECISIONS.md, "No capture-state query
 * where the stream's id answered"): s was not capturing then, and the
 * driver is not asked again. That query cost about as much as
 * cuStreamGetId on every large allocation. Special handles' ids come from
 * a per-context cache without the driver: one query. 1 with the error
 * set: refused. */
static int tcache_capture_refused(tcache *tc, cudaStream_t s, size_t size) {
  uint64_t cid;
  if ((atomic_load_relaxed(&globals.slow_paths) & SLOW_CAPTURE) != 0 || !tcache_special_handle(s) ||
      backend_capture_state(tc->ops, s, &cid) == BACKEND_CAPTURE_NONE)
    return 0;
  tcache_capture_error(s, size);
  return 1;
}

/* Decay. A thread taking turns on streams keeps each stream's magazines
 * while it works on the others, and what a refill brought (a whole
 * magazine) stays however few blocks the thread then uses: threads taking
 * turns on a few streams held many times their small blocks in use in
 * their magazines. Every TCACHE_DECAY_ENTRIES entries into a slot from
 * another, three quarters of the blocks of each small class that the slot
 * held all along since the last decay (its low-water mark over loaded and
 * prev) leave through the outbox, sealed on the
 * slot's stream, for the depot, where other threads and streams take them
 * instead of carving slabs; the class's refills then bring half as many
 * blocks as before (tcache_refill_trim), twice as many again after a decay
 * interval in which the slot ran out (jemalloc's thread caches decay
 * alike). A thread on one stream never enters another slot: nothing
 * decays there. Decay lowers peaks at the same speed, every 8 entries
 * more than every 16; the slots of threads on 24 streams or more, which
 * drain anyway, do not decay, as that slowed them (bench/DECISIONS.md,
 * "Thread caches decay every 8 entries"). */
#define TCACHE_DECAY_ENTRIES 8

/* The fast path's mark (tclass.low) and prev's count start again from
 * what the slot holds of class c now; returns that. */
static uint32_t tcache_held_restart(tslot *ts, unsigned c) {
  ts->pcount[c] = (uint8_t)ts->prev[c]->count;
  ts->cl[c].low = ts->cl[c].loaded->count;
  return ts->cl[c].low + ts->pcount[c];
}

/* The slot's blocks of class c changed on a slow path: the low-water mark
 * takes in what the fast path saw since (prev's count stood still), then
 * starts again from now. */
static void tcache_note_held(tslot *ts, unsigned c) {
  uint32_t lows = ts->lows[c], was = ts->cl[c].low + ts->pcount[c];
  uint32_t now = tcache_held_restart(ts, c);
  if (was < lows) lows = was;
  if (now < lows) lows = now;
  ts->lows[c] = (uint8_t)lows;
}

/* n blocks from the bottom of m (untouched the longest) into the outbox;
 * they stay in m if host memory for a magazine ran out. */
static void tcache_shed(tslot *ts, unsigned c, magazine *m, uint32_t n, cudaStream_t s) {
  magazine *e = magazine_get_empty(c);
  if (e == NULL) return;
  memcpy(e->slots, m->slots, n * sizeof m->slots[0]);
  memmove(m->slots, m->slots + n, (m->count - n) * sizeof m->slots[0]);
  e->count = n;
  e->cap = m->cap;
  m->count -= n;
  if (m == ts->cl[c].loaded) ts->clean[c] = ts->clean[c] > n ? (uint8_t)(ts->clean[c] - n) : 0;
  tcache_outbox_add(ts, e, s);
}

static void tcache_refill_trim(tslot *ts, unsigned c, magazine *fresh, cudaStream_t s) {
  tcache_shed(ts, c, fresh, fresh->count - ts->fill[c], s);
}

static void tcache_slot_decay(tslot *ts, cudaStream_t s) {
  ts->entries = 0;
  int shed = 0;
  for (uint64_t used = ts->used; used != 0; used &= used - 1) {
    unsigned c = (unsigned)__builtin_ctzll(used);
    const sizeclass_info *ci = &globals.sizeclass_table[c];
    tcache_note_held(ts, c);
    magazine *m = ts->cl[c].loaded, *pv = ts->prev[c];
    uint32_t low = ts->lows[c];
    uint32_t fill = ts->fill[c] != 0 ? ts->fill[c] : ci->mag_cap;
    if (ci->seg || !magazine_is_real(m)) {
      /* class blocks have their own bound */
    } else if (ts->emptied & ((uint64_t)1 << c)) {
      fill = fill * 2 < ci->mag_cap ? fill * 2 : ci->mag_cap;
    } else if (low >= 2) {
      uint32_t n = low - low / 4;
      if (magazine_is_real(pv) && pv->count > 0 && pv->count <= n) {
        n -= pv->count;
        ts->prev[c] = &magazine_sentinel;
        tcache_outbox_add(ts, pv, s);
        shed = 1;
      }
      if (n > m->count) n = m->count;
      if (n > 0) {
        tcache_shed(ts, c, m, n, s);
        shed = 1;
      }
      fill = fill / 2 > 0 ? fill / 2 : 1;
    }
    ts->fill[c] = (uint8_t)(fill < ci->mag_cap ? fill : 0);
    ts->lows[c] = (uint8_t)tcache_held_restart(ts, c);
  }
  ts->emptied = 0;
  /* What left goes on now: in the outbox it would wait for the slot's
   * next refill, which a slot that needs fewer blocks may not make. */
  if (shed) tcache_outbox_seal(ts, s);
}

void *tcache_alloc_slow(size_t size, cudaStream_t s, uint64_t id) {
  tcache *tc = tcache_tls;
  if (tc == NULL && (tc = tcache_create()) == NULL) return NULL;
  tcache_enter_slow(tc);
  void *p = tcache_alloc_slow_in(tc, size, s, id);
  tcache_relief_end(tc);
  tcache_leave(tc);
  return p;
}

static void *tcache_alloc_slow_in(tcache *tc, size_t size, cudaStream_t s, uint64_t id) {
  if (size == 0) size = 1; /* a unique minimum block, like malloc(0) */
  int idrc;
  if (id == 0 && (idrc = tc->ops->stream_id(s, &id)) != MAGPIE_OK) {
    if (idrc == MAGPIE_ERR_CAPTURE) tcache_capture_error(s, size);
    else
      error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_malloc_async: stream %p is not valid: %s", (void *)s,
                backend_error_detail());
    return NULL;
  }
  tslot *ts = tcache_slot_for_alloc(tc, s, id);
  if (ts == NULL) return NULL;
  /* Not on the special handles: their capture state is only known after a
   * query (tcache_capture_refused), and a decay may seal. Not where the
   * thread's slots drain (on TDRAIN_SLOTS streams or more, tdrain.c):
   * what a visit leaves goes at its end already. */
  if (ts != tc->last && ++ts->entries >= TCACHE_DECAY_ENTRIES && !tcache_special_handle(s) && tc->nalloc < TDRAIN_SLOTS)
    tcache_slot_decay(ts, s);
  if (ts != tc->last || ts->drained) tdrain_enter(tc, ts);
  if (size > SIZECLASS_MAX_SIZE)
    return tcache_capture_refused(tc, s, size) ? NULL : tcache_alloc_large(tc, ts, size, id, s);
  unsigned c = sizeclass_of(size);
  atomic_owner_inc_u64(&ts->cl[c].misses);
  ts->drained = 0;
  ts->used |= (uint64_t)1 << c;
  int publish = 0;
  if (ts->cl[c].loaded->count == 0) {
    ts->clean[c] = 0;
    if (ts->prev[c]->count > 0) {
      magazine *t = ts->cl[c].loaded;
      ts->cl[c].loaded = ts->prev[c];
      ts->prev[c] = t;
    } else {
      /* The outbox first: its blocks were freed on this stream. */
      magazine *fresh = tcache_outbox_take(ts, c);
      int carried = 0;
      if (fresh == NULL && (fresh = tdrain_carry_take(tc, ts, c)) != NULL) carried = 1; /* an armed slot's */
      if (fresh == NULL) {
        /* Taking from what all threads share: what waits in the outbox
         * goes there first, so that its slabs and segments may serve. */
        if (tcache_capture_refused(tc, s, size)) return NULL;
        tcache_outbox_seal(ts, s);
        tcache_relief_context(tc, ts, s);
        int rc = heap_refill(ts->heap, c, id, s, &fresh);
        if (rc != MAGPIE_OK) {
          tcache_oom_error(ts->heap, size, rc);
          return NULL;
        }
        depot_note_thread_in(&ts->heap->depots[fresh->cls], fresh);
      }
      ts->emptied |= (uint64_t)1 << c;
      if (!carried && !globals.sizeclass_table[c].seg && ts->fill[c] != 0 && fresh->count > ts->fill[c])
        tcache_refill_trim(ts, c, fresh, s);
      ts->mark[c] = tslot_allocs(ts, c);
      if (magazine_is_real(ts->prev[c])) magazine_put_empty(ts->prev[c]);
      ts->prev[c] = ts->cl[c].loaded;
      ts->cl[c].loaded = fresh;
      publish = 1;
    }
  }
  magazine *m = ts->cl[c].loaded;
  void *p = m->slots[--m->count];
  tcache_note_held(ts, c);
  if (tc->check) {
    slab *sl = pagemap_lookup((uintptr_t)p);
    uint32_t i = 0;
    slab_block_index(sl, (uintptr_t)p, &i);
    tcache_mark_used(sl, (uintptr_t)p, i);
  }
  tslot_count(ts, (int64_t)globals.sizeclass_table[c].size);
  /* Publish for the peak only when the depot was involved: swaps between
   * the two magazines stay free of shared writes. */
  if (publish) tcache_publish(tc, ts->heap);
  if (!tc->check) tc->last = ts;
  return p;
}

static int tcache_free_large(tcache *tc, tslot *ts, void *p, cudaStream_t s) {
  size_t bsize = 0;
  int sealed = 0;
  int rc = tcache_large_release(ts, p, s, &bsize, &sealed);
  if (rc != MAGPIE_OK) {
    /* Without an event the block cannot be ordered after the stream: keep
     * it allocated and tell the caller, who may retry. */
    if (!sealed)
      return error_set(rc, "magpie_free_async(%p): cannot record an event on stream %p: %s", p, (void *)s,
                       backend_error_detail());
    if (rc == MAGPIE_ERR_DOUBLE_FREE)
      return error_set(rc, "magpie_free_async(%p): block already free (double free)", p);
    if (rc == MAGPIE_ERR_INVALID_POINTER)
      return error_set(rc, "magpie_free_async(%p): not the start of an allocated large block", p);
    return error_set(rc, "magpie_free_async(%p): out of host memory; the block stays allocated", p);
  }
  tslot_count(ts, -(int64_t)bsize);
  tcache_publish(tc, ts->heap);
  heap_note_cached(ts->heap);
  return MAGPIE_OK;
}

/* A free of a large block on the last slot's stream (an ordinary handle
 * matched by value, as in the fast path; the legacy and per-thread default
 * handles, whose stream depends on the current context, by id, as
 * tcache_free_special does): the slot keeps it for its stream if the
 * thread keeps none and allocates on no other stream (one lock to mark it
 * in the large layer, none if the slot kept it before and handed it out
 * again; no event). PyTorch allocates on the legacy default stream
 * unless told otherwise, so the default handles are let in: without them
 * each large free there recorded an event and took the large layer's
 * lock. A thread taking turns on streams would strand the block while on
 * the others, holding far more memory (bench/DECISIONS.md, "A kept large
 * block: default handles, one stream only"). 0: the slow path. */
static int tcache_keep_large(tcache *tc, slab *sl, void *p, cudaStream_t s) {
  tslot *ts = tc->last;
  if (tc->check || tc->kept != NULL || tc->nalloc != 1 || sl->cls != SLAB_LARGE || ts->handle != s ||
      ts->heap != sl->heap || atomic_load_relaxed(&sl->recorded) != 0 || large_class_of(sl->seg, (uintptr_t)p) >= 0)
    return 0;
  if (tcache_special_handle(s) && tcache_stream_id(tc, s) != ts->id) return 0; /* another context's */
  lblock *b = NULL;
  /* The block this slot lent out, freed here: kept again without the
   * large cache's lock where nothing happened to it meanwhile. */
  if (ts->lout != NULL && ts->lout_base == (uintptr_t)p) {
    if (large_rekeep(ts->lout, ts->lout_word)) b = ts->lout;
    ts->lout = NULL;
  }
  if (b == NULL && !large_keep_block(&ts->heap->large, (uintptr_t)p, TCACHE_KEEP_MAX, &b)) return 0;
  tcache_kept_attach(tc, ts, b);
  tslot_count(ts, -(int64_t)b->size);
  tcache_publish(tc, ts->heap); /* cached now: trim and the threshold see it */
  return 1;
}

static int tcache_free_slow_in(tcache *tc, slab *sl, void *p, cudaStream_t s);

int tcache_free_special(void *p, cudaStream_t s) {
  tcache *tc = tcache_tls;
  slab *sl = pagemap_lookup((uintptr_t)p);
  if (tc != NULL && sl != NULL) {
    uint64_t id = tcache_stream_id(tc, s);
    if (tcache_enter(tc) && id == tc->last->id && tcache_free_push(tc, sl, p, s)) {
      tcache_leave(tc);
      return MAGPIE_OK;
    }
  }
  return tcache_free_slow(p, s);
}

/* A free on the handle of another alloc-capable slot than the last: that
 * slot becomes the last and takes the block if the fast path's checks pass
 * there (matched by handle, as in the fast path; no seal, no driver call).
 * A thread that moves between streams frees on the new one first. */
static int tcache_free_switch(tcache *tc, slab *sl, void *p, cudaStream_t s) {
  if (tc->check || tcache_special_handle(s) || sl == NULL) return 0;
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    if (tc->alloc_handle[i] != s) continue;
    tslot *was = tc->last;
    tc->last = &tc->slots[i];
    if (tcache_free_push(tc, sl, p, s)) return 1;
    tc->last = was;
    return 0;
  }
  return 0;
}

int tcache_free_slow(void *p, cudaStream_t s) {
  if (p == NULL) return MAGPIE_OK;
  tcache *tc = tcache_tls;
  if (tc == NULL && (tc = tcache_create()) == NULL) return magpie_last_error();
  slab *sl = pagemap_lookup((uintptr_t)p);
  /* A graph pool's block goes back to its pool (capture.c). */
  if (sl != NULL && sl->cls == SLAB_LARGE && large_is_graph(sl->seg, (uintptr_t)p))
    return globals.tcache_graph_free(p, sl, s);
  tcache_enter_slow(tc);
  int rc = (sl != NULL && tcache_keep_large(tc, sl, p, s)) || tcache_free_switch(tc, sl, p, s)
               ? MAGPIE_OK
               : tcache_free_slow_in(tc, sl, p, s);
  tcache_leave(tc);
  return rc;
}

int tcache_free_to_limbo(void *p, slab *sl, cudaStream_t s) {
  tcache *tc = tcache_tls;
  if (tc == NULL && (tc = tcache_create()) == NULL) return magpie_last_error();
  uint32_t bi = 0;
  if (!slab_block_index(sl, (uintptr_t)p, &bi))
    return error_set(MAGPIE_ERR_INVALID_POINTER, "magpie_free_async(%p): not the start of a block magpie handed out",
                     p);
  heap *h = sl->heap;
  unsigned c = large_block_class(sl, (uintptr_t)p);
  size_t bsize = 0;
  int rc = MAGPIE_OK;
  tcache_enter_slow(tc);
  /* A recorded block is parked by its entry (record.c), without a seal of
   * the capturing stream: a synchronisation covers it. */
  if (atomic_load_relaxed(&sl->recorded) != 0) {
    rc = record_free(&h->records, c != SLAB_LARGE ? &h->depots[c] : NULL, sl, (uintptr_t)p, NULL, s, &bsize);
    if (rc == MAGPIE_OK && bsize != 0) {
      if (tc->check && c != SLAB_LARGE) tcache_mark_free(sl, (uintptr_t)p, bi);
      goto out;
    }
    if (rc != MAGPIE_OK) goto done;
  }
  if (c == SLAB_LARGE) {
    lblock *b = NULL;
    if (!large_keep_block(&h->large, (uintptr_t)p, SIZE_MAX, &b)) {
      rc = error_set(MAGPIE_ERR_INVALID_POINTER, "magpie_free_async(%p): not an allocated large block (double free?)",
                     p);
    } else if (heap_limbo_put_large(h, b, HEAP_SYNC_EVERY_DEVICE) != MAGPIE_OK) {
      large_unkeep(b);
      rc = error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_free_async(%p): out of host memory; the block stays allocated",
                     p);
    }
    bsize = b != NULL ? b->size : 0;
  } else {
    bsize = globals.sizeclass_table[c].size;
    if (tc->check && !tcache_mark_free(sl, (uintptr_t)p, bi))
      rc = error_set(MAGPIE_ERR_DOUBLE_FREE, "magpie_free_async(%p): block already free (double free)", p);
    else if (heap_limbo_block(h, c, p, HEAP_SYNC_EVERY_DEVICE) != MAGPIE_OK)
      rc = error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_free_async(%p): out of host memory; the block stays allocated",
                     p);
  }
out:
  if (rc == MAGPIE_OK) {
    atomic_owner_add_i64(&tc->live[h->device], -(int64_t)bsize);
    tcache_publish(tc, h);
  }
done:
  tcache_leave(tc);
  return rc;
}

/* A free through slot ts (on s, whose id matched) succeeded: drain the
 * slot if it was armed and is back to its level. */
static int tcache_freed(tcache *tc, tslot *ts, cudaStream_t s) {
  if (ts->held > ts->drain_at) return MAGPIE_OK;
  tcache_kept_out(tc, ts, &s);
  if (tdrain_slot(tc, ts, s) != MAGPIE_OK) tcache_slot_empty(tc, ts); /* no seal: to limbo */
  return MAGPIE_OK;
}

static int tcache_free_slow_in(tcache *tc, slab *sl, void *p, cudaStream_t s) {
  if (sl == NULL)
    return error_set(MAGPIE_ERR_INVALID_POINTER, "magpie_free_async(%p): not a pointer returned by magpie", p);
  uint32_t bi = 0;
  if (!slab_block_index(sl, (uintptr_t)p, &bi)) {
    size_t off = (size_t)((uintptr_t)p - sl->base);
    size_t start = sl->cls == SLAB_LARGE ? 0 : (off / sl->bsize) * sl->bsize;
    return error_set(MAGPIE_ERR_INVALID_POINTER,
                     "magpie_free_async(%p): points %zu bytes into a block of %zu bytes at %p; free the block's "
                     "start",
                     p, off - start, sl->bsize, (void *)(sl->base + start));
  }
  /* A class block of a large segment (pool/large.h) is freed as a block
   * of its class. */
  unsigned c = large_block_class(sl, (uintptr_t)p);
  size_t bsize = c == SLAB_LARGE ? sl->bsize : globals.sizeclass_table[c].size;
  uint64_t id = 0;
  int idrc = tc->ops->stream_id(s, &id);
  if (idrc == MAGPIE_ERR_CAPTURE)
    return error_set(idrc,
                     "magpie_free_async(%p): stream %p is capturing a CUDA graph that magpie was not told of (CUDA "
                     "refuses its id there and invalidates the capture): call magpie_capture_begin(pool, stream) "
                     "when the capture begins; the block stays allocated",
                     p, (void *)s);
  if (idrc != MAGPIE_OK)
    return error_set(MAGPIE_ERR_INVALID_STREAM,
                     "magpie_free_async(%p): stream %p is not valid (%s); the block "
                     "stays allocated",
                     p, (void *)s, backend_error_detail());
  tslot *ts = tcache_slot_for_free(tc, s, id, sl->heap);
  if (ts == NULL) return magpie_last_error();
  /* record_stream: a recorded block is parked until its streams' work
   * completed (record.c). */
  if (unlikely(atomic_load_relaxed(&sl->recorded) != 0)) {
    size_t parked = 0;
    int rc = record_free(&sl->heap->records, c != SLAB_LARGE ? &sl->heap->depots[c] : NULL, sl, (uintptr_t)p, ts->rec,
                         s, &parked);
    if (rc != MAGPIE_OK) return rc;
    if (parked != 0) {
      if (tc->check && c != SLAB_LARGE) tcache_mark_free(sl, (uintptr_t)p, bi);
      tslot_count(ts, -(int64_t)parked);
      tcache_publish(tc, ts->heap);
      return tcache_freed(tc, ts, s);
    }
  }
  if (c == SLAB_LARGE) {
    int rc = tcache_free_large(tc, ts, p, s);
    return rc == MAGPIE_OK ? tcache_freed(tc, ts, s) : rc;
  }
  if (tc->check && !tcache_mark_free(sl, (uintptr_t)p, bi))
    return error_set(MAGPIE_ERR_DOUBLE_FREE, "magpie_free_async(%p): block already free (double free)", p);
  ts->drained = 0;
  ts->used |= (uint64_t)1 << c;
  int publish = 0;
  if (ts->cl[c].loaded->count >= ts->cl[c].loaded->cap) {
    ts->clean[c] = 0; /* the loaded magazine leaves (tdrain_slot) */
    magazine *pv = ts->prev[c];
    int pv_empty = magazine_is_real(pv) && pv->count == 0;
    /* Class blocks: the full magazine leaves at once (no second one is
     * kept), so a thread holds at most one magazine of the class. */
    int one = globals.sizeclass_table[c].seg && magazine_is_real(ts->cl[c].loaded);
    if (pv_empty && !one) {
      ts->prev[c] = ts->cl[c].loaded;
      ts->cl[c].loaded = pv;
    } else {
      magazine *e = pv_empty ? pv : magazine_get_empty(c);
      if (e == NULL) {
        if (tc->check) tcache_mark_used(sl, (uintptr_t)p, bi);
        return error_set(MAGPIE_ERR_OUT_OF_MEMORY,
                         "magpie_free_async(%p): out of host memory for a magazine; "
                         "the block stays allocated",
                         p);
      }
      if (one) {
        if (e == pv) ts->prev[c] = &magazine_sentinel;
        uint64_t bit = (uint64_t)1 << c;
        ts->out_blocks[c] += ts->cl[c].loaded->count;
        ts->round_trip = ts->out_blocks[c] <= tslot_allocs(ts, c) ? ts->round_trip | bit : ts->round_trip & ~bit;
        tcache_outbox_add(ts, ts->cl[c].loaded, s);
      } else {
        e->cap = tcache_next_cap(ts, c);
        /* The previous magazine is full: it leaves through the outbox,
         * sealed on the stream its blocks were freed on (s names it: its
         * id matched). */
        if (magazine_is_real(pv)) tcache_outbox_add(ts, pv, s);
        ts->prev[c] = ts->cl[c].loaded;
      }
      ts->cl[c].loaded = e;
      publish = 1;
    }
  }
  magazine *m = ts->cl[c].loaded;
  m->slots[m->count++] = p;
  tcache_note_held(ts, c);
  tslot_count(ts, -(int64_t)bsize);
  if (publish) tcache_publish(tc, ts->heap);
  if (!tc->check && ts->alloc_ok) tc->last = ts;
  return tcache_freed(tc, ts, s);
}

static void tcache_destroy(void *arg) {
  tcache *tc = arg;
  /* Leave the list first, so no new reclaimer can pick this cache, then
   * wait out one that already did (it set steal under the list lock). */
  atomic_store_relaxed(&tc->busy, 1);
  atomic_thread_fence(memory_order_seq_cst);
  pthread_mutex_lock(&globals.tcache_list_lock);
  if (tc->lprev) tc->lprev->lnext = tc->lnext;
  else globals.tcache_list = tc->lnext;
  if (tc->lnext) tc->lnext->lprev = tc->lprev;
  pthread_mutex_unlock(&globals.tcache_list_lock);
  while ((atomic_load_acquire(&tc->steal) & TCACHE_CLAIMED) != 0) sched_yield();
  tdrain_flush(tc, NULL);
  tdrain_release_spares(tc);
  for (int i = 0; i < TCACHE_SLOTS; i++)
    if (tc->slots[i].heap != NULL) tcache_slot_retire(tc, &tc->slots[i]);
  pthread_mutex_lock(&globals.tcache_list_lock);
  for (int d = 0; d < HEAP_MAX_DEVICES; d++) {
    globals.tcache_retired_live[d] += atomic_load_relaxed(&tc->live[d]);
    globals.tcache_retired_kept[d] += atomic_load_relaxed(&tc->kept_bytes[d]);
  }
  pthread_mutex_unlock(&globals.tcache_list_lock);
  tcache_tls = NULL;
  meta_free(tc);
}

int64_t tcache_live_bytes(int device, int64_t *kept) {
  *kept = 0;
  if (device < 0 || device >= HEAP_MAX_DEVICES) return 0;
  pthread_mutex_lock(&globals.tcache_list_lock);
  int64_t sum = globals.tcache_retired_live[device];
  *kept = globals.tcache_retired_kept[device];
  for (tcache *tc = globals.tcache_list; tc; tc = tc->lnext) {
    sum += atomic_load_relaxed(&tc->live[device]);
    *kept += atomic_load_relaxed(&tc->kept_bytes[device]);
  }
  pthread_mutex_unlock(&globals.tcache_list_lock);
  return sum;
}

void tcache_class_counts(heap *h, uint64_t *hits, uint64_t *misses) {
  pthread_mutex_lock(&globals.tcache_list_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    hits[c] += atomic_load_relaxed(&h->stat_class_hits[c]);
    misses[c] += atomic_load_relaxed(&h->stat_class_misses[c]);
  }
  for (tcache *tc = globals.tcache_list; tc; tc = tc->lnext) {
    for (int i = 0; i < TCACHE_SLOTS; i++) {
      tslot *ts = &tc->slots[i];
      if (atomic_load_relaxed(&ts->stats_heap) != h) continue;
      for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
        hits[c] += atomic_load_relaxed(&ts->cl[c].hits);
        misses[c] += atomic_load_relaxed(&ts->cl[c].misses);
      }
    }
  }
  pthread_mutex_unlock(&globals.tcache_list_lock);
}

/* Caches other than the caller's, each claimed (TCACHE_CLAIMED) under the
 * list lock; *n set. The array comes from host metadata (NULL if none). */
static tcache **tcache_claim_others(int *n) {
  tcache *self = tcache_tls;
  *n = 0;
  pthread_mutex_lock(&globals.tcache_list_lock);
  int count = 0;
  for (tcache *tc = globals.tcache_list; tc; tc = tc->lnext) count++;
  tcache **all = count ? meta_alloc((size_t)count * sizeof *all) : NULL;
  if (all != NULL) {
    for (tcache *tc = globals.tcache_list; tc; tc = tc->lnext) {
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
  pthread_mutex_unlock(&globals.tcache_list_lock);
  return all;
}

/* Is tc's owner outside magpie, so that its caches may be read or taken?
 * Only after the barrier (tcache_barrier) that followed claiming tc; the
 * acquire pairs with the owner's release store of busy = 0. */
static int tcache_owner_out(tcache *tc, int barrier) { return barrier && atomic_load_acquire(&tc->busy) == 0; }

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
static size_t tcache_reclaim_threads(heap *h) {
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
  tcache_leave(tc);
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
