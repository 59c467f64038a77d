/* Stream capture (CUDA graphs) of the simulated device: the captures under
 * way, the graphs their ends return and their launches, the calling
 * threads' capture modes and the count of forbidden calls. The rules are
 * those of include/magpie_sim.h.
 *
 * Everything here is host-side. A capture records closures instead of
 * enqueueing them, and a graph launch enqueues its closures as ordinary
 * launches (sim_stream_enqueue_launches). Workers never read a capture or a
 * graph, so capturing adds no happens-before edge between a stream's work
 * and anything else (the rule of sim_internal.h): each closure of a replay
 * gets exactly the one host -> worker edge of a launch, from the thread
 * that launched the graph.
 *
 * sim_capture_lock guards the list of captures under way, every capture
 * record and every stream's capture slot. The enqueue paths take it only
 * while a capture is under way somewhere (sim_capture_live != 0), so a
 * process that never captures pays one relaxed load per enqueue. While
 * captures run, host threads that enqueue become ordered with each other
 * through it, as through the CUDA driver's own locks (magpie_sim.h allows
 * this); a worker never takes it.
 *
 * Lock order: sim_capture_lock is a leaf: taken under an event's lock
 * (sim_event.c) or alone; nothing is locked under it, and nothing is called
 * under it but sim_fail, the C library and sim_stream_device.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/backend.h"
#include "sim/sim_internal.h"

/* A thread that never chose a mode is in the global mode, as in CUDA: the
 * zero of its thread-local mode must mean it. */
_Static_assert(MAGPIE_SIM_CAPTURE_GLOBAL == 0, "the default capture mode is the zero value");

#define SIM_CAPTURE_REASON_LEN 256

/* One capture under way on one stream.
 * INVARIANT: a record is on the sim_captures list iff exactly one stream's
 * capture slot points to it, and sim_capture_live is the list's length.
 * nodes[0..len) are the closures recorded so far, in capture order, len <=
 * cap. invalidated != 0 iff reason holds the first violation's message; an
 * invalidated capture records nothing more.
 * id, mode, device and thread are set before the record is published and
 * never change; every field is read and written under sim_capture_lock,
 * and the record is freed by the thread that unlinked it under the lock. */
struct sim_capture {
  uint64_t id;     /* unique in the process (sim_capture_next_id) */
  int mode;        /* MAGPIE_SIM_CAPTURE_*, as given to begin */
  int device;      /* the capturing stream's */
  uint64_t thread; /* sim_capture_thread_id() of the thread that began it */
  int invalidated;
  char reason[SIM_CAPTURE_REASON_LEN];
  struct sim_closure *nodes;
  size_t len, cap;
  struct sim_capture *next; /* the list of captures under way */
};

/* A graph: what one capture recorded.
 * INVARIANT: immutable from the end of its capture to its destroy;
 * nodes[0..len) are the capture's closures in order (nodes is NULL when
 * len is 0). No worker reads it (a launch copies the closures into the
 * stream's queue), so destroy frees it at once even with replays pending.
 * Threads that launch it get it from the ending thread through their own
 * synchronisation, which also orders the contents before them. */
struct magpie_sim_graph_st {
  int device;
  size_t len;
  struct sim_closure *nodes;
};

static pthread_mutex_t sim_capture_lock = PTHREAD_MUTEX_INITIALIZER;
/* The captures under way, newest first: under sim_capture_lock. */
static struct sim_capture *sim_captures;

/* See sim_internal.h: changed (relaxed RMW) under sim_capture_lock only. */
_Atomic uint32_t sim_capture_live;

/* Capture ids and thread identities: fetch_add (relaxed) by begin and by a
 * thread's first capture-related call; only uniqueness matters. Thread
 * identities are never reused, unlike the pthread_t of an exited thread. */
static _Atomic uint64_t sim_capture_next_id;
static _Atomic uint64_t sim_capture_next_thread;

/* Forbidden calls refused so far: incremented (relaxed) by the refusing
 * thread, read (relaxed) by magpie_sim_capture_violations: a count that
 * orders nothing. */
static _Atomic uint64_t sim_capture_violation_count;

/* The calling thread's capture mode (MAGPIE_SIM_CAPTURE_*) and identity
 * (0: not assigned yet); each thread reads and writes its own only. */
static _Thread_local int sim_tls_capture_mode;
static _Thread_local uint64_t sim_tls_capture_thread;

static uint64_t sim_capture_thread_id(void) {
  if (sim_tls_capture_thread == 0)
    sim_tls_capture_thread = atomic_fetch_add_explicit(&sim_capture_next_thread, 1, memory_order_relaxed) + 1;
  return sim_tls_capture_thread;
}

static const char *sim_capture_mode_name(int mode) {
  switch (mode) {
  case MAGPIE_SIM_CAPTURE_GLOBAL: return "global";
  case MAGPIE_SIM_CAPTURE_THREAD_LOCAL: return "thread-local";
  case MAGPIE_SIM_CAPTURE_RELAXED: return "relaxed";
  }
  return "unknown";
}

static int sim_capture_mode_valid(int mode) {
  return mode == MAGPIE_SIM_CAPTURE_GLOBAL || mode == MAGPIE_SIM_CAPTURE_THREAD_LOCAL ||
         mode == MAGPIE_SIM_CAPTURE_RELAXED;
}

/* ---------------------------------------------------------------- records (all under the lock) */

static void sim_capture_link(struct sim_capture *c) {
  c->next = sim_captures;
  sim_captures = c;
  atomic_fetch_add_explicit(&sim_capture_live, 1, memory_order_relaxed);
}

static void sim_capture_unlink(struct sim_capture *c) {
  for (struct sim_capture **p = &sim_captures; *p != NULL; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      atomic_fetch_sub_explicit(&sim_capture_live, 1, memory_order_relaxed);
      return;
    }
}

/* The capture under way with that id, or NULL (it ended, or never was). */
static struct sim_capture *sim_capture_find(uint64_t id) {
  for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
    if (c->id == id) return c;
  return NULL;
}

/* The first reason is kept: it names the call that broke the capture. */
static void sim_capture_invalidate(struct sim_capture *c, const char *reason) {
  if (c == NULL || c->invalidated) return;
  c->invalidated = 1;
  snprintf(c->reason, sizeof c->reason, "%s", reason);
}

/* A forbidden call: counted and refused with msg (the caller invalidated
 * the captures concerned). */
static int sim_capture_violation(const char *msg) {
  atomic_fetch_add_explicit(&sim_capture_violation_count, 1, memory_order_relaxed);
  return sim_fail(MAGPIE_ERR_CAPTURE, "%s", msg);
}

/* Work on a stream whose capture is already invalidated: refused, as CUDA
 * refuses it (cudaErrorStreamCaptureInvalidated), but not a new violation. */
static int sim_capture_refuse_invalidated(cudaStream_t h, const struct sim_capture *c) {
  return sim_fail(MAGPIE_ERR_CAPTURE, "stream %p: capture %llu was invalidated (%s); end it", (void *)h,
                  (unsigned long long)c->id, c->reason);
}

/* The legacy-stream rule: h names the default stream of device (0 or 1)
 * and is used for `what` while global-mode captures run on that device:
 * those captures are invalidated and the call refused. */
static int sim_capture_legacy(cudaStream_t h, int device, const char *what) {
  if (!sim_stream_is_legacy(h)) return MAGPIE_OK;
  int n = 0;
  for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
    if (c->mode == MAGPIE_SIM_CAPTURE_GLOBAL && c->device == device) n++;
  if (n == 0) return MAGPIE_OK;
  char msg[SIM_CAPTURE_REASON_LEN];
  snprintf(msg, sizeof msg,
           "the default stream (%p) of device %d cannot be %s while a global-mode capture runs on that device "
           "(CUDA's legacy stream would join it; %d capture(s) invalidated)",
           (void *)h, device, what, n);
  for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
    if (c->mode == MAGPIE_SIM_CAPTURE_GLOBAL && c->device == device) sim_capture_invalidate(c, msg);
  return sim_capture_violation(msg);
}

static int sim_capture_append(struct sim_capture *c, const struct sim_closure *work, size_t n) {
  if (n == 0) return MAGPIE_OK;
  if (n > c->cap - c->len) {
    size_t max = SIZE_MAX / sizeof *c->nodes;
    if (n > max - c->len) return sim_fail(MAGPIE_ERR_BACKEND, "a capture of too many launches");
    size_t need = c->len + n, ncap = c->cap ? c->cap : 16;
    while (ncap < need) ncap = ncap > max / 2 ? max : 2 * ncap;
    struct sim_closure *grown = realloc(c->nodes, ncap * sizeof *grown);
    if (grown == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a capture's launches");
    c->nodes = grown;
    c->cap = ncap;
  }
  memcpy(c->nodes + c->len, work, n * sizeof *work);
  c->len += n;
  return MAGPIE_OK;
}

static void sim_capture_free(struct sim_capture *c) {
  free(c->nodes);
  free(c);
}

/* ---------------------------------------------------------------- hooks of the other files */

int sim_capture_enqueue(cudaStream_t h, struct sim_stream *s, const struct sim_closure *work, size_t n, int *taken) {
  *taken = 0;
  pthread_mutex_lock(&sim_capture_lock);
  int rc = sim_capture_legacy(h, sim_stream_device(s), "launched on");
  struct sim_capture *c = *sim_stream_capture_slot(s);
  if (rc == MAGPIE_OK && c != NULL) {
    rc = c->invalidated ? sim_capture_refuse_invalidated(h, c) : sim_capture_append(c, work, n);
    *taken = rc == MAGPIE_OK;
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_adopt(struct sim_stream *s, const struct sim_closure *work) {
  pthread_mutex_lock(&sim_capture_lock);
  struct sim_capture *c = *sim_stream_capture_slot(s);
  int taken = 0;
  if (c != NULL) taken = !c->invalidated && sim_capture_append(c, work, 1) == MAGPIE_OK ? 1 : -1;
  pthread_mutex_unlock(&sim_capture_lock);
  return taken;
}

int sim_capture_record(cudaStream_t h, struct sim_stream *s, uint64_t *capture_id) {
  *capture_id = 0;
  pthread_mutex_lock(&sim_capture_lock);
  int rc = sim_capture_legacy(h, sim_stream_device(s), "recorded on");
  struct sim_capture *c = *sim_stream_capture_slot(s);
  if (rc == MAGPIE_OK && c != NULL) {
    if (c->invalidated) rc = sim_capture_refuse_invalidated(h, c);
    else *capture_id = c->id;
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_stream_wait(cudaStream_t ha, struct sim_stream *a, cudaStream_t hb, struct sim_stream *b) {
  pthread_mutex_lock(&sim_capture_lock);
  int rc = sim_capture_legacy(ha, sim_stream_device(a), "made to wait");
  if (rc == MAGPIE_OK) rc = sim_capture_legacy(hb, sim_stream_device(b), "waited on");
  struct sim_capture *ca = *sim_stream_capture_slot(a), *cb = *sim_stream_capture_slot(b);
  if (rc == MAGPIE_OK && ca != NULL && ca->invalidated) {
    rc = sim_capture_refuse_invalidated(ha, ca);
  } else if (rc == MAGPIE_OK && a != b && (ca != NULL || cb != NULL)) {
    /* A stream waiting on itself is ordered already; any other wait
     * crosses a capture's boundary. */
    char msg[SIM_CAPTURE_REASON_LEN];
    if (ca != NULL)
      snprintf(msg, sizeof msg,
               "stream %p is capturing a graph (capture %llu): it cannot wait on another stream (%p): the "
               "simulator captures one stream (the capture is invalidated)",
               (void *)ha, (unsigned long long)ca->id, (void *)hb);
    else
      snprintf(msg, sizeof msg,
               "stream %p cannot wait on stream %p, which is capturing a graph (capture %llu): that would join it "
               "into the capture (the capture is invalidated)",
               (void *)ha, (void *)hb, (unsigned long long)cb->id);
    sim_capture_invalidate(ca, msg);
    sim_capture_invalidate(cb, msg);
    rc = sim_capture_violation(msg);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_event_wait(cudaStream_t h, struct sim_stream *s, magpie_sim_event e, uint64_t event_capture,
                           int recorded, int *skip) {
  *skip = 0;
  pthread_mutex_lock(&sim_capture_lock);
  int rc = sim_capture_legacy(h, sim_stream_device(s), "made to wait");
  struct sim_capture *c = *sim_stream_capture_slot(s);
  char msg[SIM_CAPTURE_REASON_LEN];
  if (rc != MAGPIE_OK) {
    /* refused above */
  } else if (c != NULL && c->invalidated) {
    rc = sim_capture_refuse_invalidated(h, c);
  } else if (c != NULL && event_capture == c->id) {
    *skip = 1; /* a point of the same capture: already ordered, one stream */
  } else if (c != NULL && event_capture != 0) {
    struct sim_capture *other = sim_capture_find(event_capture);
    snprintf(msg, sizeof msg,
             "stream %p is capturing a graph (capture %llu): it cannot wait on event %p, recorded in capture %llu: "
             "captures cannot be joined (both are invalidated)",
             (void *)h, (unsigned long long)c->id, (void *)e, (unsigned long long)event_capture);
    sim_capture_invalidate(c, msg);
    sim_capture_invalidate(other, msg);
    rc = sim_capture_violation(msg);
  } else if (c != NULL && recorded) {
    snprintf(msg, sizeof msg,
             "stream %p is capturing a graph (capture %llu): it cannot wait on event %p, recorded outside the "
             "capture (the capture is invalidated)",
             (void *)h, (unsigned long long)c->id, (void *)e);
    sim_capture_invalidate(c, msg);
    rc = sim_capture_violation(msg);
  } else if (c != NULL) {
    *skip = 1; /* never recorded: a no-op, as outside a capture */
  } else if (event_capture != 0) {
    struct sim_capture *other = sim_capture_find(event_capture);
    snprintf(msg, sizeof msg, "stream %p cannot wait on event %p, recorded in capture %llu (%s)", (void *)h, (void *)e,
             (unsigned long long)event_capture,
             other != NULL ? "that would join it into the capture, which is invalidated"
                           : "which has ended: record the event outside a capture first");
    sim_capture_invalidate(other, msg);
    rc = sim_capture_violation(msg);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_event_refuse(magpie_sim_event e, uint64_t event_capture, const char *what) {
  pthread_mutex_lock(&sim_capture_lock);
  struct sim_capture *c = sim_capture_find(event_capture);
  char msg[SIM_CAPTURE_REASON_LEN];
  snprintf(
      msg, sizeof msg, "event %p was recorded in capture %llu: it cannot be %s (%s)", (void *)e,
      (unsigned long long)event_capture, what,
      c != NULL ? "the capture is invalidated" : "the capture has ended: record the event outside a capture first");
  sim_capture_invalidate(c, msg);
  int rc = sim_capture_violation(msg);
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_stream_synchronize(cudaStream_t h, struct sim_stream *s) {
  pthread_mutex_lock(&sim_capture_lock);
  int rc = sim_capture_legacy(h, sim_stream_device(s), "synchronised");
  struct sim_capture *c = *sim_stream_capture_slot(s);
  if (rc == MAGPIE_OK && c != NULL) {
    char msg[SIM_CAPTURE_REASON_LEN];
    snprintf(msg, sizeof msg,
             "stream %p is capturing a graph (capture %llu): it cannot be synchronised (the capture is invalidated)",
             (void *)h, (unsigned long long)c->id);
    sim_capture_invalidate(c, msg);
    rc = sim_capture_violation(msg);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_device_synchronize(int device) {
  pthread_mutex_lock(&sim_capture_lock);
  int n = 0, rc = MAGPIE_OK;
  for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
    if (c->device == device) n++;
  if (n != 0) {
    char msg[SIM_CAPTURE_REASON_LEN];
    snprintf(msg, sizeof msg,
             "device %d cannot be synchronised while %d of its streams capture a graph (the captures are "
             "invalidated)",
             device, n);
    for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
      if (c->device == device) sim_capture_invalidate(c, msg);
    rc = sim_capture_violation(msg);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_stream_destroy(cudaStream_t h, struct sim_stream *s) {
  pthread_mutex_lock(&sim_capture_lock);
  int rc = MAGPIE_OK;
  struct sim_capture *c = *sim_stream_capture_slot(s);
  if (c != NULL) {
    char msg[SIM_CAPTURE_REASON_LEN];
    snprintf(msg, sizeof msg,
             "stream %p is capturing a graph (capture %llu): it cannot be destroyed (the capture is invalidated; "
             "end it first)",
             (void *)h, (unsigned long long)c->id);
    sim_capture_invalidate(c, msg);
    rc = sim_capture_violation(msg);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

/* Takes s's capture (if any) out of the list and off the stream. */
static struct sim_capture *sim_capture_detach(struct sim_stream *s) {
  pthread_mutex_lock(&sim_capture_lock);
  struct sim_capture **slot = sim_stream_capture_slot(s);
  struct sim_capture *c = *slot;
  if (c != NULL) {
    sim_capture_unlink(c);
    *slot = NULL;
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return c;
}

void sim_capture_stream_retire(struct sim_stream *s) {
  struct sim_capture *c = sim_capture_detach(s);
  if (c != NULL) sim_capture_free(c);
}

/* Whether capture c prohibits a potentially unsafe call of the thread `me`
 * in capture mode `mode` (not relaxed): its own captures unless begun
 * relaxed; another thread's global-mode captures when `mode` is global. */
static int sim_capture_prohibits(const struct sim_capture *c, int mode, uint64_t me) {
  if (c->thread == me) return c->mode != MAGPIE_SIM_CAPTURE_RELAXED;
  return mode == MAGPIE_SIM_CAPTURE_GLOBAL && c->mode == MAGPIE_SIM_CAPTURE_GLOBAL;
}

int sim_capture_unsafe_call(const char *what) {
  int mode = sim_tls_capture_mode;
  if (mode == MAGPIE_SIM_CAPTURE_RELAXED || !sim_capture_any()) return MAGPIE_OK;
  uint64_t me = sim_capture_thread_id();
  pthread_mutex_lock(&sim_capture_lock);
  int n = 0, rc = MAGPIE_OK;
  struct sim_capture *first = NULL;
  for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
    if (sim_capture_prohibits(c, mode, me)) {
      if (first == NULL) first = c;
      n++;
    }
  if (n != 0) {
    char msg[SIM_CAPTURE_REASON_LEN];
    snprintf(msg, sizeof msg,
             "%s is not permitted to a thread in the %s capture mode while capture %llu (%s mode, begun by %s "
             "thread) is under way (%d capture(s) invalidated; the relaxed mode permits it)",
             what, sim_capture_mode_name(mode), (unsigned long long)first->id, sim_capture_mode_name(first->mode),
             first->thread == me ? "this" : "another", n);
    for (struct sim_capture *c = sim_captures; c != NULL; c = c->next)
      if (sim_capture_prohibits(c, mode, me)) sim_capture_invalidate(c, msg);
    rc = sim_capture_violation(msg);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return rc;
}

int sim_capture_identity_refused(cudaStream_t h, const char *what) {
  struct sim_stream *s;
  if (sim_stream_resolve(h, &s) != MAGPIE_OK) return 0; /* the caller reports an invalid handle */
  pthread_mutex_lock(&sim_capture_lock);
  struct sim_capture *c = *sim_stream_capture_slot(s);
  int refused = c != NULL;
  if (refused) {
    char msg[SIM_CAPTURE_REASON_LEN];
    snprintf(msg, sizeof msg,
             "stream %p is capturing a graph (capture %llu): it cannot be %s, as CUDA refuses a capturing stream's "
             "id, device and flags (the capture is invalidated)",
             (void *)h, (unsigned long long)c->id, what);
    if (c->invalidated) {
      sim_capture_refuse_invalidated(h, c);
    } else {
      sim_capture_invalidate(c, msg);
      sim_capture_violation(msg);
    }
  }
  pthread_mutex_unlock(&sim_capture_lock);
  return refused;
}

int sim_capture_exchange_mode(int mode) {
  int old = sim_tls_capture_mode;
  sim_tls_capture_mode = mode;
  return old;
}

int sim_capture_info(cudaStream_t h, int *status, uint64_t *id) {
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  int state = MAGPIE_SIM_CAPTURE_NONE;
  uint64_t capture = 0;
  if (sim_capture_any()) {
    pthread_mutex_lock(&sim_capture_lock);
    struct sim_capture *c = *sim_stream_capture_slot(s);
    if (c != NULL) {
      state = c->invalidated ? MAGPIE_SIM_CAPTURE_INVALIDATED : MAGPIE_SIM_CAPTURE_ACTIVE;
      capture = c->id;
    }
    pthread_mutex_unlock(&sim_capture_lock);
  }
  if (status != NULL) *status = state;
  if (id != NULL) *id = capture;
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- captures and graphs */

static int sim_capture_begin(cudaStream_t h, int mode) {
  if (!sim_capture_mode_valid(mode))
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "capture mode %d is not a MAGPIE_SIM_CAPTURE_* mode", mode);
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  if (sim_stream_is_legacy(h))
    return sim_fail(MAGPIE_ERR_CAPTURE,
                    "the default stream (%p) cannot be captured, as CUDA's legacy stream cannot: capture a created "
                    "stream or the per-thread stream",
                    (void *)h);
  struct sim_stream *s;
  rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  struct sim_capture *c = calloc(1, sizeof *c);
  if (c == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a capture");
  c->id = atomic_fetch_add_explicit(&sim_capture_next_id, 1, memory_order_relaxed) + 1;
  c->mode = mode;
  c->device = sim_stream_device(s);
  c->thread = sim_capture_thread_id();
  pthread_mutex_lock(&sim_capture_lock);
  struct sim_capture **slot = sim_stream_capture_slot(s);
  struct sim_capture *busy = *slot;
  uint64_t busy_id = busy != NULL ? busy->id : 0;
  if (busy == NULL) {
    *slot = c;
    sim_capture_link(c);
  }
  pthread_mutex_unlock(&sim_capture_lock);
  if (busy != NULL) {
    sim_capture_free(c);
    return sim_fail(MAGPIE_ERR_CAPTURE, "stream %p is already capturing a graph (capture %llu)", (void *)h,
                    (unsigned long long)busy_id);
  }
  return MAGPIE_OK;
}

static int sim_capture_end(cudaStream_t h, magpie_sim_graph *graph) {
  if (graph == NULL) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no place for the graph (NULL)");
  *graph = NULL;
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  /* Allocated first: once the capture is unlinked, the end cannot fail for
   * want of memory and leave the stream half out of capture mode. */
  struct magpie_sim_graph_st *g = malloc(sizeof *g);
  if (g == NULL) return sim_fail(MAGPIE_ERR_BACKEND, "out of host memory for a graph");
  struct sim_capture *c = sim_capture_detach(s);
  if (c == NULL) {
    free(g);
    return sim_fail(MAGPIE_ERR_CAPTURE, "stream %p is not capturing a graph", (void *)h);
  }
  if (c->invalidated) {
    rc = sim_fail(MAGPIE_ERR_CAPTURE, "capture %llu on stream %p was invalidated: %s", (unsigned long long)c->id,
                  (void *)h, c->reason);
    free(g);
    sim_capture_free(c);
    return rc;
  }
  g->device = c->device;
  g->len = c->len;
  g->nodes = c->nodes; /* the graph takes the recorded closures over */
  free(c);
  *graph = g;
  return MAGPIE_OK;
}

static int sim_graph_launch(magpie_sim_graph g, cudaStream_t h) {
  if (g == NULL) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no graph (NULL)");
  struct sim_stream *s;
  int rc = sim_stream_resolve(h, &s);
  if (rc != MAGPIE_OK) return rc;
  if (sim_stream_device(s) != g->device)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "graph of device %d launched on a stream of device %d", g->device,
                    sim_stream_device(s));
  if (sim_capture_any()) {
    /* Onto a capturing stream: its closures join that capture, as CUDA
     * would add the graph as a child node. */
    int taken;
    rc = sim_capture_enqueue(h, s, g->nodes, g->len, &taken);
    if (rc != MAGPIE_OK || taken) return rc;
  }
  return sim_stream_enqueue_launches(s, g->nodes, g->len);
}

static int sim_graph_destroy(magpie_sim_graph g) {
  if (g == NULL) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no graph (NULL)");
  free(g->nodes);
  free(g);
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- public API */

MAGPIE_API int magpie_sim_stream_begin_capture(cudaStream_t s, int mode) {
  return sim_public_result("magpie_sim_stream_begin_capture", sim_capture_begin(s, mode));
}

MAGPIE_API int magpie_sim_stream_end_capture(cudaStream_t s, magpie_sim_graph *graph) {
  return sim_public_result("magpie_sim_stream_end_capture", sim_capture_end(s, graph));
}

MAGPIE_API int magpie_sim_stream_capture_info(cudaStream_t s, int *status, uint64_t *id) {
  return sim_public_result("magpie_sim_stream_capture_info", sim_capture_info(s, status, id));
}

MAGPIE_API int magpie_sim_thread_exchange_capture_mode(int *mode) {
  int rc = MAGPIE_OK;
  if (mode == NULL) rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no mode (NULL)");
  else if (!sim_capture_mode_valid(*mode))
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "capture mode %d is not a MAGPIE_SIM_CAPTURE_* mode", *mode);
  else *mode = sim_capture_exchange_mode(*mode);
  return sim_public_result("magpie_sim_thread_exchange_capture_mode", rc);
}

MAGPIE_API int magpie_sim_graph_launch(magpie_sim_graph g, cudaStream_t s) {
  return sim_public_result("magpie_sim_graph_launch", sim_graph_launch(g, s));
}

MAGPIE_API int magpie_sim_graph_destroy(magpie_sim_graph g) {
  return sim_public_result("magpie_sim_graph_destroy", sim_graph_destroy(g));
}

MAGPIE_API uint64_t magpie_sim_capture_violations(void) {
  return atomic_load_explicit(&sim_capture_violation_count, memory_order_relaxed);
}
