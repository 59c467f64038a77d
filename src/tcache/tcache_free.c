/* The free slow paths of the thread caches: a free that misses the loaded
 * magazine, large blocks (kept by the thread or given to the large cache
 * under a seal), recorded blocks, the special handles, blocks freed on a
 * capturing stream (to limbo).
 *
 * Takes no lock of its own: the heap's and the record table's calls take
 * theirs. */
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

static int tcache_free_slow_in(tcache *tc, slab *sl, void *p, cudaStream_t s);

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
 * thread allocates on no other stream, has blocks of its own out through
 * the slot (held > 0: a thread freeing another's blocks would keep what
 * only that one uses) and keeps fewer than
 * TCACHE_KEEP_BLOCKS, within TCACHE_KEEP_MORE past the first (one lock to
 * mark it in the large layer, none if the slot kept it before and handed
 * it out again; no event). PyTorch allocates on the legacy default stream
 * unless told otherwise, so the default handles are let in: without them
 * each large free there recorded an event and took the large layer's
 * lock. A thread taking turns on streams would strand the block while on
 * the others, holding far more memory (bench/DECISIONS.md, "A kept large
 * block: default handles, one stream only"). 0: the slow path. */
static int tcache_keep_large(tcache *tc, slab *sl, void *p, cudaStream_t s) {
  tslot *ts = tc->last;
  if (!tcache_keeps_for(tc, ts) || ts->held <= 0 || ts->nkeep == TCACHE_KEEP_BLOCKS || sl->cls != SLAB_LARGE ||
      ts->handle != s || ts->heap != sl->heap || atomic_load_relaxed(&sl->recorded) != 0 ||
      large_class_of(sl, (uintptr_t)p) >= 0)
    return 0;
  if (tcache_special_handle(s) && tcache_stream_id(tc, s) != ts->id) return 0; /* another context's */
  /* The first block up to TCACHE_KEEP_MAX, more while all stay within
   * TCACHE_KEEP_MORE. */
  size_t max = ts->nkeep == 0                      ? TCACHE_KEEP_MAX
               : ts->keep_bytes < TCACHE_KEEP_MORE ? TCACHE_KEEP_MORE - ts->keep_bytes
                                                   : 0;
  if (max == 0) return 0;
  lblock *b = NULL;
  /* A block this slot lent out, freed here: kept again without the
   * large cache's lock where nothing happened to it meanwhile. */
  for (uint32_t k = 1; k <= TCACHE_LENT; k++) { /* the newest first */
    uint32_t i = (ts->lent_next + TCACHE_LENT - k) % TCACHE_LENT;
    if (ts->lent_base[i] != (uintptr_t)p) continue;
    struct tslot_lent *l = &ts->lent[i];
    if (l->size <= max && large_rekeep(l->b, l->word)) b = l->b;
    ts->lent_base[i] = 0;
    break;
  }
  if (b == NULL && !large_keep_block(&ts->heap->large, (uintptr_t)p, max, &b)) return 0;
  tcache_kept_attach(tc, ts, b);
  tslot_count(ts, -(int64_t)b->size);
  tcache_publish(tc, ts->heap); /* cached now: trim and the threshold see it */
  return 1;
}

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
  if (sl != NULL && sl->cls == SLAB_LARGE && large_is_graph(sl, (uintptr_t)p)) return tcache_st.up.graph_free(p, sl, s);
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
    rc = record_free(&h->records, c != SLAB_LARGE ? &h->depots[c] : NULL, sl, (uintptr_t)p, NULL, s, NULL, &bsize);
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
    bsize = sizeclass_table[c].size;
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

/* Full magazine m of the slot's leaves through the outbox. Class blocks
 * count as the slot's own surplus while it gave out no more of them than
 * it took (tslot.h, round_trip). */
static void tcache_class_out(tcache *tc, tslot *ts, magazine *m, cudaStream_t s) {
  unsigned c = m->cls;
  if (sizeclass_table[c].seg) {
    uint64_t bit = (uint64_t)1 << c;
    ts->out_blocks[c] += m->count;
    ts->round_trip = ts->out_blocks[c] <= tslot_allocs(ts, c) ? ts->round_trip | bit : ts->round_trip & ~bit;
  }
  tcache_outbox_add(tc, ts, m, s);
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
  size_t bsize = c == SLAB_LARGE ? sl->bsize : sizeclass_table[c].size;
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
  /* A thread that only frees still lets go of TCACHE_RECORDED once its
   * parked blocks are back. */
  if (unlikely(atomic_load_relaxed(&tc->steal) & TCACHE_RECORDED)) tcache_claim_recorded(tc, ts, 0, id, 0);
  /* record_stream: a recorded block is parked until its streams' work
   * completed (record.c). */
  if (unlikely(atomic_load_relaxed(&sl->recorded) != 0)) {
    size_t parked = 0;
    int rc = record_free(&sl->heap->records, c != SLAB_LARGE ? &sl->heap->depots[c] : NULL, sl, (uintptr_t)p, ts->rec,
                         s, tc, &parked);
    if (rc != MAGPIE_OK) return rc;
    if (parked != 0) {
      if (tc->check && c != SLAB_LARGE) tcache_mark_free(sl, (uintptr_t)p, bi);
      /* Its class's next allocations on s look for it (tcache_claim_recorded). */
      if (c != SLAB_LARGE && !(atomic_load_relaxed(&tc->steal) & TCACHE_RECORDED))
        atomic_or_relaxed(&tc->steal, TCACHE_RECORDED);
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
    /* Class blocks: unless threads contend on their paths and the thread
     * is on this stream alone, the full magazine leaves at once (no second
     * one is kept), so a thread holds at most one magazine of the class
     * (tslot.h, seg_two). */
    int seg = sizeclass_table[c].seg;
    int one = seg && magazine_is_real(ts->cl[c].loaded) && !(ts->seg_two && tcache_keeps_for(tc, ts));
    if (pv_empty && !one) {
      ts->prev[c] = ts->cl[c].loaded;
      ts->cl[c].loaded = pv;
    } else {
      magazine *e = pv_empty ? pv : tcache_spare_take(tc, c);
      if (e == NULL) {
        if (tc->check) tcache_mark_used(sl, (uintptr_t)p, bi);
        return error_set(MAGPIE_ERR_OUT_OF_MEMORY,
                         "magpie_free_async(%p): out of host memory for a magazine; "
                         "the block stays allocated",
                         p);
      }
      e->cap = seg ? tcache_seg_cap(tc, ts, c) : tcache_next_cap(ts, c);
      if (one) {
        /* A second magazine kept while threads contended leaves too. */
        if (e != pv && magazine_is_real(pv)) tcache_class_out(tc, ts, pv, s);
        ts->prev[c] = &magazine_sentinel;
        tcache_class_out(tc, ts, ts->cl[c].loaded, s);
      } else {
        /* The previous magazine is full: it leaves through the outbox,
         * sealed on the stream its blocks were freed on (s names it: its
         * id matched). */
        if (magazine_is_real(pv)) tcache_class_out(tc, ts, pv, s);
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
