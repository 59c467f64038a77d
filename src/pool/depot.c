/* Depot exchanges. Takes no lock of its own (the stacks are lock-free);
 * event queries happen on magazines the scanning thread owns exclusively
 * (epoch_ready takes the stream's seal lock for a moment, a leaf). */
#include "pool/depot.h"

#include <sched.h>

#include "base/assert.h"
#include "base/sizeclass.h"
#include "pool/epoch.h"

void depot_init(depot *d) {
  stack_init(&d->full);
  stack_init(&d->pending);
  atomic_store_relaxed(&d->scanners, 0);
  pthread_mutex_init(&d->carve_lock, NULL);
  atomic_store_relaxed(&d->ready_bytes, 0);
  atomic_store_relaxed(&d->pending_bytes, 0);
  atomic_store_relaxed(&d->thread_in, 0);
  atomic_store_relaxed(&d->thread_out, 0);
  atomic_store_relaxed(&d->exchanges, 0);
  atomic_store_relaxed(&d->migrations, 0);
  atomic_store_relaxed(&d->same_stream, 0);
  atomic_store_relaxed(&d->stream_waits, 0);
}

void depot_note_thread_out(depot *d, const magazine *m) {
  atomic_add_relaxed(&d->thread_out, (int64_t)depot_magazine_bytes(m));
}

void depot_note_thread_in(depot *d, const magazine *m) {
  atomic_add_relaxed(&d->thread_in, (int64_t)depot_magazine_bytes(m));
}

void depot_totals_get(depot *depots, unsigned n, depot_totals *out) {
  *out = (depot_totals){0};
  for (unsigned c = 0; c < n; c++) {
    depot *d = &depots[c];
    out->ready_bytes += atomic_load_relaxed(&d->ready_bytes);
    out->pending_bytes += atomic_load_relaxed(&d->pending_bytes);
    out->thread_in += atomic_load_relaxed(&d->thread_in);
    out->thread_out += atomic_load_relaxed(&d->thread_out);
    out->exchanges += atomic_load_relaxed(&d->exchanges);
    out->migrations += atomic_load_relaxed(&d->migrations);
    out->same_stream += atomic_load_relaxed(&d->same_stream);
    out->stream_waits += atomic_load_relaxed(&d->stream_waits);
  }
}

size_t depot_magazine_bytes(const magazine *m) { return (size_t)m->count * sizeclass_table[m->cls].size; }

/* depot_counted: a magazine's bytes are added to its stack's counter before
 * the push that publishes it (release), and taken off after the pop that
 * acquired it, so in the counter's modification order every subtraction
 * follows its addition and a subtraction never finds less than it
 * removes. Debug builds check it where bytes leave a counter. */
void depot_put(depot *d, magazine *m) {
  MAGAZINE_ASSERT_VALID(m);
  MAGPIE_ASSERT(m->count > 0); /* the depot holds no empties (magazine_put_empty does) */
  atomic_add_relaxed(&d->exchanges, 1);
  atomic_add_relaxed(m->ticket.rec ? &d->pending_bytes : &d->ready_bytes, (int64_t)depot_magazine_bytes(m));
  stack_push(m->ticket.rec ? &d->pending : &d->full, &magazine_st.registry, &m->link);
}

/* A pending magazine whose epoch completed moves to full: its ticket is
 * released and its bytes count as ready. */
static void depot_pending_to_full(depot *d, magazine *m) {
  int64_t b = (int64_t)depot_magazine_bytes(m);
  epoch_ticket_release(&m->ticket);
  int64_t was = atomic_sub_relaxed(&d->pending_bytes, b);
  MAGPIE_ASSERT(was >= b); /* counted when it was put (depot_counted) */
  atomic_add_relaxed(&d->ready_bytes, b);
  stack_push(&d->full, &magazine_st.registry, &m->link);
}

/* Within one scan, per stream: the lowest seq seen pending. Events on a
 * stream complete in order, so every later seq is pending too and needs no
 * query of its own. */
#define DEPOT_SCAN_MEMO 8
typedef struct depot_memo {
  struct stream_rec *rec[DEPOT_SCAN_MEMO];
  uint64_t pending_from[DEPOT_SCAN_MEMO];
  int n;
} depot_memo;

static int depot_memo_known_pending(const depot_memo *mo, const epoch_ticket *t) {
  for (int i = 0; i < mo->n; i++)
    if (mo->rec[i] == t->rec) return t->seq >= mo->pending_from[i];
  return 0;
}

static void depot_memo_note_pending(depot_memo *mo, const epoch_ticket *t) {
  for (int i = 0; i < mo->n; i++) {
    if (mo->rec[i] == t->rec) {
      if (t->seq < mo->pending_from[i]) mo->pending_from[i] = t->seq;
      return;
    }
  }
  if (mo->n < DEPOT_SCAN_MEMO) {
    mo->rec[mo->n] = t->rec;
    mo->pending_from[mo->n++] = t->seq;
  }
}

/* A pending magazine leaves the depot for a taker that may use it: on its
 * own stream (READY_SAME), after its epoch (READY_DONE), or through a
 * stream wait the taker enqueued (PENDING). */
static magazine *depot_hand_over(depot *d, magazine *m, enum epoch_state st) {
  MAGAZINE_ASSERT_VALID(m);
  MAGPIE_ASSERT(m->ticket.rec != NULL); /* pending holds sealed magazines only */
  atomic_add_relaxed(st == EPOCH_READY_SAME   ? &d->same_stream
                     : st == EPOCH_READY_DONE ? &d->migrations
                                              : &d->stream_waits,
                     1);
  epoch_ticket_release(&m->ticket);
  int64_t b = (int64_t)depot_magazine_bytes(m), was = atomic_sub_relaxed(&d->pending_bytes, b);
  MAGPIE_ASSERT(was >= b); /* counted when it was put (depot_counted) */
  atomic_add_relaxed(&d->exchanges, 1);
  return m;
}

/* A taker looks at this many pending magazines, one pop at a time, before
 * it sweeps the whole list. Popping one at a time keeps the list in place
 * for other takers; the sweep finds the older, more likely completed,
 * magazines that newer ones cover in this LIFO. */
#define DEPOT_TAKE_TRIES 8

/* Take a pending magazine that stream_id may use now: its own stream's, or
 * one whose epoch completed. Pops at most DEPOT_TAKE_TRIES; the rest of the
 * list stays available to others throughout. */
static magazine *depot_pop_pending(depot *d, uint64_t stream_id, int *tries_out) {
  registry_link *keep_first = NULL, *keep_last = NULL;
  int64_t kept = 0;
  depot_memo memo = {.n = 0};
  magazine *taken = NULL;
  int tries = 0;
  while (tries < DEPOT_TAKE_TRIES) {
    registry_link *n = stack_pop(&d->pending, &magazine_st.registry);
    if (n == NULL) break;
    tries++;
    magazine *m = (magazine *)n;
    enum epoch_state st = EPOCH_PENDING;
    if (!depot_memo_known_pending(&memo, &m->ticket) || m->ticket.rec->id == stream_id)
      st = epoch_ready(&m->ticket, stream_id);
    if (st != EPOCH_PENDING) {
      taken = depot_hand_over(d, m, st);
      break;
    }
    depot_memo_note_pending(&memo, &m->ticket);
    atomic_store_relaxed(&n->next, 0);
    if (keep_last) atomic_store_relaxed(&keep_last->next, n->idx);
    else keep_first = n;
    keep_last = n;
    kept++;
  }
  if (keep_first) stack_push_chain(&d->pending, &magazine_st.registry, keep_first, keep_last, kept);
  *tries_out = tries;
  return taken;
}

magazine *depot_take(depot *d, uint64_t stream_id) {
  for (int spin = 0;; spin++) {
    magazine *m = (magazine *)stack_pop(&d->full, &magazine_st.registry);
    if (m != NULL) {
      MAGAZINE_ASSERT_VALID(m);
      MAGPIE_ASSERT(m->ticket.rec == NULL); /* full holds unsealed magazines only */
      atomic_add_relaxed(&d->exchanges, 1);
      int64_t b = (int64_t)depot_magazine_bytes(m), was = atomic_sub_relaxed(&d->ready_bytes, b);
      MAGPIE_ASSERT(was >= b); /* counted when it was put (depot_counted) */
      return m;
    }
    int tries = 0;
    if (stack_count(&d->pending) > 0 && (m = depot_pop_pending(d, stream_id, &tries)) != NULL) return m;
    /* The newest pending magazines are not ready: sweep the whole list
     * once (completed ones move to full), unless another thread is at it. */
    if (tries == DEPOT_TAKE_TRIES && atomic_load_relaxed(&d->scanners) == 0 && spin == 0) {
      if (depot_reclaim(d) > 0) continue;
    }
    /* Another thread has the pending list out for a sweep or a snapshot:
     * what it does not take comes back within microseconds; wait briefly
     * before the caller maps new memory for nothing. */
    if (atomic_load_relaxed(&d->scanners) == 0 || spin >= 16) return NULL;
    sched_yield();
  }
}

magazine *depot_give_up(depot *d) {
  magazine *m = (magazine *)stack_pop(&d->full, &magazine_st.registry);
  _Atomic int64_t *counter = &d->ready_bytes;
  if (m == NULL) {
    m = (magazine *)stack_pop(&d->pending, &magazine_st.registry);
    counter = &d->pending_bytes;
  }
  if (m == NULL) return NULL;
  MAGAZINE_ASSERT_VALID(m);
  int64_t b = (int64_t)depot_magazine_bytes(m), was = atomic_sub_relaxed(counter, b);
  MAGPIE_ASSERT(was >= b); /* counted when it was put (depot_counted) */
  return m;
}

magazine *depot_take_waiting(depot *d, const backend_ops *ops, uint64_t stream_id, cudaStream_t stream) {
  magazine *m = (magazine *)stack_pop(&d->pending, &magazine_st.registry);
  if (m == NULL) return NULL;
  enum epoch_state st = epoch_ready(&m->ticket, stream_id);
  /* Work enqueued on `stream` from now on runs after the freeing stream's
   * work up to the seal; the wait keeps the record it was made for, so the
   * event may go back to the pool at once. */
  if (st == EPOCH_PENDING && ops->stream_wait_event(stream, m->ticket.ev->ev) != MAGPIE_OK) {
    stack_push(&d->pending, &magazine_st.registry, &m->link);
    return NULL;
  }
  return depot_hand_over(d, m, st);
}

void depot_scanners_wait(depot *d) {
  for (int spin = 0; spin < DEPOT_SCANNERS_SPINS && atomic_load_relaxed(&d->scanners) > 0; spin++) sched_yield();
}

int depot_wait_pending(depot *d) {
  int moved = 0, failed = 0;
  /* Another thread's sweep (the maintenance thread's reclaim) may have the
   * list out: wait it out, and go again for what it put back pending. */
  for (int round = 0; round < DEPOT_WAIT_ROUNDS && !failed; round++) {
    depot_scanners_wait(d);
    if (stack_count(&d->pending) == 0) break;
    atomic_add_relaxed(&d->scanners, 1);
    registry_link *chain = stack_take_all(&d->pending, &magazine_st.registry);
    for (registry_link *n = chain, *next; n; n = next) {
      next = stack_next(&magazine_st.registry, n);
      magazine *m = (magazine *)n;
      if (epoch_wait(&m->ticket) == MAGPIE_OK) {
        depot_pending_to_full(d, m);
        moved++;
      } else {
        stack_push(&d->pending, &magazine_st.registry, &m->link);
        failed = 1; /* the driver failed: leave the rest */
      }
    }
    atomic_sub_relaxed(&d->scanners, 1);
  }
  return moved;
}

int depot_reclaim(depot *d) {
  if (stack_count(&d->pending) == 0) return 0;
  atomic_add_relaxed(&d->scanners, 1);
  registry_link *chain = stack_take_all(&d->pending, &magazine_st.registry);
  depot_memo memo = {.n = 0};
  int moved = 0;
  for (registry_link *n = chain, *next; n; n = next) {
    next = stack_next(&magazine_st.registry, n);
    magazine *m = (magazine *)n;
    if (!depot_memo_known_pending(&memo, &m->ticket) && epoch_ready(&m->ticket, EPOCH_NO_STREAM) == EPOCH_READY_DONE) {
      depot_pending_to_full(d, m);
      atomic_add_relaxed(&d->migrations, 1);
      moved++;
    } else {
      depot_memo_note_pending(&memo, &m->ticket);
      stack_push(&d->pending, &magazine_st.registry, &m->link);
    }
  }
  atomic_sub_relaxed(&d->scanners, 1);
  return moved;
}
