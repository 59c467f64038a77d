/* Thread caches: slow paths, stream slots, thread exit.
 *
 * Lock order: tcache_list_lock is taken alone (never while calling into the
 * heap, depot or backend). Everything else here is thread-owned. */
#include "tcache.h"

#include <pthread.h>
#include <string.h>

#include "error.h"
#include "init.h"
#include "meta.h"
#include "stats.h"

__thread tcache *tcache_tls __attribute__((tls_model("initial-exec")));

static pthread_once_t tcache_key_once = PTHREAD_ONCE_INIT;
static pthread_key_t tcache_key;
static pthread_mutex_t tcache_list_lock = PTHREAD_MUTEX_INITIALIZER;
static tcache *tcache_list;                     /* under tcache_list_lock */
static int64_t tcache_retired_live[HEAP_MAX_DEVICES]; /* under tcache_list_lock */

static void tcache_destroy(void *arg);

static void tcache_key_create(void) { pthread_key_create(&tcache_key, tcache_destroy); }

static void tcache_slot_clear(tslot *ts) {
  ts->id = 0;
  ts->handle = (cudaStream_t)UINTPTR_MAX;
  ts->heap = NULL;
  ts->rec = NULL;
  ts->alloc_ok = 0;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) ts->loaded[c] = ts->prev[c] = &magazine_sentinel;
}

static tcache *tcache_create(void) {
  if (global_ensure() != MAGPIE_OK) return NULL; /* error already set */
  pthread_once(&tcache_key_once, tcache_key_create);
  tcache *tc = meta_alloc(sizeof *tc);
  if (tc == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a thread cache");
    return NULL;
  }
  tc->ops = global_ops();
  tc->check = global_config()->check;
  tcache_slot_clear(&tc->dummy);
  for (int i = 0; i < TCACHE_SLOTS; i++) tcache_slot_clear(&tc->slots[i]);
  tc->last = &tc->dummy;
  pthread_mutex_lock(&tcache_list_lock);
  tc->lnext = tcache_list;
  if (tcache_list) tcache_list->lprev = tc;
  tcache_list = tc;
  pthread_mutex_unlock(&tcache_list_lock);
  pthread_setspecific(tcache_key, tc);
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

/* Seal a non-empty magazine on `handle`, which the caller just passed and
 * which names the slot's stream (its id matched), and give it to the depot;
 * limbo if the seal fails. */
static void tcache_seal_to_depot(tslot *ts, magazine *m, cudaStream_t handle) {
  if (epoch_seal(ts->rec, handle, &m->ticket) == MAGPIE_OK) depot_put(ts->heap, m);
  else heap_limbo_put(ts->heap, m);
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
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    magazine *pair[2] = {ts->loaded[c], ts->prev[c]};
    for (int k = 0; k < 2; k++) {
      magazine *m = pair[k];
      if (!magazine_is_real(m)) continue;
      if (m->count == 0) magazine_put_empty(m);
      else heap_limbo_put(ts->heap, m);
    }
  }
  tcache_publish(tc, ts->heap);
  epoch_stream_release(ts->rec);
  if (tc->last == ts) tc->last = &tc->dummy;
  tcache_slot_clear(ts);
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
  for (int i = 0; i < TCACHE_SLOTS && ts == NULL; i++)
    if (tc->slots[i].heap == NULL) ts = &tc->slots[i];
  if (ts == NULL) {
    ts = &tc->slots[tc->next_evict++ % TCACHE_SLOTS];
    tcache_slot_retire(tc, ts);
  }
  stream_rec *rec = epoch_stream_acquire(&sh->epochs, id);
  if (rec == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a stream record");
    return NULL;
  }
  ts->id = id;
  ts->handle = s;
  ts->heap = h;
  ts->rec = rec;
  ts->live = &tc->live[h->device];
  ts->alloc_ok = (h == sh);
  return ts;
}

/* The alloc-capable slot of stream id (handle s), created if needed. */
static tslot *tcache_slot_for_alloc(tcache *tc, cudaStream_t s, uint64_t id) {
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tslot *ts = &tc->slots[i];
    if (ts->heap != NULL && ts->id == id && ts->alloc_ok) return ts;
#ifdef MAGPIE_TEST_IGNORE_STREAM_ID /* deliberately broken build: tests/BUILD expects its tests to fail */
    if (ts->heap != NULL && ts->handle == s && ts->alloc_ok) return (ts->id = id, ts);
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

static void tcache_oom_error(heap *h, size_t size, int rc) {
  if (rc != MAGPIE_ERR_OUT_OF_MEMORY) {
    error_set(rc, "allocating %zu bytes on device %d failed: %s", size, h->device, backend_error_detail());
    return;
  }
  char detail[512];
  stats_describe(h, detail, sizeof detail);
  error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of memory on device %d allocating %zu bytes: %s", h->device, size,
            detail);
}

static void *tcache_alloc_large(tcache *tc, tslot *ts, size_t size, uint64_t id) {
  heap *h = ts->heap;
  if (size > SIZE_MAX - h->region.gran + 1) {
    error_set(MAGPIE_ERR_SIZE_OVERFLOW, "requested size %zu cannot be rounded up to the %zu-byte granularity",
              size, h->region.gran);
    return NULL;
  }
  if (size > h->total_mem) {
    error_set(MAGPIE_ERR_TOO_LARGE, "requested %zu bytes but device %d has %zu bytes in total", size,
              h->device, h->total_mem);
    return NULL;
  }
  slab *sl = NULL;
  int rc = heap_large_alloc(h, size, id, &sl);
  if (rc != MAGPIE_OK) {
    tcache_oom_error(h, size, rc);
    return NULL;
  }
  atomic_owner_add_i64(ts->live, (int64_t)sl->size);
  tcache_publish(tc, h);
  if (!tc->check) tc->last = ts;
  return (void *)sl->base;
}

void *tcache_alloc_slow(size_t size, cudaStream_t s) {
  tcache *tc = tcache_tls;
  if (tc == NULL && (tc = tcache_create()) == NULL) return NULL;
  if (size == 0) size = 1; /* a unique minimum block, like malloc(0) */
  uint64_t id = 0;
  if (tc->ops->stream_id(s, &id) != MAGPIE_OK) {
    error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_malloc_async: stream %p is not valid: %s", (void *)s,
              backend_error_detail());
    return NULL;
  }
  tslot *ts = tcache_slot_for_alloc(tc, s, id);
  if (ts == NULL) return NULL;
  if (size > SIZECLASS_MAX_SIZE) return tcache_alloc_large(tc, ts, size, id);
  unsigned c = sizeclass_of(size);
  int publish = 0;
  if (ts->loaded[c]->count == 0) {
    if (ts->prev[c]->count > 0) {
      magazine *t = ts->loaded[c];
      ts->loaded[c] = ts->prev[c];
      ts->prev[c] = t;
    } else {
      magazine *fresh = NULL;
      int rc = heap_refill(ts->heap, c, id, &fresh);
      if (rc != MAGPIE_OK) {
        tcache_oom_error(ts->heap, size, rc);
        return NULL;
      }
      magazine_put_empty(ts->prev[c]);
      ts->prev[c] = ts->loaded[c];
      ts->loaded[c] = fresh;
      publish = 1;
    }
  }
  magazine *m = ts->loaded[c];
  void *p = m->slots[--m->count];
  if (tc->check) {
    slab *sl = pagemap_lookup((uintptr_t)p);
    uint32_t i = 0;
    slab_block_index(sl, (uintptr_t)p, &i);
    slab_mark_used(sl, i);
  }
  atomic_owner_add_i64(ts->live, (int64_t)sizeclass_table[c].size);
  /* Publish for the peak only when the depot was involved: swaps between
   * the two magazines stay free of shared writes. */
  if (publish) tcache_publish(tc, ts->heap);
  if (!tc->check) tc->last = ts;
  return p;
}

static int tcache_free_large(tcache *tc, tslot *ts, slab *sl, cudaStream_t s) {
  epoch_ticket t = {0};
  int rc = epoch_seal(ts->rec, s, &t);
  if (rc != MAGPIE_OK) {
    /* Without an event the block cannot be ordered after the stream: keep
     * it allocated and tell the caller, who may retry. */
    return error_set(rc, "magpie_free_async(%p): cannot record an event on stream %p: %s", (void *)sl->base,
                     (void *)s, backend_error_detail());
  }
  rc = large_free(ts->heap, sl, &t);
  if (rc != MAGPIE_OK) {
    epoch_ticket_release(&t);
    return error_set(rc, "magpie_free_async(%p): block already free (double free)", (void *)sl->base);
  }
  atomic_owner_add_i64(ts->live, -(int64_t)sl->size);
  tcache_publish(tc, ts->heap);
  return MAGPIE_OK;
}

int tcache_free_slow(void *p, cudaStream_t s) {
  if (p == NULL) return MAGPIE_OK;
  slab *sl = pagemap_lookup((uintptr_t)p);
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
  tcache *tc = tcache_tls;
  if (tc == NULL && (tc = tcache_create()) == NULL) return magpie_last_error();
  uint64_t id = 0;
  if (tc->ops->stream_id(s, &id) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_free_async(%p): stream %p is not valid (%s); the block "
                     "stays allocated", p, (void *)s, backend_error_detail());
  tslot *ts = tcache_slot_for_free(tc, s, id, sl->heap);
  if (ts == NULL) return magpie_last_error();
  if (sl->cls == SLAB_LARGE) return tcache_free_large(tc, ts, sl, s);
  if (tc->check && !slab_mark_free(sl, bi))
    return error_set(MAGPIE_ERR_DOUBLE_FREE, "magpie_free_async(%p): block already free (double free)", p);
  unsigned c = sl->cls;
  int publish = 0;
  if (ts->loaded[c]->count >= ts->loaded[c]->cap) {
    magazine *pv = ts->prev[c];
    if (magazine_is_real(pv) && pv->count == 0) {
      ts->prev[c] = ts->loaded[c];
      ts->loaded[c] = pv;
    } else {
      magazine *e = magazine_get_empty(c);
      if (e == NULL) {
        if (tc->check) slab_mark_used(sl, bi);
        return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_free_async(%p): out of host memory for a magazine; "
                         "the block stays allocated", p);
      }
      /* The previous magazine is full: it leaves the thread, sealed on the
       * stream its blocks were freed on (s names it: its id matched). */
      if (magazine_is_real(pv)) tcache_seal_to_depot(ts, pv, s);
      ts->prev[c] = ts->loaded[c];
      ts->loaded[c] = e;
      publish = 1;
    }
  }
  magazine *m = ts->loaded[c];
  m->slots[m->count++] = p;
  atomic_owner_add_i64(ts->live, -(int64_t)sl->bsize);
  if (publish) tcache_publish(tc, ts->heap);
  if (!tc->check && ts->alloc_ok) tc->last = ts;
  return MAGPIE_OK;
}

static void tcache_destroy(void *arg) {
  tcache *tc = arg;
  for (int i = 0; i < TCACHE_SLOTS; i++)
    if (tc->slots[i].heap != NULL) tcache_slot_retire(tc, &tc->slots[i]);
  pthread_mutex_lock(&tcache_list_lock);
  for (int d = 0; d < HEAP_MAX_DEVICES; d++) tcache_retired_live[d] += atomic_load_relaxed(&tc->live[d]);
  if (tc->lprev) tc->lprev->lnext = tc->lnext;
  else tcache_list = tc->lnext;
  if (tc->lnext) tc->lnext->lprev = tc->lprev;
  pthread_mutex_unlock(&tcache_list_lock);
  tcache_tls = NULL;
  meta_free(tc);
}

int64_t tcache_live_bytes(int device) {
  if (device < 0 || device >= HEAP_MAX_DEVICES) return 0;
  pthread_mutex_lock(&tcache_list_lock);
  int64_t sum = tcache_retired_live[device];
  for (tcache *tc = tcache_list; tc; tc = tc->lnext) sum += atomic_load_relaxed(&tc->live[device]);
  pthread_mutex_unlock(&tcache_list_lock);
  return sum;
}
