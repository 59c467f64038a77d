/* A thread cache's stream slots: finding or making the slot of a stream,
 * the outbox that sends full magazines to the depot under one seal, the
 * large block a slot keeps, a slot's magazines handed out (sealed or to
 * limbo), retiring and recycling slots.
 *
 * Lock order: tcache_st.list_lock alone (tcache.c); the rest is the owning
 * thread's. */
#include "tcache/tcache.h"

#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/error.h"
#include "base/meta.h"
#include "base/sizeclass.h"
#include "base/ticks.h"
#include "pool/record.h"
#include "tcache/tcache_internal.h"
#include "tcache/tdrain.h"

void tcache_slot_clear(tslot *ts) {
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
  ts->seg_two = 0;
  ts->seg_quiet = 0;
  ts->contention_seen = UINT64_MAX; /* not looked yet */
  memset(ts->out_blocks, 0, sizeof ts->out_blocks);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    ts->cl[c].loaded = ts->prev[c] = &magazine_sentinel;
    ts->cl[c].low = ts->pcount[c] = ts->lows[c] = 0;
    ts->fill[c] = 0;
  }
  ts->entries = 0;
  ts->emptied = 0;
  MAGPIE_ASSERT(ts->nout == 0 && ts->nkeep == 0); /* emptied before (tcache_slot_out) or never used */
  ts->nout = 0;
  ts->out_bytes = 0;
  ts->nkeep = 0;
  ts->keep_bytes = 0;
  memset(ts->lent_base, 0, sizeof ts->lent_base);
  memset(ts->lent, 0, sizeof ts->lent);
  ts->lent_next = 0;
}

/* Bring the slot's entries of tc->alloc_id / alloc_handle up to date. */
void tcache_slot_index(tcache *tc, const tslot *ts) {
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
uint32_t tcache_next_cap(tslot *ts, unsigned c) {
  const sizeclass_info *ci = &sizeclass_table[c];
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
void tcache_outbox_seal(tslot *ts, cudaStream_t handle) {
  if (ts->nout == 0) return;
  epoch_ticket t;
  tcache_outbox_give(ts, epoch_seal(ts->rec, handle, &t) == MAGPIE_OK ? &t : NULL);
}

/* A full magazine leaves loaded/prev on a free on `handle` (as above): into
 * the outbox, sealed with the others once it is full. */
void tcache_outbox_add(tcache *tc, tslot *ts, magazine *m, cudaStream_t handle) {
  MAGPIE_ASSERT(ts->nout < TCACHE_OUTBOX && m->count > 0);
  ts->outbox[ts->nout++] = m;
  ts->out_bytes += depot_magazine_bytes(m);
  if (tcache_outbox_full(tc, ts)) tcache_outbox_seal(ts, handle);
}

/* An outbox magazine of class c, taken back (NULL if none). */
magazine *tcache_outbox_take(tslot *ts, unsigned c) {
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
int tcache_large_release(tslot *ts, void *p, cudaStream_t s, size_t *bsize, int *sealed) {
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
 * statistics say so together; detach undoes it for lkeep[i]. */
void tcache_kept_attach(tcache *tc, tslot *ts, lblock *b) {
  MAGPIE_ASSERT(ts->nkeep < TCACHE_KEEP_BLOCKS && (tc->kept == NULL || tc->kept == ts));
  ts->lkeep_size[ts->nkeep] = b->size;
  ts->lkeep[ts->nkeep++] = b;
  ts->keep_bytes += b->size;
  tc->kept = ts;
  atomic_owner_add_i64(&tc->kept_bytes[ts->heap->device], (int64_t)b->size);
}

void tcache_kept_detach(tcache *tc, tslot *ts, uint32_t i) {
  MAGPIE_ASSERT(i < ts->nkeep && ts->lkeep_size[i] == ts->lkeep[i]->size);
  lblock *b = ts->lkeep[i];
  atomic_owner_add_i64(&tc->kept_bytes[ts->heap->device], -(int64_t)b->size);
  ts->keep_bytes -= b->size;
  ts->lkeep[i] = ts->lkeep[--ts->nkeep];
  ts->lkeep_size[i] = ts->lkeep_size[ts->nkeep];
  if (ts->nkeep == 0) tc->kept = NULL;
}

/* The slot's kept large blocks leave: to the large layer under one seal on
 * *seal_on and one hold of its lock, the outbox with them, or with seal_on
 * NULL (or a failed seal, or no host memory for the large layer's ticket)
 * to limbo. Returns their bytes (a block not even limbo could take stays,
 * kept). */
size_t tcache_kept_out(tcache *tc, tslot *ts, const cudaStream_t *seal_on) {
  uint32_t n = ts->nkeep;
  if (n == 0) return 0;
  lblock *out[TCACHE_KEEP_BLOCKS];
  size_t bytes = ts->keep_bytes;
  memcpy(out, ts->lkeep, n * sizeof out[0]);
  while (ts->nkeep > 0) tcache_kept_detach(tc, ts, ts->nkeep - 1);
  epoch_ticket t = {0};
  if (seal_on != NULL && epoch_seal(ts->rec, *seal_on, &t) == MAGPIE_OK) {
    epoch_ticket u = {0};
    if (ts->nout > 0) epoch_ticket_copy(&t, &u); /* large_free_kept takes t over */
    if (large_free_kept(&ts->heap->large, out, n, &t) == MAGPIE_OK) {
      if (u.rec != NULL) tcache_outbox_give(ts, &u);
      heap_note_cached(ts->heap);
      return bytes;
    }
    epoch_ticket_release(&t);
    if (u.rec != NULL) epoch_ticket_release(&u);
  }
  for (uint32_t i = 0; i < n; i++) {
    if (heap_limbo_put_large(ts->heap, out[i], ts->sdev) == MAGPIE_OK) continue;
    tcache_kept_attach(tc, ts, out[i]); /* stays: not even limbo could take it */
    bytes -= out[i]->size;
  }
  return bytes;
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
size_t tcache_slot_out(tcache *tc, tslot *ts, const cudaStream_t *seal_on) {
  size_t bytes = ts->out_bytes + tcache_kept_out(tc, ts, seal_on);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) bytes += tcache_class_to_outbox(ts, c, seal_on);
  tcache_outbox_leave(ts, seal_on);
  return bytes;
}

/* Before the slot's allocation maps device memory, its magazines of class
 * blocks (the classes without slabs) join the outbox, to go back to their
 * segments with it (heap_put, as the slot's own: their classes are marked
 * round trips in ts->round_trip, which the caller restores after its
 * seal). Cached in the thread they sit between the segments' free holes
 * and keep them apart, so the segments grew beside them
 * (bench/DECISIONS.md, "Class blocks go back before a large allocation"). */
static void tcache_class_blocks_out(tslot *ts, cudaStream_t s) {
  for (unsigned c = SIZECLASS_FINE_COUNT; c < SIZECLASS_COUNT; c++) {
    if (!sizeclass_table[c].seg) continue;
    uint64_t round_trip = ts->round_trip;
    ts->round_trip |= (uint64_t)1 << c; /* for a seal of a full outbox too */
    if (tcache_class_to_outbox(ts, c, &s) == 0) ts->round_trip = round_trip;
  }
}

int tcache_own_cached(const tslot *ts) {
  if (ts->nout > 0 || ts->nkeep > 0) return 1;
  for (unsigned c = SIZECLASS_FINE_COUNT; c < SIZECLASS_COUNT; c++)
    if (sizeclass_table[c].seg && (ts->cl[c].loaded->count > 0 || ts->prev[c]->count > 0)) return 1;
  return 0;
}

void tcache_own_out(tcache *tc, tslot *ts, cudaStream_t s) {
  uint64_t round_trip = ts->round_trip;
  tcache_class_blocks_out(ts, s);
  tcache_kept_out(tc, ts, &s); /* the outbox goes under its seal */
  tcache_outbox_seal(ts, s);
  ts->round_trip = round_trip;
}

/* Hand a slot's non-empty magazines to limbo (the slot stays). */
size_t tcache_slot_empty(tcache *tc, tslot *ts) { return tcache_slot_out(tc, ts, NULL); }

/* Fold a retiring slot's class counters into its heap. */
static void tcache_slot_fold(tslot *ts) {
  pthread_mutex_lock(&tcache_st.list_lock);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    atomic_add_relaxed(&ts->heap->stat_class_hits[c], atomic_load_relaxed(&ts->cl[c].hits));
    atomic_add_relaxed(&ts->heap->stat_class_misses[c], atomic_load_relaxed(&ts->cl[c].misses));
    atomic_store_relaxed(&ts->cl[c].hits, 0);
    atomic_store_relaxed(&ts->cl[c].misses, 0);
  }
  pthread_mutex_unlock(&tcache_st.list_lock);
}

/* Give back everything a slot holds. Its non-empty magazines go to limbo,
 * which waits for a device synchronisation: the slot's handle may name a
 * destroyed stream by now, and a stored handle is never passed to the
 * driver again (cuStreamGetId on a destroyed stream crashes the process,
 * and an event recorded on a recycled handle would follow the wrong
 * stream). Retiring happens at thread exit, on slot eviction and when a
 * handle is found recycled; seals on live streams happen in the free path,
 * where the caller's handle is known to be valid. */
void tcache_slot_retire(tcache *tc, tslot *ts) {
  tcache_slot_empty(tc, ts);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    if (magazine_is_real(ts->cl[c].loaded)) magazine_put_empty(ts->cl[c].loaded);
    if (magazine_is_real(ts->prev[c])) magazine_put_empty(ts->prev[c]);
  }
  tcache_slot_fold(ts);
  tcache_publish_exact(tc, ts->heap);
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
  tcache_publish_exact(tc, ts->heap);
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
    ts->cap[c] = (uint8_t)sizeclass_table[c].mag_cap;
    ts->mark[c] = tslot_allocs(ts, c);
    ts->run[c] = 0;
  }
  return ts;
}

/* The alloc-capable slot of stream id (handle s), created if needed. */
tslot *tcache_slot_for_alloc(tcache *tc, cudaStream_t s, uint64_t id) {
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

tslot *tcache_slot_for_free(tcache *tc, cudaStream_t s, uint64_t id, heap *h) {
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tslot *ts = &tc->slots[i];
    if (ts->heap == h && ts->id == id) return ts;
  }
  return tcache_slot_new(tc, s, id, h);
}
