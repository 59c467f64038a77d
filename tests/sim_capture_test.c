/* Stream capture on the simulated device (magpie_sim.h, "Stream capture"):
 * capturing launches and replaying the graph, the capture states and ids,
 * every call CUDA forbids during a capture (refused, counted, the capture
 * invalidated), a capturing stream's id and device (refused in every mode),
 * the per-thread capture modes for the potentially unsafe calls (memory
 * calls, event queries and synchronisations, stream synchronisations), the
 * default stream's rules, events recorded in a capture, graphs destroyed
 * with replays pending, the device table's relaxed memory and event calls,
 * its identity calls and its stream_capture, and the stream-order checker's
 * view of replays.
 *
 * Every test ends the captures it begins, so each starts with none under
 * way (checked through sim_capture_any). Counters written by closures are
 * plain memory, read only after an edge from their stream (synchronize).
 * A thread's synchronisations during its own capture (not relaxed) or
 * during another thread's global capture are themselves forbidden: the
 * tests make them from the relaxed mode, or after the captures ended.
 */
#include "sim/sim_check.h"
#include "tests/sim_test_util.h"

static cudaStream_t mk(void) {
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  return s;
}

static void add_one(void *arg) { (*(int *)arg)++; }

/* Set by closures that must not run (yet): atomic, so that reading it
 * while they might run is not itself a race. */
static atomic_int ran_early;

static void note_run(void *arg) {
  (void)arg;
  atomic_store(&ran_early, 1);
}

static void assert_no_capture(void) { assert_false(sim_capture_any()); }

static void assert_state(cudaStream_t s, int want, uint64_t *id) {
  int st = -1;
  uint64_t got = 12345;
  assert_int_equal(magpie_sim_stream_capture_info(s, &st, &got), MAGPIE_OK);
  assert_int_equal(st, want);
  if (want == MAGPIE_SIM_CAPTURE_NONE) assert_true(got == 0);
  else assert_true(got != 0);
  if (id != NULL) *id = got;
}

/* Ends s's capture, which must have been invalidated. */
static void end_invalidated(cudaStream_t s) {
  magpie_sim_graph g = (magpie_sim_graph)(uintptr_t)1;
  assert_int_equal(magpie_sim_stream_end_capture(s, &g), MAGPIE_ERR_CAPTURE);
  assert_null(g);
  assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "invalidated"));
  assert_state(s, MAGPIE_SIM_CAPTURE_NONE, NULL);
}

static magpie_sim_graph end_ok(cudaStream_t s) {
  magpie_sim_graph g = NULL;
  assert_int_equal(magpie_sim_stream_end_capture(s, &g), MAGPIE_OK);
  assert_non_null(g);
  assert_state(s, MAGPIE_SIM_CAPTURE_NONE, NULL);
  return g;
}

/* Sets the calling thread's capture mode; returns the old one. */
static int set_mode(int mode) {
  assert_int_equal(magpie_sim_thread_exchange_capture_mode(&mode), MAGPIE_OK);
  return mode;
}

static const backend_ops *table(void) {
  const backend_ops *ops = magpie_sim_device_table(BACKEND_ABI);
  assert_non_null(ops);
  return ops;
}

/* ---------------------------------------------------------------- capture and replay */

static void test_capture_and_replay(void **state) {
  (void)state;
  enum { LAUNCHES = 3, REPLAYS = 5 };
  static int counter;
  counter = 0;
  atomic_store(&ran_early, 0);
  cudaStream_t a = mk(), b = mk(), c = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(a, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  for (int i = 0; i < LAUNCHES; i++) assert_int_equal(magpie_sim_launch(a, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(a, note_run, NULL), MAGPIE_OK);
  magpie_sim_graph g = end_ok(a);
  /* Nothing ran: the launches were recorded, not enqueued. */
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);
  assert_int_equal(atomic_load(&ran_early), 0);
  assert_int_equal(counter, 0);
  /* Replays on two streams, one after the other (the counter is plain). */
  for (int i = 0; i < REPLAYS; i++) assert_int_equal(magpie_sim_graph_launch(g, b), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(b), MAGPIE_OK);
  assert_int_equal(counter, LAUNCHES * REPLAYS);
  for (int i = 0; i < REPLAYS; i++) assert_int_equal(magpie_sim_graph_launch(g, c), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(c), MAGPIE_OK);
  assert_int_equal(counter, 2 * LAUNCHES * REPLAYS);
  assert_int_equal(atomic_load(&ran_early), 1);
  /* The capturing stream itself works as before. */
  assert_int_equal(magpie_sim_launch(a, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);
  assert_int_equal(counter, 2 * LAUNCHES * REPLAYS + 1);
  assert_int_equal(magpie_sim_graph_destroy(g), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(c);
  assert_no_capture();
}

/* Capture order is replay order; an empty capture gives an empty graph. */
static void test_replay_keeps_capture_order(void **state) {
  (void)state;
  static struct order_log log;
  static struct order_item items[16];
  memset(&log, 0, sizeof log);
  cudaStream_t s = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_RELAXED), MAGPIE_OK);
  for (int i = 0; i < 16; i++) {
    items[i] = (struct order_item){&log, i};
    assert_int_equal(magpie_sim_launch(s, order_append, &items[i]), MAGPIE_OK);
  }
  magpie_sim_graph g = end_ok(s);
  assert_int_equal(magpie_sim_graph_launch(g, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_graph_launch(g, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(log.next, 32);
  for (int i = 0; i < 32; i++) assert_int_equal(log.seen[i], i % 16);
  assert_int_equal(magpie_sim_graph_destroy(g), MAGPIE_OK);

  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  magpie_sim_graph empty = end_ok(s);
  assert_int_equal(magpie_sim_graph_launch(empty, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(magpie_sim_graph_destroy(empty), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* A replay longer than a stream's queue: the launching thread waits for
 * room, as with single launches. */
static void test_replay_longer_than_queue(void **state) {
  (void)state;
  enum { N = MAGPIE_SIM_QUEUE_DEPTH + 500 };
  static int counter;
  counter = 0;
  cudaStream_t s = mk(), r = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  for (int i = 0; i < N; i++) assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  magpie_sim_graph g = end_ok(s);
  assert_int_equal(magpie_sim_graph_launch(g, r), MAGPIE_OK);
  assert_int_equal(magpie_sim_graph_launch(g, r), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(r), MAGPIE_OK);
  assert_int_equal(counter, 2 * N);
  assert_int_equal(magpie_sim_graph_destroy(g), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(r);
}

/* A graph launched onto a capturing stream joins that capture. */
static void test_graph_launched_into_capture(void **state) {
  (void)state;
  static int counter;
  counter = 0;
  cudaStream_t s = mk(), t = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  magpie_sim_graph inner = end_ok(s);
  assert_int_equal(magpie_sim_stream_begin_capture(t, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_graph_launch(inner, t), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(t, add_one, &counter), MAGPIE_OK);
  magpie_sim_graph outer = end_ok(t);
  /* The outer graph holds copies of the closures: the inner may go. */
  assert_int_equal(magpie_sim_graph_destroy(inner), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(t), MAGPIE_OK);
  assert_int_equal(counter, 0);
  assert_int_equal(magpie_sim_graph_launch(outer, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(counter, 3);
  assert_int_equal(magpie_sim_graph_destroy(outer), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(t);
}

static void test_graph_launch_errors(void **state) {
  (void)state;
  static int counter;
  cudaStream_t s = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  magpie_sim_graph g = end_ok(s);
  assert_int_equal(magpie_sim_graph_launch(NULL, s), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_graph_destroy(NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  /* A stream of another device. */
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t other = mk();
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_int_equal(magpie_sim_graph_launch(g, other), MAGPIE_ERR_INVALID_ARGUMENT);
  magpie_sim_stream_destroy(other);
  /* A destroyed stream. */
  cudaStream_t dead = mk();
  magpie_sim_stream_destroy(dead);
  assert_int_equal(magpie_sim_graph_launch(g, dead), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_graph_destroy(g), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
}

/* ---------------------------------------------------------------- states and ids */

static void test_capture_info_states_and_ids(void **state) {
  (void)state;
  cudaStream_t s = mk(), t = mk();
  uint64_t v0 = magpie_sim_capture_violations();
  assert_state(s, MAGPIE_SIM_CAPTURE_NONE, NULL);
  assert_state(NULL, MAGPIE_SIM_CAPTURE_NONE, NULL);
  assert_state(MAGPIE_SIM_STREAM_PER_THREAD, MAGPIE_SIM_CAPTURE_NONE, NULL);
  /* NULL outputs are allowed. */
  assert_int_equal(magpie_sim_stream_capture_info(s, NULL, NULL), MAGPIE_OK);

  uint64_t id1, id2, id3, again;
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &id1);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &again); /* the query changes nothing */
  assert_true(again == id1);
  assert_state(t, MAGPIE_SIM_CAPTURE_NONE, NULL);
  assert_int_equal(magpie_sim_stream_begin_capture(t, MAGPIE_SIM_CAPTURE_RELAXED), MAGPIE_OK);
  assert_state(t, MAGPIE_SIM_CAPTURE_ACTIVE, &id2);
  assert_true(id2 != id1);
  magpie_sim_graph_destroy(end_ok(t));
  magpie_sim_graph_destroy(end_ok(s));
  /* A new capture of the same stream has a new id. */
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_THREAD_LOCAL), MAGPIE_OK);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &id3);
  assert_true(id3 != id1 && id3 != id2);
  /* Invalidated: the state says so, with the same id, until the end. */
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_ERR_CAPTURE);
  assert_state(s, MAGPIE_SIM_CAPTURE_INVALIDATED, &again);
  assert_true(again == id3);
  end_invalidated(s);
  assert_true(magpie_sim_capture_violations() == v0 + 1);
  /* Destroyed streams are invalid handles, as elsewhere. */
  magpie_sim_stream_destroy(t);
  assert_int_equal(magpie_sim_stream_capture_info(t, NULL, NULL), MAGPIE_ERR_INVALID_STREAM);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* Errors of begin and end: refused, not counted, nothing invalidated. */
static void test_begin_and_end_errors(void **state) {
  (void)state;
  cudaStream_t s = mk();
  uint64_t v0 = magpie_sim_capture_violations();
  assert_int_equal(magpie_sim_stream_begin_capture(NULL, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_ERR_CAPTURE);
  assert_int_equal(magpie_sim_stream_begin_capture((cudaStream_t)1, MAGPIE_SIM_CAPTURE_RELAXED), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "default stream"));
  assert_int_equal(magpie_sim_stream_begin_capture(s, 3), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_stream_begin_capture(s, -1), MAGPIE_ERR_INVALID_ARGUMENT);
  magpie_sim_graph g = (magpie_sim_graph)(uintptr_t)1;
  assert_int_equal(magpie_sim_stream_end_capture(s, &g), MAGPIE_ERR_CAPTURE);
  assert_null(g);
  assert_non_null(strstr(magpie_sim_last_error_message(), "not capturing"));
  assert_int_equal(magpie_sim_stream_end_capture(s, NULL), MAGPIE_ERR_INVALID_ARGUMENT);

  uint64_t id, again;
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &id);
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "already capturing"));
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &again);
  assert_true(again == id);
  assert_int_equal(magpie_sim_stream_end_capture(s, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  magpie_sim_graph_destroy(end_ok(s));
  assert_true(magpie_sim_capture_violations() == v0);

  /* Modes: exchange validates and swaps. */
  int mode = 7;
  assert_int_equal(magpie_sim_thread_exchange_capture_mode(&mode), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(mode, 7);
  assert_int_equal(magpie_sim_thread_exchange_capture_mode(NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  mode = MAGPIE_SIM_CAPTURE_THREAD_LOCAL;
  assert_int_equal(magpie_sim_thread_exchange_capture_mode(&mode), MAGPIE_OK);
  assert_int_equal(mode, MAGPIE_SIM_CAPTURE_GLOBAL); /* the default */
  assert_int_equal(magpie_sim_thread_exchange_capture_mode(&mode), MAGPIE_OK);
  assert_int_equal(mode, MAGPIE_SIM_CAPTURE_THREAD_LOCAL);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* The per-thread stream may be captured, and a capture left under way on it
 * when its thread exits is dropped with the stream. */
static int per_thread_counter;

static void *per_thread_capture_main(void *arg) {
  int leave_open = *(int *)arg;
  uint64_t id;
  int rc = magpie_sim_stream_begin_capture(MAGPIE_SIM_STREAM_PER_THREAD, MAGPIE_SIM_CAPTURE_THREAD_LOCAL);
  if (rc != MAGPIE_OK) return (void *)1;
  if (magpie_sim_stream_capture_info(MAGPIE_SIM_STREAM_PER_THREAD, NULL, &id) != MAGPIE_OK || id == 0) return (void *)2;
  if (magpie_sim_launch(MAGPIE_SIM_STREAM_PER_THREAD, add_one, &per_thread_counter) != MAGPIE_OK) return (void *)3;
  if (leave_open) return NULL;
  magpie_sim_graph g = NULL;
  if (magpie_sim_stream_end_capture(MAGPIE_SIM_STREAM_PER_THREAD, &g) != MAGPIE_OK) return (void *)4;
  if (magpie_sim_graph_launch(g, MAGPIE_SIM_STREAM_PER_THREAD) != MAGPIE_OK) return (void *)5;
  if (magpie_sim_stream_synchronize(MAGPIE_SIM_STREAM_PER_THREAD) != MAGPIE_OK) return (void *)6;
  magpie_sim_graph_destroy(g);
  return per_thread_counter == 1 ? NULL : (void *)7;
}

static void test_per_thread_stream_capture(void **state) {
  (void)state;
  per_thread_counter = 0;
  for (int leave_open = 0; leave_open < 2; leave_open++) {
    pthread_t t;
    void *ret = (void *)99;
    assert_int_equal(pthread_create(&t, NULL, per_thread_capture_main, &leave_open), 0);
    assert_int_equal(pthread_join(t, &ret), 0);
    assert_null(ret);
    assert_no_capture();
  }
  assert_int_equal(per_thread_counter, 1); /* the dropped capture never ran */
}

/* ---------------------------------------------------------------- forbidden calls */

/* The set-up of one forbidden call: s captures (global mode) with one
 * launch and an event recorded in it (in_capture); t is another stream with
 * an event recorded on it (outside). */
struct ctx {
  cudaStream_t s, t;
  magpie_sim_event in_capture, outside;
  int counter;
};

static int forbid_stream_sync(struct ctx *c) { return magpie_sim_stream_synchronize(c->s); }
static int forbid_event_query(struct ctx *c) { return magpie_sim_event_query(c->in_capture); }
static int forbid_event_sync(struct ctx *c) { return magpie_sim_event_synchronize(c->in_capture); }
static int forbid_device_sync(struct ctx *c) {
  (void)c;
  return magpie_sim_device_synchronize();
}
static int forbid_destroy(struct ctx *c) { return magpie_sim_stream_destroy(c->s); }
static int forbid_wait_other_stream(struct ctx *c) { return magpie_sim_stream_wait(c->s, c->t); }
static int forbid_join_stream(struct ctx *c) { return magpie_sim_stream_wait(c->t, c->s); }
static int forbid_wait_outside_event(struct ctx *c) { return magpie_sim_stream_wait_event(c->s, c->outside); }
static int forbid_join_event(struct ctx *c) { return magpie_sim_stream_wait_event(c->t, c->in_capture); }
static int forbid_launch_default(struct ctx *c) { return magpie_sim_launch(NULL, add_one, &c->counter); }
static int forbid_launch_legacy(struct ctx *c) { return magpie_sim_launch((cudaStream_t)1, add_one, &c->counter); }
static int forbid_record_default(struct ctx *c) { return magpie_sim_event_record(c->outside, NULL); }
static int forbid_default_waits(struct ctx *c) { return magpie_sim_stream_wait(NULL, c->t); }
static int forbid_wait_on_default(struct ctx *c) { return magpie_sim_stream_wait(c->t, (cudaStream_t)1); }
static int forbid_default_waits_event(struct ctx *c) { return magpie_sim_stream_wait_event(NULL, c->outside); }
static int forbid_sync_default(struct ctx *c) { return magpie_sim_stream_synchronize(NULL); }

static int forbid_graph_on_default(struct ctx *c) {
  /* A graph made before the capture, launched onto the default stream. */
  cudaStream_t u = mk();
  int rc = magpie_sim_stream_begin_capture(u, MAGPIE_SIM_CAPTURE_RELAXED);
  assert_int_equal(rc, MAGPIE_OK);
  magpie_sim_graph g = end_ok(u);
  magpie_sim_stream_destroy(u);
  rc = magpie_sim_graph_launch(g, NULL);
  magpie_sim_graph_destroy(g);
  return rc;
}

static int forbid_map_own_capture(struct ctx *c) {
  (void)c;
  uintptr_t base;
  return sim_memory_reserve(0, 2 * MiB, &base); /* refused: nothing reserved */
}

static int forbid_stream_id(struct ctx *c) {
  uint64_t id = 0;
  return table()->stream_id(c->s, &id);
}
static int forbid_stream_device(struct ctx *c) {
  int device = -1;
  return table()->stream_device(c->s, &device);
}
/* This thread's own global capture prohibits its potentially unsafe calls,
 * whatever the stream or event. */
static int forbid_query_outside(struct ctx *c) { return magpie_sim_event_query(c->outside); }
static int forbid_sync_outside(struct ctx *c) { return magpie_sim_event_synchronize(c->outside); }
static int forbid_sync_other_stream(struct ctx *c) { return magpie_sim_stream_synchronize(c->t); }

static const struct forbidden {
  const char *name;
  int (*call)(struct ctx *);
  const char *says; /* in the refusal's message */
} forbidden[] = {
    {"stream synchronize", forbid_stream_sync, "cannot be synchronised"},
    {"event query", forbid_event_query, "cannot be queried"},
    {"event synchronize", forbid_event_sync, "cannot be synchronised"},
    {"device synchronize", forbid_device_sync, "device 0 cannot be synchronised"},
    {"destroy", forbid_destroy, "cannot be destroyed"},
    {"wait on another stream", forbid_wait_other_stream, "cannot wait on another stream"},
    {"join by a stream wait", forbid_join_stream, "join"},
    {"wait on an event recorded outside", forbid_wait_outside_event, "recorded outside"},
    {"join by an event wait", forbid_join_event, "join"},
    {"launch on 0", forbid_launch_default, "default stream"},
    {"launch on 1", forbid_launch_legacy, "default stream"},
    {"record on 0", forbid_record_default, "default stream"},
    {"0 waits", forbid_default_waits, "default stream"},
    {"wait on 1", forbid_wait_on_default, "default stream"},
    {"0 waits on an event", forbid_default_waits_event, "default stream"},
    {"synchronize 0", forbid_sync_default, "default stream"},
    {"graph launch on 0", forbid_graph_on_default, "default stream"},
    {"memory call in the own capture", forbid_map_own_capture, "reserving device address space"},
    {"id of the capturing stream", forbid_stream_id, "asked its id"},
    {"device of the capturing stream", forbid_stream_device, "asked its device"},
    {"query of an event recorded outside", forbid_query_outside, "querying an event"},
    {"synchronize of an event recorded outside", forbid_sync_outside, "synchronising an event"},
    {"synchronize of another stream", forbid_sync_other_stream, "synchronising a stream"},
};

static void test_forbidden_calls_invalidate(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof forbidden / sizeof forbidden[0]; i++) {
    struct ctx c;
    memset(&c, 0, sizeof c);
    c.s = mk();
    c.t = mk();
    c.in_capture = magpie_sim_event_create();
    c.outside = magpie_sim_event_create();
    assert_int_equal(magpie_sim_event_record(c.outside, c.t), MAGPIE_OK);
    assert_int_equal(magpie_sim_stream_begin_capture(c.s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
    assert_int_equal(magpie_sim_launch(c.s, add_one, &c.counter), MAGPIE_OK);
    assert_int_equal(magpie_sim_event_record(c.in_capture, c.s), MAGPIE_OK);
    uint64_t v0 = magpie_sim_capture_violations();

    int rc = forbidden[i].call(&c);
    if (rc != MAGPIE_ERR_CAPTURE) fail_msg("%s: returned %d, not MAGPIE_ERR_CAPTURE", forbidden[i].name, rc);
    /* The reason, as the failing call left it (the memory call is the
     * simulator's internal one, which keeps no last error). */
    if (strstr(backend_error_detail(), forbidden[i].says) == NULL)
      fail_msg("%s: message \"%s\" does not say \"%s\"", forbidden[i].name, backend_error_detail(), forbidden[i].says);
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    assert_state(c.s, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
    /* Work on the invalidated capture is refused but not counted again. */
    assert_int_equal(magpie_sim_launch(c.s, add_one, &c.counter), MAGPIE_ERR_CAPTURE);
    assert_int_equal(magpie_sim_event_record(c.in_capture, c.s), MAGPIE_ERR_CAPTURE);
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    end_invalidated(c.s);
    /* The first reason is the one kept. */
    if (strstr(magpie_sim_last_error_message(), forbidden[i].says) == NULL)
      fail_msg("%s: end's message \"%s\" does not say \"%s\"", forbidden[i].name, magpie_sim_last_error_message(),
               forbidden[i].says);

    /* Everything is usable again; nothing captured ever ran. */
    assert_int_equal(magpie_sim_stream_synchronize(c.s), MAGPIE_OK);
    assert_int_equal(magpie_sim_stream_synchronize(c.t), MAGPIE_OK);
    assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
    assert_int_equal(c.counter, 0);
    assert_int_equal(magpie_sim_event_destroy(c.in_capture), MAGPIE_OK);
    assert_int_equal(magpie_sim_event_destroy(c.outside), MAGPIE_OK);
    assert_int_equal(magpie_sim_stream_destroy(c.s), MAGPIE_OK);
    assert_int_equal(magpie_sim_stream_destroy(c.t), MAGPIE_OK);
    assert_no_capture();
  }
}

/* Device synchronize invalidates every capture of the device, none of
 * another device's; a join of two captures invalidates both. */
static void test_invalidation_scope(void **state) {
  (void)state;
  cudaStream_t a = mk(), b = mk();
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t d1 = mk();
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(a, MAGPIE_SIM_CAPTURE_RELAXED), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(b, MAGPIE_SIM_CAPTURE_THREAD_LOCAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(d1, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "2 of its streams"));
  assert_state(a, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  assert_state(b, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  assert_state(d1, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  end_invalidated(a);
  end_invalidated(b);
  magpie_sim_graph_destroy(end_ok(d1));

  /* Two captures joined through a stream wait, and through an event. */
  magpie_sim_event e = magpie_sim_event_create();
  assert_int_equal(magpie_sim_stream_begin_capture(a, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(b, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait(a, b), MAGPIE_ERR_CAPTURE);
  assert_state(a, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  assert_state(b, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  end_invalidated(a);
  end_invalidated(b);
  assert_int_equal(magpie_sim_stream_begin_capture(a, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(b, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait_event(b, e), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "both are invalidated"));
  assert_state(a, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  assert_state(b, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  end_invalidated(a);
  end_invalidated(b);
  magpie_sim_event_destroy(e);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(d1);
  assert_no_capture();
}

/* A capturing stream's id and device, as CUDA refuses cuStreamGetId and
 * cuStreamGetDevice there: through the public functions and the device
 * table, in every capture mode and thread mode. */
enum identity_query { ASK_ID, ASK_DEVICE, ASK_TABLE_ID, ASK_TABLE_ID_FAST, ASK_TABLE_DEVICE, ASK_COUNT };

static const char *const ask_says[ASK_COUNT] = {
    [ASK_ID] = "asked its id",
    [ASK_DEVICE] = "asked its device",
    [ASK_TABLE_ID] = "asked its id",
    [ASK_TABLE_ID_FAST] = "asked its id",
    [ASK_TABLE_DEVICE] = "asked its device",
};

/* Asks s's id or device: MAGPIE_OK with the answer in *answer, or the
 * refusal: the table's code for stream_id and stream_device, and
 * MAGPIE_ERR_CAPTURE standing for the other queries' refusal, which has no
 * code (magpie_sim_stream_id answers 0, magpie_sim_stream_device -1,
 * stream_id_fast nonzero). */
static int ask_identity(cudaStream_t s, enum identity_query q, uint64_t *answer) {
  const backend_ops *ops = table();
  uint64_t id = 0;
  unsigned long long fast = 0;
  int d = -1, rc;
  switch (q) {
  case ASK_ID:
    id = magpie_sim_stream_id(s);
    if (id == 0) return MAGPIE_ERR_CAPTURE;
    *answer = id;
    return MAGPIE_OK;
  case ASK_DEVICE:
    d = magpie_sim_stream_device(s);
    if (d == -1) return MAGPIE_ERR_CAPTURE;
    *answer = (uint64_t)d;
    return MAGPIE_OK;
  case ASK_TABLE_ID:
    rc = ops->stream_id(s, &id);
    if (rc == MAGPIE_OK) *answer = id;
    return rc;
  case ASK_TABLE_ID_FAST:
    if (ops->stream_id_fast(s, &fast) != 0) return MAGPIE_ERR_CAPTURE;
    *answer = fast;
    return MAGPIE_OK;
  case ASK_TABLE_DEVICE:
    rc = ops->stream_device(s, &d);
    if (rc == MAGPIE_OK) *answer = (uint64_t)d;
    return rc;
  case ASK_COUNT: break;
  }
  return -1;
}

/* Whether q's refusal leaves its reason in the error detail (the table's
 * stream_id and stream_device). */
static int ask_says_why(enum identity_query q) { return q == ASK_TABLE_ID || q == ASK_TABLE_DEVICE; }

/* The answer q gives for s outside a capture. */
static uint64_t identity_of(cudaStream_t s, enum identity_query q) {
  uint64_t answer = 12345;
  int rc = ask_identity(s, q, &answer);
  if (rc != MAGPIE_OK) fail_msg("query %d of %p outside a capture: rc %d", (int)q, (void *)s, rc);
  return answer;
}

/* Each query, asked of a capturing stream: refused, counted once, the
 * capture invalidated; asked again (any of them), refused without being
 * counted. The capture state stays a permitted query; other streams answer
 * as usual; after the end the stream answers as before. */
static void test_stream_identity_refused(void **state) {
  (void)state;
  const backend_ops *ops = table();
  cudaStream_t s = mk(), t = mk();
  uint64_t s_id = magpie_sim_stream_id(s), t_id = magpie_sim_stream_id(t);
  assert_true(s_id != 0 && t_id != 0 && s_id != t_id);
  for (int mode = MAGPIE_SIM_CAPTURE_GLOBAL; mode <= MAGPIE_SIM_CAPTURE_RELAXED; mode++) {
    for (int q = 0; q < ASK_COUNT; q++) {
      uint64_t before = identity_of(s, q);
      assert_true(before == (q == ASK_DEVICE || q == ASK_TABLE_DEVICE ? 0 : s_id));
      uint64_t cid, again, v0 = magpie_sim_capture_violations();
      assert_int_equal(magpie_sim_stream_begin_capture(s, mode), MAGPIE_OK);
      /* Permitted: the capture state (public and table), other streams. */
      assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &cid);
      int st = -1;
      uint64_t tid = 0;
      assert_int_equal(ops->stream_capture(s, &st, &tid), MAGPIE_OK);
      assert_int_equal(st, BACKEND_CAPTURE_ACTIVE);
      assert_true(tid == cid);
      assert_true(identity_of(t, q) == (q == ASK_DEVICE || q == ASK_TABLE_DEVICE ? 0 : t_id));
      assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
      assert_true(magpie_sim_capture_violations() == v0);

      /* Refused, in the capture's mode as the thread's. */
      int old = set_mode(mode);
      uint64_t answer = 777;
      int rc = ask_identity(s, q, &answer);
      set_mode(old);
      if (rc != MAGPIE_ERR_CAPTURE) fail_msg("capture mode %d, query %d: rc %d", mode, q, rc);
      assert_true(answer == 777);
      if (ask_says_why(q) && strstr(backend_error_detail(), ask_says[q]) == NULL)
        fail_msg("query %d: message \"%s\" does not say \"%s\"", q, backend_error_detail(), ask_says[q]);
      assert_true(magpie_sim_capture_violations() == v0 + 1);
      assert_state(s, MAGPIE_SIM_CAPTURE_INVALIDATED, &again);
      assert_true(again == cid);
      /* Every query again: refused, not counted. */
      for (int r = 0; r < ASK_COUNT; r++) {
        rc = ask_identity(s, r, &answer);
        if (rc != MAGPIE_ERR_CAPTURE) fail_msg("capture mode %d, query %d again: rc %d", mode, r, rc);
      }
      assert_true(answer == 777);
      assert_true(magpie_sim_capture_violations() == v0 + 1);
      end_invalidated(s);
      if (strstr(magpie_sim_last_error_message(), ask_says[q]) == NULL)
        fail_msg("query %d: end's message \"%s\" does not say \"%s\"", q, magpie_sim_last_error_message(), ask_says[q]);
      /* Answered again, unchanged. */
      assert_true(identity_of(s, q) == before);
      assert_true(magpie_sim_capture_violations() == v0 + 1);
    }
  }
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(t);
  assert_no_capture();
}

/* The same for the per-thread handle while the calling thread's
 * per-thread stream captures; another thread's per-thread stream is
 * another stream, and answers. A stream capturing on one thread is refused
 * to every thread. */
struct identity_asker {
  cudaStream_t s;
  uint64_t id;
  int device;
};

static void *identity_asker_main(void *arg) {
  struct identity_asker *x = arg;
  x->id = magpie_sim_stream_id(x->s);
  x->device = magpie_sim_stream_device(x->s);
  return NULL;
}

static struct identity_asker ask_on_other_thread(cudaStream_t s) {
  struct identity_asker x = {s, 12345, -2};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, identity_asker_main, &x), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  return x;
}

static void test_per_thread_identity_refused(void **state) {
  (void)state;
  const backend_ops *ops = table();
  cudaStream_t pt = MAGPIE_SIM_STREAM_PER_THREAD;
  uint64_t pt_id = magpie_sim_stream_id(pt), other_id = ask_on_other_thread(pt).id;
  assert_true(pt_id != 0 && other_id != 0 && other_id != pt_id);
  /* Every query but stream_id_fast, which takes ordinary handles only. */
  static const enum identity_query queries[] = {ASK_ID, ASK_DEVICE, ASK_TABLE_ID, ASK_TABLE_DEVICE};
  for (size_t i = 0; i < sizeof queries / sizeof queries[0]; i++) {
    enum identity_query q = queries[i];
    uint64_t v0 = magpie_sim_capture_violations();
    assert_int_equal(magpie_sim_stream_begin_capture(pt, MAGPIE_SIM_CAPTURE_THREAD_LOCAL), MAGPIE_OK);
    assert_state(pt, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
    struct identity_asker x = ask_on_other_thread(pt);
    assert_true(x.id != 0 && x.id != pt_id);
    assert_int_equal(x.device, 0);
    assert_state(pt, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
    assert_true(magpie_sim_capture_violations() == v0);
    uint64_t answer = 777;
    assert_int_equal(ask_identity(pt, q, &answer), MAGPIE_ERR_CAPTURE);
    assert_true(answer == 777);
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    assert_state(pt, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
    uint64_t id = 1;
    int d = -1;
    assert_int_equal(ops->stream_id(pt, &id), MAGPIE_ERR_CAPTURE);
    assert_int_equal(ops->stream_device(pt, &d), MAGPIE_ERR_CAPTURE);
    assert_true(magpie_sim_stream_id(pt) == 0);
    assert_int_equal(magpie_sim_stream_device(pt), -1);
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    end_invalidated(pt);
    if (strstr(magpie_sim_last_error_message(), ask_says[q]) == NULL)
      fail_msg("end's message \"%s\" does not say \"%s\"", magpie_sim_last_error_message(), ask_says[q]);
    assert_true(magpie_sim_stream_id(pt) == pt_id);
    assert_int_equal(magpie_sim_stream_device(pt), 0);
  }

  /* A created stream capturing on this thread, asked by another thread. */
  cudaStream_t s = mk();
  uint64_t v0 = magpie_sim_capture_violations();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_RELAXED), MAGPIE_OK);
  struct identity_asker x = ask_on_other_thread(s);
  assert_true(x.id == 0);
  assert_int_equal(x.device, -1);
  assert_true(magpie_sim_capture_violations() == v0 + 1);
  end_invalidated(s);
  assert_true(ask_on_other_thread(s).id == magpie_sim_stream_id(s));
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* What stays allowed during a capture: in the capturing thread's global
 * mode, work on other streams and their id and device; in the relaxed
 * mode, the potentially unsafe calls too (synchronising other streams,
 * querying and synchronising an event recorded outside the capture, the
 * memory calls). */
static void test_allowed_during_capture(void **state) {
  (void)state;
  static int counter;
  counter = 0;
  cudaStream_t s = mk(), t = mk();
  magpie_sim_event e = magpie_sim_event_create(), never = magpie_sim_event_create();
  magpie_sim_event outside = magpie_sim_event_create();
  uint64_t t_id = magpie_sim_stream_id(t);
  assert_true(t_id != 0);
  uint64_t v0 = magpie_sim_capture_violations();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  /* Waits already satisfied by the capture's own order. */
  assert_int_equal(magpie_sim_stream_wait_event(s, e), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait(s, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait_event(s, never), MAGPIE_OK);
  /* Other streams: work on them, their id and device. */
  assert_int_equal(magpie_sim_launch(t, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(outside, t), MAGPIE_OK);
  assert_true(magpie_sim_stream_id(t) == t_id);
  assert_int_equal(magpie_sim_stream_device(t), 0);
  assert_true(magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD) != 0);
  assert_int_equal(magpie_sim_stream_device(MAGPIE_SIM_STREAM_PER_THREAD), 0);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  /* Synchronising other streams (the per-thread stream, another device's
   * default stream) and events recorded outside: from the relaxed mode. */
  int old = set_mode(MAGPIE_SIM_CAPTURE_RELAXED);
  assert_int_equal(magpie_sim_event_synchronize(outside), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(outside), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(t), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(MAGPIE_SIM_STREAM_PER_THREAD), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(NULL), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_int_equal(counter, 1); /* t's launch only */
  /* Memory calls. */
  uintptr_t base;
  assert_int_equal(sim_memory_reserve(0, 2 * MiB, &base), MAGPIE_OK);
  assert_int_equal(sim_memory_map(0, base, 2 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(sim_memory_unmap(0, base, 2 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unreserve(0, base, 2 * MiB), MAGPIE_OK);
  assert_int_equal(set_mode(old), MAGPIE_SIM_CAPTURE_RELAXED);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  assert_true(magpie_sim_capture_violations() == v0);
  magpie_sim_graph g = end_ok(s);
  assert_int_equal(magpie_sim_graph_launch(g, t), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(t), MAGPIE_OK);
  assert_int_equal(counter, 2);
  magpie_sim_graph_destroy(g);
  magpie_sim_event_destroy(e);
  magpie_sim_event_destroy(never);
  magpie_sim_event_destroy(outside);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(t);
  assert_no_capture();
}

/* ---------------------------------------------------------------- default stream */

/* The default stream is refused only during a global-mode capture of its
 * device, whatever the calling thread's mode. Its synchronisations here are
 * made from the relaxed mode: in the global and thread-local modes this
 * thread's own capture would prohibit them as potentially unsafe calls,
 * whatever the stream. */
static void test_default_stream_rules(void **state) {
  (void)state;
  static int counter;
  counter = 0;
  cudaStream_t s = mk();
  uint64_t v0 = magpie_sim_capture_violations();
  /* Thread-local and relaxed captures leave the default stream usable. */
  int old = set_mode(MAGPIE_SIM_CAPTURE_RELAXED);
  for (int mode = MAGPIE_SIM_CAPTURE_THREAD_LOCAL; mode <= MAGPIE_SIM_CAPTURE_RELAXED; mode++) {
    assert_int_equal(magpie_sim_stream_begin_capture(s, mode), MAGPIE_OK);
    assert_int_equal(magpie_sim_launch(NULL, add_one, &counter), MAGPIE_OK);
    assert_int_equal(magpie_sim_stream_synchronize((cudaStream_t)1), MAGPIE_OK);
    magpie_sim_graph_destroy(end_ok(s));
  }
  assert_int_equal(counter, 2);
  assert_true(magpie_sim_capture_violations() == v0);
  /* A global capture on device 1 leaves device 0's default stream alone,
   * not device 1's, even to a relaxed thread. */
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t d1 = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(d1, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(NULL, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(NULL), MAGPIE_OK);
  assert_int_equal(counter, 3);
  assert_state(d1, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  assert_true(magpie_sim_capture_violations() == v0);
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(NULL), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "default stream"));
  assert_state(d1, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
  assert_int_equal(set_mode(old), MAGPIE_SIM_CAPTURE_RELAXED);
  end_invalidated(d1);
  /* Once it ended, the default stream is free again, in any mode. */
  assert_int_equal(magpie_sim_stream_synchronize(NULL), MAGPIE_OK);
  magpie_sim_stream_destroy(d1);
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_true(magpie_sim_capture_violations() == v0 + 1);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* ---------------------------------------------------------------- events */

static void test_event_recorded_in_capture(void **state) {
  (void)state;
  static int counter;
  counter = 0;
  cudaStream_t s = mk(), t = mk();
  magpie_sim_event e = magpie_sim_event_create();
  /* Recorded outside first: the capture's record replaces it. */
  assert_int_equal(magpie_sim_event_record(e, t), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  magpie_sim_graph g = end_ok(s);
  /* Still the capture's after it ended: refused and counted, with no
   * capture left to invalidate. */
  uint64_t v0 = magpie_sim_capture_violations();
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_ERR_CAPTURE);
  assert_non_null(strstr(magpie_sim_last_error_message(), "has ended"));
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_ERR_CAPTURE);
  assert_int_equal(magpie_sim_stream_wait_event(t, e), MAGPIE_ERR_CAPTURE);
  assert_true(magpie_sim_capture_violations() == v0 + 3);
  /* A replay does not record it. */
  assert_int_equal(magpie_sim_graph_launch(g, t), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(t), MAGPIE_OK);
  assert_int_equal(counter, 1);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_ERR_CAPTURE);
  /* Recorded outside a capture: an ordinary event again. */
  struct gated gate;
  gated_init(&gate);
  assert_int_equal(magpie_sim_launch(t, gated_run, &gate), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, t), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_SIM_NOT_READY);
  sem_post(&gate.gate);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_OK);
  assert_int_equal(gate.done, 1);
  assert_int_equal(magpie_sim_stream_wait_event(s, e), MAGPIE_OK);
  /* Destroyed and created again: nothing of the capture remains. */
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  magpie_sim_graph_destroy(end_ok(s));
  assert_int_equal(magpie_sim_event_destroy(e), MAGPIE_OK);
  magpie_sim_event f = magpie_sim_event_create();
  assert_int_equal(magpie_sim_event_query(f), MAGPIE_OK);
  assert_true(magpie_sim_capture_violations() == v0 + 4);
  magpie_sim_event_destroy(f);
  magpie_sim_graph_destroy(g);
  gated_fini(&gate);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(t);
  assert_no_capture();
}

/* ---------------------------------------------------------------- graph lifetime */

static void test_graph_destroy_with_replays_in_flight(void **state) {
  (void)state;
  enum { REPLAYS = 4 };
  static int counter;
  counter = 0;
  struct gated gate;
  gated_init(&gate);
  cudaStream_t s = mk(), r = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, add_one, &counter), MAGPIE_OK);
  magpie_sim_graph g = end_ok(s);
  /* The stream is held by a closed gate: every replay stays pending. */
  assert_int_equal(magpie_sim_launch(r, gated_run, &gate), MAGPIE_OK);
  for (int i = 0; i < REPLAYS; i++) assert_int_equal(magpie_sim_graph_launch(g, r), MAGPIE_OK);
  assert_int_equal(magpie_sim_graph_destroy(g), MAGPIE_OK);
  sem_post(&gate.gate);
  assert_int_equal(magpie_sim_stream_synchronize(r), MAGPIE_OK);
  assert_int_equal(gate.opened, 1);
  assert_int_equal(counter, 2 * REPLAYS);
  gated_fini(&gate);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(r);
}

/* ---------------------------------------------------------------- capture modes and unsafe calls */

/* The calls CUDA deems potentially unsafe during a capture: the memory
 * calls, querying or synchronising an event recorded outside any capture,
 * synchronising a stream that does not capture. */
enum unsafe_op {
  OP_RESERVE,
  OP_UNRESERVE,
  OP_MAP,
  OP_UNMAP,
  OP_ALLOC,
  OP_FREE,
  OP_EVENT_QUERY,
  OP_EVENT_SYNC,
  OP_STREAM_SYNC,
  OP_COUNT
};

/* What a refusal of each says. */
static const char *const op_says[OP_COUNT] = {
    [OP_RESERVE] = "reserving device address space",
    [OP_UNRESERVE] = "releasing device address space",
    [OP_MAP] = "mapping device memory",
    [OP_UNMAP] = "unmapping device memory",
    [OP_ALLOC] = "allocating device memory",
    [OP_FREE] = "freeing device memory",
    [OP_EVENT_QUERY] = "querying an event",
    [OP_EVENT_SYNC] = "synchronising an event",
    [OP_STREAM_SYNC] = "synchronising a stream",
};

/* Whether the op, when permitted, undoes itself (the others would release
 * what the fixture needs). */
static int op_repeatable(enum unsafe_op op) { return op != OP_UNRESERVE && op != OP_FREE; }

/* Prepared outside any capture: a reservation with one mapped and one
 * unmapped granule, a plain allocation, and a stream (never capturing)
 * with an event recorded on it. */
struct fixture {
  uintptr_t base, spare, alloc;
  cudaStream_t stream;
  magpie_sim_event event;
};

static void fixture_init(struct fixture *m) {
  assert_int_equal(sim_memory_reserve(0, 4 * MiB, &m->base), MAGPIE_OK);
  assert_int_equal(sim_memory_map(0, m->base, 2 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(sim_memory_reserve(0, 2 * MiB, &m->spare), MAGPIE_OK);
  assert_int_equal(sim_memory_alloc(0, 2 * MiB, &m->alloc), MAGPIE_OK);
  m->stream = mk();
  m->event = magpie_sim_event_create();
  assert_non_null(m->event);
  assert_int_equal(magpie_sim_event_record(m->event, m->stream), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_synchronize(m->event), MAGPIE_OK);
}

static void fixture_fini(struct fixture *m) {
  assert_int_equal(sim_memory_unmap(0, m->base, 2 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unreserve(0, m->base, 4 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unreserve(0, m->spare, 2 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_free(0, m->alloc, 2 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_destroy(m->event), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(m->stream), MAGPIE_OK);
}

/* One potentially unsafe call that, when permitted, changes nothing
 * overall (each undoes itself); the rc of the call the rules look at. */
static int unsafe_call(const struct fixture *m, enum unsafe_op op) {
  uintptr_t p;
  int rc;
  switch (op) {
  case OP_RESERVE:
    rc = sim_memory_reserve(0, 2 * MiB, &p);
    if (rc == MAGPIE_OK) assert_int_equal(sim_memory_unreserve(0, p, 2 * MiB), MAGPIE_OK);
    return rc;
  case OP_UNRESERVE:
    rc = sim_memory_unreserve(0, m->spare, 2 * MiB);
    if (rc == MAGPIE_OK) fail_msg("the spare reservation was released while the fixture needs it");
    return rc;
  case OP_MAP:
    rc = sim_memory_map(0, m->base + 2 * MiB, 2 * MiB, 0, 0);
    if (rc == MAGPIE_OK) assert_int_equal(sim_memory_unmap(0, m->base + 2 * MiB, 2 * MiB), MAGPIE_OK);
    return rc;
  case OP_UNMAP:
    rc = sim_memory_unmap(0, m->base, 2 * MiB);
    if (rc == MAGPIE_OK) assert_int_equal(sim_memory_map(0, m->base, 2 * MiB, 0, 0), MAGPIE_OK);
    return rc;
  case OP_ALLOC:
    rc = sim_memory_alloc(0, 2 * MiB, &p);
    if (rc == MAGPIE_OK) assert_int_equal(sim_memory_free(0, p, 2 * MiB), MAGPIE_OK);
    return rc;
  case OP_FREE:
    rc = sim_memory_free(0, m->alloc, 2 * MiB);
    if (rc == MAGPIE_OK) fail_msg("the fixture's allocation was freed while the fixture needs it");
    return rc;
  case OP_EVENT_QUERY: return magpie_sim_event_query(m->event);
  case OP_EVENT_SYNC: return magpie_sim_event_synchronize(m->event);
  case OP_STREAM_SYNC: return magpie_sim_stream_synchronize(m->stream);
  case OP_COUNT: break;
  }
  return -1;
}

/* A thread that begins a capture of `mode` on s, and returns. */
struct beginner {
  cudaStream_t s;
  int mode;
  int rc;
};

static void *beginner_main(void *arg) {
  struct beginner *b = arg;
  b->rc = magpie_sim_stream_begin_capture(b->s, b->mode);
  return NULL;
}

static void begin_on_other_thread(cudaStream_t s, int mode) {
  struct beginner b = {s, mode, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, beginner_main, &b), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(b.rc, MAGPIE_OK);
}

/* Every potentially unsafe call is refused (and invalidates) when the mode
 * prohibits it: a global-mode thread during another thread's global
 * capture, and a thread during its own global or thread-local capture. */
static void test_unsafe_calls_refused_by_mode(void **state) {
  (void)state;
  struct fixture m;
  fixture_init(&m);
  cudaStream_t s = mk();
  size_t free0, f;
  assert_int_equal(sim_memory_info(0, &free0, NULL), MAGPIE_OK);
  for (int op = 0; op < OP_COUNT; op++) {
    for (int own = 0; own < 2; own++) {
      for (int cmode = MAGPIE_SIM_CAPTURE_GLOBAL; cmode <= (own ? MAGPIE_SIM_CAPTURE_THREAD_LOCAL : 0); cmode++) {
        if (own) assert_int_equal(magpie_sim_stream_begin_capture(s, cmode), MAGPIE_OK);
        else begin_on_other_thread(s, cmode);
        uint64_t v0 = magpie_sim_capture_violations();
        /* Own capture: refused in the global and thread-local modes. */
        for (int tmode = MAGPIE_SIM_CAPTURE_GLOBAL; tmode <= (own ? MAGPIE_SIM_CAPTURE_THREAD_LOCAL : 0); tmode++) {
          int old = set_mode(tmode);
          int rc = unsafe_call(&m, op);
          set_mode(old);
          if (rc != MAGPIE_ERR_CAPTURE)
            fail_msg("op %d, own %d, capture mode %d, thread mode %d: rc %d", op, own, cmode, tmode, rc);
          if (strstr(backend_error_detail(), op_says[op]) == NULL)
            fail_msg("op %d: message \"%s\" does not say \"%s\"", op, backend_error_detail(), op_says[op]);
          assert_state(s, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
        }
        assert_true(magpie_sim_capture_violations() == v0 + (own ? 2 : 1));
        /* The relaxed mode is permitted everything. */
        int old = set_mode(MAGPIE_SIM_CAPTURE_RELAXED);
        if (op_repeatable(op)) assert_int_equal(unsafe_call(&m, op), MAGPIE_OK);
        set_mode(old);
        assert_true(magpie_sim_capture_violations() == v0 + (own ? 2 : 1));
        end_invalidated(s);
        if (strstr(magpie_sim_last_error_message(), op_says[op]) == NULL)
          fail_msg("op %d: end's message \"%s\" does not say \"%s\"", op, magpie_sim_last_error_message(), op_says[op]);
      }
    }
  }
  /* Nothing was done by a refused call. */
  assert_int_equal(sim_memory_info(0, &f, NULL), MAGPIE_OK);
  assert_true(f == free0);
  fixture_fini(&m);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* What each mode permits, with a capture of each mode on this thread and
 * on another, for every repeatable call. */
static void test_capture_mode_rules(void **state) {
  (void)state;
  struct fixture m;
  fixture_init(&m);
  cudaStream_t s = mk();
  /* [own capture?][capture mode][thread mode]: permitted? */
  static const int permitted[2][3][3] = {
      /* another thread's capture: only global-mode threads mind global ones */
      {{0, 1, 1}, {1, 1, 1}, {1, 1, 1}},
      /* this thread's capture: all but relaxed captures prohibit, in the
       * global and thread-local modes */
      {{0, 0, 1}, {0, 0, 1}, {1, 1, 1}},
  };
  for (int op = 0; op < OP_COUNT; op++) {
    if (!op_repeatable(op)) continue;
    for (int own = 0; own < 2; own++)
      for (int cmode = 0; cmode < 3; cmode++)
        for (int tmode = 0; tmode < 3; tmode++) {
          if (own) assert_int_equal(magpie_sim_stream_begin_capture(s, cmode), MAGPIE_OK);
          else begin_on_other_thread(s, cmode);
          uint64_t v0 = magpie_sim_capture_violations();
          int old = set_mode(tmode);
          int rc = unsafe_call(&m, op);
          set_mode(old);
          int want = permitted[own][cmode][tmode] ? MAGPIE_OK : MAGPIE_ERR_CAPTURE;
          if (rc != want)
            fail_msg("op %d, own %d, capture mode %d, thread mode %d: rc %d, expected %d", op, own, cmode, tmode, rc,
                     want);
          if (want == MAGPIE_OK) {
            assert_true(magpie_sim_capture_violations() == v0);
            assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
            magpie_sim_graph_destroy(end_ok(s));
          } else {
            assert_true(magpie_sim_capture_violations() == v0 + 1);
            end_invalidated(s);
          }
        }
  }
  fixture_fini(&m);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* A thread-local capture lets other threads make every unsafe call; a
 * relaxed thread may make them while another's global capture runs, and a
 * global-mode one may not. */
struct caller {
  const struct fixture *m;
  enum unsafe_op op;
  int mode;
  int rc;
};

static void *caller_main(void *arg) {
  struct caller *x = arg;
  int mode = x->mode;
  magpie_sim_thread_exchange_capture_mode(&mode);
  x->rc = unsafe_call(x->m, x->op);
  return NULL;
}

static int call_on_other_thread(const struct fixture *m, enum unsafe_op op, int mode) {
  struct caller x = {m, op, mode, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, caller_main, &x), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  return x.rc;
}

static void test_other_threads_and_modes(void **state) {
  (void)state;
  struct fixture m;
  fixture_init(&m);
  cudaStream_t s = mk();
  for (int op = 0; op < OP_COUNT; op++) {
    if (!op_repeatable(op)) continue;
    assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
    assert_int_equal(call_on_other_thread(&m, op, MAGPIE_SIM_CAPTURE_RELAXED), MAGPIE_OK);
    assert_int_equal(call_on_other_thread(&m, op, MAGPIE_SIM_CAPTURE_THREAD_LOCAL), MAGPIE_OK);
    assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
    assert_int_equal(call_on_other_thread(&m, op, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_ERR_CAPTURE);
    assert_state(s, MAGPIE_SIM_CAPTURE_INVALIDATED, NULL);
    end_invalidated(s);
    assert_int_equal(magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_THREAD_LOCAL), MAGPIE_OK);
    assert_int_equal(call_on_other_thread(&m, op, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
    assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
    assert_int_equal(unsafe_call(&m, op), MAGPIE_ERR_CAPTURE); /* this thread's own */
    end_invalidated(s);
  }
  fixture_fini(&m);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* The synchronisations in particular, as the header states them: querying
 * or synchronising an event recorded outside any capture and synchronising
 * a stream that does not capture, from a global-mode thread while another
 * thread captures in the global mode, are refused, counted and invalidate
 * that capture; from the relaxed mode they pass, as they do during another
 * thread's thread-local or relaxed capture. The device table's event_query
 * and event_synchronize switch to the relaxed mode: they pass (answers
 * unchanged) and leave the thread's mode as it was. */
static void test_sync_calls_during_another_capture(void **state) {
  (void)state;
  static int counter;
  counter = 0;
  const backend_ops *ops = table();
  cudaStream_t s = mk(), t = mk();
  magpie_sim_event e = magpie_sim_event_create();
  assert_int_equal(magpie_sim_launch(t, add_one, &counter), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, t), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  const struct fixture target = {.stream = t, .event = e}; /* the calls' objects */
  static const enum unsafe_op calls[] = {OP_EVENT_QUERY, OP_EVENT_SYNC, OP_STREAM_SYNC};
  for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
    const char *says = op_says[calls[i]];
    int rc;
    /* Global mode, another thread's global capture: refused. */
    begin_on_other_thread(s, MAGPIE_SIM_CAPTURE_GLOBAL);
    uint64_t id, again, v0 = magpie_sim_capture_violations();
    assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &id);
    rc = unsafe_call(&target, calls[i]);
    assert_int_equal(rc, MAGPIE_ERR_CAPTURE);
    assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_CAPTURE);
    if (strstr(magpie_sim_last_error_message(), says) == NULL)
      fail_msg("message \"%s\" does not say \"%s\"", magpie_sim_last_error_message(), says);
    assert_non_null(strstr(magpie_sim_last_error_message(), "another thread"));
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    assert_state(s, MAGPIE_SIM_CAPTURE_INVALIDATED, &again);
    assert_true(again == id);
    end_invalidated(s);
    if (strstr(magpie_sim_last_error_message(), says) == NULL)
      fail_msg("end's message \"%s\" does not say \"%s\"", magpie_sim_last_error_message(), says);

    /* The relaxed mode: passes, nothing invalidated. */
    begin_on_other_thread(s, MAGPIE_SIM_CAPTURE_GLOBAL);
    v0 = magpie_sim_capture_violations();
    int old = set_mode(MAGPIE_SIM_CAPTURE_RELAXED);
    rc = unsafe_call(&target, calls[i]);
    assert_int_equal(set_mode(old), MAGPIE_SIM_CAPTURE_RELAXED);
    assert_int_equal(rc, MAGPIE_OK);
    assert_true(magpie_sim_capture_violations() == v0);
    assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
    magpie_sim_graph_destroy(end_ok(s));

    /* Thread-local and relaxed captures of another thread prohibit nothing
     * to this thread, in the global mode. */
    for (int cmode = MAGPIE_SIM_CAPTURE_THREAD_LOCAL; cmode <= MAGPIE_SIM_CAPTURE_RELAXED; cmode++) {
      begin_on_other_thread(s, cmode);
      rc = unsafe_call(&target, calls[i]);
      if (rc != MAGPIE_OK) fail_msg("%s during a capture of mode %d: rc %d", says, cmode, rc);
      assert_true(magpie_sim_capture_violations() == v0);
      assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
      magpie_sim_graph_destroy(end_ok(s));
    }
  }

  /* The table's event calls in the global mode during another thread's
   * global capture: they pass, and give the usual answers. */
  begin_on_other_thread(s, MAGPIE_SIM_CAPTURE_GLOBAL);
  uint64_t v0 = magpie_sim_capture_violations();
  void *ev = NULL;
  assert_int_equal(ops->event_create(0, &ev), MAGPIE_OK);
  struct gated gate;
  gated_init(&gate);
  assert_int_equal(ops->event_record(ev, t), MAGPIE_OK); /* complete once t ran it */
  assert_int_equal(ops->event_synchronize(ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(t, gated_run, &gate), MAGPIE_OK);
  assert_int_equal(ops->event_record(ev, t), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), BACKEND_NOT_READY);
  sem_post(&gate.gate);
  assert_int_equal(ops->event_synchronize(ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  assert_int_equal(gate.opened, 1);
  assert_int_equal(ops->event_query(e), MAGPIE_OK);
  assert_int_equal(ops->event_synchronize(e), MAGPIE_OK);
  assert_true(magpie_sim_capture_violations() == v0);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  /* This thread is still in the global mode: the simulator's own query,
   * which has no such switch, is refused. */
  assert_int_equal(set_mode(MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_SIM_CAPTURE_GLOBAL);
  assert_int_equal(magpie_sim_event_query(ev), MAGPIE_ERR_CAPTURE);
  assert_true(magpie_sim_capture_violations() == v0 + 1);
  end_invalidated(s);
  assert_int_equal(ops->event_destroy(ev), MAGPIE_OK);
  gated_fini(&gate);
  assert_int_equal(magpie_sim_stream_synchronize(t), MAGPIE_OK);
  assert_int_equal(counter, 1);
  magpie_sim_event_destroy(e);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(t);
  assert_no_capture();
}

/* ---------------------------------------------------------------- the device table */

static void test_backend_table(void **state) {
  (void)state;
  const backend_ops *ops = magpie_sim_device_table(BACKEND_ABI);
  assert_non_null(ops);
  assert_non_null(ops->stream_capture);
  cudaStream_t s = mk();
  int st = -1;
  uint64_t id = 99, info_id;
  assert_int_equal(ops->stream_capture(s, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_NONE);
  assert_true(id == 0);
  assert_int_equal(ops->stream_capture(MAGPIE_SIM_STREAM_PER_THREAD, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_NONE);
  cudaStream_t dead = mk();
  magpie_sim_stream_destroy(dead);
  assert_int_equal(ops->stream_capture(dead, &st, &id), MAGPIE_ERR_INVALID_STREAM);

  /* An event recorded outside any capture, on a stream that never captures. */
  cudaStream_t u = mk();
  void *ev = NULL;
  assert_int_equal(ops->event_create(0, &ev), MAGPIE_OK);
  assert_int_equal(ops->event_record(ev, u), MAGPIE_OK);

  /* Another thread's global capture: the table's memory and event calls
   * pass (the relaxed switch) where the simulator's own, in this thread's
   * global mode, would not; this thread's mode is the same afterwards. The
   * identity of a stream that does not capture is answered. */
  begin_on_other_thread(s, MAGPIE_SIM_CAPTURE_GLOBAL);
  assert_int_equal(ops->stream_capture(s, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_ACTIVE);
  assert_state(s, MAGPIE_SIM_CAPTURE_ACTIVE, &info_id);
  assert_true(id == info_id);
  uint64_t v0 = magpie_sim_capture_violations();
  uintptr_t base, p;
  assert_int_equal(ops->reserve(0, 4 * MiB, &base), MAGPIE_OK);
  assert_int_equal(ops->map(0, base, 4 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(ops->unmap(0, base, 2 * MiB), MAGPIE_OK);
  assert_int_equal(ops->mem_alloc(0, 2 * MiB, &p), MAGPIE_OK);
  assert_int_equal(ops->mem_free(0, p, 2 * MiB), MAGPIE_OK);
  assert_int_equal(ops->event_synchronize(ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  uint64_t u_id = 0;
  unsigned long long u_fast = 0;
  int u_dev = -1;
  assert_int_equal(ops->stream_id(u, &u_id), MAGPIE_OK);
  assert_int_equal(ops->stream_id_fast(u, &u_fast), 0);
  assert_true(u_id != 0 && u_fast == u_id);
  assert_int_equal(ops->stream_device(u, &u_dev), MAGPIE_OK);
  assert_int_equal(u_dev, 0);
  assert_int_equal(set_mode(MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_SIM_CAPTURE_GLOBAL);
  assert_int_equal(ops->stream_capture(s, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_ACTIVE);
  assert_true(magpie_sim_capture_violations() == v0);
  /* This thread's own global capture too. */
  cudaStream_t own = mk();
  assert_int_equal(magpie_sim_stream_begin_capture(own, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(ops->map(0, base, 2 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(ops->unmap(0, base, 4 * MiB), MAGPIE_OK);
  assert_int_equal(ops->unreserve(0, base, 4 * MiB), MAGPIE_OK);
  assert_int_equal(ops->event_record(ev, u), MAGPIE_OK);
  assert_int_equal(ops->event_synchronize(ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  assert_int_equal(set_mode(MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_SIM_CAPTURE_GLOBAL);
  assert_state(own, MAGPIE_SIM_CAPTURE_ACTIVE, NULL);
  assert_true(magpie_sim_capture_violations() == v0);
  /* The simulator's own call has no such switch: refused, both invalidated. */
  assert_int_equal(sim_memory_reserve(0, 2 * MiB, &base), MAGPIE_ERR_CAPTURE);
  assert_int_equal(ops->stream_capture(s, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_INVALIDATED);
  assert_true(id == info_id);
  assert_int_equal(ops->stream_capture(own, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_INVALIDATED);
  end_invalidated(s);
  end_invalidated(own);
  assert_int_equal(ops->stream_capture(s, &st, &id), MAGPIE_OK);
  assert_int_equal(st, BACKEND_CAPTURE_NONE);
  assert_true(id == 0);
  assert_int_equal(ops->event_destroy(ev), MAGPIE_OK);
  magpie_sim_stream_destroy(u);
  magpie_sim_stream_destroy(own);
  magpie_sim_stream_destroy(s);
  assert_no_capture();
}

/* ---------------------------------------------------------------- the stream-order checker */

static _Alignas(256) char arena[1 << 16]; /* stand-in block addresses, never touched */

/* A replay's closures are launches to the checker: a block freed on a
 * stream after a replay there is not ordered before another stream that
 * waited only for an event recorded before the replay. */
static void test_checker_sees_replays(void **state) {
  (void)state;
  static int counter;
  assert_int_equal(magpie_sim_check_enable(1), MAGPIE_OK);
  cudaStream_t a = mk(), b = mk(), c = mk();
  magpie_sim_event e = magpie_sim_event_create();
  assert_int_equal(magpie_sim_stream_begin_capture(c, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(c, add_one, &counter), MAGPIE_OK);
  magpie_sim_graph g = end_ok(c);
  for (int replay = 0; replay < 2; replay++) {
    void *p = arena + replay * 4096;
    sim_check_handout(p, 4096, a);
    assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
    if (replay) assert_int_equal(magpie_sim_graph_launch(g, a), MAGPIE_OK);
    sim_check_free(p, a);
    assert_int_equal(magpie_sim_stream_wait_event(b, e), MAGPIE_OK);
    uint64_t v0 = magpie_sim_check_violations();
    sim_check_handout(p, 4096, b);
    sim_check_free(p, b);
    /* Without the replay the wait covers the use; with it, not. */
    assert_true(magpie_sim_check_violations() == v0 + (uint64_t)replay);
  }
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_graph_destroy(g);
  magpie_sim_event_destroy(e);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(c);
  assert_int_equal(magpie_sim_check_enable(0), MAGPIE_OK);
}

/* ---------------------------------------------------------------- threads */

/* Threads capturing and replaying their own graphs at once, while others
 * map memory and query events through the table (relaxed), ask the id of
 * streams that do not capture, and launch on ordinary streams: for
 * ThreadSanitizer, which must find nothing. Each thread synchronises from
 * the relaxed mode, since the others' global captures would prohibit it in
 * the global mode. */
struct worker {
  pthread_t thread;
  int index;
  int counter;
  int failures;
};

static void *capture_worker_main(void *arg) {
  struct worker *w = arg;
  const backend_ops *ops = magpie_sim_device_table(BACKEND_ABI);
  cudaStream_t s = magpie_sim_stream_create(), r = magpie_sim_stream_create();
  void *ev = NULL;
  if (ops->event_create(0, &ev) != MAGPIE_OK) w->failures++;
  uint64_t r_id = magpie_sim_stream_id(r);
  int modes[3] = {MAGPIE_SIM_CAPTURE_GLOBAL, MAGPIE_SIM_CAPTURE_THREAD_LOCAL, MAGPIE_SIM_CAPTURE_RELAXED};
  for (int round = 0; round < 20; round++) {
    if (magpie_sim_stream_begin_capture(s, modes[(w->index + round) % 3]) != MAGPIE_OK) w->failures++;
    for (int i = 0; i < 3; i++)
      if (magpie_sim_launch(s, add_one, &w->counter) != MAGPIE_OK) w->failures++;
    uintptr_t base;
    if (ops->reserve(0, 2 * MiB, &base) != MAGPIE_OK || ops->map(0, base, 2 * MiB, 0, 0) != MAGPIE_OK ||
        ops->unmap(0, base, 2 * MiB) != MAGPIE_OK || ops->unreserve(0, base, 2 * MiB) != MAGPIE_OK)
      w->failures++;
    int st;
    uint64_t id;
    if (ops->stream_capture(s, &st, &id) != MAGPIE_OK || st != BACKEND_CAPTURE_ACTIVE || id == 0) w->failures++;
    /* An event recorded on r, which does not capture: its queries pass. */
    uint64_t rid = 0;
    if (ops->event_record(ev, r) != MAGPIE_OK || ops->event_synchronize(ev) != MAGPIE_OK ||
        ops->event_query(ev) != MAGPIE_OK || ops->stream_id(r, &rid) != MAGPIE_OK || rid != r_id)
      w->failures++;
    magpie_sim_graph g = NULL;
    if (magpie_sim_stream_end_capture(s, &g) != MAGPIE_OK) {
      w->failures++;
      continue;
    }
    for (int i = 0; i < 2; i++)
      if (magpie_sim_graph_launch(g, r) != MAGPIE_OK) w->failures++;
    if (magpie_sim_graph_destroy(g) != MAGPIE_OK) w->failures++;
  }
  int mode = MAGPIE_SIM_CAPTURE_RELAXED;
  if (magpie_sim_thread_exchange_capture_mode(&mode) != MAGPIE_OK) w->failures++;
  if (magpie_sim_stream_synchronize(r) != MAGPIE_OK) w->failures++;
  if (magpie_sim_thread_exchange_capture_mode(&mode) != MAGPIE_OK) w->failures++;
  if (ops->event_destroy(ev) != MAGPIE_OK) w->failures++;
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(r);
  return NULL;
}

static void test_concurrent_captures(void **state) {
  (void)state;
  enum { THREADS = 6 };
  static struct worker w[THREADS];
  uint64_t v0 = magpie_sim_capture_violations();
  for (int i = 0; i < THREADS; i++) {
    w[i] = (struct worker){.index = i};
    assert_int_equal(pthread_create(&w[i].thread, NULL, capture_worker_main, &w[i]), 0);
  }
  for (int i = 0; i < THREADS; i++) {
    assert_int_equal(pthread_join(w[i].thread, NULL), 0);
    assert_int_equal(w[i].failures, 0);
    assert_int_equal(w[i].counter, 20 * 3 * 2);
  }
  assert_true(magpie_sim_capture_violations() == v0);
  assert_no_capture();
}

int main(void) {
  /* Before the simulator's first use: it reads the environment once. */
  setenv("MAGPIE_SIM_DEVICES", "2", 1);
  unsetenv("MAGPIE_SIM_MEMORY");
  unsetenv("MAGPIE_SIM_VMM");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_capture_and_replay),
      cmocka_unit_test(test_replay_keeps_capture_order),
      cmocka_unit_test(test_replay_longer_than_queue),
      cmocka_unit_test(test_graph_launched_into_capture),
      cmocka_unit_test(test_graph_launch_errors),
      cmocka_unit_test(test_capture_info_states_and_ids),
      cmocka_unit_test(test_begin_and_end_errors),
      cmocka_unit_test(test_per_thread_stream_capture),
      cmocka_unit_test(test_forbidden_calls_invalidate),
      cmocka_unit_test(test_invalidation_scope),
      cmocka_unit_test(test_stream_identity_refused),
      cmocka_unit_test(test_per_thread_identity_refused),
      cmocka_unit_test(test_allowed_during_capture),
      cmocka_unit_test(test_default_stream_rules),
      cmocka_unit_test(test_event_recorded_in_capture),
      cmocka_unit_test(test_graph_destroy_with_replays_in_flight),
      cmocka_unit_test(test_unsafe_calls_refused_by_mode),
      cmocka_unit_test(test_capture_mode_rules),
      cmocka_unit_test(test_other_threads_and_modes),
      cmocka_unit_test(test_sync_calls_during_another_capture),
      cmocka_unit_test(test_backend_table),
      cmocka_unit_test(test_checker_sees_replays),
      cmocka_unit_test(test_concurrent_captures),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
