/* record_stream: recorded streams, parking at free, polling (see record.h).
 *
 * Lock order: record_lock is a leaf: no other magpie lock is taken while it
 * is held and no driver call is made under it (stream records are acquired
 * before it is taken; seals, event queries and the hand-back to the depot
 * and the large cache happen after it is released). Host metadata is
 * allocated under it (jemalloc's own locks are leaves). */
#include "record.h"

#include <pthread.h>
#include <string.h>

#include "error.h"
#include "init.h"
#include "magazine.h"
#include "meta.h"
#include "pagemap.h"

#define RECORD_BUCKETS 256
#define RECORD_POLL_FILLED 64 /* magazines one poll hands back at most */

typedef struct record_ref {
  stream_rec *rec; /* one reference held by the entry */
  cudaStream_t handle;
} record_ref;

/* One recorded block.
 * INVARIANT: an entry is in its device's hash from the first
 *            magpie_record_stream of its block until its block goes back
 *            to the pools; its slab's `recorded` counts it all that time.
 * INVARIANT: parked == 0: refs[0..nrefs) are the recorded streams (distinct
 *            ids), no tickets. parked == 1: the block was freed; refs are
 *            gone and tickets[0..ntickets) are the seals of the freeing and
 *            recorded streams; the entry is on the parked list or in one
 *            poller's private chain, never both. */
typedef struct record_entry {
  uintptr_t ptr;
  size_t bytes; /* the block's size */
  slab *slab;
  int parked;
  unsigned nrefs, cap;
  record_ref *refs;
  unsigned ntickets;
  epoch_ticket *tickets;
  struct record_entry *hnext; /* hash chain; under record_lock */
  struct record_entry *pnext; /* parked list or a poller's chain */
} record_entry;

typedef struct record_table {
  record_entry *buckets[RECORD_BUCKETS]; /* under record_lock */
  record_entry *parked;                  /* under record_lock */
  /* Written under record_lock; read relaxed by record_poll's early exit (a
   * stale zero only delays the hand-back to a later slow path) and by
   * statistics. */
  _Atomic size_t parked_count;
  _Atomic size_t parked_bytes;
  _Atomic size_t parked_large_bytes; /* part of parked_bytes */
} record_table;

static pthread_mutex_t record_lock = PTHREAD_MUTEX_INITIALIZER;
static record_table record_tables[HEAP_MAX_DEVICES];

MAGPIE_WRAPS static inline unsigned record_bucket(uintptr_t p) {
  return (unsigned)(((uint64_t)p >> 8) * 0x9E3779B97F4A7C15ull >> 56) & (RECORD_BUCKETS - 1);
}

static record_table *record_table_of(const slab *sl) { return &record_tables[sl->heap->device]; }

/* Under record_lock. */
static record_entry **record_find(record_table *t, uintptr_t p) {
  record_entry **pp = &t->buckets[record_bucket(p)];
  while (*pp != NULL && (*pp)->ptr != p) pp = &(*pp)->hnext;
  return pp;
}

/* Under record_lock: an entry joins (+1) or leaves (-1) the parked ones. */
static void record_count(record_table *t, const record_entry *e, int dir) {
  size_t n = atomic_load_relaxed(&t->parked_count), b = atomic_load_relaxed(&t->parked_bytes);
  size_t lb = atomic_load_relaxed(&t->parked_large_bytes);
  size_t eb = e->slab->cls == SLAB_LARGE ? e->bytes : 0;
  atomic_store_relaxed(&t->parked_count, dir > 0 ? n + 1 : n - 1);
  atomic_store_relaxed(&t->parked_bytes, dir > 0 ? b + e->bytes : b - e->bytes);
  atomic_store_relaxed(&t->parked_large_bytes, dir > 0 ? lb + eb : lb - eb);
}

int record_add(slab *sl, uintptr_t p, size_t bytes, stream_rec *rec, cudaStream_t handle) {
  record_table *t = record_table_of(sl);
  int rc = MAGPIE_OK, dup = 0;
  pthread_mutex_lock(&record_lock);
  record_entry **pp = record_find(t, p);
  record_entry *e = *pp;
  if (e == NULL) {
    e = meta_alloc(sizeof *e);
    if (e == NULL) {
      rc = MAGPIE_ERR_OUT_OF_MEMORY;
      goto out;
    }
    e->ptr = p;
    e->bytes = bytes;
    e->slab = sl;
    *pp = e;
    atomic_add_relaxed(&sl->recorded, 1);
  } else if (e->parked) {
    rc = MAGPIE_ERR_INVALID_POINTER;
    goto out;
  }
  for (unsigned i = 0; i < e->nrefs && !dup; i++) dup = e->refs[i].rec->id == rec->id;
  if (dup) goto out;
  if (e->nrefs == e->cap) {
    unsigned ncap = e->cap ? 2 * e->cap : 4;
    record_ref *n = meta_alloc(ncap * sizeof *n);
    if (n == NULL) {
      rc = MAGPIE_ERR_OUT_OF_MEMORY;
      goto out; /* an entry with no refs is harmless: its free seals the freeing stream only */
    }
    if (e->nrefs) memcpy(n, e->refs, e->nrefs * sizeof *n);
    meta_free(e->refs);
    e->refs = n;
    e->cap = ncap;
  }
  epoch_stream_ref(rec);
  e->refs[e->nrefs++] = (record_ref){.rec = rec, .handle = handle};
out:
  pthread_mutex_unlock(&record_lock);
  return rc;
}

static void record_tickets_release(epoch_ticket *tk, unsigned n) {
  for (unsigned i = 0; i < n; i++) epoch_ticket_release(&tk[i]);
}

int record_free(slab *sl, uintptr_t p, stream_rec *frec, cudaStream_t handle, size_t *parked) {
  record_table *t = record_table_of(sl);
  *parked = 0;
  pthread_mutex_lock(&record_lock);
  record_entry *e = *record_find(t, p);
  int was_parked = e != NULL && e->parked;
  if (e != NULL) e->parked = 1; /* a racing second free now fails */
  pthread_mutex_unlock(&record_lock);
  if (e == NULL) return MAGPIE_OK;
  if (was_parked)
    return error_set(MAGPIE_ERR_DOUBLE_FREE, "magpie_free_async(%p): block already free (double free)", (void *)p);
  /* The entry is ours now (parked, not yet on the list): seal outside the
   * lock. */
  epoch_ticket *tk = meta_alloc((e->nrefs + 1) * sizeof *tk);
  unsigned n = 0;
  int rc = tk == NULL ? MAGPIE_ERR_OUT_OF_MEMORY : epoch_seal(frec, handle, &tk[n]);
  if (rc == MAGPIE_OK) n++;
  for (unsigned i = 0; rc == MAGPIE_OK && i < e->nrefs; i++) {
    if (e->refs[i].rec->id == frec->id) continue; /* the freeing stream's seal covers it */
    rc = epoch_seal(e->refs[i].rec, e->refs[i].handle, &tk[n]);
    if (rc == MAGPIE_OK) n++;
  }
  if (rc != MAGPIE_OK) {
    if (tk != NULL) record_tickets_release(tk, n);
    meta_free(tk);
    pthread_mutex_lock(&record_lock);
    e->parked = 0;
    pthread_mutex_unlock(&record_lock);
    return error_set(rc, "magpie_free_async(%p): cannot record an event on a stream the block was used on "
                     "(magpie_record_stream): %s; the block stays allocated",
                     (void *)p, rc == MAGPIE_ERR_OUT_OF_MEMORY ? "out of host memory" : backend_error_detail());
  }
  /* The tickets hold their own references to the stream records. */
  for (unsigned i = 0; i < e->nrefs; i++) epoch_stream_release(e->refs[i].rec);
  meta_free(e->refs);
  e->refs = NULL;
  e->nrefs = e->cap = 0;
  e->tickets = tk;
  e->ntickets = n;
  size_t bytes = e->bytes; /* e belongs to the pollers once on the list */
  /* Statistics: a small block leaves the freeing thread here (as a
   * magazine given back would), and is counted as waiting on streams until
   * record_poll hands it to the depot. */
  if (sl->cls != SLAB_LARGE) atomic_add_relaxed(&sl->heap->depots[sl->cls].thread_out, (int64_t)bytes);
  pthread_mutex_lock(&record_lock);
  e->pnext = t->parked;
  t->parked = e;
  record_count(t, e, 1);
  pthread_mutex_unlock(&record_lock);
  *parked = bytes;
  return MAGPIE_OK;
}

static int record_entry_ready(const record_entry *e) {
  for (unsigned i = 0; i < e->ntickets; i++)
    if (epoch_ready(&e->tickets[i], EPOCH_NO_STREAM) == EPOCH_PENDING) return 0;
  return 1;
}

void record_poll(heap *h) {
  record_table *t = &record_tables[h->device];
  if (likely(atomic_load_relaxed(&t->parked_count) == 0)) return;
  /* Another thread polling (or recording) now: leave it to a later slow
   * path rather than wait here. */
  if (pthread_mutex_trylock(&record_lock) != 0) return;
  record_entry *chain = t->parked;
  t->parked = NULL;
  pthread_mutex_unlock(&record_lock);

  /* Event queries, outside the lock. Small blocks go into magazines per
   * class (published only after their entries left the hash). */
  magazine *mags[SIZECLASS_COUNT] = {0}; /* being filled, per class */
  magazine *filled[RECORD_POLL_FILLED];    /* full ones; the rest wait for the next poll */
  unsigned nfilled = 0;
  record_entry *ready = NULL, *keep = NULL;
  for (record_entry *e = chain, *next; e != NULL; e = next) {
    next = e->pnext;
    int ok = record_entry_ready(e);
    slab *sl = e->slab;
    if (ok && sl->cls != SLAB_LARGE) {
      magazine **mp = &mags[sl->cls];
      if (*mp != NULL && (*mp)->count == (*mp)->cap) {
        if (nfilled < RECORD_POLL_FILLED) {
          filled[nfilled++] = *mp;
          *mp = NULL;
        } else {
          ok = 0;
        }
      }
      if (ok && *mp == NULL && (*mp = magazine_get_empty(sl->cls)) == NULL) ok = 0; /* host memory: later */
      if (ok) (*mp)->slots[(*mp)->count++] = (void *)e->ptr;
    }
    e->pnext = ok ? ready : keep;
    if (ok) ready = e;
    else keep = e;
  }

  /* Out of the hash first: a block back in a magazine may be handed out and
   * freed again at once, and that free must not find a parked entry. */
  pthread_mutex_lock(&record_lock);
  for (record_entry *e = ready; e != NULL; e = e->pnext) {
    record_entry **pp = record_find(t, e->ptr);
    *pp = e->hnext;
    atomic_sub_relaxed(&e->slab->recorded, 1);
    record_count(t, e, -1);
  }
  while (keep != NULL) {
    record_entry *e = keep;
    keep = e->pnext;
    e->pnext = t->parked;
    t->parked = e;
  }
  pthread_mutex_unlock(&record_lock);

  /* Back to the pools, for any stream: every ticket completed. */
  for (record_entry *e = ready, *next; e != NULL; e = next) {
    next = e->pnext;
    if (e->slab->cls != SLAB_LARGE) {
      record_tickets_release(e->tickets, e->ntickets);
      meta_free(e->tickets);
      meta_free(e);
      continue;
    }
    /* A large block goes back with one of its tickets, all completed: the
     * large cache takes it over and treats the block as ready for every
     * stream. */
    size_t bsize = 0;
    if (large_free(h, e->ptr, &e->tickets[0], &bsize) == MAGPIE_OK) {
      record_tickets_release(e->tickets + 1, e->ntickets - 1);
      meta_free(e->tickets);
      meta_free(e);
      continue;
    }
    /* Out of host memory: park it again with its completed tickets and
     * try at the next poll rather than lose the block. */
    pthread_mutex_lock(&record_lock);
    record_entry **pp = record_find(t, e->ptr);
    e->hnext = NULL;
    *pp = e;
    e->pnext = t->parked;
    t->parked = e;
    atomic_add_relaxed(&e->slab->recorded, 1);
    record_count(t, e, 1);
    pthread_mutex_unlock(&record_lock);
  }
  for (unsigned i = 0; i < nfilled; i++) depot_put(h, filled[i]);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++)
    if (mags[c] != NULL) depot_put(h, mags[c]);
}

size_t record_pending_bytes(const heap *h) { return atomic_load_relaxed(&record_tables[h->device].parked_bytes); }

void record_pending(const heap *h, size_t *small, size_t *large) {
  const record_table *t = &record_tables[h->device];
  size_t all = atomic_load_relaxed(&t->parked_bytes), lb = atomic_load_relaxed(&t->parked_large_bytes);
  *large = lb <= all ? lb : all;
  *small = all - *large;
}

/* ---- public entry point ---- */

MAGPIE_API int magpie_record_stream(void *ptr, cudaStream_t stream) {
  if (ptr == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_record_stream: NULL pointer");
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  slab *sl = pagemap_lookup((uintptr_t)ptr);
  if (sl == NULL)
    return error_set(MAGPIE_ERR_INVALID_POINTER, "magpie_record_stream(%p): not a pointer returned by magpie", ptr);
  uint32_t bi = 0;
  size_t bytes = sl->bsize;
  if (!slab_block_index(sl, (uintptr_t)ptr, &bi) ||
      (sl->cls == SLAB_LARGE && !large_lookup(sl->heap, (uintptr_t)ptr, &bytes)))
    return error_set(MAGPIE_ERR_INVALID_POINTER, "magpie_record_stream(%p): not the start of an allocated block",
                     ptr);
  if ((uintptr_t)stream == 2)
    return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_record_stream(%p): the per-thread default stream handle "
                     "names another stream in every thread; pass a stream created by the application", ptr);
  const backend_ops *ops = global_ops();
  uint64_t id = 0;
  int dev = -1;
  if (ops->stream_id(stream, &id) != MAGPIE_OK || ops->stream_device(stream, &dev) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_record_stream(%p): stream %p is not valid: %s", ptr,
                     (void *)stream, backend_error_detail());
  heap *h = sl->heap;
  if (dev != h->device)
    return error_set(MAGPIE_ERR_INVALID_STREAM, "magpie_record_stream(%p): stream %p is on device %d, the block "
                     "on device %d", ptr, (void *)stream, dev, h->device);
  stream_rec *rec = epoch_stream_acquire(&h->epochs, id);
  if (rec == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_record_stream: out of host memory");
  rc = record_add(sl, (uintptr_t)ptr, bytes, rec, stream);
  epoch_stream_release(rec); /* the entry took its own reference */
  if (rc == MAGPIE_ERR_INVALID_POINTER)
    return error_set(rc, "magpie_record_stream(%p): the block is free", ptr);
  if (rc != MAGPIE_OK) return error_set(rc, "magpie_record_stream(%p): out of host memory", ptr);
  return MAGPIE_OK;
}
