/* The depot: per device and size class, the magazines no thread holds.
 *
 *   full    — ready for any stream (fresh from a slab, or their epoch has
 *             completed);
 *   pending — sealed by a stream whose epoch may not have completed; ready
 *             at once for that same stream, for others after the epoch.
 *
 * Both are lock-free stacks. Threads exchange whole magazines here on their
 * slow paths only (one exchange per magazine's worth of operations). */
#ifndef MAGPIE_DEPOT_H
#define MAGPIE_DEPOT_H

#include <pthread.h>
#include <stdint.h>

#include "base/stack.h"
#include "device/backend.h"
#include "magpie.h"
#include "pool/magazine.h"

/* One per size class, on lines of its own: every exchange of a class
 * touches its stacks and counters, and threads exchanging other classes
 * must not share those lines (they did when the counters were per heap). */
typedef struct depot {
  _Alignas(64) stack full;
  stack pending;
  /* Threads currently holding the pending list taken for a scan (relaxed
   * counter; a heuristic that keeps others from mapping a new slab while
   * reusable magazines are only out for inspection). */
  _Atomic int scanners;
  /* Held by heap_refill across one slab carve of this class (a map call
   * included): a thread that found the class empty while another carved
   * takes from that carve instead of mapping a slab of its own. */
  pthread_mutex_t carve_lock;
  /* Statistics of this class, relaxed counters written by any thread on
   * slow paths, summed by magpie_stats_get; none publishes other memory.
   * On a line of their own: the stacks' heads above take compare-and-swaps
   * from every thread exchanging this class. */
  _Alignas(64) _Atomic int64_t ready_bytes; /* bytes in full */
  _Atomic int64_t pending_bytes;            /* bytes in pending */
  _Atomic int64_t thread_in;                /* bytes of magazines handed to threads */
  _Atomic int64_t thread_out;               /* bytes of magazines threads gave back */
  _Atomic uint64_t exchanges;
  _Atomic uint64_t migrations;
  _Atomic uint64_t same_stream;
  _Atomic uint64_t stream_waits; /* taken through depot_take_waiting */
} depot;

void depot_init(depot *d);
/* Give a non-empty magazine of d's class to d: to pending if it carries a
 * ticket, else to full. */
void depot_put(depot *d, magazine *m);
/* A magazine whose blocks stream_id may use now, or NULL. Never blocks and
 * never maps memory. The returned magazine carries no ticket. */
magazine *depot_take(depot *d, uint64_t stream_id);
/* A pending magazine of another stream, made usable on `stream` (whose id
 * is stream_id) by making it wait (through ops) on the magazine's event: no host wait,
 * and nothing mapped. NULL if none is pending or the wait cannot be
 * enqueued. The returned magazine carries no ticket. */
magazine *depot_take_waiting(depot *d, const backend_ops *ops, uint64_t stream_id, cudaStream_t stream);
/* Wait (yielding, a bounded while) until no other thread has d's pending
 * list out for a sweep: what it does not take comes back within
 * microseconds. */
#define DEPOT_SCANNERS_SPINS 100000
#define DEPOT_WAIT_ROUNDS 8
void depot_scanners_wait(depot *d);
/* A magazine leaving the depot for a lower layer (class blocks going back
 * to their segments): from full, else from pending with its ticket, which
 * the caller takes over. NULL when both are empty. */
magazine *depot_give_up(depot *d);
/* Pressure: wait for every pending magazine of d (blocking on their
 * events) and move them to full, including those another thread's sweep
 * had out meanwhile. Returns how many moved. */
int depot_wait_pending(depot *d);
/* Pressure: move the pending magazines of d whose epochs completed to full
 * (queries, no waiting). Returns how many moved. */
int depot_reclaim(depot *d);
/* Bytes of the blocks in a magazine. */
size_t depot_magazine_bytes(const magazine *m);
/* Magazine m leaves a thread's cache for a lower layer (depot, limbo, a
 * record), or (in) one comes in: thread-cached bytes are in - out. */
void depot_note_thread_out(depot *d, const magazine *m);
void depot_note_thread_in(depot *d, const magazine *m);

/* Sums over the n depots of an array (a device's classes), for statistics. */
typedef struct depot_totals {
  int64_t ready_bytes, pending_bytes, thread_in, thread_out;
  uint64_t exchanges, migrations, same_stream, stream_waits;
} depot_totals;
void depot_totals_get(depot *depots, unsigned n, depot_totals *out);

#endif /* MAGPIE_DEPOT_H */
