/* Depot exchanges. Takes no lock (the stacks are lock-free); event queries
 * happen on magazines the scanning thread owns exclusively. */
#include "depot.h"

#include <sched.h>

#include "epoch.h"
#include "heap.h"
#include "sizeclass.h"

void depot_init(depot *d) {
  stack_init(&d->full);
  stack_init(&d->pending);
  atomic_store_relaxed(&d->scanners, 0);
}

size_t depot_magazine_bytes(const magazine *m) { return (size_t)m->count * sizeclass_table[m->cls].size; }

void depot_put(struct heap *h, magazine *m) {
  depot *d = &h->depots[m->cls];
  atomic_add_relaxed(&h->stat_exchanges, 1);
  atomic_add_relaxed(m->ticket.rec ? &h->stat_depot_pending : &h->stat_depot_ready,
                     (int64_t)depot_magazine_bytes(m));
  stack_push(m->ticket.rec ? &d->pending : &d->full, &magazine_registry, &m->link);
}

/* A pending magazine becomes ready (its ticket is released). */
static void depot_pending_to_ready(struct heap *h, magazine *m) {
  int64_t b = (int64_t)depot_magazine_bytes(m);
  atomic_sub_relaxed(&h->stat_depot_pending, b);
  atomic_add_relaxed(&h->stat_depot_ready, b);
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

static magazine *depot_scan_pending(struct heap *h, depot *d, uint64_t stream_id) {
  registry_link *chain = stack_take_all(&d->pending, &magazine_registry);
  if (chain == NULL) return NULL;
  magazine *taken = NULL;
  registry_link *keep_first = NULL, *keep_last = NULL;
  int64_t kept = 0;
  depot_memo memo = {.n = 0};
  for (registry_link *n = chain, *next; n; n = next) {
    next = stack_next(&magazine_registry, n);
    magazine *m = (magazine *)n;
    enum epoch_state st = EPOCH_PENDING;
    if (!depot_memo_known_pending(&memo, &m->ticket) || m->ticket.rec->id == stream_id)
      st = epoch_ready(&m->ticket, stream_id);
    if (st == EPOCH_READY_DONE) {
      /* Its epoch completed: any stream may reuse it from now on. */
      epoch_ticket_release(&m->ticket);
      atomic_add_relaxed(&h->stat_migrations, 1);
      if (taken == NULL) {
        taken = m;
        atomic_sub_relaxed(&h->stat_depot_pending, (int64_t)depot_magazine_bytes(m));
      } else {
        depot_pending_to_ready(h, m);
        stack_push(&d->full, &magazine_registry, &m->link);
      }
      continue;
    }
    if (st == EPOCH_READY_SAME && taken == NULL) {
      epoch_ticket_release(&m->ticket);
      taken = m;
      atomic_sub_relaxed(&h->stat_depot_pending, (int64_t)depot_magazine_bytes(m));
      atomic_add_relaxed(&h->stat_same_stream, 1);
      continue;
    }
    if (st == EPOCH_PENDING) depot_memo_note_pending(&memo, &m->ticket);
    atomic_store_relaxed(&n->next, 0);
    if (keep_last) atomic_store_relaxed(&keep_last->next, n->idx);
    else keep_first = n;
    keep_last = n;
    kept++;
  }
  if (keep_first) stack_push_chain(&d->pending, &magazine_registry, keep_first, keep_last, kept);
  return taken;
}

magazine *depot_take(struct heap *h, unsigned cls, uint64_t stream_id) {
  depot *d = &h->depots[cls];
  for (int spin = 0;; spin++) {
    magazine *m = (magazine *)stack_pop(&d->full, &magazine_registry);
    if (m != NULL) {
      atomic_add_relaxed(&h->stat_exchanges, 1);
      atomic_sub_relaxed(&h->stat_depot_ready, (int64_t)depot_magazine_bytes(m));
      return m;
    }
    if (stack_count(&d->pending) > 0) {
      atomic_add_relaxed(&d->scanners, 1);
      m = depot_scan_pending(h, d, stream_id);
      atomic_sub_relaxed(&d->scanners, 1);
      if (m != NULL) {
        atomic_add_relaxed(&h->stat_exchanges, 1);
        return m;
      }
    }
    /* Another thread has the pending list out for a scan: what it does not
     * take comes back within microseconds; wait briefly before the caller
     * maps new memory for nothing. */
    if (atomic_load_relaxed(&d->scanners) == 0 || spin >= 16) return NULL;
    sched_yield();
  }
}

int depot_wait_pending(struct heap *h, unsigned cls) {
  depot *d = &h->depots[cls];
  registry_link *chain = stack_take_all(&d->pending, &magazine_registry);
  int moved = 0;
  for (registry_link *n = chain, *next; n; n = next) {
    next = stack_next(&magazine_registry, n);
    magazine *m = (magazine *)n;
    if (epoch_wait(&m->ticket) == MAGPIE_OK) {
      epoch_ticket_release(&m->ticket);
      depot_pending_to_ready(h, m);
      stack_push(&d->full, &magazine_registry, &m->link);
      moved++;
    } else {
      stack_push(&d->pending, &magazine_registry, &m->link);
    }
  }
  return moved;
}

int depot_reclaim(struct heap *h, unsigned cls) {
  depot *d = &h->depots[cls];
  if (stack_count(&d->pending) == 0) return 0;
  registry_link *chain = stack_take_all(&d->pending, &magazine_registry);
  depot_memo memo = {.n = 0};
  int moved = 0;
  for (registry_link *n = chain, *next; n; n = next) {
    next = stack_next(&magazine_registry, n);
    magazine *m = (magazine *)n;
    if (!depot_memo_known_pending(&memo, &m->ticket) &&
        epoch_ready(&m->ticket, EPOCH_NO_STREAM) == EPOCH_READY_DONE) {
      epoch_ticket_release(&m->ticket);
      depot_pending_to_ready(h, m);
      atomic_add_relaxed(&h->stat_migrations, 1);
      stack_push(&d->full, &magazine_registry, &m->link);
      moved++;
    } else {
      depot_memo_note_pending(&memo, &m->ticket);
      stack_push(&d->pending, &magazine_registry, &m->link);
    }
  }
  return moved;
}
