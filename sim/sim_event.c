/* Completion cells, the reaper thread that frees them, and events.
 *
 * A cell is one point on one stream. A marker enqueued on the stream
 * completes it (release); whoever sees it complete (event query, event or
 * stream synchronize, a waiting stream) acquires, so exactly the work before
 * the marker is ordered before the observer, as with CUDA. Every record
 * gets its own cell, so a wait stays tied to the record it was made for even
 * if the event is recorded again or destroyed.
 *
 * Cells are reference-counted by the parties that may still touch them (the
 * marker, an event, each pending wait, a synchronizing host). References
 * are dropped with a release decrement and never acquired by the dropper:
 * an acquire by "whoever drops last" would order, say, a waiting stream's
 * work before the marking stream's later work. The last dropper hands the
 * cell to the reaper thread, which acquires everything and only frees.
 *
 * Events live in a pool and are never freed, so a destroyed event is
 * detected (until it is reused) rather than read after free. Only host
 * threads touch an event; markers and waits hold cells, not events.
 *
 * Lock order: an event's lock and sim_event_pool_lock are never held
 * together; under an event's lock only the leaf locks of the capture
 * (sim_graph.c) and of the checker (sim_check.c) are taken, one at a time;
 * nothing is locked under the pool lock. Workers take none of them.
 */
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "device/backend.h"
#include "sim/sim_internal.h"

/* ---------------------------------------------------------------- cells */

enum { SIM_CELL_PENDING = 0, SIM_CELL_SLEEPERS = 1, SIM_CELL_DONE = 2 };

/* INVARIANT: state only moves PENDING -> SLEEPERS -> DONE or PENDING ->
 * DONE; DONE is final. A cell is freed only by the reaper, after refs
 * reached 0. */
struct sim_cell {
  /* Set to DONE by the marker's worker (exchange, release); set to
   * SLEEPERS by a thread about to sleep on it (relaxed CAS: it publishes
   * nothing); read by observers with acquire, which pairs with the marker's
   * release. The marker's exchange reads a sleeper's CAS but is not an
   * acquire, so no waiter is ordered before the marker. Also the futex
   * word. */
  _Atomic uint32_t state;
  /* Incremented (relaxed) by a holder of a reference; decremented with
   * release by each holder when done; read with acquire by the reaper only,
   * which so orders every holder's accesses before the free. */
  _Atomic uint32_t refs;
  struct sim_cell *reap_next; /* written by the last dropper before its push */
  /* The stream-order checker's clock at the marker (NULL when it is off):
   * written by the recording host before the marker is pushed and the cell
   * published under the event lock; immutable after; freed with the cell. */
  struct sim_vc *vc;
};

struct sim_cell *sim_event_cell_new(uint32_t refs) {
  struct sim_cell *c = malloc(sizeof *c);
  if (c == NULL) return NULL;
  atomic_init(&c->state, SIM_CELL_PENDING);
  atomic_init(&c->refs, refs);
  c->reap_next = NULL;
  c->vc = NULL;
  return c;
}

void sim_event_cell_ref(struct sim_cell *c) { atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed); }

void sim_event_cell_complete(struct sim_cell *c) {
  uint32_t old = atomic_exchange_explicit(&c->state, SIM_CELL_DONE, memory_order_release);
  if (old == SIM_CELL_SLEEPERS) sim_futex_wake_all(&c->state);
}

int sim_event_cell_is_complete(struct sim_cell *c) {
  return atomic_load_explicit(&c->state, memory_order_acquire) == SIM_CELL_DONE;
}

void sim_event_cell_wait(struct sim_cell *c) {
  for (;;) {
    uint32_t v = atomic_load_explicit(&c->state, memory_order_acquire);
    if (v == SIM_CELL_DONE) return;
    if (v == SIM_CELL_PENDING) {
      uint32_t expected = SIM_CELL_PENDING;
      if (!atomic_compare_exchange_strong_explicit(&c->state, &expected, SIM_CELL_SLEEPERS, memory_order_relaxed,
                                                   memory_order_relaxed))
        continue; /* completed meanwhile: re-read with acquire */
    }
    sim_futex_wait(&c->state, SIM_CELL_SLEEPERS);
  }
}

/* ---------------------------------------------------------------- reaper */

/* Cells whose last reference was dropped. Pushed (CAS, release) by
 * droppers; taken whole (exchange, acquire) by the reaper, which so orders
 * the last dropper before the free. The reaper's exchange is not a release:
 * no dropper is ordered after the reaper.
 * The reaper is woken once per SIM_REAP_BATCH cells, not per cell: every
 * event record drops its event's previous cell, and a wake-up per record
 * cost a context switch per record on a host of few cores.
 * sim_reap_count: cells counted and not yet taken; raised (relaxed) by each
 * dropper before its push, lowered (relaxed) by the reaper by what it took,
 * so never below zero (raised after the push, a reaper that took the cell
 * first lowered it below zero for a moment). It orders nothing (the list
 * does). INVARIANT: fewer than SIM_REAP_BATCH cells wait without a post of
 * sim_reap_sem pending (the dropper that brings the count to
 * SIM_REAP_BATCH posts after its push): at most that many cells, a few
 * KiB, stay unfreed while the process is quiet. */
enum { SIM_REAP_BATCH = 64 };
static _Atomic(struct sim_cell *) sim_reap_head;
static _Atomic uint32_t sim_reap_count;
static sem_t sim_reap_sem;
/* Written once by sim_event_start_reaper inside sim_init's pthread_once,
 * before any cell exists. Without a reaper (thread creation failed) cells
 * are never freed: a leak rather than a failure. */
static int sim_reaper_running;

static void *sim_event_reaper(void *arg) {
  (void)arg;
  for (;;) {
    while (sem_wait(&sim_reap_sem) != 0) {
      /* EINTR only: retry */
    }
    struct sim_cell *c = atomic_exchange_explicit(&sim_reap_head, NULL, memory_order_acquire);
    uint32_t taken = 0;
    while (c != NULL) {
      struct sim_cell *next = c->reap_next;
      /* Acquire the release sequence of every holder's decrement. */
      (void)atomic_load_explicit(&c->refs, memory_order_acquire);
      sim_vc_free(c->vc);
      free(c);
      c = next;
      taken++;
    }
    atomic_fetch_sub_explicit(&sim_reap_count, taken, memory_order_relaxed);
  }
  return NULL;
}

void sim_event_start_reaper(void) {
  if (sem_init(&sim_reap_sem, 0, 0) != 0) return;
  sigset_t all, old;
  sigfillset(&all);
  pthread_attr_t attr;
  pthread_t tid;
  if (pthread_attr_init(&attr) != 0) return;
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  int err = pthread_create(&tid, &attr, sim_event_reaper, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  sim_reaper_running = err == 0;
}

void sim_event_cell_unref(struct sim_cell *c) {
  if (c == NULL) return;
  if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_release) != 1) return;
  if (!sim_reaper_running) return;
  int full = atomic_fetch_add_explicit(&sim_reap_count, 1, memory_order_relaxed) + 1 == SIM_REAP_BATCH;
  struct sim_cell *head = atomic_load_explicit(&sim_reap_head, memory_order_relaxed);
  do {
    c->reap_next = head;
  } while (
      !atomic_compare_exchange_weak_explicit(&sim_reap_head, &head, c, memory_order_release, memory_order_relaxed));
  if (full) sem_post(&sim_reap_sem);
}

/* ---------------------------------------------------------------- events */

/* INVARIANT: live, device, cell and capture are accessed only under lock.
 * cell is the cell of the last record (NULL if never recorded since
 * creation, or if that record was captured); the event holds one reference
 * to it. capture is the id of the capture the last record was made in (0:
 * none), so capture != 0 implies cell == NULL. A free event (live == 0) has
 * no cell and no capture. */
struct magpie_sim_event_st {
  pthread_mutex_t lock;
  int live;
  int device;
  struct sim_cell *cell;
  /* While nonzero, the event belongs to that capture (even after it ended):
   * a query, a synchronize or a wait outside that capture is refused
   * (sim_graph.c) until an ordinary record replaces it. */
  uint64_t capture;
  struct magpie_sim_event_st *next_free; /* under sim_event_pool_lock */
};

#define SIM_EVENT_CHUNK 64

/* Free events, most recently destroyed first. Chunks are never freed. */
static pthread_mutex_t sim_event_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct magpie_sim_event_st *sim_event_free;

int sim_event_create(int device, magpie_sim_event *out) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  if (device < 0 || device >= sim_device_count())
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d does not exist (%d simulated)", device, sim_device_count());
  pthread_mutex_lock(&sim_event_pool_lock);
  if (sim_event_free == NULL) {
    struct magpie_sim_event_st *chunk = calloc(SIM_EVENT_CHUNK, sizeof *chunk);
    if (chunk == NULL) {
      pthread_mutex_unlock(&sim_event_pool_lock);
      return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for an event");
    }
    for (int i = SIM_EVENT_CHUNK - 1; i >= 0; i--) {
      pthread_mutex_init(&chunk[i].lock, NULL);
      chunk[i].next_free = sim_event_free;
      sim_event_free = &chunk[i];
    }
  }
  struct magpie_sim_event_st *e = sim_event_free;
  sim_event_free = e->next_free;
  pthread_mutex_unlock(&sim_event_pool_lock);

  pthread_mutex_lock(&e->lock);
  e->live = 1;
  e->device = device;
  e->cell = NULL;
  e->capture = 0;
  pthread_mutex_unlock(&e->lock);
  *out = e;
  return MAGPIE_OK;
}

/* Locks e if it is a live event; otherwise returns the error. */
static int sim_event_lock(magpie_sim_event e) {
  if (e == NULL) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no event (NULL)");
  pthread_mutex_lock(&e->lock);
  if (!e->live) {
    pthread_mutex_unlock(&e->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "event %p was destroyed", (void *)e);
  }
  return MAGPIE_OK;
}

int sim_event_destroy(magpie_sim_event e) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  int rc = sim_event_lock(e);
  if (rc != MAGPIE_OK) return rc;
  struct sim_cell *c = e->cell;
  e->cell = NULL;
  e->capture = 0;
  e->live = 0;
  pthread_mutex_unlock(&e->lock);
  sim_event_cell_unref(c); /* pending work still completes the cell; waits keep theirs */
  pthread_mutex_lock(&sim_event_pool_lock);
  e->next_free = sim_event_free;
  sim_event_free = e;
  pthread_mutex_unlock(&sim_event_pool_lock);
  return MAGPIE_OK;
}

int sim_event_record(magpie_sim_event e, cudaStream_t h) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  rc = sim_event_lock(e);
  if (rc != MAGPIE_OK) return rc;
  if (e->device != sim_stream_device(s)) {
    int ed = e->device;
    pthread_mutex_unlock(&e->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "event of device %d recorded on a stream of device %d", ed,
                    sim_stream_device(s));
  }
  if (sim_capture_any()) {
    /* Under the event lock (the capture lock nests inside it), so the
     * event's mark and its capture agree. */
    uint64_t capture = 0;
    rc = sim_capture_record(h, s, &capture);
    if (rc != MAGPIE_OK || capture != 0) {
      struct sim_cell *old = NULL;
      if (rc == MAGPIE_OK) {
        /* A node of the capture: nothing enqueued; the previous record is
         * forgotten, as the event now stands for a point of the capture. */
        old = e->cell;
        e->cell = NULL;
        e->capture = capture;
      }
      pthread_mutex_unlock(&e->lock);
      sim_event_cell_unref(old);
      return rc;
    }
  }
  struct sim_cell *c = sim_event_cell_new(2); /* the event's and the marker's */
  if (c == NULL) {
    pthread_mutex_unlock(&e->lock);
    return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for an event record");
  }
  c->vc = sim_check_mark(s);
  rc = sim_stream_enqueue_marker(s, c);
  if (rc != MAGPIE_OK) {
    pthread_mutex_unlock(&e->lock);
    sim_event_cell_unref(c);
    sim_event_cell_unref(c);
    return rc;
  }
  struct sim_cell *old = e->cell;
  e->cell = c;
  e->capture = 0; /* an ordinary record: usable outside the capture again */
  pthread_mutex_unlock(&e->lock);
  sim_event_cell_unref(old);
  return MAGPIE_OK;
}

int sim_event_query(magpie_sim_event e) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  int rc = sim_event_lock(e);
  if (rc != MAGPIE_OK) return rc;
  if (e->capture != 0) {
    /* Neither complete nor pending: a point of a graph not run yet. */
    rc = sim_capture_event_refuse(e, e->capture, "queried");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  if (sim_capture_any() && (rc = sim_capture_unsafe_call("querying an event")) != MAGPIE_OK) {
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  /* Never recorded: complete, as in CUDA. */
  rc = e->cell == NULL || sim_event_cell_is_complete(e->cell) ? MAGPIE_OK : MAGPIE_SIM_NOT_READY;
  if (rc == MAGPIE_OK && e->cell != NULL) sim_check_observe(e->cell->vc);
  pthread_mutex_unlock(&e->lock);
  return rc;
}

/* The cell of e's last record with a reference for the caller, or NULL if
 * never recorded or recorded in a capture; *capture: the id of that
 * capture, or 0. */
static int sim_event_take_cell(magpie_sim_event e, struct sim_cell **out, uint64_t *capture) {
  int rc = sim_event_lock(e);
  if (rc != MAGPIE_OK) return rc;
  struct sim_cell *c = e->cell;
  if (c != NULL) sim_event_cell_ref(c);
  *capture = e->capture;
  pthread_mutex_unlock(&e->lock);
  *out = c;
  return MAGPIE_OK;
}

int sim_event_synchronize(magpie_sim_event e) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  struct sim_cell *c = NULL;
  uint64_t capture = 0;
  int rc = sim_event_take_cell(e, &c, &capture);
  if (rc == MAGPIE_OK && capture != 0) rc = sim_capture_event_refuse(e, capture, "synchronised");
  if (rc == MAGPIE_OK && sim_capture_any()) rc = sim_capture_unsafe_call("synchronising an event");
  if (rc != MAGPIE_OK || c == NULL) {
    if (c != NULL) sim_event_cell_unref(c);
    return rc;
  }
  sim_event_cell_wait(c);
  sim_check_observe(c->vc);
  sim_event_cell_unref(c);
  return MAGPIE_OK;
}

int sim_event_stream_wait(cudaStream_t h, magpie_sim_event e) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  struct sim_cell *c;
  uint64_t capture;
  rc = sim_event_take_cell(e, &c, &capture);
  if (rc != MAGPIE_OK) return rc;
  if (capture != 0 || sim_capture_any()) {
    int skip = 0;
    rc = sim_capture_event_wait(h, s, e, capture, c != NULL, &skip);
    if (rc != MAGPIE_OK || skip) {
      sim_event_cell_unref(c);
      return rc;
    }
  }
  if (c == NULL) return MAGPIE_OK; /* never recorded: nothing to wait for */
  sim_check_join_vc(s, c->vc);
  rc = sim_stream_enqueue_wait(s, c);
  if (rc != MAGPIE_OK) sim_event_cell_unref(c);
  return rc;
}

/* ---------------------------------------------------------------- public API */

MAGPIE_API magpie_sim_event magpie_sim_event_create(void) {
  magpie_sim_event e = NULL;
  int rc = sim_event_create(sim_current_device(), &e);
  if (sim_public_result("magpie_sim_event_create", rc) != MAGPIE_OK) return NULL;
  return e;
}

MAGPIE_API int magpie_sim_event_destroy(magpie_sim_event e) {
  return sim_public_result("magpie_sim_event_destroy", sim_event_destroy(e));
}

MAGPIE_API int magpie_sim_event_record(magpie_sim_event e, cudaStream_t s) {
  return sim_public_result("magpie_sim_event_record", sim_event_record(e, s));
}

MAGPIE_API int magpie_sim_event_query(magpie_sim_event e) {
  return sim_public_result("magpie_sim_event_query", sim_event_query(e));
}

MAGPIE_API int magpie_sim_event_synchronize(magpie_sim_event e) {
  return sim_public_result("magpie_sim_event_synchronize", sim_event_synchronize(e));
}

MAGPIE_API int magpie_sim_stream_wait_event(cudaStream_t s, magpie_sim_event e) {
  return sim_public_result("magpie_sim_stream_wait_event", sim_event_stream_wait(s, e));
}
