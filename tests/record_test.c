/* magpie_record_stream on the simulated device: a block used on streams
 * other than the freeing one is reused by nobody (the freeing stream
 * included) until the work enqueued on every recorded stream before the
 * free has completed; it comes back once it has; errors are reported.
 *
 * "Work" is a gated closure (tests/sim_test_util.h) that blocks its stream
 * until the test opens the gate, so "not yet completed" lasts as long as
 * the test needs, however many allocations it makes meanwhile. */
#include "tests/sim_test_util.h"

#include "heap/heap.h"
#include "pool/record.h"
#include "tcache/tcache.h"

#define SMALL 4096
#define LARGE (4 * MiB)
#define ROUNDS 3000 /* allocations while the work is pending: dozens of refills */

static heap *heap0(void) { return heap_peek(0); }

/* The stats' layers add up to what is reserved (no thread inside magpie),
 * parked blocks counted as waiting on streams; returns that figure. The
 * maintenance thread may be inside magpie, between the counters one
 * snapshot reads: the identity is asked of a snapshot taken while nothing
 * moves, retried for up to WAIT_MS. In the debug build (at 89e95d5), 1
 * run in 40 met such a snapshot once. */
static size_t layers_add_up(void) {
  magpie_stats s;
  size_t sum = 0;
  for (int i = 0; i < WAIT_MS; i++) {
    assert_int_equal(magpie_stats_get(0, &s), MAGPIE_OK);
    sum = s.in_use_bytes + s.thread_cached_bytes + s.depot_bytes + s.epoch_pending_bytes + s.large_free_bytes +
          s.overhead_bytes;
    if (sum == s.reserved_bytes) break;
    sleep_ms(1);
  }
  assert_int_equal(sum, s.reserved_bytes);
  assert_true(s.large_in_use_bytes <= s.in_use_bytes);
  assert_true(s.epoch_pending_bytes >= record_pending_bytes(&heap0()->records));
  return s.epoch_pending_bytes;
}

/* Allocate n blocks of size on s into out[], asserting none overlaps the
 * block of that size at p. */
static void alloc_none_is(void **out, int n, size_t size, cudaStream_t s, void *p) {
  for (int i = 0; i < n; i++) {
    out[i] = magpie_malloc_async(size, s);
    assert_non_null(out[i]);
    uintptr_t q = (uintptr_t)out[i], b = (uintptr_t)p;
    assert_false(q < b + size && b < q + size);
  }
}

static void free_all(void **v, int n, cudaStream_t s) {
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(v[i], s), MAGPIE_OK);
}

/* Does block q share a byte with block p, both of size bytes? */
static int overlaps(const void *q, const void *p, size_t size) {
  return (const char *)q < (const char *)p + size && (const char *)p < (const char *)q + size;
}

/* Allocates blocks of p's size on s until p's bytes come back (bounded);
 * frees what it took. A slab block comes back as itself. A large block's
 * bytes may come back inside a block that starts elsewhere: its free
 * neighbours merge with it, and since spans take granules the large
 * segments lend (and give them back when empty), a returned granule next
 * to p made the 4 MiB blocks that followed start 2 MiB before it, in 3 of
 * 16 runs of this test under TSan; every byte of the device was handed out
 * and p never was, at its own address. */
static int comes_back(void *p, size_t size, cudaStream_t s) {
  static void *v[20000];
  int n = 0, found = 0;
  while (n < 20000 && !found) {
    v[n] = magpie_malloc_async(size, s);
    assert_non_null(v[n]);
    void *q = v[n++];
    found = q == p || (size > SIZECLASS_MAX_SIZE && overlaps(q, p, size));
  }
  free_all(v, n, s);
  return found;
}

/* Opens the gate and waits (in the test, not the library) until the gated
 * stream and the block's other stream (freeing or recorded) drained, so
 * that the events sealed at the free have completed when the test expects
 * the block back: the simulator completes even an idle stream's event on
 * its worker thread, a little later. */
static void gate_open_and_sync(struct gated *g, cudaStream_t s, cudaStream_t other) {
  sem_post(&g->gate);
  assert_int_equal(sem_wait_ms(&g->finished, WAIT_MS), 0);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(other), MAGPIE_OK);
  assert_true(g->opened);
}

/* The control: without a record, a block freed on A comes straight back to
 * A (so the tests below would see the reuse if record_stream did nothing). */
static void test_control_same_stream_reuse(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create();
  void *p = magpie_malloc_async(SMALL, a);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  void *q = magpie_malloc_async(SMALL, a);
  assert_ptr_equal(q, p);
  assert_int_equal(magpie_free_async(q, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
}

/* Used on B (slow), recorded on B, freed on A: neither A nor C gets it while
 * B's work is pending; it returns after. */
static void run_recorded_case(size_t size, int rounds) {
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  void *p = magpie_malloc_async(size, a);
  assert_non_null(p);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(b, gated_run, &g), MAGPIE_OK); /* B "reads" p */
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK); /* twice: one entry */
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  assert_int_equal(record_pending_bytes(&heap0()->records), magpie_usable_size(p));
  layers_add_up();

  void **va = calloc((size_t)rounds, sizeof *va), **vc = calloc((size_t)rounds, sizeof *vc);
  alloc_none_is(va, rounds, size, a, p);
  alloc_none_is(vc, rounds, size, c, p);
  free_all(va, rounds, a); /* and reuse on A again, still not p */
  alloc_none_is(va, rounds, size, a, p);
  free_all(va, rounds, a);
  free_all(vc, rounds, c);
  assert_false(g.done); /* all of it happened while B's work was pending */

  gate_open_and_sync(&g, b, a);
  assert_true(comes_back(p, size, c));
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  layers_add_up();
  free(va);
  free(vc);
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(c), MAGPIE_OK);
}

static void test_recorded_small_waits_for_recorded_stream(void **state) {
  (void)state;
  run_recorded_case(SMALL, ROUNDS);
}

static void test_recorded_large_waits_for_recorded_stream(void **state) {
  (void)state;
  run_recorded_case(LARGE, 4);
}

/* PyTorch's test_record_stream: once its recorded stream's work completed,
 * the block is the next allocation of its size on the stream it was freed
 * on (tcache_claim_recorded), not a block from elsewhere; before that, it
 * is not. */
static void test_recorded_block_is_next_on_its_stream(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  void *keep = magpie_malloc_async(SMALL, a); /* the magazine stays loaded */
  void *p = magpie_malloc_async(SMALL, a);
  assert_non_null(p);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(b, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  void *q = magpie_malloc_async(SMALL, a);
  assert_non_null(q);
  assert_ptr_not_equal(q, p);
  sleep_ms(1); /* past the claim's interval: it looks, and p is not ready */
  void *q2 = magpie_malloc_async(SMALL, a);
  assert_ptr_not_equal(q2, p);
  gate_open_and_sync(&g, b, a);
  sleep_ms(1);
  void *r = magpie_malloc_async(SMALL, a);
  assert_ptr_equal(r, p);
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  layers_add_up();
  void *v[] = {keep, q, q2, r};
  free_all(v, 4, a);
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
}

/* A thread that frees a recorded block and then only frees lets go of the
 * bit that sends its fast paths to the slow path once the block is back
 * (tcache_claim_recorded from the free path), rather than keep it. A free
 * only tries the record table's lock (another thread's poll or the
 * maintenance thread may hold it), so the bit goes within a few frees,
 * not necessarily at the first. */
#define BIT_FREES 200
static void test_recorded_bit_goes_on_frees(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  static void *v[BIT_FREES + 2];
  for (int i = 0; i < BIT_FREES + 2; i++) assert_non_null(v[i] = magpie_malloc_async(SMALL, a));
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(b, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(v[0], b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(v[0], a), MAGPIE_OK);
  assert_true(atomic_load_relaxed(&tcache_tls->steal) & TCACHE_RECORDED);
  sleep_ms(1);
  assert_int_equal(magpie_free_async(v[1], a), MAGPIE_OK); /* still parked: the bit stays */
  assert_true(atomic_load_relaxed(&tcache_tls->steal) & TCACHE_RECORDED);
  gate_open_and_sync(&g, b, a);
  int n = 2;
  while (n < BIT_FREES + 2 && (atomic_load_relaxed(&tcache_tls->steal) & TCACHE_RECORDED)) {
    sleep_ms(1); /* past the interval between looks */
    assert_int_equal(magpie_free_async(v[n++], a), MAGPIE_OK);
  }
  assert_false(atomic_load_relaxed(&tcache_tls->steal) & TCACHE_RECORDED);
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  free_all(v + n, BIT_FREES + 2 - n, a);
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
}

/* The freeing stream's own pending work also holds a recorded block back,
 * even from the freeing stream (a recorded block is parked as a whole). */
static void test_recorded_waits_for_freeing_stream(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  void *p = magpie_malloc_async(SMALL, a);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(a, gated_run, &g), MAGPIE_OK); /* A slow, B idle */
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  static void *v[ROUNDS];
  alloc_none_is(v, ROUNDS, SMALL, c, p);
  free_all(v, ROUNDS, c);
  alloc_none_is(v, ROUNDS, SMALL, a, p);
  free_all(v, ROUNDS, a);
  assert_false(g.done);
  gate_open_and_sync(&g, a, b); /* B (recorded, idle) too */
  assert_true(comes_back(p, SMALL, c));
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(c);
}

/* A recorded stream that captures a graph when the block is freed (on a
 * stream that does not): asking its id or recording an event on it would
 * invalidate the capture. The block waits instead for a device
 * synchronisation made once no announced capture runs, and never comes
 * back before the recorded stream's earlier work completed. */
static void run_recorded_capturing_case(size_t size, int rounds) {
  uint64_t v0 = magpie_sim_capture_violations();
  cudaStream_t a = magpie_sim_stream_create(), o = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  void *p = magpie_malloc_async(size, a);
  assert_non_null(p);
  /* Announced before the gated work is launched: an announcement waits
   * for a device synchronisation of the maintenance thread under way,
   * which would wait for that work. */
  uint64_t pool = 0;
  assert_int_equal(magpie_graph_pool_create(0, &pool), MAGPIE_OK);
  assert_int_equal(magpie_capture_begin(pool, o), MAGPIE_OK);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(o, gated_run, &g), MAGPIE_OK); /* O "reads" p */
  assert_int_equal(magpie_record_stream(p, o), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(o, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  void **va = calloc((size_t)rounds, sizeof *va), **vc = calloc((size_t)rounds, sizeof *vc);
  alloc_none_is(va, rounds, size, a, p);
  alloc_none_is(vc, rounds, size, c, p);
  free_all(va, rounds, a);
  free_all(vc, rounds, c);
  magpie_sim_graph graph = NULL;
  int rc = magpie_sim_stream_end_capture(o, &graph);
  if (rc != MAGPIE_OK) fail_msg("the capture was invalidated: %s", magpie_sim_last_error_message());
  assert_int_equal(magpie_sim_capture_violations(), v0);
  assert_int_equal(magpie_capture_end(pool, o), MAGPIE_OK);
  /* Still not back: O's work from before the capture is pending. */
  alloc_none_is(va, rounds, size, a, p);
  free_all(va, rounds, a);
  assert_false(g.done);
  gate_open_and_sync(&g, o, a);
  /* The maintenance thread synchronises the device, then hands it back. */
  for (int i = 0; i < WAIT_MS && record_pending_bytes(&heap0()->records) > 0; i++) sleep_ms(1);
  assert_true(comes_back(p, size, c));
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  free(va);
  free(vc);
  gated_fini(&g);
  assert_int_equal(magpie_sim_graph_destroy(graph), MAGPIE_OK);
  assert_int_equal(magpie_graph_pool_release(pool), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(o), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(c), MAGPIE_OK);
}

static void test_recorded_small_stream_capturing_at_free(void **state) {
  (void)state;
  run_recorded_capturing_case(SMALL, ROUNDS);
}

static void test_recorded_large_stream_capturing_at_free(void **state) {
  (void)state;
  run_recorded_capturing_case(LARGE, 4);
}

/* The sibling: a recorded block freed on a stream that captures (an
 * announced capture). The capturing stream can be neither asked its id nor
 * sealed; the block waits for a device synchronisation made after the
 * capture, and the recorded stream's work still holds it back. */
static void test_recorded_block_freed_in_capture(void **state) {
  (void)state;
  uint64_t v0 = magpie_sim_capture_violations();
  cudaStream_t a = magpie_sim_stream_create(), o = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  void *p = magpie_malloc_async(SMALL, a);
  assert_non_null(p);
  uint64_t pool = 0; /* announced first, as above */
  assert_int_equal(magpie_graph_pool_create(0, &pool), MAGPIE_OK);
  assert_int_equal(magpie_capture_begin(pool, a), MAGPIE_OK);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(o, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, o), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_begin_capture(a, MAGPIE_SIM_CAPTURE_GLOBAL), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  magpie_sim_graph graph = NULL;
  int rc = magpie_sim_stream_end_capture(a, &graph);
  if (rc != MAGPIE_OK) fail_msg("the capture was invalidated: %s", magpie_sim_last_error_message());
  assert_int_equal(magpie_capture_end(pool, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_capture_violations(), v0);
  static void *v[ROUNDS];
  alloc_none_is(v, ROUNDS, SMALL, c, p);
  free_all(v, ROUNDS, c);
  assert_false(g.done);
  gate_open_and_sync(&g, o, a);
  /* The maintenance thread synchronises the device, then hands it back. */
  for (int i = 0; i < WAIT_MS && record_pending_bytes(&heap0()->records) > 0; i++) sleep_ms(1);
  assert_true(comes_back(p, SMALL, c));
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  gated_fini(&g);
  assert_int_equal(magpie_sim_graph_destroy(graph), MAGPIE_OK);
  assert_int_equal(magpie_graph_pool_release(pool), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(o), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(c), MAGPIE_OK);
}

/* Two recorded streams: completing one is not enough. */
static void test_every_recorded_stream_counts(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create(), d = magpie_sim_stream_create();
  void *p = magpie_malloc_async(LARGE, a);
  struct gated gb, gd;
  gated_init(&gb);
  gated_init(&gd);
  assert_int_equal(magpie_sim_launch(b, gated_run, &gb), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(d, gated_run, &gd), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, d), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  gate_open_and_sync(&gb, b, a);
  void *q = magpie_malloc_async(LARGE, a);
  assert_false(overlaps(q, p, LARGE)); /* not at p, nor over its bytes from elsewhere */
  assert_false(gd.done);
  gate_open_and_sync(&gd, d, a);
  void *r = magpie_malloc_async(LARGE, a); /* the large path polls first */
  assert_ptr_equal(r, p);
  assert_int_equal(magpie_free_async(q, a), MAGPIE_OK);
  assert_int_equal(magpie_free_async(r, a), MAGPIE_OK);
  gated_fini(&gb);
  gated_fini(&gd);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
  magpie_sim_stream_destroy(d);
}

/* Recorded on one thread, freed on another: the count on the slab is seen
 * by the freeing thread (the hand-over between threads orders it). */
struct xfree {
  void *p;
  cudaStream_t s;
  int rc;
};

static void *xfree_main(void *arg) {
  struct xfree *x = arg;
  x->rc = magpie_free_async(x->p, x->s);
  return NULL;
}

static void test_record_then_free_on_other_thread(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  void *p = magpie_malloc_async(SMALL, a);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(b, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  struct xfree x = {.p = p, .s = a, .rc = -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, xfree_main, &x), 0);
  pthread_join(t, NULL);
  assert_int_equal(x.rc, MAGPIE_OK);
  static void *v[ROUNDS];
  alloc_none_is(v, ROUNDS, SMALL, a, p);
  free_all(v, ROUNDS, a);
  gate_open_and_sync(&g, b, a);
  assert_true(comes_back(p, SMALL, a));
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

static void test_errors(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  int x = 0;
  assert_int_equal(magpie_record_stream(NULL, a), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_record_stream(&x, a), MAGPIE_ERR_INVALID_POINTER);
  assert_non_null(strstr(magpie_last_error_message(), "not a pointer returned by magpie"));
  void *p = magpie_malloc_async(SMALL, a);
  assert_int_equal(magpie_record_stream((char *)p + 256, a), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(magpie_record_stream(p, MAGPIE_SIM_STREAM_PER_THREAD), MAGPIE_ERR_INVALID_STREAM);
  cudaStream_t dead = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_stream_destroy(dead), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, dead), MAGPIE_ERR_INVALID_STREAM);
  /* A recorded block's double free is caught without checked mode, and a
   * freed block cannot be recorded. */
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(b, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_ERR_DOUBLE_FREE);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_ERR_INVALID_POINTER);
  assert_non_null(strstr(magpie_last_error_message(), "free"));
  /* A block on another device's stream. */
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t other = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  void *q = magpie_malloc_async(SMALL, a);
  assert_int_equal(magpie_record_stream(q, other), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_free_async(q, a), MAGPIE_OK);
  gate_open_and_sync(&g, b, a);
  assert_true(comes_back(p, SMALL, a));
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(other);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b);
}

/* done() polled every millisecond, for up to WAIT_MS: 1 once it holds. */
static int poll_until(int (*done)(void)) {
  for (int i = 0; i < WAIT_MS; i++) {
    if (done()) return 1;
    sleep_ms(1);
  }
  return 0;
}

/* Waits (bounded) until nothing is parked: a block whose recorded stream
 * is gone comes back through the maintenance thread's device
 * synchronisation, on its own time. */
static int nothing_parked(void) { return record_pending_bytes(&heap0()->records) == 0; }
static int parked_drains(void) { return poll_until(nothing_parked); }

/* The recorded stream is destroyed, its work still running, before the
 * free. The free succeeds (it used to fail with MAGPIE_ERR_INVALID_STREAM
 * forever), and nobody gets the block before that work completed: not
 * through the destroyed stream's handle, which the next stream created
 * reuses (a seal there would vouch for the new, idle stream only). */
static uint64_t device_syncs(void) {
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  return st.device_syncs;
}

/* retire: magpie_stream_retire before the destroy, as documented; then the
 * block waits for the retire's event, not for a device synchronisation.
 * Without: the simulated device answers the free's query about the
 * destroyed handle (a GPU's driver would crash unless a newer stream got
 * the handle value, as here) and a device synchronisation covers it. */
static void run_destroyed_case(size_t size, int rounds, int retire) {
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  void *p = magpie_malloc_async(size, a);
  assert_non_null(p);
  struct gated g;
  gated_init(&g);
  assert_int_equal(magpie_sim_launch(b, gated_run, &g), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, b), MAGPIE_OK);
  uint64_t syncs = device_syncs(), synced = atomic_load(&heap0()->records.sync_total);
  if (retire) assert_int_equal(magpie_stream_retire(b), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(b), MAGPIE_OK);
  cudaStream_t b2 = magpie_sim_stream_create();
  assert_ptr_equal(b2, b); /* the handle value came back, as CUDA's do */
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(b2), MAGPIE_OK); /* a seal on b2 would have completed, */
  assert_int_equal(magpie_sim_stream_synchronize(a), MAGPIE_OK);  /* and the freeing stream's */
  /* Retired: the free needed no device synchronisation (the destroyed
   * stream's work waits behind nothing but the retire's event). */
  if (retire) assert_int_equal(atomic_load(&heap0()->records.sync_total), synced);
  else assert_int_equal(atomic_load(&heap0()->records.sync_total), synced + 1);
  void **va = calloc((size_t)rounds, sizeof *va), **vc = calloc((size_t)rounds, sizeof *vc);
  alloc_none_is(va, rounds, size, a, p);
  alloc_none_is(vc, rounds, size, c, p);
  free_all(va, rounds, a);
  free_all(vc, rounds, c);
  alloc_none_is(vc, rounds, size, b2, p);
  free_all(vc, rounds, b2);
  assert_false(g.done); /* all of it while the destroyed stream's work ran */
  assert_true(layers_add_up() >= size);
  sem_post(&g.gate);
  assert_int_equal(sem_wait_ms(&g.finished, WAIT_MS), 0);
  if (retire) assert_int_equal(magpie_sim_stream_synchronize(b2), MAGPIE_OK); /* the retire's event: completed */
  assert_true(parked_drains() || retire);
  assert_true(comes_back(p, size, c));
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  if (!retire) assert_true(device_syncs() > syncs);
  layers_add_up();
  free(va);
  free(vc);
  gated_fini(&g);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
  magpie_sim_stream_destroy(b2);
  magpie_sim_stream_destroy(c);
}

static void test_small_recorded_stream_destroyed_before_free(void **state) {
  (void)state;
  run_destroyed_case(SMALL, ROUNDS, 0);
  run_destroyed_case(SMALL, ROUNDS, 1);
}

static void test_large_recorded_stream_destroyed_before_free(void **state) {
  (void)state;
  run_destroyed_case(LARGE, 32, 0);
  run_destroyed_case(LARGE, 32, 1);
}

/* Without checked mode a freed small block sitting in a magazine looks
 * handed out, so magpie_record_stream on it succeeds and the record
 * stays with the block. When the recorded stream is then destroyed, the
 * block's next, unrelated owner can still free it (it used to get
 * MAGPIE_ERR_INVALID_STREAM on every free), and the block comes back. */
static void test_stale_record_outlives_its_stream(void **state) {
  (void)state;
  cudaStream_t a = magpie_sim_stream_create(), o = magpie_sim_stream_create();
  void *p = magpie_malloc_async(SMALL, a);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  assert_int_equal(magpie_record_stream(p, o), MAGPIE_OK); /* a mistake checked mode refuses */
  assert_int_equal(magpie_sim_stream_destroy(o), MAGPIE_OK);
  void *q = magpie_malloc_async(SMALL, a);
  assert_ptr_equal(q, p); /* the next owner, on the same stream */
  assert_int_equal(magpie_free_async(q, a), MAGPIE_OK);
  assert_true(parked_drains());
  assert_true(comes_back(p, SMALL, a));
  layers_add_up();
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(a);
}

/* Waits (bounded) until the maintenance thread has nothing left that needs
 * a device synchronisation (limbo, kept blocks in limbo, parked blocks of
 * destroyed streams) and no reap is under way: what earlier tests left
 * there is drained by a synchronisation on the maintenance thread's own
 * time, which would otherwise count in a later test's figures. */
static int nothing_to_reap(void) {
  heap *h = heap0();
  pthread_mutex_lock(&h->klimbo_lock);
  int kept = h->klimbo != NULL;
  pthread_mutex_unlock(&h->klimbo_lock);
  return !kept && stack_count(&h->limbo) == 0 && record_sync_wanted(&h->records) == 0 && atomic_load(&h->reaping) == 0;
}

static int maintenance_idle(void) { return poll_until(nothing_to_reap); }

/* Blocks of class cls the calling thread's slot for handle s holds
 * (loaded, previous and outbox magazines), or -1 if it has no such slot. */
static int64_t slot_cached_blocks(cudaStream_t s, unsigned cls) {
  for (int i = 0; i < TCACHE_SLOTS; i++) {
    tslot *ts = &tcache_tls->slots[i];
    if (ts->heap == NULL || ts->handle != s) continue;
    int64_t n = ts->cl[cls].loaded->count + ts->prev[cls]->count;
    for (uint32_t k = 0; k < ts->nout; k++)
      if (ts->outbox[k]->cls == cls) n += ts->outbox[k]->count;
    return n;
  }
  return -1;
}

/* retire_main runs in a thread of its own, where a cmocka assertion
 * cannot report (it exits the process without a word): it notes the
 * first failing line for the test's thread to assert on. */
static int retire_failed_line;
#define RT_CHECK(x)                                               \
  do {                                                            \
    if (!(x)) {                                                   \
      if (retire_failed_line == 0) retire_failed_line = __LINE__; \
      return NULL;                                                \
    }                                                             \
  } while (0)
#define RT_CHECK_NONNULL(x) RT_CHECK((x) != NULL)
#define RT_CHECK_EQ(a, b) RT_CHECK((a) == (b))
#define RT_CHECK_NE(a, b) RT_CHECK((a) != (b))

/* How many blocks retire_main (below) frees on the stream it retires: all
 * of them stay in
 * its slot. The slot's outbox seals (and its blocks leave for the depot)
 * at TCACHE_OUTBOX_BYTES or TCACHE_OUTBOX magazines. With the two
 * magazines the allocations leave in the slot (at most 2 * mag_max blocks)
 * it holds at most RETIRE_BLOCKS + 128 blocks of 4 KiB, under 1 MiB; and
 * eight full magazines need at least 132 frees in a row beyond what the
 * slot held (empty magazines start at mag_cap = 12 blocks and grow as
 * tcache_next_cap says: 12, 12, 12, 24, 24, 48). With 256 blocks, a slot
 * that had kept 51 blocks from its allocations sealed its outbox now and
 * then, and the check below failed about once in a hundred runs. */
#define RETIRE_BLOCKS 120

/* magpie_stream_retire of a stream the calling thread cached blocks of:
 * they go to the shared pools sealed on it (no limbo, no device
 * synchronisation), another stream gets them once its work completed, and
 * the retired handle is refused after the destroy. */
static void *retire_main(void *arg) {
  (void)arg;
  RT_CHECK(maintenance_idle()); /* the device_syncs count below is this test's alone */
  cudaStream_t s = magpie_sim_stream_create(), c = magpie_sim_stream_create();
  unsigned cls = sizeclass_of(SMALL);
  RT_CHECK(RETIRE_BLOCKS + 2 * sizeclass_table[cls].mag_max < TCACHE_OUTBOX_BYTES / SMALL);
  RT_CHECK(sizeclass_table[cls].mag_cap == 12);
  static void *v[RETIRE_BLOCKS];
  for (int i = 0; i < RETIRE_BLOCKS; i++) RT_CHECK_NONNULL(v[i] = magpie_malloc_async(SMALL, s));
  struct gated g;
  gated_init(&g);
  RT_CHECK_EQ(magpie_sim_launch(s, gated_run, &g), MAGPIE_OK);
  free_all(v, RETIRE_BLOCKS, s);
  magpie_stats before, after;
  RT_CHECK_EQ(magpie_stats_get(0, &before), MAGPIE_OK);
  /* What this thread caches for s, read from its slot (the statistics'
   * thread-cached figure is the whole device's, which a reap on the
   * maintenance thread may move meanwhile), and what the depot holds of
   * the class: only this thread uses the class now, and the maintenance
   * thread only ever adds to it. */
  int64_t cached = slot_cached_blocks(s, cls) * (int64_t)SMALL;
  RT_CHECK(cached >= RETIRE_BLOCKS * SMALL);
  depot *d = &heap0()->depots[cls];
  int64_t depot0 = atomic_load(&d->ready_bytes) + atomic_load(&d->pending_bytes);
  RT_CHECK_EQ(magpie_stream_retire(s), MAGPIE_OK);
  RT_CHECK_EQ(magpie_sim_stream_destroy(s), MAGPIE_OK); /* its work still gated */
  RT_CHECK_EQ(magpie_stats_get(0, &after), MAGPIE_OK);
  RT_CHECK_EQ(slot_cached_blocks(s, cls), -1); /* the slot is gone */
  RT_CHECK(atomic_load(&d->ready_bytes) + atomic_load(&d->pending_bytes) >= depot0 + cached);
  RT_CHECK_EQ(after.limbo_magazines, before.limbo_magazines);
  static void *w[256];
  for (int i = 0; i < 256; i++) { /* none of s's blocks while its work is gated */
    RT_CHECK_NONNULL(w[i] = magpie_malloc_async(SMALL, c));
    for (int j = 0; j < RETIRE_BLOCKS; j++) RT_CHECK_NE(w[i], v[j]);
  }
  free_all(w, 256, c);
  sem_post(&g.gate);
  RT_CHECK_EQ(sem_wait_ms(&g.finished, WAIT_MS), 0);
  RT_CHECK_EQ(magpie_sim_device_synchronize(), MAGPIE_OK);
  RT_CHECK_EQ(device_syncs(), before.device_syncs);
  RT_CHECK_EQ(magpie_stream_retire(s), MAGPIE_ERR_INVALID_STREAM);
  RT_CHECK_EQ(magpie_stream_retire(NULL), MAGPIE_ERR_INVALID_STREAM);
  gated_fini(&g);
  magpie_sim_stream_destroy(c);
  return NULL;
}

/* In a thread of its own: a fresh cache, whose slots no earlier test's
 * streams fill (an evicted slot would send its magazines to limbo). */
static void test_retire_hands_back_thread_cache(void **state) {
  (void)state;
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, retire_main, NULL), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(retire_failed_line, 0);
}

/* Threads record, free and allocate at once (records on shared streams,
 * polls racing frees): under --config=tsan, any unordered access to the
 * record table is a reported race. Everything comes back in the end. */
#define RT_THREADS 4
#define RT_ROUNDS 400
static cudaStream_t rt_shared[2];

static void *rt_main(void *arg) {
  cudaStream_t own = magpie_sim_stream_create();
  unsigned seed = (unsigned)(uintptr_t)arg * 7919u + 1;
  long errors = 0;
  void *keep[8] = {0};
  for (int i = 0; i < RT_ROUNDS; i++) {
    seed ^= seed << 13; /* xorshift: no wrapping arithmetic for the sanitizer to flag */
    seed ^= seed >> 17;
    seed ^= seed << 5;
    size_t size = (seed >> 16) % 5 == 0 ? LARGE : (size_t)256 << ((seed >> 8) % 8);
    void *p = magpie_malloc_async(size, own);
    if (p == NULL) {
      errors++;
      continue;
    }
    if (magpie_record_stream(p, rt_shared[i & 1]) != MAGPIE_OK) errors++;
    if ((seed >> 4) & 1 && magpie_record_stream(p, rt_shared[(i + 1) & 1]) != MAGPIE_OK) errors++;
    void *old = keep[i % 8]; /* freed a few rounds later */
    keep[i % 8] = p;
    if (old != NULL && magpie_free_async(old, own) != MAGPIE_OK) errors++;
  }
  for (int i = 0; i < 8; i++)
    if (keep[i] != NULL && magpie_free_async(keep[i], own) != MAGPIE_OK) errors++;
  magpie_sim_stream_synchronize(own);
  magpie_sim_stream_destroy(own);
  return (void *)errors;
}

static void test_threads_record_and_free(void **state) {
  (void)state;
  rt_shared[0] = magpie_sim_stream_create();
  rt_shared[1] = magpie_sim_stream_create();
  pthread_t t[RT_THREADS];
  for (uintptr_t i = 0; i < RT_THREADS; i++) assert_int_equal(pthread_create(&t[i], NULL, rt_main, (void *)i), 0);
  for (int i = 0; i < RT_THREADS; i++) {
    void *errors = NULL;
    pthread_join(t[i], &errors);
    assert_int_equal((long)(intptr_t)errors, 0);
  }
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  /* Slow paths poll: small and large allocations until nothing is parked. */
  cudaStream_t s = magpie_sim_stream_create();
  for (int i = 0; i < 100 && record_pending_bytes(&heap0()->records) != 0; i++) {
    void *a = magpie_malloc_async(LARGE, s), *b[200];
    for (int k = 0; k < 200; k++) b[k] = magpie_malloc_async(256 << (k % 8), s);
    assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
    free_all(b, 200, s);
  }
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
  layers_add_up();
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
  magpie_sim_stream_destroy(rt_shared[0]);
  magpie_sim_stream_destroy(rt_shared[1]);
}

/* Last: nothing leaked, nothing left parked. */
static void test_accounting(void **state) {
  (void)state;
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
  assert_int_equal(record_pending_bytes(&heap0()->records), 0);
}

int main(void) {
  setenv("MAGPIE_SIM_DEVICES", "2", 1);
  unsetenv("MAGPIE_SIM_MEMORY");
  unsetenv("MAGPIE_SIM_VMM");
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  if (magpie_init(&cfg) != MAGPIE_OK) {
    fprintf(stderr, "magpie_init: %s\n", magpie_last_error_message());
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_control_same_stream_reuse),
      cmocka_unit_test(test_recorded_small_waits_for_recorded_stream),
      cmocka_unit_test(test_recorded_large_waits_for_recorded_stream),
      cmocka_unit_test(test_recorded_waits_for_freeing_stream),
      cmocka_unit_test(test_recorded_block_is_next_on_its_stream),
      cmocka_unit_test(test_recorded_bit_goes_on_frees),
      cmocka_unit_test(test_every_recorded_stream_counts),
      cmocka_unit_test(test_recorded_small_stream_capturing_at_free),
      cmocka_unit_test(test_recorded_large_stream_capturing_at_free),
      cmocka_unit_test(test_recorded_block_freed_in_capture),
      cmocka_unit_test(test_record_then_free_on_other_thread),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_threads_record_and_free),
      cmocka_unit_test(test_small_recorded_stream_destroyed_before_free),
      cmocka_unit_test(test_large_recorded_stream_destroyed_before_free),
      cmocka_unit_test(test_stale_record_outlives_its_stream),
      cmocka_unit_test(test_retire_hands_back_thread_cache),
      cmocka_unit_test(test_accounting),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
