/* Epoch-based reclamation keyed on device events.
 *
 * Blocks freed on stream S are reusable on S at once (stream order covers
 * them). When a magazine of them leaves the thread that freed them, it is
 * *sealed*: one event is recorded on S for the whole magazine and the
 * magazine carries a ticket (S, seq, event). Another stream may reuse it
 * once that event has completed. Events on one stream complete in order, so
 * each stream keeps `done`, the highest sequence number known complete: a
 * ticket with seq <= done is complete by a comparison, and one event query
 * that succeeds vouches for every earlier ticket of the stream.
 *
 * Stream records are keyed by the backend's stream id, which is unique for
 * the life of the process (a destroyed stream's handle value can come back;
 * its id does not), so handle reuse can never make a new stream inherit an
 * old stream's pending blocks.
 *
 * Lock order: epoch_table.lock -> (nothing). stream_rec.seal_lock -> (the
 * backend's event_record only, in epoch_seal; no other magpie lock;
 * epoch_ready holds it only to take a reference). The two are never held
 * together.
 */
#ifndef MAGPIE_EPOCH_H
#define MAGPIE_EPOCH_H

#include <pthread.h>
#include <stdint.h>

#include "base/registry.h"
#include "base/stack.h"
#include "device/backend.h"
#include "pool/magazine.h"

#define EPOCH_BUCKETS 256

struct epoch_table;

/* INVARIANT: done <= sealed; every ticket issued for this stream has a seq
 * in 1..sealed, and seq order is the order of the event records on the
 * stream. */
typedef struct stream_rec {
  uint64_t id; /* backend stream id; immutable */
  int device;  /* the stream's device; immutable */
  struct epoch_table *table;
  /* Last sequence number issued. Written under seal_lock (relaxed); read by
   * diagnostics only. */
  _Atomic uint64_t sealed;
  /* Highest seq known complete. Raised (release, CAS-max) by any thread
   * whose event query reported completion; read with acquire by
   * epoch_ready, which then inherits that query's view of the device. */
  _Atomic uint64_t done;
  /* Holders: thread slots using the stream and sealed tickets. 0 is final:
   * lookups revive only nonzero records (inc-if-nonzero under the table
   * lock), and the thread that drops it to 0 frees it. */
  _Atomic int64_t refs;
  /* Makes "take the next seq" and "record its event" one step, so seq order
   * is stream order even when several threads seal on one stream. */
  pthread_mutex_t seal_lock;
  /* The event of the last seal (seq `sealed`), with one reference held, so
   * that one query can vouch for every ticket of the stream at once; NULL
   * before the first seal. Under seal_lock. */
  struct event_node *newest;
  struct stream_rec *hnext; /* bucket chain; under table->lock */
} stream_rec;

/* INVARIANT: a node is in the pool (free_events) iff refs == 0; it is
 * recorded again only after it left the pool, so whoever holds a reference
 * queries the record it took the reference for. */
typedef struct event_node {
  registry_link link; /* stack node; must be first */
  void *ev;           /* backend event */
  int device;
  /* Holders: the ticket of its seal, the stream record while it is that
   * stream's newest, and queriers for the length of one query. Taken from
   * 0 only by epoch_seal; taken from nonzero under the stream's seal_lock;
   * dropped (acq_rel) by anyone: the holder that drops it to 0 pushes the
   * node to the pool (the push releases, the pool's pop acquires). */
  _Atomic uint32_t refs;
} event_node;

typedef struct epoch_table {
  int device;
  const backend_ops *ops;
  pthread_mutex_t lock; /* guards buckets */
  stream_rec *buckets[EPOCH_BUCKETS];
  stack free_events; /* event_nodes of this device, not in use */
  /* 1 while a refill of free_events has been asked for and not done:
   * exchanged by the thread that finds the pool low, reset (release) by
   * the filler. Keeps the background thread from being woken per event. */
  _Atomic int refill_asked;
  _Atomic uint64_t events_recorded;
  /* Completion queries made by epoch_ready, and those that found the
   * event pending (relaxed counters, any thread; statistics only). */
  _Atomic uint64_t events_queried;
  _Atomic uint64_t queries_pending;
  _Atomic uint64_t events_created;
  _Atomic int64_t live_records;
} epoch_table;

/* A stream id no stream has: asks "ready for every stream?". */
#define EPOCH_NO_STREAM UINT64_MAX

enum epoch_state { EPOCH_PENDING = 0, EPOCH_READY_SAME = 1, EPOCH_READY_DONE = 2 };

void epoch_module_init(void);
int epoch_table_init(epoch_table *t, int device, const backend_ops *ops);

/* The record for stream id (created if needed), with one reference taken;
 * NULL if host memory ran out. */
stream_rec *epoch_stream_acquire(epoch_table *t, uint64_t id);
void epoch_stream_release(stream_rec *r);
static inline void epoch_stream_ref(stream_rec *r) { atomic_add_relaxed(&r->refs, 1); }

/* The event pool: where the backend asks for it (event_prefill), filled at
 * heap creation and, when it falls below a quarter of that, refilled by
 * the heap's background thread (epoch_pool_fill), which the hook wakes. */
void epoch_set_low_hook(void (*fn)(void));
/* Create events until the pool holds n. MAGPIE_ERR_BACKEND if creating
 * one failed (the pool keeps what was made). */
int epoch_pool_fill(epoch_table *t, int64_t n);

/* Seal now: record an event on `handle`, which must currently name r's
 * stream. The ticket holds a reference to r. */
int epoch_seal(stream_rec *r, cudaStream_t handle, epoch_ticket *out);
/* May blocks under this ticket be reused by stream `stream_id` now? Never
 * blocks. Queries the stream's newest seal first (one query then vouches
 * for all its tickets), the ticket's own event only if that one is still
 * pending. */
enum epoch_state epoch_ready(const epoch_ticket *t, uint64_t stream_id);
/* Block until the ticket's epoch completed (off the allocation fast path). */
int epoch_wait(const epoch_ticket *t);
/* A second ticket for the same seal, for more blocks sealed by one event:
 * it holds its own references to the event and to the stream's record, so
 * either ticket may be released first. t holds its references meanwhile. */
void epoch_ticket_copy(const epoch_ticket *t, epoch_ticket *out);
/* Let go of a ticket: its event returns to the pool, its reference drops. */
void epoch_ticket_release(epoch_ticket *t);

#endif /* MAGPIE_EPOCH_H */
