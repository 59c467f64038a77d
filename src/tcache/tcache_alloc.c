/* The allocation slow path of the thread caches: refills of a slot's
 * magazines from the heap, large blocks, the decay of slots a thread
 * leaves, the refusal of captures magpie was not told of, the give-back of
 * the thread's own magazines under pressure.
 *
 * Takes no lock of its own: the heap's calls take theirs. */
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

static void *tcache_alloc_slow_in(tcache *tc, size_t size, cudaStream_t s, uint64_t id);

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
size_t tcache_give_back_own(tcache *tc, tslot *cur, cudaStream_t s) {
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
void tcache_relief_end(tcache *tc) {
  tc->relief_slot = NULL;
  if (unlikely(atomic_load_relaxed(&tc->relieving))) atomic_store_relaxed(&tc->relieving, 0);
}

static void tcache_oom_error(heap *h, size_t size, int rc) {
  if (rc != MAGPIE_ERR_OUT_OF_MEMORY) {
    error_set(rc, "allocating %zu bytes on device %d failed: %s", size, h->device, backend_error_detail());
    return;
  }
  char detail[512] = "";
  if (tcache_st.up.describe != NULL) tcache_st.up.describe(h, detail, sizeof detail);
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
  if (ts->nkeep > 0) {
    /* The smallest block kept for this stream that the request fits
     * within an eighth. */
    size_t need = large_round(size);
    uint32_t best = TCACHE_KEEP_BLOCKS;
    for (uint32_t i = 0; i < ts->nkeep; i++) {
      size_t bs = ts->lkeep_size[i];
      if (bs >= need && bs - need <= need / 8 && (best == TCACHE_KEEP_BLOCKS || bs < ts->lkeep_size[best])) {
        best = i;
        if (bs == need) break; /* none fits closer */
      }
    }
    if (best != TCACHE_KEEP_BLOCKS) {
      lblock *k = ts->lkeep[best];
      uintptr_t kp = k->base;
      size_t ks = k->size;
      tcache_kept_detach(tc, ts, best);
      tcache_lent_add(ts, k, kp, ks, large_lend(k));
      /* Published at the next exchange, as the fast paths do. */
      tslot_count(ts, (int64_t)ks);
      if (!tc->check) tc->last = ts;
      return (void *)kp;
    }
  }
  uintptr_t p = 0;
  size_t bsize = 0;
  /* Kept blocks none fits: they go (the outbox with them, one seal) once
   * there are TCACHE_KEEP_MISS of them. */
  if (ts->nkeep >= TCACHE_KEEP_MISS) tcache_kept_out(tc, ts, &s);
  tcache_relief_context(tc, ts, s);
  /* A thread that may keep large blocks (tcache_keep_large) takes the
   * block lent: its free here keeps it without the large cache's lock. */
  large_lent lent = {0}, *lentp = tcache_keeps_for(tc, ts) ? &lent : NULL;
  int rc = heap_large_alloc(h, size, id, s, tcache_own_cached(ts) ? HEAP_NO_MAP : 0, &p, &bsize, lentp);
  if (rc == HEAP_WOULD_MAP) {
    tcache_own_out(tc, ts, s);
    rc = heap_large_alloc(h, size, id, s, 0, &p, &bsize, lentp);
  }
  if (rc != MAGPIE_OK) {
    tcache_oom_error(h, size, rc);
    return NULL;
  }
  if (lent.b != NULL) tcache_lent_add(ts, lent.b, p, bsize, lent.word);
  tslot_count(ts, (int64_t)bsize);
  tcache_publish(tc, h);
  if (!tc->check) tc->last = ts;
  return (void *)p;
}

/* Checked mode: a block of slab sl (index bi) or a class block of sl's
 * segment marked handed out or free (0: it already was). */
int tcache_mark_used(slab *sl, uintptr_t p, uint32_t bi) {
  return sl->cls == SLAB_LARGE ? large_class_mark(sl->seg, p, 1) : slab_mark_used(sl, bi);
}

int tcache_mark_free(slab *sl, uintptr_t p, uint32_t bi) {
  return sl->cls == SLAB_LARGE ? large_class_mark(sl->seg, p, 0) : slab_mark_free(sl, bi);
}

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
  if (!tcache_special_handle(s) || tcache_st.up.capture_announced() ||
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
void tcache_note_held(tslot *ts, unsigned c) {
  uint32_t lows = ts->lows[c], was = ts->cl[c].low + ts->pcount[c];
  uint32_t now = tcache_held_restart(ts, c);
  if (was < lows) lows = was;
  if (now < lows) lows = now;
  ts->lows[c] = (uint8_t)lows;
}

/* n blocks from the bottom of m (untouched the longest) into the outbox;
 * they stay in m if host memory for a magazine ran out. */
static void tcache_shed(tcache *tc, tslot *ts, unsigned c, magazine *m, uint32_t n, cudaStream_t s) {
  magazine *e = tcache_spare_take(tc, c);
  if (e == NULL) return;
  memcpy(e->slots, m->slots, n * sizeof m->slots[0]);
  memmove(m->slots, m->slots + n, (m->count - n) * sizeof m->slots[0]);
  e->count = n;
  e->cap = m->cap;
  m->count -= n;
  if (m == ts->cl[c].loaded) ts->clean[c] = ts->clean[c] > n ? (uint8_t)(ts->clean[c] - n) : 0;
  tcache_outbox_add(tc, ts, e, s);
}

static void tcache_refill_trim(tcache *tc, tslot *ts, unsigned c, magazine *fresh, cudaStream_t s) {
  tcache_shed(tc, ts, c, fresh, fresh->count - ts->fill[c], s);
}

static void tcache_slot_decay(tcache *tc, tslot *ts, cudaStream_t s) {
  ts->entries = 0;
  int shed = 0;
  for (uint64_t used = ts->used; used != 0; used &= used - 1) {
    unsigned c = (unsigned)__builtin_ctzll(used);
    const sizeclass_info *ci = &sizeclass_table[c];
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
        tcache_outbox_add(tc, ts, pv, s);
        shed = 1;
      }
      if (n > m->count) n = m->count;
      if (n > 0) {
        tcache_shed(tc, ts, c, m, n, s);
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

/* record_stream: a small block this thread freed with recorded streams is
 * parked until their work completed; then the next allocation of its class
 * on the stream it was freed on gets it back, on top of the slot's loaded
 * magazine, as PyTorch's allocator hands the block to its stream again
 * once its events completed. Other blocks come back through the depot
 * (record_poll on a refill). While the thread has blocks parked its
 * allocations and frees take the slow path (TCACHE_RECORDED), which
 * queries at most every TCACHE_RECORDED_POLL_NS; the bit goes once none is
 * left (a free only counts them). */
#define TCACHE_RECORDED_POLL_NS 20000

void tcache_claim_recorded(tcache *tc, tslot *ts, unsigned c, uint64_t id, int take) {
  uint64_t now = ticks_now_ns();
  if (now - tc->recorded_poll_ns < TCACHE_RECORDED_POLL_NS) return;
  tc->recorded_poll_ns = now;
  /* A free takes nothing: what completed goes back to the pools, and the
   * rest is counted. */
  if (!take) record_poll(&ts->heap->records, ts->heap->depots, &ts->heap->large);
  magazine *m = ts->cl[c].loaded;
  unsigned mine = 1;
  /* The shared empty magazine (a class the slot has not used yet) takes
   * nothing and is not written: only the count of parked blocks is asked. */
  unsigned room = take && magazine_is_real(m) ? m->cap - m->count : 0;
  unsigned n = record_claim(&ts->heap->records, &ts->heap->depots[c], tc, id, c, m->slots + m->count, room, &mine);
  if (n > 0) m->count += n;
  if (mine == 0) atomic_and_relaxed(&tc->steal, ~TCACHE_RECORDED);
}

/* A refill of class blocks: has anyone found their paths' locks held since
 * the slot last looked? (A slot's first look only takes the count.) */
static void tcache_note_contention(tslot *ts) {
  uint64_t n = heap_class_contention(ts->heap);
  if (ts->contention_seen == UINT64_MAX) {
    ts->contention_seen = n;
  } else if (n != ts->contention_seen) {
    ts->contention_seen = n;
    ts->seg_quiet = 0;
    ts->seg_two = 1;
  } else if (ts->seg_two && ++ts->seg_quiet >= TCACHE_QUIET_REFILLS) {
    ts->seg_two = 0;
  }
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
    tcache_slot_decay(tc, ts, s);
  if (ts != tc->last || ts->drained) tdrain_enter(tc, ts);
  if (size > SIZECLASS_MAX_SIZE)
    return tcache_capture_refused(tc, s, size) ? NULL : tcache_alloc_large(tc, ts, size, id, s);
  unsigned c = sizeclass_of(size);
  if (unlikely(atomic_load_relaxed(&tc->steal) & TCACHE_RECORDED)) tcache_claim_recorded(tc, ts, c, id, 1);
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
        /* From what all threads share; what this slot caches goes there
         * first if the refill would map (tcache_own_out). */
        if (tcache_capture_refused(tc, s, size)) return NULL;
        /* An outbox filled while the thread was on this stream alone is
         * bounded as a thread's on several (tcache_outbox_full) now. */
        if (tcache_outbox_full(tc, ts)) tcache_outbox_seal(ts, s);
        tcache_relief_context(tc, ts, s);
        uint32_t cap = sizeclass_table[c].seg ? tcache_seg_cap(tc, ts, c) : 0;
        int rc = heap_refill(ts->heap, c, cap, id, s, tcache_own_cached(ts) ? HEAP_NO_MAP : 0, &fresh);
        if (rc == HEAP_WOULD_MAP) {
          tcache_own_out(tc, ts, s);
          rc = heap_refill(ts->heap, c, cap, id, s, 0, &fresh);
        }
        if (rc != MAGPIE_OK) {
          tcache_oom_error(ts->heap, size, rc);
          return NULL;
        }
        depot_note_thread_in(&ts->heap->depots[fresh->cls], fresh);
        if (sizeclass_table[c].seg) tcache_note_contention(ts);
      }
      ts->emptied |= (uint64_t)1 << c;
      if (!carried && !sizeclass_table[c].seg && ts->fill[c] != 0 && fresh->count > ts->fill[c])
        tcache_refill_trim(tc, ts, c, fresh, s);
      ts->mark[c] = tslot_allocs(ts, c);
      tcache_spare_give(tc, ts->prev[c]);
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
  tslot_count(ts, (int64_t)sizeclass_table[c].size);
  /* Publish for the peak only when the depot was involved: swaps between
   * the two magazines stay free of shared writes. */
  if (publish) tcache_publish(tc, ts->heap);
  if (!tc->check) tc->last = ts;
  return p;
}
