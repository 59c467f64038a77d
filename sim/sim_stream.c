/* Simulated streams: one worker thread per stream running the closures
 * enqueued on it in order; handle slots and their LIFO recycling; default
 * and per-thread streams; stream waits, stream and device synchronize; the
 * simulator's start-up (environment) and devices.
 *
 * Happens-before edges made here (see sim_internal.h for the rule):
 *   host -> worker: exactly one per closure, the push (release) of its node
 *     read by the worker (acquire). The wake-up is a futex-based token whose
 *     atomics are relaxed (ordered with fences, which ThreadSanitizer does
 *     not model): a semaphore would hand the worker the poster's latest
 *     state, including what the host learned from other streams after
 *     enqueueing the closure, and so hide races between streams;
 *   worker -> others: only through completion cells (sim_event.c) and the
 *     registry entry a dying worker clears, which only device synchronize
 *     of the same device reads.
 *
 * Lock order: sim_slot_lock and sim_default_lock are never held together,
 * and nothing else is locked while either is held. Workers take neither
 * (a worker unlocking a lock that a host then locks would order the
 * stream's work before the host).
 */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/backend.h"
#include "sim/sim_internal.h"

/* ---------------------------------------------------------------- errors */

/* The simulator's last error of this thread (magpie_sim_last_error),
 * separate from the allocator's, as a CUDA driver's error state is. */
static _Thread_local int sim_tls_error;
static _Thread_local char sim_tls_error_msg[512];

int sim_fail(int code, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  backend_set_error_detail("%s", buf);
  return code;
}

int sim_public_result(const char *fn, int rc) {
  if (rc != MAGPIE_OK && rc != MAGPIE_SIM_NOT_READY) {
    snprintf(sim_tls_error_msg, sizeof sim_tls_error_msg, "%s: %s", fn, backend_error_detail());
    sim_tls_error = rc;
  }
  return rc;
}

MAGPIE_API int magpie_sim_last_error(void) { return sim_tls_error; }

MAGPIE_API const char *magpie_sim_last_error_message(void) {
  return sim_tls_error == MAGPIE_OK ? "success" : sim_tls_error_msg;
}

/* ---------------------------------------------------------------- queues */

enum sim_node_kind { SIM_NODE_CLOSURE, SIM_NODE_MARKER, SIM_NODE_WAIT, SIM_NODE_EXIT };

/* One unit of work in a stream's queue (Vyukov's intrusive MPSC queue).
 * INVARIANT: the stream's head node is a stub whose work already ran (or
 * the initial empty node); the worker frees it when it moves to the next.
 * INVARIANT: only the producer that exchanged a node out of the tail writes
 * that node's next, exactly once. */
struct sim_node {
  /* Written NULL (relaxed) by this node's producer before it publishes the
   * node with the tail exchange (acq_rel, so the next producer's store
   * below is ordered after it); then written once (release) by the next
   * node's producer; read by the worker (acquire), pairing with that
   * release so the next node's payload and everything its producer did
   * before the push are visible to the work. Before the push the node is
   * its producer's alone, which may chain a batch through it (relaxed,
   * sim_stream_enqueue_launches). */
  _Atomic(struct sim_node *) next;
  enum sim_node_kind kind;
  void (*fn)(void *);
  void *arg;
  struct sim_cell *cell;
};

/* INVARIANT: id, device, reg_index and exit_node are set before the worker
 * starts and never change. The worker alone frees the stream, after its
 * EXIT node ran and no device synchronize holds its registry entry. */
struct sim_stream {
  uint64_t id;
  int device;
  uint32_t reg_index;
  /* Producers' end: exchanged (acq_rel) by producers only; the worker
   * never touches it, so no producer acquires anything from a worker. */
  _Atomic(struct sim_node *) tail;
  struct sim_node *head; /* the worker's end: worker only */
  /* Wake-up token, also the futex word: SIM_WAKE_NONE, SIM_WAKE_TOKEN
   * (work was pushed since the worker last looked), SIM_WAKE_SLEEPING (the
   * worker sleeps, no token). Producers exchange in TOKEN after a push; the
   * worker exchanges it out, or CASes NONE -> SLEEPING before sleeping.
   * All relaxed RMWs on this one word, so no wake-up is lost; a release
   * fence before the producer's exchange and an acquire fence after the
   * worker's make the pushed links visible. Deliberately invisible to
   * ThreadSanitizer (see the top of this file). */
  _Atomic uint32_t wake;
  struct sim_node *exit_node; /* preallocated so destroy cannot fail */
  /* Launches enqueued and not yet run, at most MAGPIE_SIM_QUEUE_DEPTH:
   * raised by launching threads (CAS, relaxed) before their push, lowered
   * by the worker (relaxed) after the launch ran; also the futex word a
   * launching thread sleeps on while the queue is full, as a CUDA host
   * thread blocks when a stream's queue is full. Orders nothing: the queue
   * itself carries the work's happens-before edges. */
  _Atomic uint32_t launches;
  /* Nodes pushed and not yet run to their end (the low bits), and
   * SIM_RAN_WORK once the worker ran a launch or a stream wait. Raised by
   * one (relaxed) by each producer before its push; the worker sets
   * SIM_RAN_WORK (relaxed) after such a node, then lowers the count
   * (release) after every node. A recorder that reads 0 (relaxed) knows
   * that everything pushed before its record ran and that the worker never
   * ran work: it may complete its marker at once, without waking the
   * worker (as a GPU completes an event recorded on an idle stream), after
   * an acquire fence that orders the earlier markers' completions before
   * it. Every value read as 0 precedes the flag in this word's order, so
   * that fence orders no device work before the recorder, which a record
   * must not do (it would hide the host's unsynchronized reads from
   * ThreadSanitizer); once the stream ran work, every marker goes through
   * the worker as before. INVARIANT: the count never goes below 0; the
   * flag is never cleared. */
  _Atomic uint64_t busy;
  /* The stream-order checker's state: host threads only, under the
   * checker's lock (sim_check.c); the worker never touches it. */
  struct sim_check_stream *chk;
  /* The capture under way on this stream (NULL: none): host threads only,
   * under the capture lock (sim_graph.c); the worker never touches it. */
  struct sim_capture *capture;
};

/* The device registry: every stream of a device that can still have work
 * (live, default, per-thread, and destroyed ones still draining), for
 * device synchronize.
 *
 * stream: claimed by a creator with a CAS NULL -> SIM_REG_CLAIMED
 *   (relaxed), published with an exchange to the stream (release); cleared
 *   by the dying worker with an exchange to NULL (seq_cst), after all its
 *   work ran and it counted itself in sim_device.retired. Read (seq_cst)
 *   only by device synchronize of this device.
 *   The edge from workers that already finished comes from
 *   sim_device.retired, not from this entry (a creator's later claim
 *   would have to carry it through a release sequence).
 * pins: incremented (relaxed) and decremented (release) by a thread that
 *   pushes onto a stream it found here (device synchronize) or is
 *   destroying; the dying worker reads it (acquire) and frees its stream
 *   only at 0, so those pushes happen before the free. A seq_cst fence on
 *   both sides (pin then read stream; clear stream then read pins) makes
 *   sure either the pusher sees NULL or the worker sees the pin.
 * INVARIANT: a worker frees its stream only after clearing its entry and
 * then reading pins == 0. */
struct sim_reg_entry {
  _Atomic(struct sim_stream *) stream;
  _Atomic uint32_t pins;
};

static char sim_reg_claimed_tag;
#define SIM_REG_CLAIMED ((struct sim_stream *)(void *)&sim_reg_claimed_tag)

struct sim_device {
  /* Created once under sim_default_lock, published with a release store;
   * read with acquire by any thread naming handle 0 on this device. */
  _Atomic(struct sim_stream *) default_stream;
  /* One past the highest registry index ever claimed; raised (relaxed
   * CAS) by creators, read (relaxed) by device synchronize to bound its
   * scan: a claim that happens before the synchronize is seen by coherence. */
  _Atomic uint32_t reg_high;
  /* Streams of this device whose workers finished (all their work ran).
   * Incremented by each dying worker once its last work ran, before it
   * leaves the registry, with a seq_cst read-modify-write; read (seq_cst)
   * by device synchronize after its scan of the registry. Every release
   * RMW merges into what the next acquire sees, so one load orders the
   * work of every finished worker before the synchronize, without leaning
   * on release sequences through other threads' RMWs (which
   * ThreadSanitizer does not follow) and without giving stream creators an
   * edge from dead streams that CUDA does not have.
   * INVARIANT: a synchronize that finds a dying stream's registry entry
   * gone (NULL, or claimed again by a new stream) sees its increment: the
   * increment precedes the entry's clearing, which precedes the scan's
   * read of the entry, which precedes the load, all in the seq_cst order.
   * (Incremented after the clearing, as it once was, a synchronize between
   * the two found neither the stream nor its count when a new stream had
   * claimed the entry, and ThreadSanitizer reported the reuse that
   * followed in about one run of sim_stress_test in eight.) */
  _Atomic uint64_t retired;
  struct sim_reg_entry reg[SIM_MAX_STREAMS];
};

static struct sim_device sim_devices[SIM_MAX_DEVICES];
static pthread_mutex_t sim_default_lock = PTHREAD_MUTEX_INITIALIZER;

/* Stream ids: fetch_add (relaxed) by creators; only uniqueness matters. */
static _Atomic uint64_t sim_next_id;

struct sim_slot sim_slots[SIM_MAX_HANDLES];
/* Both under sim_slot_lock. INVARIANT: the free list holds exactly the
 * slots below sim_slot_unused whose id is 0, most recently freed first. */
static pthread_mutex_t sim_slot_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t sim_slot_free_head; /* index + 1; 0 = empty */
static uint32_t sim_slot_unused;    /* slots at or above it were never used */

/* The calling thread's current device and per-thread streams. */
struct sim_thread {
  struct sim_stream *per_thread[SIM_MAX_DEVICES];
};
static _Thread_local int sim_tls_device;
static _Thread_local struct sim_thread *sim_tls_thread;
static pthread_key_t sim_thread_key; /* its destructor retires per-thread streams */

/* ---------------------------------------------------------------- start-up */

/* Written once inside pthread_once; pthread_once orders them before every
 * reader. */
static pthread_once_t sim_once = PTHREAD_ONCE_INIT;
static int sim_init_status;
static char sim_init_detail[256];
static int sim_ndevices = 1;

static void sim_stream_thread_exit(void *arg);

/* fork(): the simulated device cannot be used in a child forked after it
 * started, as CUDA cannot: its streams are threads of the parent, which
 * the child does not have, so work pushed there would never run and a
 * synchronisation would wait forever. Set once by the child handler (the
 * child's only thread); read plainly by every entry point of the child. */
static int sim_forked;

static void sim_atfork_child(void) { sim_forked = 1; }

int sim_usable(void) {
  if (!sim_forked) return MAGPIE_OK;
  return sim_fail(MAGPIE_ERR_NO_DEVICE,
                  "the simulated device started in the parent process before fork(); a forked child cannot use "
                  "it (as with CUDA): its streams are the parent's threads");
}

int sim_parse_size(const char *text, int allow_suffix, uint64_t *out) {
  const char *p = text;
  uint64_t v = 0;
  if (p == NULL || *p < '0' || *p > '9') return -1;
  for (; *p >= '0' && *p <= '9'; p++) {
    unsigned d = (unsigned)(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return -1;
    v = v * 10 + d;
  }
  unsigned shift = 0;
  if (allow_suffix && *p != '\0') {
    switch (*p) {
    case 'k':
    case 'K': shift = 10; break;
    case 'm':
    case 'M': shift = 20; break;
    case 'g':
    case 'G': shift = 30; break;
    default: return -1;
    }
    p++;
  }
  if (*p != '\0') return -1;
  if (shift && v > (UINT64_MAX >> shift)) return -1;
  *out = v << shift;
  return 0;
}

static void sim_init_once(void) {
  const char *v = getenv("MAGPIE_SIM_DEVICES");
  if (v != NULL) {
    uint64_t n;
    if (sim_parse_size(v, 0, &n) != 0 || n < 1 || n > SIM_MAX_DEVICES) {
      sim_init_status = MAGPIE_ERR_CONFIG;
      snprintf(sim_init_detail, sizeof sim_init_detail, "MAGPIE_SIM_DEVICES=\"%s\" is not a device count from 1 to %d",
               v, SIM_MAX_DEVICES);
      return;
    }
    sim_ndevices = (int)n;
  }
  int rc = sim_memory_configure(sim_init_detail, sizeof sim_init_detail);
  if (rc != MAGPIE_OK) {
    sim_init_status = rc;
    return;
  }
  if (pthread_key_create(&sim_thread_key, sim_stream_thread_exit) != 0) {
    sim_init_status = MAGPIE_ERR_BACKEND;
    snprintf(sim_init_detail, sizeof sim_init_detail, "cannot create the simulator's thread key");
    return;
  }
  sim_event_start_reaper();
  pthread_atfork(NULL, NULL, sim_atfork_child);
}

int sim_init(void) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  pthread_once(&sim_once, sim_init_once);
  if (sim_init_status != MAGPIE_OK) return sim_fail(sim_init_status, "%s", sim_init_detail);
  return MAGPIE_OK;
}

int sim_device_count(void) { return sim_ndevices; }

int sim_current_device(void) { return sim_tls_device; }

int sim_set_current_device(int device) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  if (device < 0 || device >= sim_ndevices)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d does not exist (%d simulated)", device, sim_ndevices);
  sim_tls_device = device;
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- workers */

enum { SIM_WAKE_NONE = 0, SIM_WAKE_TOKEN = 1, SIM_WAKE_SLEEPING = 2 };
#define SIM_RAN_WORK ((uint64_t)1 << 63) /* in sim_stream.busy */

static void sim_stream_push(struct sim_stream *s, struct sim_node *n) {
  atomic_fetch_add_explicit(&s->busy, 1, memory_order_relaxed);
  atomic_store_explicit(&n->next, NULL, memory_order_relaxed);
  struct sim_node *prev = atomic_exchange_explicit(&s->tail, n, memory_order_acq_rel);
  atomic_store_explicit(&prev->next, n, memory_order_release);
  atomic_thread_fence(memory_order_release);
  if (atomic_exchange_explicit(&s->wake, SIM_WAKE_TOKEN, memory_order_relaxed) == SIM_WAKE_SLEEPING)
    sim_futex_wake_one(&s->wake);
}

/* Worker only: returns once a push happened since the last return. */
static void sim_stream_sleep(struct sim_stream *s) {
  for (;;) {
    if (atomic_exchange_explicit(&s->wake, SIM_WAKE_NONE, memory_order_relaxed) == SIM_WAKE_TOKEN) break;
    uint32_t expected = SIM_WAKE_NONE;
    if (atomic_compare_exchange_strong_explicit(&s->wake, &expected, SIM_WAKE_SLEEPING, memory_order_relaxed,
                                                memory_order_relaxed))
      sim_futex_wait(&s->wake, SIM_WAKE_SLEEPING);
    /* else a token arrived meanwhile: take it on the next turn */
  }
  atomic_thread_fence(memory_order_acquire);
}

/* Worker only. The returned node becomes the stub; its payload is valid. */
static struct sim_node *sim_stream_pop(struct sim_stream *s) {
  struct sim_node *h = s->head;
  struct sim_node *next = atomic_load_explicit(&h->next, memory_order_acquire);
  if (next == NULL) return NULL;
  s->head = next;
  free(h);
  return next;
}

static int sim_stream_run_node(struct sim_stream *s, struct sim_node *n);

/* A marker's work, by the worker or, on a stream that never ran work, by
 * the recorder (sim_stream_enqueue_marker): its cell completes and the
 * marker's reference to it goes. */
static void sim_stream_mark(struct sim_cell *c) {
  sim_event_cell_complete(c);
  sim_event_cell_unref(c);
}

/* Runs one node's work, then counts it done; returns 1 for EXIT. */
static int sim_stream_run(struct sim_stream *s, struct sim_node *n) {
  int work = n->kind == SIM_NODE_CLOSURE || n->kind == SIM_NODE_WAIT;
  int exit = sim_stream_run_node(s, n);
  if (work) atomic_fetch_or_explicit(&s->busy, SIM_RAN_WORK, memory_order_relaxed);
  atomic_fetch_sub_explicit(&s->busy, 1, memory_order_release);
  return exit;
}

static int sim_stream_run_node(struct sim_stream *s, struct sim_node *n) {
  switch (n->kind) {
  case SIM_NODE_CLOSURE:
    n->fn(n->arg);
    /* A slot of the queue is free: wake launchers waiting for one. */
    if (atomic_fetch_sub_explicit(&s->launches, 1, memory_order_relaxed) >= MAGPIE_SIM_QUEUE_DEPTH)
      sim_futex_wake_all(&s->launches);
    return 0;
  case SIM_NODE_MARKER: sim_stream_mark(n->cell); return 0;
  case SIM_NODE_WAIT:
    sim_event_cell_wait(n->cell);
    sim_event_cell_unref(n->cell);
    return 0;
  case SIM_NODE_EXIT: return 1;
  }
  return 0;
}

static struct sim_reg_entry *sim_stream_entry(const struct sim_stream *s) {
  return &sim_devices[s->device].reg[s->reg_index];
}

/* The dying worker: leave the registry, let pinned pushers finish, run what
 * they pushed, free everything. */
static void sim_stream_finish(struct sim_stream *s) {
  struct sim_reg_entry *e = sim_stream_entry(s);
  /* Every work node ran before EXIT (nothing is launched on a destroyed
   * stream); what pinned pushers add later are synchronize markers, which
   * their own cells order. */
  atomic_fetch_add_explicit(&sim_devices[s->device].retired, 1, memory_order_seq_cst);
  atomic_exchange_explicit(&e->stream, NULL, memory_order_seq_cst);
  atomic_thread_fence(memory_order_seq_cst);
  while (atomic_load_explicit(&e->pins, memory_order_acquire) != 0)
    sched_yield(); /* a pin lasts one push: a few instructions */
  struct sim_node *n;
  while ((n = sim_stream_pop(s)) != NULL) sim_stream_run(s, n);
  free(s->head);
  free(s);
}

static void *sim_stream_worker(void *arg) {
  struct sim_stream *s = arg;
  int exiting = 0;
  while (!exiting) {
    sim_stream_sleep(s);
    struct sim_node *n;
    while ((n = sim_stream_pop(s)) != NULL)
      if (sim_stream_run(s, n)) exiting = 1;
  }
  sim_stream_finish(s);
  return NULL;
}

/* ---------------------------------------------------------------- creation */

static int sim_stream_reg_claim(int device, uint32_t *index) {
  struct sim_device *d = &sim_devices[device];
  for (uint32_t i = 0; i < SIM_MAX_STREAMS; i++) {
    struct sim_stream *expected = NULL;
    if (atomic_load_explicit(&d->reg[i].stream, memory_order_relaxed) != NULL) continue;
    if (!atomic_compare_exchange_strong_explicit(&d->reg[i].stream, &expected, SIM_REG_CLAIMED, memory_order_relaxed,
                                                 memory_order_relaxed))
      continue;
    uint32_t high = atomic_load_explicit(&d->reg_high, memory_order_relaxed);
    while (high < i + 1 && !atomic_compare_exchange_weak_explicit(&d->reg_high, &high, i + 1, memory_order_relaxed,
                                                                  memory_order_relaxed)) {
    }
    *index = i;
    return MAGPIE_OK;
  }
  return sim_fail(MAGPIE_ERR_BACKEND, "too many streams on device %d (at most %d)", device, SIM_MAX_STREAMS);
}

/* A new stream with a running worker, registered on device. */
static int sim_stream_new(int device, struct sim_stream **out) {
  struct sim_stream *s = calloc(1, sizeof *s);
  struct sim_node *stub = calloc(1, sizeof *stub);
  struct sim_node *exit_node = calloc(1, sizeof *exit_node);
  if (s == NULL || stub == NULL || exit_node == NULL) {
    free(s);
    free(stub);
    free(exit_node);
    return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a stream");
  }
  s->id = atomic_fetch_add_explicit(&sim_next_id, 1, memory_order_relaxed) + 1;
  s->device = device;
  s->head = stub;
  atomic_init(&stub->next, NULL);
  atomic_init(&s->tail, stub);
  exit_node->kind = SIM_NODE_EXIT;
  s->exit_node = exit_node;
  atomic_init(&s->wake, SIM_WAKE_NONE);
  atomic_init(&s->busy, 0);
  int rc = sim_stream_reg_claim(device, &s->reg_index);
  if (rc != MAGPIE_OK) goto fail_reg;

  /* Workers get no asynchronous signals: those belong to the user's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_attr_t attr;
  pthread_t tid;
  int err = pthread_attr_init(&attr);
  if (err == 0) {
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    err = pthread_create(&tid, &attr, sim_stream_worker, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
  }
  if (err != 0) {
    rc = sim_fail(MAGPIE_ERR_BACKEND, "cannot start a stream's worker thread: %s", strerror(err));
    goto fail_thread;
  }
  atomic_exchange_explicit(&sim_stream_entry(s)->stream, s, memory_order_release);
  *out = s;
  return MAGPIE_OK;

fail_thread:
  atomic_exchange_explicit(&sim_stream_entry(s)->stream, NULL, memory_order_release);
fail_reg:
  free(exit_node);
  free(stub);
  free(s);
  return rc;
}

/* Enqueues EXIT: pending work still runs, then the worker frees the stream.
 * The pin keeps the worker from freeing the stream before our wake-up
 * returned. */
static void sim_stream_retire(struct sim_stream *s) {
  struct sim_reg_entry *e = sim_stream_entry(s);
  /* Both before the push: then the worker may free s. */
  if (sim_capture_any()) sim_capture_stream_retire(s);
  sim_check_stream_retire(s);
  atomic_fetch_add_explicit(&e->pins, 1, memory_order_relaxed);
  sim_stream_push(s, s->exit_node);
  atomic_fetch_sub_explicit(&e->pins, 1, memory_order_release);
}

static int sim_stream_default(int device, struct sim_stream **out) {
  struct sim_device *d = &sim_devices[device];
  struct sim_stream *s = atomic_load_explicit(&d->default_stream, memory_order_acquire);
  int rc = MAGPIE_OK;
  if (s == NULL) {
    pthread_mutex_lock(&sim_default_lock);
    s = atomic_load_explicit(&d->default_stream, memory_order_relaxed);
    if (s == NULL) {
      rc = sim_stream_new(device, &s);
      if (rc == MAGPIE_OK) atomic_store_explicit(&d->default_stream, s, memory_order_release);
    }
    pthread_mutex_unlock(&sim_default_lock);
  }
  *out = s;
  return rc;
}

static int sim_stream_per_thread(int device, struct sim_stream **out) {
  struct sim_thread *t = sim_tls_thread;
  if (t == NULL) {
    t = calloc(1, sizeof *t);
    if (t == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a thread");
    if (pthread_setspecific(sim_thread_key, t) != 0) {
      free(t);
      return sim_fail(MAGPIE_ERR_BACKEND, "cannot register the per-thread stream");
    }
    sim_tls_thread = t;
  }
  if (t->per_thread[device] == NULL) {
    int rc = sim_stream_new(device, &t->per_thread[device]);
    if (rc != MAGPIE_OK) return rc;
  }
  *out = t->per_thread[device];
  return MAGPIE_OK;
}

/* Thread exit: retire the thread's per-thread streams (their pending work
 * still runs). */
static void sim_stream_thread_exit(void *arg) {
  struct sim_thread *t = arg;
  for (int d = 0; d < SIM_MAX_DEVICES; d++)
    if (t->per_thread[d] != NULL) sim_stream_retire(t->per_thread[d]);
  if (sim_tls_thread == t) sim_tls_thread = NULL;
  free(t);
}

/* ---------------------------------------------------------------- handles */

static struct sim_slot *sim_stream_slot_of(cudaStream_t h) {
  uintptr_t base = (uintptr_t)sim_slots, p = (uintptr_t)h;
  /* Two comparisons rather than one wrapping subtraction: clean under
   * -fsanitize=unsigned-integer-overflow. */
  if (p >= base && p - base < sizeof sim_slots && (p - base) % sizeof(struct sim_slot) == 0)
    return &sim_slots[(p - base) / sizeof(struct sim_slot)];
  return NULL;
}

static int sim_stream_is_special(cudaStream_t h) {
  return sim_stream_is_legacy(h) || h == MAGPIE_SIM_STREAM_PER_THREAD;
}

int sim_stream_resolve(cudaStream_t h, struct sim_stream **out) {
  if (sim_usable() != MAGPIE_OK) return MAGPIE_ERR_NO_DEVICE;
  struct sim_slot *slot = sim_stream_slot_of(h);
  if (slot != NULL) {
    if (atomic_load_explicit(&slot->id, memory_order_acquire) != 0) {
      struct sim_stream *s = atomic_load_explicit(&slot->stream, memory_order_relaxed);
      if (s != NULL) {
        *out = s;
        return MAGPIE_OK;
      }
    }
    return sim_fail(MAGPIE_ERR_INVALID_STREAM, "stream %p was destroyed", (void *)h);
  }
  if (!sim_stream_is_special(h))
    return sim_fail(MAGPIE_ERR_INVALID_STREAM, "%p is not a stream of the simulated device", (void *)h);
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  int device = sim_tls_device;
  if (h == MAGPIE_SIM_STREAM_PER_THREAD) return sim_stream_per_thread(device, out);
  return sim_stream_default(device, out);
}

uint64_t sim_stream_id_slow(cudaStream_t h) {
  struct sim_stream *s;
  if (!sim_stream_is_special(h) || sim_stream_resolve(h, &s) != MAGPIE_OK) return 0;
  return s->id;
}

int sim_stream_device(const struct sim_stream *s) { return s->device; }

uint64_t sim_stream_uid(const struct sim_stream *s) { return s->id; }

struct sim_check_stream **sim_stream_check_state(struct sim_stream *s) {
  return &s->chk;
}

struct sim_capture **sim_stream_capture_slot(struct sim_stream *s) {
  return &s->capture;
}

static int sim_stream_device_of_handle_in(cudaStream_t h) {
  struct sim_slot *slot = sim_stream_slot_of(h);
  if (slot != NULL) {
    if (atomic_load_explicit(&slot->id, memory_order_acquire) == 0) return -1;
    return atomic_load_explicit(&slot->device, memory_order_relaxed);
  }
  if (!sim_stream_is_special(h) || sim_init() != MAGPIE_OK) return -1;
  return sim_tls_device;
}

int sim_stream_device_of_handle(cudaStream_t h) {
  int d = sim_stream_device_of_handle_in(h);
  if (d >= 0 && sim_capture_any() && sim_capture_identity_refused(h, "asked its device")) return -1;
  return d;
}

int sim_stream_create(cudaStream_t *out) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  uint32_t i;
  pthread_mutex_lock(&sim_slot_lock);
  if (sim_slot_free_head != 0) {
    i = sim_slot_free_head - 1;
    sim_slot_free_head = sim_slots[i].next_free;
  } else if (sim_slot_unused < SIM_MAX_HANDLES) {
    i = sim_slot_unused++;
  } else {
    pthread_mutex_unlock(&sim_slot_lock);
    return sim_fail(MAGPIE_ERR_BACKEND, "too many streams (at most %d at once)", SIM_MAX_HANDLES);
  }
  pthread_mutex_unlock(&sim_slot_lock);

  struct sim_slot *slot = &sim_slots[i];
  struct sim_stream *s;
  int device = sim_tls_device;
  rc = sim_stream_new(device, &s);
  if (rc != MAGPIE_OK) {
    /* Back on top of the free list: the LIFO order is as before. */
    pthread_mutex_lock(&sim_slot_lock);
    slot->next_free = sim_slot_free_head;
    sim_slot_free_head = i + 1;
    pthread_mutex_unlock(&sim_slot_lock);
    return rc;
  }
  atomic_store_explicit(&slot->stream, s, memory_order_relaxed);
  atomic_store_explicit(&slot->device, device, memory_order_relaxed);
  atomic_store_explicit(&slot->id, s->id, memory_order_release);
  *out = (cudaStream_t)slot;
  return MAGPIE_OK;
}

int sim_stream_destroy(cudaStream_t h) {
  struct sim_slot *slot = sim_stream_slot_of(h);
  if (slot == NULL) {
    if (sim_stream_is_special(h))
      return sim_fail(MAGPIE_ERR_INVALID_STREAM, "the default and per-thread streams cannot be destroyed");
    return sim_fail(MAGPIE_ERR_INVALID_STREAM, "%p is not a stream of the simulated device", (void *)h);
  }
  if (sim_capture_any()) {
    /* A capturing stream stays (CUDA refuses to destroy it too). Checked
     * before the slot lock, which nests no other lock; a destroy racing
     * with a begin on the same handle is the caller's bug, as in CUDA. */
    struct sim_stream *live;
    if (sim_stream_resolve(h, &live) == MAGPIE_OK) {
      int rc = sim_capture_stream_destroy(h, live);
      if (rc != MAGPIE_OK) return rc;
    }
  }
  pthread_mutex_lock(&sim_slot_lock);
  struct sim_stream *s = NULL;
  if (atomic_load_explicit(&slot->id, memory_order_relaxed) != 0) {
    s = atomic_load_explicit(&slot->stream, memory_order_relaxed);
    atomic_store_explicit(&slot->id, 0, memory_order_relaxed);
    atomic_store_explicit(&slot->stream, NULL, memory_order_relaxed);
    slot->next_free = sim_slot_free_head;
    sim_slot_free_head = (uint32_t)(slot - sim_slots) + 1;
  }
  pthread_mutex_unlock(&sim_slot_lock);
  if (s == NULL) return sim_fail(MAGPIE_ERR_INVALID_STREAM, "stream %p was already destroyed", (void *)h);
  sim_stream_retire(s);
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- work */

static struct sim_node *sim_stream_node_new(enum sim_node_kind kind, void (*fn)(void *), void *arg,
                                            struct sim_cell *c) {
  struct sim_node *n = malloc(sizeof *n);
  if (n == NULL) return NULL;
  atomic_init(&n->next, NULL);
  n->kind = kind;
  n->fn = fn;
  n->arg = arg;
  n->cell = c;
  return n;
}

static int sim_stream_enqueue(struct sim_stream *s, enum sim_node_kind kind, void (*fn)(void *), void *arg,
                              struct sim_cell *c) {
  struct sim_node *n = sim_stream_node_new(kind, fn, arg, c);
  if (n == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a stream's work");
  sim_stream_push(s, n);
  return MAGPIE_OK;
}

int sim_stream_enqueue_marker(struct sim_stream *s, struct sim_cell *c) {
  if (atomic_load_explicit(&s->busy, memory_order_relaxed) == 0) {
    /* Idle, and never ran work: the marker's work, done here (see
     * sim_stream.busy). */
    atomic_thread_fence(memory_order_acquire);
    sim_stream_mark(c);
    return MAGPIE_OK;
  }
  return sim_stream_enqueue(s, SIM_NODE_MARKER, NULL, NULL, c);
}

int sim_stream_enqueue_wait(struct sim_stream *s, struct sim_cell *c) {
  return sim_stream_enqueue(s, SIM_NODE_WAIT, NULL, NULL, c);
}

/* Takes one of s's queue slots for a launch; a full queue blocks the
 * launching thread until the stream ran one. */
static void sim_stream_take_launch_slot(struct sim_stream *s) {
  uint32_t n = atomic_load_explicit(&s->launches, memory_order_relaxed);
  for (;;) {
    if (n >= MAGPIE_SIM_QUEUE_DEPTH) {
      sim_futex_wait(&s->launches, n); /* returns once the count moved */
      n = atomic_load_explicit(&s->launches, memory_order_relaxed);
    } else if (atomic_compare_exchange_weak_explicit(&s->launches, &n, n + 1, memory_order_relaxed,
                                                     memory_order_relaxed)) {
      return;
    }
  }
}

int sim_stream_enqueue_launches(struct sim_stream *s, const struct sim_closure *work, size_t n) {
  /* The nodes, chained through their (still private) next links, all
   * allocated before the first push. */
  struct sim_node *first = NULL, *last = NULL;
  for (size_t i = 0; i < n; i++) {
    struct sim_node *node = sim_stream_node_new(SIM_NODE_CLOSURE, work[i].fn, work[i].arg, NULL);
    if (node == NULL) {
      while (first != NULL) {
        struct sim_node *after = atomic_load_explicit(&first->next, memory_order_relaxed);
        free(first);
        first = after;
      }
      return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a stream's work");
    }
    if (last != NULL) atomic_store_explicit(&last->next, node, memory_order_relaxed); /* still private */
    else first = node;
    last = node;
  }
  for (struct sim_node *node = first; node != NULL;) {
    /* Read before the push, which resets the link and hands the node over. */
    struct sim_node *after = atomic_load_explicit(&node->next, memory_order_relaxed);
    sim_check_launch(s);
    sim_stream_take_launch_slot(s);
    sim_stream_push(s, node);
    node = after;
  }
  return MAGPIE_OK;
}

int sim_stream_launch(cudaStream_t h, void (*fn)(void *), void *arg) {
  if (fn == NULL) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no function to launch");
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  struct sim_closure work = {fn, arg};
  if (sim_capture_any()) {
    int taken;
    rc = sim_capture_enqueue(h, s, &work, 1, &taken);
    if (rc != MAGPIE_OK || taken) return rc;
  }
  return sim_stream_enqueue_launches(s, &work, 1);
}

int sim_stream_wait(cudaStream_t waiter, cudaStream_t waited) {
  struct sim_stream *a, *b;
  int rc = sim_stream_resolve(waiter, &a);
  if (rc == MAGPIE_OK) rc = sim_stream_resolve(waited, &b);
  if (rc == MAGPIE_OK && sim_capture_any()) rc = sim_capture_stream_wait(waiter, a, waited, b);
  if (rc != MAGPIE_OK) return rc;
  if (a == b) return MAGPIE_OK; /* a stream is already ordered with itself */
  struct sim_cell *c = sim_event_cell_new(2);
  if (c == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a stream wait");
  /* Both nodes exist before either is pushed: a failure leaves no half wait. */
  struct sim_node *marker = sim_stream_node_new(SIM_NODE_MARKER, NULL, NULL, c);
  struct sim_node *wait = sim_stream_node_new(SIM_NODE_WAIT, NULL, NULL, c);
  if (marker == NULL || wait == NULL) {
    free(marker);
    free(wait);
    sim_event_cell_unref(c);
    sim_event_cell_unref(c);
    return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a stream wait");
  }
  sim_check_join_stream(a, b);
  sim_stream_push(b, marker);
  sim_stream_push(a, wait);
  return MAGPIE_OK;
}

int sim_stream_synchronize(cudaStream_t h) {
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc == MAGPIE_OK && sim_capture_any()) rc = sim_capture_stream_synchronize(h, s);
  if (rc == MAGPIE_OK && sim_capture_any()) rc = sim_capture_unsafe_call("synchronising a stream");
  if (rc != MAGPIE_OK) return rc;
  struct sim_cell *c = sim_event_cell_new(2);
  if (c == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a synchronize");
  struct sim_vc *vc = sim_check_mark(s);
  rc = sim_stream_enqueue_marker(s, c);
  if (rc != MAGPIE_OK) {
    sim_vc_free(vc);
    sim_event_cell_unref(c);
    sim_event_cell_unref(c);
    return rc;
  }
  sim_event_cell_wait(c);
  sim_event_cell_unref(c);
  sim_check_observe(vc);
  sim_vc_free(vc);
  return MAGPIE_OK;
}

int sim_stream_device_synchronize(int device) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  if (device < 0 || device >= sim_ndevices)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d does not exist (%d simulated)", device, sim_ndevices);
  if (sim_capture_any()) {
    rc = sim_capture_device_synchronize(device);
    if (rc != MAGPIE_OK) return rc;
  }
  struct sim_device *d = &sim_devices[device];
  /* The checker's clocks as of now: what the markers below will cover. */
  struct sim_vc *vc = sim_check_device_snapshot(device);
  uint32_t high = atomic_load_explicit(&d->reg_high, memory_order_relaxed);
  struct sim_cell **cells = NULL;
  size_t ncells = 0, cap = 0;
  for (uint32_t i = 0; i < high && rc == MAGPIE_OK; i++) {
    struct sim_reg_entry *e = &d->reg[i];
    atomic_fetch_add_explicit(&e->pins, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    struct sim_stream *s = atomic_load_explicit(&e->stream, memory_order_seq_cst);
    if (s != NULL && s != SIM_REG_CLAIMED) {
      if (ncells == cap) {
        size_t ncap = cap ? 2 * cap : 16;
        struct sim_cell **grown = realloc(cells, ncap * sizeof *cells);
        if (grown == NULL) {
          rc = sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a device synchronize");
        } else {
          cells = grown;
          cap = ncap;
        }
      }
      struct sim_cell *c = rc == MAGPIE_OK ? sim_event_cell_new(2) : NULL;
      if (rc == MAGPIE_OK && c == NULL)
        rc = sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a device synchronize");
      if (c != NULL) {
        rc = sim_stream_enqueue_marker(s, c);
        if (rc == MAGPIE_OK) {
          cells[ncells++] = c;
        } else {
          sim_event_cell_unref(c);
          sim_event_cell_unref(c);
        }
      }
    }
    atomic_fetch_sub_explicit(&e->pins, 1, memory_order_release);
  }
  /* Even after a failure, wait for what was enqueued: nothing half done. */
  for (size_t k = 0; k < ncells; k++) {
    sim_event_cell_wait(cells[k]);
    sim_event_cell_unref(cells[k]);
  }
  free(cells);
  /* Destroyed streams whose workers already finished: their work is done,
   * and this acquire orders it before the caller (see sim_device.retired). */
  (void)atomic_load_explicit(&d->retired, memory_order_seq_cst);
  if (rc == MAGPIE_OK) sim_check_observe(vc);
  sim_vc_free(vc);
  return rc;
}

/* ---------------------------------------------------------------- public API */

MAGPIE_API int magpie_sim_device_count(void) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) {
    sim_public_result("magpie_sim_device_count", rc);
    return 0;
  }
  return sim_ndevices;
}

MAGPIE_API int magpie_sim_set_device(int device) {
  return sim_public_result("magpie_sim_set_device", sim_set_current_device(device));
}

MAGPIE_API int magpie_sim_get_device(void) { return sim_tls_device; }

MAGPIE_API cudaStream_t magpie_sim_stream_create(void) {
  cudaStream_t h = NULL;
  if (sim_public_result("magpie_sim_stream_create", sim_stream_create(&h)) != MAGPIE_OK) return NULL;
  return h;
}

MAGPIE_API int magpie_sim_stream_destroy(cudaStream_t s) {
  return sim_public_result("magpie_sim_stream_destroy", sim_stream_destroy(s));
}

MAGPIE_API int magpie_sim_launch(cudaStream_t s, void (*fn)(void *), void *arg) {
  return sim_public_result("magpie_sim_launch", sim_stream_launch(s, fn, arg));
}

MAGPIE_API int magpie_sim_stream_wait(cudaStream_t waiter, cudaStream_t waited) {
  return sim_public_result("magpie_sim_stream_wait", sim_stream_wait(waiter, waited));
}

MAGPIE_API int magpie_sim_stream_synchronize(cudaStream_t s) {
  return sim_public_result("magpie_sim_stream_synchronize", sim_stream_synchronize(s));
}

MAGPIE_API int magpie_sim_device_synchronize(void) {
  return sim_public_result("magpie_sim_device_synchronize", sim_stream_device_synchronize(sim_tls_device));
}

/* Why a stream's identity query failed: its capture (CUDA refuses a
 * capturing stream's id and device; the refusal set the detail) or an
 * invalid handle. */
static int sim_stream_identity_code(cudaStream_t s) {
  int st = MAGPIE_SIM_CAPTURE_NONE;
  uint64_t cid;
  if (sim_capture_any() && sim_capture_info(s, &st, &cid) == MAGPIE_OK && st != MAGPIE_SIM_CAPTURE_NONE)
    return MAGPIE_ERR_CAPTURE;
  return MAGPIE_ERR_INVALID_STREAM;
}

MAGPIE_API uint64_t magpie_sim_stream_id(cudaStream_t s) {
  uint64_t id = sim_stream_id(s);
  if (id == 0) {
    int rc = sim_stream_identity_code(s);
    if (rc != MAGPIE_ERR_INVALID_STREAM) {
      /* the refusal's detail stands */
    } else if (sim_stream_slot_of(s) != NULL) {
      sim_fail(rc, "stream %p was destroyed", (void *)s);
    } else if (!sim_stream_is_special(s)) {
      sim_fail(rc, "%p is not a stream of the simulated device", (void *)s);
    }
    sim_public_result("magpie_sim_stream_id", rc);
  }
  return id;
}

MAGPIE_API int magpie_sim_stream_device(cudaStream_t s) {
  int device = sim_stream_device_of_handle(s);
  if (device < 0) {
    int rc = sim_stream_identity_code(s);
    if (rc == MAGPIE_ERR_INVALID_STREAM) sim_fail(rc, "stream %p is not valid", (void *)s);
    sim_public_result("magpie_sim_stream_device", rc);
  }
  return device;
}
