/* Stream records, the event pool, sealing and completion checks.
 * Lock order: see epoch.h (table lock and seal lock are never nested). */
#include "pool/epoch.h"

#include "base/assert.h"
#include <string.h>

#include "base/meta.h"

/* This file's state: the event nodes (type-stable; grown under its grow
 * lock); the hook that asks for a refill, set once at set-up. */
static struct epoch_events {
  registry event_registry;
  void (*low_hook)(void);
} epoch_st;

void epoch_module_init(void) { registry_init(&epoch_st.event_registry, sizeof(event_node)); }

int epoch_table_init(epoch_table *t, int device, const backend_ops *ops) {
  memset(t, 0, sizeof *t);
  t->device = device;
  t->ops = ops;
  pthread_mutex_init(&t->lock, NULL);
  stack_init(&t->free_events);
  return MAGPIE_OK;
}

MAGPIE_WRAPS static inline unsigned epoch_bucket(uint64_t id) {
  return (unsigned)((id * 0x9E3779B97F4A7C15ull) >> 56) & (EPOCH_BUCKETS - 1);
}

stream_rec *epoch_stream_acquire(epoch_table *t, uint64_t id) {
  unsigned b = epoch_bucket(id);
  pthread_mutex_lock(&t->lock);
  for (stream_rec *r = t->buckets[b]; r; r = r->hnext) {
    if (r->id != id) continue;
    int64_t refs = atomic_load_relaxed(&r->refs);
    while (refs > 0 && !atomic_cas_weak_acq_rel(&r->refs, &refs, refs + 1)) {
    }
    if (refs > 0) {
      pthread_mutex_unlock(&t->lock);
      return r;
    }
    /* refs reached 0: being freed by its last holder; make a fresh one. */
  }
  stream_rec *r = meta_alloc(sizeof *r);
  if (r != NULL) {
    r->id = id;
    r->device = t->device;
    r->table = t;
    atomic_store_relaxed(&r->refs, 1);
    pthread_mutex_init(&r->seal_lock, NULL);
    r->hnext = t->buckets[b];
    t->buckets[b] = r;
    atomic_add_relaxed(&t->live_records, 1);
  }
  pthread_mutex_unlock(&t->lock);
  return r;
}

static void epoch_event_unref(epoch_table *t, event_node *e);

void epoch_stream_release(stream_rec *r) {
  if (r == NULL || atomic_sub_acq_rel(&r->refs, 1) != 1) return;
  epoch_table *t = r->table;
  pthread_mutex_lock(&t->lock);
  for (stream_rec **pp = &t->buckets[epoch_bucket(r->id)]; *pp; pp = &(*pp)->hnext) {
    if (*pp == r) {
      *pp = r->hnext;
      break;
    }
  }
  atomic_sub_relaxed(&t->live_records, 1);
  pthread_mutex_unlock(&t->lock);
  pthread_mutex_destroy(&r->seal_lock);
  if (r->newest != NULL) epoch_event_unref(t, r->newest);
  meta_free(r);
}

void epoch_set_low_hook(void (*fn)(void)) { epoch_st.low_hook = fn; }

static event_node *epoch_event_new(epoch_table *t) {
  event_node *e = registry_new(&epoch_st.event_registry);
  if (e == NULL) return NULL;
  e->device = t->device;
  atomic_store_relaxed(&e->refs, 0);
  if (t->ops->event_create(t->device, &e->ev) != MAGPIE_OK) {
    /* Keep the node (type-stable) without an event; it is not pooled. */
    return NULL;
  }
  atomic_add_relaxed(&t->events_created, 1);
  return e;
}

int epoch_pool_fill(epoch_table *t, int64_t n) {
  int rc = MAGPIE_OK;
  while (stack_count(&t->free_events) < n) {
    event_node *e = epoch_event_new(t);
    if (e == NULL) {
      rc = MAGPIE_ERR_BACKEND;
      break;
    }
    stack_push(&t->free_events, &epoch_st.event_registry, &e->link);
  }
  atomic_store_release(&t->refill_asked, 0);
  return rc;
}

/* An event from the pool. Creating one can take tens of milliseconds while
 * the device is busy, so the pool is refilled in the background before it
 * runs dry; creating one here is the fallback (bench/DECISIONS.md, "Events
 * come from a pool refilled in the background"). */
static event_node *epoch_event_get(epoch_table *t) {
  event_node *e = (event_node *)stack_pop(&t->free_events, &epoch_st.event_registry);
  if (t->ops->event_prefill > 0 && stack_count(&t->free_events) < t->ops->event_prefill / 4 &&
      epoch_st.low_hook != NULL && atomic_exchange_acq_rel(&t->refill_asked, 1) == 0)
    epoch_st.low_hook();
  return e != NULL ? e : epoch_event_new(t);
}

/* Drop one reference; the last one returns the node to the pool. */
static void epoch_event_unref(epoch_table *t, event_node *e) {
  MAGPIE_ASSERT(atomic_load_relaxed(&e->refs) > 0); /* INVARIANT (epoch.h): pooled iff refs == 0 */
  if (atomic_sub_acq_rel(&e->refs, 1) == 1) stack_push(&t->free_events, &epoch_st.event_registry, &e->link);
}

int epoch_seal(stream_rec *r, cudaStream_t handle, epoch_ticket *out) {
  epoch_table *t = r->table;
  /* An event recorded on a capturing stream would belong to the capture,
   * and querying it later would invalidate the capture: the seal is
   * refused instead (its callers send the blocks to limbo). One driver
   * call per seal, a seal per eight magazines or a large free. */
  uint64_t capture;
  if (backend_capture_state(t->ops, handle, &capture) != BACKEND_CAPTURE_NONE) {
    backend_set_error_detail("stream %p is capturing a CUDA graph: no event is recorded on it", (void *)handle);
    return MAGPIE_ERR_CAPTURE;
  }
  event_node *e = epoch_event_get(t);
  if (e == NULL) return MAGPIE_ERR_BACKEND;
  MAGPIE_ASSERT(atomic_load_relaxed(&e->refs) == 0); /* from the pool: nobody holds it */
  event_node *old = NULL;
  pthread_mutex_lock(&r->seal_lock);
  int rc = t->ops->event_record(e->ev, handle);
  uint64_t seq = 0;
  if (rc == MAGPIE_OK) {
    seq = atomic_load_relaxed(&r->sealed) + 1;
    atomic_store_relaxed(&r->sealed, seq);
    atomic_store_relaxed(&e->refs, 2); /* the ticket's and the record's */
    old = r->newest;
    r->newest = e;
  }
  pthread_mutex_unlock(&r->seal_lock);
  if (rc != MAGPIE_OK) {
    stack_push(&t->free_events, &epoch_st.event_registry, &e->link);
    return rc;
  }
  if (old != NULL) epoch_event_unref(t, old);
  atomic_add_relaxed(&t->events_recorded, 1);
  epoch_stream_ref(r);
  *out = (epoch_ticket){.rec = r, .seq = seq, .ev = e};
  return MAGPIE_OK;
}

/* Has the seal `seq` of r, whose event is e (a reference held), completed?
 * If so, raise r->done to seq. */
static int epoch_query(stream_rec *r, event_node *e, uint64_t seq) {
  atomic_add_relaxed(&r->table->events_queried, 1);
  if (r->table->ops->event_query(e->ev) == MAGPIE_OK) {
    atomic_max_u64_release(&r->done, seq);
    return 1;
  }
  atomic_add_relaxed(&r->table->queries_pending, 1);
  return 0;
}

enum epoch_state epoch_ready(const epoch_ticket *t, uint64_t stream_id) {
  stream_rec *r = t->rec;
  if (r == NULL) return EPOCH_READY_DONE;
#ifdef MAGPIE_TEST_BREAK_EPOCH_CHECK
  return EPOCH_READY_DONE; /* deliberately broken build: tests/BUILD expects its tests to fail */
#endif
  /* INVARIANT (epoch.h): done <= sealed, tickets carry a seq in 1..sealed. */
  MAGPIE_ASSERT(t->seq >= 1 && t->seq <= atomic_load_relaxed(&r->sealed));
  MAGPIE_ASSERT(atomic_load_relaxed(&r->done) <= atomic_load_relaxed(&r->sealed));
  if (r->id == stream_id) return EPOCH_READY_SAME;
  if (atomic_load_acquire(&r->done) >= t->seq) return EPOCH_READY_DONE;
  /* The stream's newest seal first: blocks are wanted long after most
   * seals, so it has usually completed too, and then every ticket of the
   * stream is decided by comparison until the next seal, and an event
   * query costs far more than a comparison (bench/DECISIONS.md, "A
   * completion check queries the newest seal first"). Only tried: a seal
   * holds the lock across its event's record, a driver call, and checks
   * of other threads waited for it (bench/DECISIONS.md, "A completion
   * check only tries the stream's seal lock"); then the ticket's own event
   * is asked. */
  event_node *n = NULL;
  uint64_t nseq = 0;
  if (pthread_mutex_trylock(&r->seal_lock) == 0) {
    n = r->newest;
    nseq = atomic_load_relaxed(&r->sealed);
    if (n != NULL && n != t->ev) atomic_add_relaxed(&n->refs, 1);
    else n = NULL;
    pthread_mutex_unlock(&r->seal_lock);
  }
  if (n != NULL) {
    int ok = epoch_query(r, n, nseq);
    epoch_event_unref(r->table, n);
    if (ok) return EPOCH_READY_DONE;
  }
  return epoch_query(r, t->ev, t->seq) ? EPOCH_READY_DONE : EPOCH_PENDING;
}

int epoch_wait(const epoch_ticket *t) {
  stream_rec *r = t->rec;
  if (r == NULL || atomic_load_acquire(&r->done) >= t->seq) return MAGPIE_OK;
  int rc = r->table->ops->event_synchronize(t->ev->ev);
  if (rc == MAGPIE_OK) atomic_max_u64_release(&r->done, t->seq);
  return rc;
}

void epoch_ticket_copy(const epoch_ticket *t, epoch_ticket *out) {
  if (t->rec != NULL) {
    /* INVARIANT (epoch.h): a ticket's event is out of the pool (refs > 0)
     * while the ticket is held, so adding one cannot race its return. */
    MAGPIE_ASSERT(atomic_load_relaxed(&t->ev->refs) > 0);
    atomic_add_relaxed(&t->ev->refs, 1);
    epoch_stream_ref(t->rec);
  }
  *out = *t;
}

void epoch_ticket_release(epoch_ticket *t) {
  stream_rec *r = t->rec;
  if (r == NULL) return;
  epoch_event_unref(r->table, t->ev);
  *t = (epoch_ticket){0};
  epoch_stream_release(r);
}
