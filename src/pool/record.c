/* record_stream: recorded streams, parking at free, polling (see record.h).
 *
 * Lock order: record_table.lock is a leaf: no other magpie lock is taken
 * while it is held and no driver call is made under it (stream records are acquired
 * before it is taken; seals, event queries and the hand-back to the depot
 * and the large cache happen after it is released). Host metadata is
 * allocated under it (jemalloc's own locks are leaves). */
#include "pool/record.h"

#include <pthread.h>
#include <string.h>

#include "base/assert.h"
#include "base/error.h"
#include "base/meta.h"
#include "base/pagemap.h"
#include "pool/magazine.h"

#define RECORD_POLL_FILLED 64 /* magazines one poll hands back at most */

/* INVARIANT: closed == 0: handle names rec's stream (the application keeps
 * it alive until the free or magpie_stream_retire), ticket unused.
 * closed == 1: the stream was retired; ticket is the retire's seal, which
 * covers all the stream's work, and handle is never passed on again. */
typedef struct record_ref {
  stream_rec *rec; /* one reference held by the entry */
  cudaStream_t handle;
  int closed;
  epoch_ticket ticket;
} record_ref;

/* One recorded block.
 * INVARIANT: an entry is in its device's hash from the first
 *            magpie_record_stream of its block until its block goes back
 *            to the pools; its slab's `recorded` counts it all that time.
 * INVARIANT: parked == 0: refs[0..nrefs) are the recorded streams (distinct
 *            ids), no tickets. parked == 1: the block was freed; refs are
 *            gone and tickets[0..ntickets) are the seals of the freeing and
 *            recorded streams it could seal (none of the freeing stream's
 *            if it was capturing), and the entry is on exactly one of: the
 *            parked list, the sync list (a recorded stream was gone or
 *            capturing, or the freeing stream was capturing), one poller's
 *            or syncer's private chain.
 * INVARIANT: ntickets >= 1 unless sync_devs != 0 (the freeing stream was
 *            capturing: a synchronisation of every device covered it). */
typedef struct record_entry {
  uintptr_t ptr;
  size_t bytes; /* the block's size */
  slab *slab;
  unsigned cls; /* the block's size class, SLAB_LARGE for a large block */
  int parked;
  unsigned nrefs, cap;
  record_ref *refs;
  unsigned ntickets;
  epoch_ticket *tickets;
  /* Devices besides the block's own whose synchronisation it waits for on
   * the sync list (heap/heap.h, "Limbo"): every device when the freeing
   * stream was capturing, else none. */
  uint64_t sync_devs;
  /* Who freed the block and on which stream (record_free's owner and the
   * freeing stream's id; NULL and 0 when that stream was capturing), for
   * record_claim. Written before the entry is parked; read under the lock. */
  const void *owner;
  uint64_t free_stream;
  /* Sharing with other processes (record.h, exports). export_id: nonzero
   * once exported, with its secret; revoked: imports refused from then on;
   * pending: MAGPIE_IPC_HOLD holds no import has taken over. All under
   * record_table.lock.
   * INVARIANT: pending <= holds. */
  uint64_t export_id;
  unsigned char secret[RECORD_SECRET_LEN];
  int revoked;
  unsigned pending;
  /* Imports open in other processes plus pending holds: the block goes back
   * to the pools only at 0. Written under record_table.lock; read relaxed by
   * a poller outside it (record_entry_ready): it publishes nothing (the
   * importing process's device work is ordered by its application), and a
   * stale nonzero only keeps the block parked until the next poll. */
  _Atomic unsigned holds;
  struct record_entry *hnext; /* hash chain; under record_table.lock */
  struct record_entry *pnext; /* parked list or a poller's chain */
} record_entry;

void record_table_init(record_table *t, void (*sync_hook)(void *), void *sync_arg) {
  memset(t, 0, sizeof *t);
  pthread_mutex_init(&t->lock, NULL);
  t->sync_hook = sync_hook;
  t->sync_arg = sync_arg;
}

MAGPIE_WRAPS static inline unsigned record_bucket(uintptr_t p) {
  return (unsigned)(((uint64_t)p >> 8) * 0x9E3779B97F4A7C15ull >> 56) & (RECORD_BUCKETS - 1);
}

/* Under t->lock. */
static record_entry **record_find(record_table *t, uintptr_t p) {
  record_entry **pp = &t->buckets[record_bucket(p)];
  while (*pp != NULL && (*pp)->ptr != p) pp = &(*pp)->hnext;
  return pp;
}

/* Under t->lock: an entry joins (+1) or leaves (-1) the parked ones. */
static void record_count(record_table *t, const record_entry *e, int dir) {
  size_t n = atomic_load_relaxed(&t->parked_count), b = atomic_load_relaxed(&t->parked_bytes);
  size_t lb = atomic_load_relaxed(&t->parked_large_bytes);
  size_t eb = e->cls == SLAB_LARGE ? e->bytes : 0;
  atomic_store_relaxed(&t->parked_count, dir > 0 ? n + 1 : n - 1);
  atomic_store_relaxed(&t->parked_bytes, dir > 0 ? b + e->bytes : b - e->bytes);
  atomic_store_relaxed(&t->parked_large_bytes, dir > 0 ? lb + eb : lb - eb);
}

/* Under t->lock: the entry of the live block p, made if it has none (it
 * then joins the hash and its slab's recorded count). NULL with *rc
 * MAGPIE_ERR_INVALID_POINTER if the block is parked (freed), or
 * MAGPIE_ERR_OUT_OF_MEMORY. */
static record_entry *record_entry_get(record_table *t, slab *sl, unsigned cls, uintptr_t p, size_t bytes, int *rc) {
  record_entry **pp = record_find(t, p);
  record_entry *e = *pp;
  if (e != NULL && e->parked) {
    *rc = MAGPIE_ERR_INVALID_POINTER;
    return NULL;
  }
  if (e != NULL) return e;
  e = meta_alloc(sizeof *e);
  if (e == NULL) {
    *rc = MAGPIE_ERR_OUT_OF_MEMORY;
    return NULL;
  }
  memset(e, 0, sizeof *e);
  e->ptr = p;
  e->bytes = bytes;
  e->slab = sl;
  e->cls = cls;
  atomic_store_relaxed(&e->holds, 0);
  *pp = e;
  atomic_add_relaxed(&sl->recorded, 1);
  return e;
}

int record_add(record_table *t, slab *sl, unsigned cls, uintptr_t p, size_t bytes, stream_rec *rec,
               cudaStream_t handle) {
  int rc = MAGPIE_OK, dup = 0;
  pthread_mutex_lock(&t->lock);
  record_entry *e = record_entry_get(t, sl, cls, p, bytes, &rc);
  if (e == NULL) goto out;
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
  pthread_mutex_unlock(&t->lock);
  return rc;
}

/* Does the recorded handle still name the recorded stream, and may it be
 * sealed now? No if it was destroyed (the backend refuses the handle) or
 * its value now names a newer stream (the ids differ: ids are never
 * reused), and no while it captures a graph: its id may not be asked then
 * (CUDA invalidates the capture) and an event recorded there would belong
 * to the capture (the rule at backend_capture_state, device/backend.h).
 * At most two queries, on the free slow path of a recorded block only. */
static int record_ref_sealable(const record_ref *r) {
  uint64_t id = 0;
  const backend_ops *ops = r->rec->table->ops;
  if (backend_capture_state(ops, r->handle, &id) != BACKEND_CAPTURE_NONE) return 0;
  return ops->stream_id(r->handle, &id) == MAGPIE_OK && id == r->rec->id;
}

static void record_tickets_release(epoch_ticket *tk, unsigned n) {
  for (unsigned i = 0; i < n; i++) epoch_ticket_release(&tk[i]);
}

int record_free(record_table *t, depot *d, slab *sl, uintptr_t p, stream_rec *frec, cudaStream_t handle,
                const void *owner, size_t *parked) {
  *parked = 0;
  pthread_mutex_lock(&t->lock);
  record_entry *e = *record_find(t, p);
  int was_parked = e != NULL && e->parked;
  if (e != NULL) e->parked = 1; /* a racing second free now fails */
  pthread_mutex_unlock(&t->lock);
  if (e == NULL) return MAGPIE_OK;
  if (was_parked)
    return error_set(MAGPIE_ERR_DOUBLE_FREE, "magpie_free_async(%p): block already free (double free)", (void *)p);
  /* The entry is ours now (parked, not yet on the list): seal outside the
   * lock. */
  epoch_ticket *tk = meta_alloc((e->nrefs + 1) * sizeof *tk);
  unsigned n = 0;
  int rc = tk == NULL ? MAGPIE_ERR_OUT_OF_MEMORY : frec == NULL ? MAGPIE_OK : epoch_seal(frec, handle, &tk[n]);
  if (rc != MAGPIE_OK) {
    meta_free(tk);
    pthread_mutex_lock(&t->lock);
    e->parked = 0;
    pthread_mutex_unlock(&t->lock);
    return error_set(
        rc, "magpie_free_async(%p): cannot record an event on the freeing stream: %s; the block stays allocated",
        (void *)p, rc == MAGPIE_ERR_OUT_OF_MEMORY ? "out of host memory" : backend_error_detail());
  }
  /* A freeing stream that captures (frec NULL) is covered by a
   * synchronisation of every device (it cannot be asked its own). */
  uint64_t sync_devs = 0;
  if (frec != NULL) n++;
  else sync_devs = ~(uint64_t)0;
  /* A recorded stream that is gone, or cannot be sealed now, is covered by
   * a synchronisation of the block's device (recorded streams are of the
   * block's device, front/record_api.c) instead (record.h): never an
   * error, never a seal on a handle that may name another stream now. */
  int need_sync = sync_devs != 0;
  for (unsigned i = 0; i < e->nrefs; i++) {
    record_ref *r = &e->refs[i];
    if (r->closed) { /* retired: its seal is the ticket */
      tk[n++] = r->ticket;
      r->closed = 0;
    } else if (frec != NULL && r->rec->id == frec->id) {
      continue; /* the freeing stream's seal covers it */
    } else if (!need_sync && record_ref_sealable(r) && epoch_seal(r->rec, r->handle, &tk[n]) == MAGPIE_OK) {
      n++;
    } else {
      need_sync = 1;
    }
  }
  e->sync_devs = sync_devs;
  /* The tickets hold their own references to the stream records. */
  for (unsigned i = 0; i < e->nrefs; i++) epoch_stream_release(e->refs[i].rec);
  meta_free(e->refs);
  e->refs = NULL;
  e->nrefs = e->cap = 0;
  e->tickets = tk;
  e->ntickets = n;
  e->owner = frec != NULL ? owner : NULL;
  e->free_stream = frec != NULL ? frec->id : 0;
  size_t bytes = e->bytes; /* e belongs to the pollers once on the list */
  /* Statistics: a small block leaves the freeing thread here (as a
   * magazine given back would), and is counted as waiting on streams until
   * record_poll hands it to the depot. */
  if (d != NULL) atomic_add_relaxed(&d->thread_out, (int64_t)bytes);
  pthread_mutex_lock(&t->lock);
  record_entry **list = need_sync ? &t->sync : &t->parked;
  e->pnext = *list;
  *list = e;
  if (need_sync) {
    atomic_store_relaxed(&t->sync_count, atomic_load_relaxed(&t->sync_count) + 1);
    atomic_add_relaxed(&t->sync_total, 1);
  }
  record_count(t, e, 1);
  pthread_mutex_unlock(&t->lock);
  if (need_sync && t->sync_hook != NULL) t->sync_hook(t->sync_arg);
  *parked = bytes;
  return MAGPIE_OK;
}

/* The open refs to stream id of blocks recorded and not yet freed (a
 * parked entry's free reads its refs: never touched), under t's lock. With
 * tk NULL, only whether there is one; else each gets a copy of *tk and is
 * closed (no driver call: references only). */
static int record_close_refs(record_table *t, uint64_t id, const epoch_ticket *tk) {
  int found = 0;
  for (unsigned b = 0; b < RECORD_BUCKETS; b++)
    for (record_entry *e = t->buckets[b]; e != NULL; e = e->hnext)
      for (unsigned i = 0; !e->parked && i < e->nrefs; i++) {
        record_ref *r = &e->refs[i];
        if (r->closed || r->rec->id != id) continue;
        if (tk == NULL) return 1;
        epoch_ticket_copy(tk, &r->ticket);
        r->closed = 1;
        found = 1;
      }
  return found;
}

int record_retire(record_table *t, stream_rec *rec, cudaStream_t handle) {
  /* Anything recorded on the stream and not yet freed? (Entries being
   * freed are parked: their free seals the handle, still valid now.) */
  pthread_mutex_lock(&t->lock);
  int any = record_close_refs(t, rec->id, NULL);
  pthread_mutex_unlock(&t->lock);
  if (!any) return MAGPIE_OK;
  /* One seal, outside the lock, for every such ref. */
  epoch_ticket tk;
  int rc = epoch_seal(rec, handle, &tk);
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&t->lock);
  record_close_refs(t, rec->id, &tk);
  pthread_mutex_unlock(&t->lock);
  epoch_ticket_release(&tk);
  return MAGPIE_OK;
}

size_t record_sync_wanted(const record_table *t) { return atomic_load_relaxed(&t->sync_count); }

uint64_t record_sync_devs(const record_entry *chain) {
  uint64_t devs = 0;
  for (const record_entry *e = chain; e != NULL; e = e->pnext) devs |= e->sync_devs;
  return devs;
}

record_entry *record_sync_take(record_table *t) {
  if (atomic_load_relaxed(&t->sync_count) == 0) return NULL;
  pthread_mutex_lock(&t->lock);
  record_entry *chain = t->sync;
  t->sync = NULL;
  atomic_store_relaxed(&t->sync_count, 0);
  pthread_mutex_unlock(&t->lock);
  return chain;
}

void record_sync_done(record_table *t, record_entry *chain, int ok) {
  if (chain == NULL) return;
  record_entry **list = ok ? &t->parked : &t->sync;
  pthread_mutex_lock(&t->lock);
  size_t n = atomic_load_relaxed(&t->sync_count);
  for (record_entry *e = chain, *next; e != NULL; e = next) {
    next = e->pnext;
    e->pnext = *list;
    *list = e;
    n += !ok;
  }
  atomic_store_relaxed(&t->sync_count, n);
  pthread_mutex_unlock(&t->lock);
}

static int record_entry_ready(const record_entry *e) {
  /* INVARIANT (above): a parked entry has its tickets, no refs. */
  MAGPIE_ASSERT(e->parked == 1 && (e->ntickets >= 1 || e->sync_devs != 0) && e->nrefs == 0);
  if (atomic_load_relaxed(&e->holds) != 0) return 0; /* imported elsewhere */
  for (unsigned i = 0; i < e->ntickets; i++)
    if (epoch_ready(&e->tickets[i], EPOCH_NO_STREAM) == EPOCH_PENDING) return 0;
  return 1;
}

/* Pressure: block until every ticket of e completed (event waits). */
static void record_entry_wait(const record_entry *e) {
  for (unsigned i = 0; i < e->ntickets; i++) epoch_wait(&e->tickets[i]);
}

/* An entry whose block went back to the pools: its tickets from the first
 * on (those before it were handed over with the block), then itself. */
static void record_entry_drop(record_entry *e, unsigned first) {
  if (e->ntickets > first) record_tickets_release(e->tickets + first, e->ntickets - first);
  meta_free(e->tickets);
  meta_free(e);
}

/* After the queries: the ready entries leave the hash (their blocks go
 * back to the pools next), the others are parked again. */
static void record_settle(record_table *t, record_entry *ready, record_entry *keep) {
  pthread_mutex_lock(&t->lock);
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
  pthread_mutex_unlock(&t->lock);
}

/* record_poll and record_wait: hand back what is ready; with wait, first
 * wait for every parked entry's tickets (and take the lock even when
 * another thread holds it for a moment). Returns bytes handed back. */
static size_t record_hand_back(record_table *t, depot *depots, large_cache *lc, int wait);

void record_poll(record_table *t, depot *depots, large_cache *lc) { record_hand_back(t, depots, lc, 0); }

size_t record_wait(record_table *t, depot *depots, large_cache *lc) { return record_hand_back(t, depots, lc, 1); }

unsigned record_claim(record_table *t, depot *d, const void *owner, uint64_t stream_id, unsigned cls, void **out,
                      unsigned max, unsigned *mine) {
  *mine = 0;
  if (atomic_load_relaxed(&t->parked_count) == 0) return 0;
  /* Waits for the lock (a poll's hold is a list walk): a try that found it
   * held would hand the allocation another block while the caller's own is
   * ready. */
  pthread_mutex_lock(&t->lock);
  /* The candidates leave the parked list for the queries, which happen
   * outside the lock; the owner's entries are counted on both lists. */
  record_entry *cand = NULL;
  unsigned ncand = 0;
  for (record_entry **pp = &t->parked; *pp != NULL;) {
    record_entry *e = *pp;
    if (owner != NULL && e->owner == owner) (*mine)++;
    if (ncand < max && e->cls == cls && e->free_stream == stream_id && stream_id != 0) {
      *pp = e->pnext;
      e->pnext = cand;
      cand = e;
      ncand++;
      continue;
    }
    pp = &e->pnext;
  }
  for (record_entry *e = t->sync; e != NULL; e = e->pnext) *mine += owner != NULL && e->owner == owner;
  pthread_mutex_unlock(&t->lock);
  if (cand == NULL) return 0;

  record_entry *ready = NULL, *keep = NULL;
  for (record_entry *e = cand, *next; e != NULL; e = next) {
    next = e->pnext;
    int ok = record_entry_ready(e);
    e->pnext = ok ? ready : keep;
    if (ok) ready = e;
    else keep = e;
  }
  unsigned n = 0;
  record_settle(t, ready, keep);
  for (record_entry *e = ready, *next; e != NULL; e = next) {
    next = e->pnext;
    out[n++] = (void *)e->ptr;
    if (owner != NULL && e->owner == owner) (*mine)--;
    atomic_add_relaxed(&d->thread_in, (int64_t)e->bytes); /* back in a thread's magazine */
    record_entry_drop(e, 0);
  }
  return n;
}

static size_t record_hand_back(record_table *t, depot *depots, large_cache *lc, int wait) {
  if (likely(atomic_load_relaxed(&t->parked_count) == 0)) return 0;
  /* Another thread polling (or recording) now: leave it to a later slow
   * path rather than wait here. */
  if (wait) pthread_mutex_lock(&t->lock);
  else if (pthread_mutex_trylock(&t->lock) != 0) return 0;
  record_entry *chain = t->parked;
  t->parked = NULL;
  pthread_mutex_unlock(&t->lock);

  /* Event queries, outside the lock. Small blocks go into magazines per
   * class (published only after their entries left the hash). */
  magazine *mags[SIZECLASS_COUNT] = {0}; /* being filled, per class */
  magazine *filled[RECORD_POLL_FILLED];  /* full ones; the rest wait for the next poll */
  unsigned nfilled = 0;
  record_entry *ready = NULL, *keep = NULL;
  size_t back = 0;
  for (record_entry *e = chain, *next; e != NULL; e = next) {
    next = e->pnext;
    if (wait) record_entry_wait(e);
    int ok = record_entry_ready(e);
    if (ok && e->cls != SLAB_LARGE) {
      magazine **mp = &mags[e->cls];
      if (*mp != NULL && (*mp)->count == (*mp)->cap) {
        if (nfilled < RECORD_POLL_FILLED) {
          filled[nfilled++] = *mp;
          *mp = NULL;
        } else {
          ok = 0;
        }
      }
      if (ok && *mp == NULL && (*mp = magazine_get_empty(e->cls)) == NULL) ok = 0; /* host memory: later */
      if (ok) (*mp)->slots[(*mp)->count++] = (void *)e->ptr;
    }
    e->pnext = ok ? ready : keep;
    if (ok) ready = e;
    else keep = e;
  }

  /* Out of the hash first: a block back in a magazine may be handed out and
   * freed again at once, and that free must not find a parked entry. */
  record_settle(t, ready, keep);

  /* Back to the pools, for any stream: every ticket completed. */
  for (record_entry *e = ready, *next; e != NULL; e = next) {
    next = e->pnext;
    if (e->cls != SLAB_LARGE) {
      back += e->bytes;
      record_entry_drop(e, 0);
      continue;
    }
    /* A large block goes back with one of its tickets, all completed: the
     * large cache takes it over and treats the block as ready for every
     * stream. */
    size_t bsize = 0;
    epoch_ticket none = {0};
    if (large_free(lc, e->ptr, e->ntickets > 0 ? &e->tickets[0] : &none, &bsize) == MAGPIE_OK) {
      back += e->bytes;
      record_entry_drop(e, 1);
      continue;
    }
    /* Out of host memory: park it again with its completed tickets and
     * try at the next poll rather than lose the block. */
    pthread_mutex_lock(&t->lock);
    record_entry **pp = record_find(t, e->ptr);
    e->hnext = NULL;
    *pp = e;
    e->pnext = t->parked;
    t->parked = e;
    atomic_add_relaxed(&e->slab->recorded, 1);
    record_count(t, e, 1);
    pthread_mutex_unlock(&t->lock);
  }
  for (unsigned i = 0; i < nfilled; i++) depot_put(&depots[filled[i]->cls], filled[i]);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++)
    if (mags[c] != NULL) depot_put(&depots[c], mags[c]);
  return back;
}

size_t record_pending_bytes(const record_table *t) { return atomic_load_relaxed(&t->parked_bytes); }

void record_pending(const record_table *t, size_t *small, size_t *large) {
  size_t all = atomic_load_relaxed(&t->parked_bytes), lb = atomic_load_relaxed(&t->parked_large_bytes);
  *large = lb <= all ? lb : all;
  *small = all - *large;
}

void record_parked_each(record_table *t, record_parked_fn fn, void *ctx) {
  pthread_mutex_lock(&t->lock);
  record_entry *lists[2] = {t->parked, t->sync};
  for (int i = 0; i < 2; i++)
    for (record_entry *e = lists[i]; e; e = e->pnext) {
      uint64_t stream = 0;
      for (unsigned k = 0; k < e->ntickets && stream == 0; k++)
        if (e->tickets[k].rec != NULL) stream = e->tickets[k].rec->id;
      fn(ctx, e->ptr, e->slab, stream);
    }
  pthread_mutex_unlock(&t->lock);
}

/* ---- exports (record.h) ---- */

int record_export(record_table *t, slab *sl, unsigned cls, uintptr_t p, size_t bytes, int hold, uint64_t new_id,
                  const unsigned char new_secret[RECORD_SECRET_LEN], uint64_t *id,
                  unsigned char secret[RECORD_SECRET_LEN]) {
  int rc = MAGPIE_OK;
  pthread_mutex_lock(&t->lock);
  record_entry *e = record_entry_get(t, sl, cls, p, bytes, &rc);
  if (e != NULL) {
    if (e->export_id == 0 || e->revoked) { /* a revoked export is replaced by a new one */
      e->export_id = new_id;
      memcpy(e->secret, new_secret, RECORD_SECRET_LEN);
      e->revoked = 0;
    }
    if (hold) {
      e->pending++;
      atomic_store_relaxed(&e->holds, atomic_load_relaxed(&e->holds) + 1);
    }
    *id = e->export_id;
    memcpy(secret, e->secret, RECORD_SECRET_LEN);
  }
  pthread_mutex_unlock(&t->lock);
  return rc;
}

/* Under t->lock: p's entry if it carries export id with secret. */
static record_entry *record_export_find(record_table *t, uintptr_t p, uint64_t id,
                                        const unsigned char secret[RECORD_SECRET_LEN]) {
  record_entry *e = *record_find(t, p);
  if (e == NULL || id == 0 || e->export_id != id || memcmp(e->secret, secret, RECORD_SECRET_LEN) != 0) return NULL;
  return e;
}

int record_import_hold(record_table *t, uintptr_t p, uint64_t id, const unsigned char secret[RECORD_SECRET_LEN],
                       size_t *bytes) {
  int rc = RECORD_IMPORT_OK;
  pthread_mutex_lock(&t->lock);
  record_entry *e = record_export_find(t, p, id, secret);
  if (e == NULL) rc = RECORD_IMPORT_UNKNOWN;
  else if (e->revoked) rc = RECORD_IMPORT_REVOKED;
  else if (e->pending > 0) e->pending--; /* takes the export's hold over */
  else if (e->parked) rc = RECORD_IMPORT_FREED;
  else atomic_store_relaxed(&e->holds, atomic_load_relaxed(&e->holds) + 1);
  if (rc == RECORD_IMPORT_OK) *bytes = e->bytes;
  pthread_mutex_unlock(&t->lock);
  return rc;
}

void record_import_release(record_table *t, uintptr_t p, uint64_t id) {
  pthread_mutex_lock(&t->lock);
  record_entry *e = *record_find(t, p);
  /* INVARIANT: an entry with holds stays in the hash (record_entry_ready). */
  MAGPIE_ASSERT(e != NULL && e->export_id == id && atomic_load_relaxed(&e->holds) > e->pending);
  if (e != NULL && e->export_id == id && atomic_load_relaxed(&e->holds) > e->pending)
    atomic_store_relaxed(&e->holds, atomic_load_relaxed(&e->holds) - 1);
  pthread_mutex_unlock(&t->lock);
}

int record_revoke(record_table *t, uintptr_t p, uint64_t id, const unsigned char secret[RECORD_SECRET_LEN]) {
  pthread_mutex_lock(&t->lock);
  record_entry *e = record_export_find(t, p, id, secret);
  if (e != NULL) {
    atomic_store_relaxed(&e->holds, atomic_load_relaxed(&e->holds) - e->pending);
    e->pending = 0;
    e->revoked = 1;
  }
  pthread_mutex_unlock(&t->lock);
  return e != NULL ? MAGPIE_OK : MAGPIE_ERR_INVALID_ARGUMENT;
}
