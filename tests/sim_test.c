/* Tests of the simulated device (magpie_sim.h) and of the backend table over
 * it (backend_sim()). Each test creates and destroys its own streams and
 * restores what it changes (current device, capacity, VMM switch).
 *
 * The process simulates three devices (MAGPIE_SIM_DEVICES is set in main
 * before the simulator's first use). Closures block on semaphores that the
 * test opens ("gates"), so each test controls when work may finish; every
 * blocking wait is bounded, so a broken simulator fails instead of hanging.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>
#include <pthread.h>
#include <spawn.h>
#include <sys/wait.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "magpie_sim.h"
#include "src/backend.h"
#include "src/sim_internal.h"

#define MiB ((size_t)1 << 20)
#define TEST_DEVICES 3
#define WAIT_MS 10000 /* bound on every wait that a correct simulator ends */

/* ---------------------------------------------------------------- helpers */

/* 0 if s was posted within ms, -1 on timeout. */
static int sem_wait_ms(sem_t *s, int ms) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  t.tv_sec += ms / 1000;
  t.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec++;
    t.tv_nsec -= 1000000000L;
  }
  int rc;
  while ((rc = sem_timedwait(s, &t)) != 0 && errno == EINTR) {
  }
  return rc == 0 ? 0 : -1;
}

static void sleep_ms(int ms) {
  struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* A closure that waits for a gate (bounded), then sets a flag and posts a
 * completion semaphore. The flag is plain memory: reading it is correct only
 * after an edge from the stream (synchronize, event, device synchronize). */
struct gated {
  sem_t gate;
  sem_t finished;
  int opened;   /* 1 if the gate opened in time (written by the closure) */
  int done;     /* written by the closure */
  atomic_int started;
};

static void gated_init(struct gated *g) {
  memset(g, 0, sizeof *g);
  sem_init(&g->gate, 0, 0);
  sem_init(&g->finished, 0, 0);
}

static void gated_fini(struct gated *g) {
  sem_destroy(&g->gate);
  sem_destroy(&g->finished);
}

static void gated_run(void *arg) {
  struct gated *g = arg;
  atomic_store(&g->started, 1);
  g->opened = sem_wait_ms(&g->gate, WAIT_MS) == 0;
  g->done = 1;
  sem_post(&g->finished);
}

/* Opens a gate from another thread after a delay, so that the main thread is
 * already blocked in the call under test when the work completes. */
struct opener {
  pthread_t thread;
  sem_t *gate;
  int posts;
};

static void *opener_main(void *arg) {
  struct opener *o = arg;
  sleep_ms(20);
  for (int i = 0; i < o->posts; i++) sem_post(o->gate);
  return NULL;
}

static void opener_start(struct opener *o, sem_t *gate, int posts) {
  o->gate = gate;
  o->posts = posts;
  assert_int_equal(pthread_create(&o->thread, NULL, opener_main, o), 0);
}

static void opener_join(struct opener *o) { pthread_join(o->thread, NULL); }

static void set_flag(void *arg) { *(int *)arg = 1; }

/* ---------------------------------------------------------------- streams */

struct order_log {
  int next;
  int seen[1000];
};
struct order_item {
  struct order_log *log;
  int index;
};

static void order_append(void *arg) {
  struct order_item *it = arg;
  it->log->seen[it->log->next++] = it->index;
}

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

struct ordered {
  struct gated g;
  int x;          /* written on the first stream after its gate */
  int seen;       /* the value the second stream read */
  atomic_int b_ran;
};

static void ordered_writer(void *arg) {
  struct ordered *o = arg;
  gated_run(&o->g);
  o->x = 1;
}

static void ordered_reader(void *arg) {
  struct ordered *o = arg;
  o->seen = o->x;
  atomic_store(&o->b_ran, 1);
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
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create(),
               c = magpie_sim_stream_create();
  assert_non_null(a);
  assert_non_null(b);
  assert_non_null(c);
  uint64_t ia = magpie_sim_stream_id(a), ib = magpie_sim_stream_id(b),
           ic = magpie_sim_stream_id(c);
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
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_device(s), -1);
  int x = 0;
  assert_int_equal(magpie_sim_launch(s, set_flag, &x), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_INVALID_STREAM);
  assert_non_null(strstr(magpie_last_error_message(), "magpie_sim_launch"));
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_wait(s, live), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_wait(live, s), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_event_record(e, s), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_wait_event(s, e), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_ERR_INVALID_STREAM);
  /* Not a handle at all, and the special handles that cannot be destroyed. */
  assert_int_equal(magpie_sim_launch((cudaStream_t)&x, set_flag, &x),
                   MAGPIE_ERR_INVALID_STREAM);
  assert_true(magpie_sim_stream_id((cudaStream_t)&x) == 0);
  assert_int_equal(magpie_sim_stream_destroy(NULL), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_sim_stream_destroy(MAGPIE_SIM_STREAM_PER_THREAD),
                   MAGPIE_ERR_INVALID_STREAM);
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
  assert_int_equal(magpie_sim_launch(MAGPIE_SIM_STREAM_PER_THREAD, set_flag, &flag),
                   MAGPIE_OK);
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
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_INVALID_ARGUMENT);
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
  for (int t = 0; t < PRODUCERS; t++)
    assert_int_equal(pthread_create(&th[t], NULL, producer_main, &args[t]), 0);
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
    if (magpie_sim_launch(MAGPIE_SIM_STREAM_PER_THREAD, churn_count, c) == MAGPIE_OK)
      atomic_fetch_add(&c->launched, 1);
    if (magpie_sim_stream_destroy(s) != MAGPIE_OK) atomic_fetch_add(&c->failures, 1);
  }
  return NULL;
}

static void test_churn_with_device_synchronize(void **state) {
  (void)state;
  struct churn c = {0};
  pthread_t th[CHURNERS];
  for (int t = 0; t < CHURNERS; t++)
    assert_int_equal(pthread_create(&th[t], NULL, churn_main, &c), 0);
  for (int i = 0; i < 50; i++) assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  for (int t = 0; t < CHURNERS; t++) pthread_join(th[t], NULL);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(atomic_load(&c.failures), 0);
  assert_int_equal(atomic_load(&c.launched), CHURNERS * CHURN_ROUNDS * 4);
  assert_int_equal(atomic_load(&c.ran), atomic_load(&c.launched));
}

/* ---------------------------------------------------------------- memory */

static void test_memory_reserve_map_unmap(void **state) {
  (void)state;
  size_t free0, total0, f, t;
  assert_int_equal(sim_memory_info(0, &free0, &total0), MAGPIE_OK);
  uintptr_t base;
  assert_int_equal(sim_memory_reserve(0, 8 * MiB, &base), MAGPIE_OK);
  assert_int_equal(base % SIM_GRANULARITY, 0);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0); /* a reservation costs no capacity */
  assert_int_equal(sim_memory_map(0, base + 2 * MiB, 4 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0 - 4 * MiB && t == total0);
  memset((void *)(base + 2 * MiB), 0xab, 4 * MiB);
  assert_int_equal(((unsigned char *)base)[6 * MiB - 1], 0xab);
  /* Honest errors: mapping twice, unmapping what is not mapped, ranges
   * outside reservations or not on the granularity, unreserving a mapped
   * reservation. Each leaves the figures unchanged. */
  assert_int_equal(sim_memory_map(0, base + 4 * MiB, 2 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_unmap(0, base, 2 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_map(0, base + 1, 2 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_map(0, base + 6 * MiB, 4 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_map(1, base, 2 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_unreserve(0, base, 8 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_true(strlen(backend_error_detail()) > 0);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0 - 4 * MiB);
  /* Partial unmap, then the rest. */
  assert_int_equal(sim_memory_unmap(0, base + 2 * MiB, 2 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0 - 2 * MiB);
  assert_int_equal(sim_memory_unmap(0, base + 4 * MiB, 2 * MiB), MAGPIE_OK);
  /* Mapped again after an unmap: usable. */
  assert_int_equal(sim_memory_map(0, base, 8 * MiB), MAGPIE_OK);
  ((volatile char *)base)[8 * MiB - 1] = 1;
  assert_int_equal(sim_memory_unmap(0, base, 8 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0);
  assert_int_equal(sim_memory_unreserve(0, base, 8 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unreserve(0, base, 8 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_reserve(0, 3 * MiB, &base), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_reserve(0, 0, &base), MAGPIE_ERR_INVALID_ARGUMENT);
}

static void test_memory_over_capacity(void **state) {
  (void)state;
  assert_int_equal(sim_memory_set_capacity(1, 6 * MiB), MAGPIE_OK);
  size_t f, t;
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 6 * MiB && t == 6 * MiB);
  uintptr_t base;
  assert_int_equal(sim_memory_reserve(1, 16 * MiB, &base), MAGPIE_OK);
  assert_int_equal(sim_memory_map(1, base, 4 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_map(1, base + 4 * MiB, 4 * MiB), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 2 * MiB && t == 6 * MiB);
  /* The failed map left its range unmapped: mapping part of it works. */
  assert_int_equal(sim_memory_map(1, base + 4 * MiB, 2 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 0);
  uintptr_t p;
  assert_int_equal(sim_memory_alloc(1, 1, &p), MAGPIE_ERR_OUT_OF_MEMORY);
  /* A capacity below what is in use: nothing free, nothing lost. */
  assert_int_equal(sim_memory_set_capacity(1, 2 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 0 && t == 2 * MiB);
  assert_int_equal(sim_memory_set_capacity(1, 6 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unmap(1, base, 6 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 6 * MiB);
  assert_int_equal(sim_memory_unreserve(1, base, 16 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_set_capacity(1, SIM_DEFAULT_CAPACITY), MAGPIE_OK);
}

static void test_memory_alloc_free(void **state) {
  (void)state;
  assert_int_equal(sim_memory_set_capacity(2, 8 * MiB), MAGPIE_OK);
  uintptr_t p, q;
  size_t f, t;
  assert_int_equal(sim_memory_alloc(2, 3 * MiB, &p), MAGPIE_OK);
  assert_int_equal(p % SIM_GRANULARITY, 0);
  memset((void *)p, 1, 3 * MiB);
  assert_int_equal(sim_memory_info(2, &f, &t), MAGPIE_OK);
  assert_true(f == 4 * MiB); /* counted in whole granules */
  assert_int_equal(sim_memory_alloc(2, 4 * MiB + 1, &q), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(sim_memory_alloc(2, 4 * MiB, &q), MAGPIE_OK);
  assert_int_equal(sim_memory_free(2, p + 4096, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_free(1, p, 3 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_free(2, p, 3 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_free(2, p, 3 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_free(2, q, 4 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(2, &f, &t), MAGPIE_OK);
  assert_true(f == 8 * MiB);
  assert_int_equal(sim_memory_alloc(2, 0, &p), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_alloc(2, SIZE_MAX, &p), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(sim_memory_set_capacity(2, SIM_DEFAULT_CAPACITY), MAGPIE_OK);
}

static void test_config_parsing(void **state) {
  (void)state;
  uint64_t v;
  assert_int_equal(sim_parse_size("4g", 1, &v), 0);
  assert_true(v == (uint64_t)4 << 30);
  assert_int_equal(sim_parse_size("12M", 1, &v), 0);
  assert_true(v == (uint64_t)12 << 20);
  assert_int_equal(sim_parse_size("512k", 1, &v), 0);
  assert_true(v == 512 * 1024);
  assert_int_equal(sim_parse_size("123", 0, &v), 0);
  assert_true(v == 123);
  assert_int_equal(sim_parse_size("", 1, &v), -1);
  assert_int_equal(sim_parse_size("4x", 1, &v), -1);
  assert_int_equal(sim_parse_size("4g", 0, &v), -1);
  assert_int_equal(sim_parse_size("-1", 1, &v), -1);
  assert_int_equal(sim_parse_size("4gb", 1, &v), -1);
  assert_int_equal(sim_parse_size("99999999999999999999", 1, &v), -1);
  assert_int_equal(sim_parse_size("17179869184g", 1, &v), -1);
  assert_int_equal(sim_parse_size(NULL, 1, &v), -1);
}

/* A malformed variable is reported, not fatal. The environment is read once
 * per process, so each case runs in a fresh copy of this program (see
 * config_child in main). */
extern char **environ;

static int run_config_child(const char *assignment, const char *variable) {
  char *argv[] = {"sim_test", "--config-child", (char *)variable, NULL};
  size_t n = 0;
  while (environ[n] != NULL) n++;
  char **envp = calloc(n + 2, sizeof *envp);
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "MAGPIE_SIM_", 11) != 0) envp[k++] = environ[i];
  envp[k++] = (char *)assignment;
  envp[k] = NULL;
  pid_t pid;
  int rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, envp);
  free(envp);
  if (rc != 0) return -1;
  int status;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* In the child: every entry point fails with MAGPIE_ERR_CONFIG naming the
 * variable; exit 0 if so. */
static int config_child(const char *variable) {
  int ok = 1;
  ok &= magpie_sim_stream_create() == NULL;
  ok &= magpie_last_error() == MAGPIE_ERR_CONFIG;
  ok &= strstr(magpie_last_error_message(), variable) != NULL;
  static int flag;
  ok &= magpie_sim_launch(NULL, set_flag, &flag) == MAGPIE_ERR_CONFIG;
  ok &= magpie_sim_device_count() == 0;
  ok &= backend_sim()->init() == MAGPIE_ERR_CONFIG;
  ok &= strstr(backend_error_detail(), variable) != NULL;
  size_t f, t;
  ok &= magpie_sim_mem_info(0, &f, &t) == MAGPIE_ERR_CONFIG;
  return ok ? 0 : 1;
}

static void test_bad_environment_is_reported(void **state) {
  (void)state;
  assert_int_equal(run_config_child("MAGPIE_SIM_MEMORY=12x", "MAGPIE_SIM_MEMORY"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_MEMORY=0", "MAGPIE_SIM_MEMORY"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_DEVICES=17", "MAGPIE_SIM_DEVICES"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_DEVICES=two", "MAGPIE_SIM_DEVICES"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_VMM=yes", "MAGPIE_SIM_VMM"), 0);
  /* The check can fail: a good value is not reported. */
  assert_int_equal(run_config_child("MAGPIE_SIM_MEMORY=64m", "MAGPIE_SIM_MEMORY"), 1);
}

/* ---------------------------------------------------------------- backend */

static void test_backend_table(void **state) {
  (void)state;
  const backend_ops *ops = backend_sim();
  assert_string_equal(ops->name, "sim");
  assert_int_equal(ops->init(), MAGPIE_OK);
  assert_int_equal(ops->init(), MAGPIE_OK); /* idempotent */
  int n = 0, vmm = -1;
  assert_int_equal(ops->device_count(&n), MAGPIE_OK);
  assert_int_equal(n, TEST_DEVICES);
  size_t gran = 0, f, t;
  assert_int_equal(ops->granularity(0, &gran), MAGPIE_OK);
  assert_true(gran == 2 * MiB);
  assert_int_equal(ops->vmm_supported(0, &vmm), MAGPIE_OK);
  assert_int_equal(vmm, 1);
  assert_int_equal(ops->mem_info(0, &f, &t), MAGPIE_OK);
  assert_true(t == SIM_DEFAULT_CAPACITY);
  assert_int_equal(ops->granularity(TEST_DEVICES, &gran), MAGPIE_ERR_INVALID_ARGUMENT);

  /* Virtual memory. */
  uintptr_t base, p;
  assert_int_equal(ops->reserve(0, 4 * gran, &base), MAGPIE_OK);
  assert_int_equal(ops->map(0, base, 2 * gran), MAGPIE_OK);
  *(volatile int *)base = 7;
  size_t f2;
  assert_int_equal(ops->mem_info(0, &f2, &t), MAGPIE_OK);
  assert_true(f2 == f - 2 * gran);
  assert_int_equal(ops->unmap(0, base, 2 * gran), MAGPIE_OK);
  assert_int_equal(ops->unreserve(0, base, 4 * gran), MAGPIE_OK);
  assert_int_equal(ops->mem_alloc(0, gran, &p), MAGPIE_OK);
  assert_int_equal(ops->mem_free(0, p, gran), MAGPIE_OK);

  /* Without VMM: reported, and the VMM operations refuse. */
  sim_memory_set_vmm(0);
  assert_int_equal(ops->vmm_supported(0, &vmm), MAGPIE_OK);
  assert_int_equal(vmm, 0);
  assert_int_equal(ops->reserve(0, gran, &base), MAGPIE_ERR_BACKEND);
  assert_non_null(strstr(backend_error_detail(), "MAGPIE_SIM_VMM"));
  assert_int_equal(ops->mem_alloc(0, gran, &p), MAGPIE_OK);
  assert_int_equal(ops->mem_free(0, p, gran), MAGPIE_OK);
  sim_memory_set_vmm(1);

  /* Streams and events. */
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  uint64_t id;
  int dev = -1;
  assert_int_equal(ops->stream_id(a, &id), MAGPIE_OK);
  assert_true(id == magpie_sim_stream_id(a));
  assert_int_equal(ops->stream_id(NULL, &id), MAGPIE_OK);
  assert_true(id == magpie_sim_stream_id(NULL));
  assert_int_equal(ops->stream_device(b, &dev), MAGPIE_OK);
  assert_int_equal(dev, 0);
  void *ev = NULL;
  assert_int_equal(ops->event_create(0, &ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  struct ordered o;
  memset(&o, 0, sizeof o);
  gated_init(&o.g);
  assert_int_equal(magpie_sim_launch(a, ordered_writer, &o), MAGPIE_OK);
  assert_int_equal(ops->event_record(ev, a), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), BACKEND_NOT_READY);
  assert_int_equal(ops->stream_wait_event(b, ev), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(b, ordered_reader, &o), MAGPIE_OK);
  sem_post(&o.g.gate);
  assert_int_equal(ops->event_synchronize(ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  assert_int_equal(ops->device_synchronize(0), MAGPIE_OK);
  assert_int_equal(o.seen, 1);
  assert_int_equal(atomic_load(&o.b_ran), 1);
  assert_int_equal(ops->event_destroy(ev), MAGPIE_OK);
  assert_int_equal(ops->event_create(TEST_DEVICES, &ev), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->device_synchronize(TEST_DEVICES), MAGPIE_ERR_INVALID_ARGUMENT);

  /* Destroyed stream: INVALID_STREAM with a reason. */
  magpie_sim_stream_destroy(a);
  backend_set_error_detail("%s", "");
  assert_int_equal(ops->stream_id(a, &id), MAGPIE_ERR_INVALID_STREAM);
  assert_true(strlen(backend_error_detail()) > 0);
  assert_int_equal(ops->stream_device(a, &dev), MAGPIE_ERR_INVALID_STREAM);
  magpie_sim_stream_destroy(b);
  gated_fini(&o.g);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--config-child") == 0) return config_child(argv[2]);
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
      cmocka_unit_test(test_stream_wait_event_orders_work),
      cmocka_unit_test(test_many_producers_one_stream),
      cmocka_unit_test(test_churn_with_device_synchronize),
      cmocka_unit_test(test_memory_reserve_map_unmap),
      cmocka_unit_test(test_memory_over_capacity),
      cmocka_unit_test(test_memory_alloc_free),
      cmocka_unit_test(test_config_parsing),
      cmocka_unit_test(test_bad_environment_is_reported),
      cmocka_unit_test(test_backend_table),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
