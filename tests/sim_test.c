/* Tests of the simulated device's streams and events (magpie_sim.h); its
 * memory, configuration and backend table are in sim_memory_test.c. Each test creates and destroys its own streams and
 * restores what it changes (current device, capacity, VMM switch).
 *
 * The process simulates three devices (MAGPIE_SIM_DEVICES is set in main
 * before the simulator's first use). Closures block on semaphores that the
 * test opens ("gates"), so each test controls when work may finish; every
 * blocking wait is bounded, so a broken simulator fails instead of hanging.
 */
#include "tests/sim_test_util.h"

/* ---------------------------------------------------------------- streams */

static void test_in_order_on_one_stream(void **state) {
  (void)state;
  static struct order_log log;
  static struct order_item items[1000];
  memset(&log, 0, sizeof log);
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  for (int i = 0; i < 1000; i++) {
    items[i] = (struct order_item){&log, i};
    assert_int_equal(magpie_sim_launch(s, order_append, &items[i]), MAGPIE_OK);
  }
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(log.next, 1000);
  for (int i = 0; i < 1000; i++) assert_int_equal(log.seen[i], i);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
}

/* Work on A blocks until work on B, launched after it, runs: only possible
 * if the two streams execute in parallel. */
static void post_gate(void *arg) { sem_post(arg); }

static void test_streams_run_concurrently(void **state) {
  (void)state;
  struct gated g;
  gated_init(&g);
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  assert_non_null(a);
  assert_non_null(b);
  assert_int_equal(magpie_sim_launch(a, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(b, post_gate, &g.gate), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(b), MAGPIE_OK);
  assert_int_equal(g.done, 1);
  assert_int_equal(g.opened, 1);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  gated_fini(&g);
}

static void test_stream_wait_orders_work(void **state) {
  (void)state;
  struct ordered o;
  memset(&o, 0, sizeof o);
  gated_init(&o.g);
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_launch(a, ordered_writer, &o), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait(b, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(b, ordered_reader, &o), MAGPIE_OK);
  sleep_ms(20); /* room for a broken simulator to run b early */
  assert_int_equal(atomic_load(&o.b_ran), 0);
  sem_post(&o.g.gate);
  assert_int_equal(magpie_sim_stream_synchronize(b), MAGPIE_OK);
  assert_int_equal(o.seen, 1);
  assert_int_equal(o.g.opened, 1);
  /* Waiting on oneself is a no-op, not a deadlock. */
  assert_int_equal(magpie_sim_stream_wait(a, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  gated_fini(&o.g);
}

static void test_stream_synchronize_waits(void **state) {
  (void)state;
  struct gated g;
  gated_init(&g);
  cudaStream_t s = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_launch(s, gated_run, &g), MAGPIE_OK);
  struct opener o;
  opener_start(&o, &g.gate, 1);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(g.done, 1);
  assert_int_equal(g.opened, 1);
  opener_join(&o);
  magpie_sim_stream_destroy(s);
  gated_fini(&g);
}

static void test_device_synchronize_waits_all(void **state) {
  (void)state;
  enum { N = 3 };
  struct gated g[N + 2];
  cudaStream_t s[N];
  for (int i = 0; i < N + 2; i++) gated_init(&g[i]);
  for (int i = 0; i < N; i++) {
    s[i] = magpie_sim_stream_create();
    assert_int_equal(magpie_sim_launch(s[i], gated_run, &g[i]), MAGPIE_OK);
  }
  /* A destroyed stream with pending work, and the default stream. */
  cudaStream_t dead = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_launch(dead, gated_run, &g[N]), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(dead), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(NULL, gated_run, &g[N + 1]), MAGPIE_OK);
  struct opener o[N + 2];
  for (int i = 0; i < N + 2; i++) opener_start(&o[i], &g[i].gate, 1);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  for (int i = 0; i < N + 2; i++) {
    assert_int_equal(g[i].done, 1);
    assert_int_equal(g[i].opened, 1);
    opener_join(&o[i]);
  }
  for (int i = 0; i < N; i++) magpie_sim_stream_destroy(s[i]);
  for (int i = 0; i < N + 2; i++) gated_fini(&g[i]);
}

/* Work on another device is not waited for by this device's synchronize. */
static void test_device_synchronize_is_per_device(void **state) {
  (void)state;
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t other = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_launch(other, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  /* Returns without the gate: had it waited for device 1, the closure's
   * gate would have timed out first. */
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  sem_post(&g.gate);
  assert_int_equal(sem_wait_ms(&g.finished, WAIT_MS), 0);
  assert_int_equal(g.opened, 1);
  magpie_sim_stream_destroy(other);
  gated_fini(&g);
}

static void test_handles_recycled_lifo_with_new_ids(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  assert_non_null(a);
  assert_non_null(b);
  assert_non_null(c);
  uint64_t ia = magpie_sim_stream_id(a), ib = magpie_sim_stream_id(b), ic = magpie_sim_stream_id(c);
  assert_true(ia != 0 && ib != 0 && ic != 0);
  assert_true(ia != ib && ib != ic && ia != ic);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
  cudaStream_t x = magpie_sim_stream_create(), y = magpie_sim_stream_create();
  assert_ptr_equal(x, b); /* most recently destroyed first */
  assert_ptr_equal(y, a);
  uint64_t ix = magpie_sim_stream_id(x), iy = magpie_sim_stream_id(y);
  assert_true(ix > ic && iy > ix); /* fresh ids, never reused */
  magpie_sim_stream_destroy(x);
  magpie_sim_stream_destroy(y);
  magpie_sim_stream_destroy(c);
}

static void test_destroyed_handle_is_invalid(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create(), live = magpie_sim_stream_create();
  magpie_sim_event e = magpie_sim_event_create();
  assert_non_null(e);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
  assert_true(magpie_sim_stream_id(s) == 0);
  assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_device(s), -1);
  int x = 0;
  assert_int_equal(magpie_sim_launch(s, set_flag, &x), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_INVALID_STREAM);
  assert_non_null(strstr(magpie_sim_last_error_message(), "magpie_sim_launch"));
  /* The simulator's error state is its own, not the allocator's. */
  assert_int_equal(magpie_last_error(), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_wait(s, live), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_wait(live, s), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_wait_event(s, e), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_ERR_INVALID_STREAM);
  /* Not a handle at all, and the special handles that cannot be destroyed. */
  assert_int_equal(magpie_sim_launch((cudaStream_t)&x, set_flag, &x), MAGPIE_ERR_INVALID_STREAM);
  assert_true(magpie_sim_stream_id((cudaStream_t)&x) == 0);
  assert_int_equal(magpie_sim_stream_destroy(NULL), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_destroy(MAGPIE_SIM_STREAM_PER_THREAD), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_launch(live, NULL, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(x, 0);
  magpie_sim_event_destroy(e);
  magpie_sim_stream_destroy(live);
}

struct two_steps {
  struct gated g;
  int second_after_first; /* written by the second closure */
  sem_t second_done;
};

static void second_step(void *arg) {
  struct two_steps *t = arg;
  t->second_after_first = t->g.done;
  sem_post(&t->second_done);
}

static void test_destroy_with_pending_work_runs_it(void **state) {
  (void)state;
  struct two_steps t;
  memset(&t, 0, sizeof t);
  gated_init(&t.g);
  sem_init(&t.second_done, 0, 0);
  cudaStream_t s = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_launch(s, gated_run, &t.g), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(s, second_step, &t), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK); /* returns at once */
  assert_true(magpie_sim_stream_id(s) == 0);
  sem_post(&t.g.gate);
  assert_int_equal(sem_wait_ms(&t.second_done, WAIT_MS), 0);
  assert_int_equal(t.second_after_first, 1);
  assert_int_equal(t.g.opened, 1);
  gated_fini(&t.g);
  sem_destroy(&t.second_done);
}

struct thread_ids {
  uint64_t first, second;
  struct gated *g; /* launched on the thread's per-thread stream */
  int launch_rc;
};

static void *per_thread_main(void *arg) {
  struct thread_ids *t = arg;
  t->first = magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD);
  t->second = magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD);
  t->launch_rc = magpie_sim_launch(MAGPIE_SIM_STREAM_PER_THREAD, gated_run, t->g);
  return NULL; /* the stream retires here; its pending work must still run */
}

static void test_per_thread_streams(void **state) {
  (void)state;
  uint64_t mine = magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD);
  assert_true(mine != 0);
  assert_true(magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD) == mine);
  assert_true(mine != magpie_sim_stream_id(NULL));
  int flag = 0;
  assert_int_equal(magpie_sim_launch(MAGPIE_SIM_STREAM_PER_THREAD, set_flag, &flag), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(MAGPIE_SIM_STREAM_PER_THREAD), MAGPIE_OK);
  assert_int_equal(flag, 1);

  struct gated g;
  gated_init(&g);
  struct thread_ids t = {.g = &g};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, per_thread_main, &t), 0);
  pthread_join(th, NULL);
  assert_int_equal(t.launch_rc, MAGPIE_OK);
  assert_true(t.first != 0);
  assert_true(t.first == t.second);
  assert_true(t.first != mine);
  sem_post(&g.gate);
  assert_int_equal(sem_wait_ms(&g.finished, WAIT_MS), 0);
  assert_int_equal(g.opened, 1);
  gated_fini(&g);
}

static void test_default_stream_per_device(void **state) {
  (void)state;
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  uint64_t d0 = magpie_sim_stream_id(NULL);
  assert_true(d0 != 0);
  assert_true(magpie_sim_stream_id((cudaStream_t)1) == d0); /* legacy handle */
  assert_true(magpie_sim_stream_id(NULL) == d0);
  assert_int_equal(magpie_sim_stream_device(NULL), 0);
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  uint64_t d1 = magpie_sim_stream_id(NULL);
  assert_true(d1 != 0 && d1 != d0);
  assert_int_equal(magpie_sim_stream_device(NULL), 1);
  uint64_t pt1 = magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD);
  assert_int_equal(magpie_sim_stream_device(MAGPIE_SIM_STREAM_PER_THREAD), 1);
  int flag = 0;
  assert_int_equal(magpie_sim_launch(NULL, set_flag, &flag), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(NULL), MAGPIE_OK);
  assert_int_equal(flag, 1);
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_true(magpie_sim_stream_id(NULL) == d0);
  assert_true(magpie_sim_stream_id(MAGPIE_SIM_STREAM_PER_THREAD) != pt1);
}

static void test_devices(void **state) {
  (void)state;
  assert_int_equal(magpie_sim_device_count(), TEST_DEVICES);
  assert_int_equal(magpie_sim_get_device(), 0);
  assert_int_equal(magpie_sim_set_device(TEST_DEVICES), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_set_device(-1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_get_device(), 0);
  magpie_sim_event e0 = magpie_sim_event_create(); /* device 0 */
  assert_int_equal(magpie_sim_set_device(2), MAGPIE_OK);
  assert_int_equal(magpie_sim_get_device(), 2);
  cudaStream_t s = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_stream_device(s), 2);
  /* An event belongs to its device, as in CUDA. */
  assert_int_equal(magpie_sim_event_record(e0, s), MAGPIE_ERR_INVALID_ARGUMENT);
  magpie_sim_event e2 = magpie_sim_event_create();
  assert_int_equal(magpie_sim_event_record(e2, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_synchronize(e2), MAGPIE_OK);
  /* Waiting across devices is allowed. */
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait_event(NULL, e2), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait(NULL, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(NULL), MAGPIE_OK);
  /* Stream handles keep their device whatever the current device is. */
  assert_int_equal(magpie_sim_stream_device(s), 2);
  size_t f0, t0, f2, t2;
  assert_int_equal(magpie_sim_mem_info(0, &f0, &t0), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(2, &f2, &t2), MAGPIE_OK);
  assert_true(t0 == SIM_DEFAULT_CAPACITY && t2 == SIM_DEFAULT_CAPACITY);
  assert_int_equal(magpie_sim_mem_info(TEST_DEVICES, &f0, &t0), MAGPIE_ERR_INVALID_ARGUMENT);
  magpie_sim_event_destroy(e0);
  magpie_sim_event_destroy(e2);
  magpie_sim_stream_destroy(s);
}

/* ---------------------------------------------------------------- events */

static void test_events(void **state) {
  (void)state;
  magpie_sim_event e = magpie_sim_event_create();
  assert_non_null(e);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_OK); /* never recorded */
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  struct gated g;
  gated_init(&g);
  cudaStream_t s = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_launch(s, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_SIM_NOT_READY);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_SIM_NOT_READY);
  sem_post(&g.gate);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_OK);
  assert_int_equal(g.done, 1); /* the synchronize ordered the work before us */

  /* Re-record: the event follows the latest record. */
  struct gated g2;
  gated_init(&g2);
  assert_int_equal(magpie_sim_launch(s, gated_run, &g2), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_SIM_NOT_READY);
  struct opener o;
  opener_start(&o, &g2.gate, 1);
  while (magpie_sim_event_query(e) == MAGPIE_SIM_NOT_READY) sleep_ms(1);
  assert_int_equal(g2.done, 1); /* a query reporting completion is an edge too */
  opener_join(&o);

  /* Destroyed: detected (the event is not reused meanwhile). */
  assert_int_equal(magpie_sim_event_destroy(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_event_destroy(e), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_event_query(NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  magpie_sim_stream_destroy(s);
  gated_fini(&g);
  gated_fini(&g2);
}

/* An event recorded on a stream with nothing pending that never ran work
 * (markers alone) completes at once, without its worker. Once the stream
 * ran work its records go through the worker again: completing at once
 * there would order the work before the recording host, which no CUDA call
 * does (sim_race_demo_test's host-record mode). */
static void test_event_on_idle_stream_completes_at_once(void **state) {
  (void)state;
  magpie_sim_event e = magpie_sim_event_create();
  assert_non_null(e);
  cudaStream_t s = magpie_sim_stream_create();
  for (int i = 0; i < 3; i++) {
    assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
    assert_int_equal(magpie_sim_event_query(e), MAGPIE_OK);
  }
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_OK);

  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(s, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_query(e), MAGPIE_SIM_NOT_READY); /* work queued: pending */
  sem_post(&g.gate);
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(g.done, 1);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_OK); /* through the worker now */
  assert_int_equal(magpie_sim_event_synchronize(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_destroy(e), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
  gated_fini(&g);
}

/* A destroyed event's pending record still orders a stream wait made
 * before the destroy. */
static void test_stream_wait_event_orders_work(void **state) {
  (void)state;
  struct ordered o;
  memset(&o, 0, sizeof o);
  gated_init(&o.g);
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  magpie_sim_event e = magpie_sim_event_create();
  /* Never recorded: waiting on it is a no-op. */
  assert_int_equal(magpie_sim_stream_wait_event(b, e), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(a, ordered_writer, &o), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_record(e, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_wait_event(b, e), MAGPIE_OK);
  assert_int_equal(magpie_sim_event_destroy(e), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(b, ordered_reader, &o), MAGPIE_OK);
  sleep_ms(20); /* room for a broken simulator to run b early */
  assert_int_equal(atomic_load(&o.b_ran), 0);
  sem_post(&o.g.gate);
  assert_int_equal(magpie_sim_stream_synchronize(b), MAGPIE_OK);
  assert_int_equal(o.seen, 1);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  gated_fini(&o.g);
}

/* ---------------------------------------------------------------- producers */

enum { PRODUCERS = 4, PER_PRODUCER = 500 };
struct produced {
  int count;
  int last[PRODUCERS]; /* last sequence number seen per producer */
  int out_of_order;
};
struct produce_item {
  struct produced *p;
  int producer, seq;
};
struct producer_arg {
  cudaStream_t s;
  struct produce_item items[PER_PRODUCER];
};

static void produce_record(void *arg) {
  struct produce_item *it = arg;
  if (it->seq != it->p->last[it->producer] + 1) it->p->out_of_order++;
  it->p->last[it->producer] = it->seq;
  it->p->count++;
}

static void *producer_main(void *arg) {
  struct producer_arg *a = arg;
  for (int i = 0; i < PER_PRODUCER; i++)
    if (magpie_sim_launch(a->s, produce_record, &a->items[i]) != MAGPIE_OK) break;
  return NULL;
}

static void test_many_producers_one_stream(void **state) {
  (void)state;
  static struct produced p;
  static struct producer_arg args[PRODUCERS];
  memset(&p, 0, sizeof p);
  cudaStream_t s = magpie_sim_stream_create();
  pthread_t th[PRODUCERS];
  for (int t = 0; t < PRODUCERS; t++) {
    p.last[t] = -1;
    args[t].s = s;
    for (int i = 0; i < PER_PRODUCER; i++) args[t].items[i] = (struct produce_item){&p, t, i};
  }
  for (int t = 0; t < PRODUCERS; t++) assert_int_equal(pthread_create(&th[t], NULL, producer_main, &args[t]), 0);
  for (int t = 0; t < PRODUCERS; t++) pthread_join(th[t], NULL);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(p.count, PRODUCERS * PER_PRODUCER);
  assert_int_equal(p.out_of_order, 0);
  magpie_sim_stream_destroy(s);
}

/* Streams created, used and destroyed with work pending on several
 * threads, while the main thread synchronizes the device: exercises the
 * registry pins and the dying workers' hand-over. Every counted closure ran
 * once the device synchronize after the churn returns. */
enum { CHURNERS = 3, CHURN_ROUNDS = 60 };
struct churn {
  atomic_int ran;
  atomic_int launched;
  atomic_int failures;
};

static void churn_count(void *arg) { atomic_fetch_add(&((struct churn *)arg)->ran, 1); }

static void *churn_main(void *arg) {
  struct churn *c = arg;
  for (int r = 0; r < CHURN_ROUNDS; r++) {
    cudaStream_t s = magpie_sim_stream_create();
    if (s == NULL) {
      atomic_fetch_add(&c->failures, 1);
      continue;
    }
    for (int k = 0; k < 3; k++)
      if (magpie_sim_launch(s, churn_count, c) == MAGPIE_OK) atomic_fetch_add(&c->launched, 1);
    if (r % 4 == 0) magpie_sim_stream_synchronize(s);
    if (magpie_sim_launch(MAGPIE_SIM_STREAM_PER_THREAD, churn_count, c) == MAGPIE_OK) atomic_fetch_add(&c->launched, 1);
    if (magpie_sim_stream_destroy(s) != MAGPIE_OK) atomic_fetch_add(&c->failures, 1);
  }
  return NULL;
}

static void test_churn_with_device_synchronize(void **state) {
  (void)state;
  struct churn c = {0};
  pthread_t th[CHURNERS];
  for (int t = 0; t < CHURNERS; t++) assert_int_equal(pthread_create(&th[t], NULL, churn_main, &c), 0);
  for (int i = 0; i < 50; i++) assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  for (int t = 0; t < CHURNERS; t++) pthread_join(th[t], NULL);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(atomic_load(&c.failures), 0);
  assert_int_equal(atomic_load(&c.launched), CHURNERS * CHURN_ROUNDS * 4);
  assert_int_equal(atomic_load(&c.ran), atomic_load(&c.launched));
}

/* The launch queue is bounded: with the stream held by a closure waiting at
 * a gate, a thread launching more blocks once MAGPIE_SIM_QUEUE_DEPTH
 * launches wait, and goes on when the stream runs them. Unbounded, a host
 * running ahead grew the queue by ~550 MB/s until the process was killed. */
struct launcher {
  cudaStream_t s;
  atomic_int launched;
  atomic_int ran;
};

static void count_run(void *arg) { atomic_fetch_add(&((struct launcher *)arg)->ran, 1); }

static void *launch_many(void *arg) {
  struct launcher *l = arg;
  for (unsigned i = 0; i < 2 * MAGPIE_SIM_QUEUE_DEPTH; i++) {
    if (magpie_sim_launch(l->s, count_run, l) != MAGPIE_OK) break;
    atomic_fetch_add(&l->launched, 1);
  }
  return NULL;
}

static void test_launch_queue_bounded(void **state) {
  (void)state;
  struct launcher l = {.s = magpie_sim_stream_create()};
  assert_non_null(l.s);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(l.s, gated_run, &g), MAGPIE_OK); /* holds the stream */
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, launch_many, &l), 0);
  /* Until the gate opens the launcher gets DEPTH - 1 more in, then blocks. */
  for (int i = 0; i < 200 && atomic_load(&l.launched) < (int)MAGPIE_SIM_QUEUE_DEPTH - 1; i++) sleep_ms(5);
  sleep_ms(100);
  assert_int_equal(atomic_load(&l.launched), (int)MAGPIE_SIM_QUEUE_DEPTH - 1);
  assert_int_equal(atomic_load(&l.ran), 0);
  sem_post(&g.gate);
  pthread_join(t, NULL);
  assert_int_equal(magpie_sim_stream_synchronize(l.s), MAGPIE_OK);
  assert_int_equal(atomic_load(&l.launched), 2 * (int)MAGPIE_SIM_QUEUE_DEPTH);
  assert_int_equal(atomic_load(&l.ran), 2 * (int)MAGPIE_SIM_QUEUE_DEPTH);
  assert_int_equal(magpie_sim_stream_destroy(l.s), MAGPIE_OK);
  gated_fini(&g);
}

int main(void) {
  /* Before the simulator's first use: it reads the environment once. */
  setenv("MAGPIE_SIM_DEVICES", "3", 1);
  unsetenv("MAGPIE_SIM_MEMORY");
  unsetenv("MAGPIE_SIM_VMM");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_in_order_on_one_stream),
      cmocka_unit_test(test_streams_run_concurrently),
      cmocka_unit_test(test_stream_wait_orders_work),
      cmocka_unit_test(test_stream_synchronize_waits),
      cmocka_unit_test(test_device_synchronize_waits_all),
      cmocka_unit_test(test_device_synchronize_is_per_device),
      cmocka_unit_test(test_handles_recycled_lifo_with_new_ids),
      cmocka_unit_test(test_destroyed_handle_is_invalid),
      cmocka_unit_test(test_destroy_with_pending_work_runs_it),
      cmocka_unit_test(test_per_thread_streams),
      cmocka_unit_test(test_default_stream_per_device),
      cmocka_unit_test(test_devices),
      cmocka_unit_test(test_events),
      cmocka_unit_test(test_event_on_idle_stream_completes_at_once),
      cmocka_unit_test(test_stream_wait_event_orders_work),
      cmocka_unit_test(test_many_producers_one_stream),
      cmocka_unit_test(test_churn_with_device_synchronize),
      cmocka_unit_test(test_launch_queue_bounded),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
