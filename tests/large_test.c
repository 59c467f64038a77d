/* Large blocks, the out-of-memory ladder, statistics and snapshots against
 * the deterministic fake device (tests/fake_backend.c): splitting and
 * coalescing, segments growing and shrinking by granule, stream rules,
 * stealing from an idle thread, per-layer statistics after random
 * operation sequences, and snapshots parsed back and checked against the
 * statistics. */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "front/init.h"
#include "heap/heap.h"
#include "magpie.h"
#include "pool/large.h"
#include "tests/fake_backend.h"
#include "tests/json_mini.h"
#include "tests/tcache_util.h"

#define MiB ((size_t)1 << 20)

/* reserved = in_use + thread + depot + pending + large free + overhead,
 * whenever no thread is inside magpie. */
static void check_layers(int dev) {
  magpie_stats s;
  assert_int_equal(magpie_stats_get(dev, &s), MAGPIE_OK);
  size_t sum = s.in_use_bytes + s.thread_cached_bytes + s.depot_bytes + s.epoch_pending_bytes + s.large_free_bytes +
               s.overhead_bytes;
  if (sum != s.reserved_bytes)
    fail_msg("reserved %zu != in_use %zu + thread %zu + depot %zu + pending %zu + large free %zu + overhead %zu",
             s.reserved_bytes, s.in_use_bytes, s.thread_cached_bytes, s.depot_bytes, s.epoch_pending_bytes,
             s.large_free_bytes, s.overhead_bytes);
  assert_int_equal(s.cached_bytes, s.reserved_bytes - s.in_use_bytes);
  assert_true(s.peak_reserved_bytes >= s.reserved_bytes);
  assert_true(s.large_mapped_bytes <= s.reserved_bytes);
}

/* Free blocks in the large layer (under its lock). */
static int large_free_count(int dev) {
  heap *h = heap_peek(dev);
  int n = 0;
  pthread_mutex_lock(&h->large.lock);
  for (lblock *b = large_free_first(&h->large); b; b = large_free_next(&h->large, b)) n++;
  pthread_mutex_unlock(&h->large.lock);
  return n;
}

static void test_split_and_coalesce(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  char *a = magpie_malloc_async(3 * MiB, s);
  char *b = magpie_malloc_async(5 * MiB, s);
  char *c = magpie_malloc_async(3 * MiB, s);
  assert_non_null(a);
  /* Carved one after another out of one segment, not rounded to 2 MiB. */
  assert_ptr_equal(b, a + 3 * MiB);
  assert_ptr_equal(c, b + 5 * MiB);
  memset(a, 1, 3 * MiB);
  memset(b, 2, 5 * MiB);
  memset(c, 3, 3 * MiB);
  check_layers(0);
  /* A hole of 5 MiB: a 4 MiB request takes it (best fit: the segment's
   * tail is larger) at its end, on a granule boundary, leaving 1 MiB split
   * off at its start, in the granule a already cuts into: at the hole's
   * start it would have cut into a whole free granule. */
  assert_int_equal(magpie_free_async(b, s), MAGPIE_OK);
  char *d = magpie_malloc_async(4 * MiB, s);
  assert_ptr_equal(d, b + 1 * MiB);
  assert_int_equal(magpie_usable_size(d), 4 * MiB);
  char *e = magpie_malloc_async(1 * MiB + 4096, s); /* > 1 MiB: large, does not fit the 1 MiB rest */
  assert_true(e > c);
  /* Freeing everything on one stream merges the neighbours back into one
   * block waiting on s, beside the never-used (ready) rest of the segment. */
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(d, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(c, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(e, s), MAGPIE_OK);
  assert_int_equal(large_free_count(0), 2);
  check_layers(0);
  /* The whole merged range serves one block of their total size. */
  char *f = magpie_malloc_async(12 * MiB, s);
  assert_ptr_equal(f, a);
  assert_int_equal(magpie_free_async(f, s), MAGPIE_OK);
  /* Once s's work completed, the two merge. */
  fake_stream_complete(s);
  large_reclaim(&heap_peek(0)->large);
  assert_int_equal(large_free_count(0), 1);
  check_layers(0);
}

/* A mapped hole that is ready for every stream joins a block freed next
 * to it on s: s's next request of their total size takes both at once;
 * another stream cannot use them until s's work completed. Kept apart,
 * neither was large enough and the segment grew. */
static void test_ready_hole_joins_pending_neighbour(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  char *a = magpie_malloc_async(4 * MiB, s);
  char *b = magpie_malloc_async(4 * MiB, s);
  char *c = magpie_malloc_async(4 * MiB, s);
  assert_ptr_equal(b, a + 4 * MiB);
  assert_ptr_equal(c, b + 4 * MiB);
  /* b freed on t, whose work completes: a ready hole. */
  assert_int_equal(magpie_free_async(b, t), MAGPIE_OK);
  fake_stream_complete(t);
  large_reclaim(&heap_peek(0)->large);
  /* a freed on s, still running: it waits on s and takes b in. */
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  char *e = magpie_malloc_async(8 * MiB, s);
  assert_ptr_equal(e, a);
  memset(e, 5, 8 * MiB);
  check_layers(0);
  /* Freed again on s: another stream has the range only after s's work,
   * through a stream wait. */
  assert_int_equal(magpie_free_async(e, s), MAGPIE_OK);
  magpie_stats s0, s1;
  assert_int_equal(magpie_stats_get(0, &s0), MAGPIE_OK);
  char *d = magpie_malloc_async(8 * MiB, t);
  assert_non_null(d);
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  if (d < a + 8 * MiB && d + 8 * MiB > a) assert_int_equal(s1.stream_waits, s0.stream_waits + 1);
  assert_int_equal(magpie_free_async(c, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(d, t), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
  check_layers(0);
}

static void test_segment_grows_and_shrinks(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  magpie_stats s0, s1, s2;
  assert_int_equal(magpie_stats_get(0, &s0), MAGPIE_OK);
  char *x = magpie_malloc_async(10 * MiB, s);
  char *y = magpie_malloc_async(10 * MiB, s);
  char *z = magpie_malloc_async(10 * MiB, s);
  assert_int_equal(magpie_stats_get(0, &s1), MAGPIE_OK);
  /* Grown granule by granule: 30 MiB mapped for 30 MiB of blocks. */
  assert_int_equal(s1.large_mapped_bytes - s0.large_mapped_bytes, 30 * MiB);
  memset(x, 0x11, 10 * MiB);
  memset(z, 0x33, 10 * MiB);
  assert_int_equal(magpie_free_async(y, s), MAGPIE_OK);
  fake_stream_complete(s);
  /* Shrink: the hole's granules go back; its neighbours stay mapped. */
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &s2), MAGPIE_OK);
  assert_int_equal(s1.large_mapped_bytes - s2.large_mapped_bytes, 10 * MiB);
  assert_true(s2.large_bytes_unmapped >= 10 * MiB);
  for (size_t i = 0; i < 10 * MiB; i += 4096) assert_true(x[i] == 0x11 && z[i] == 0x33);
  check_layers(0);
  /* Growing again into the hole (an exact fit) maps it back. */
  char *w = magpie_malloc_async(10 * MiB, t);
  assert_ptr_equal(w, y);
  memset(w, 0x22, 10 * MiB);
  assert_int_equal(magpie_free_async(x, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(z, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(w, t), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &s2), MAGPIE_OK);
  assert_int_equal(s2.large_mapped_bytes, 0);
  check_layers(0);
}

/* magpie_trim while another thread's release is between taking memory off
 * the free lists and the driver's unmap: the trim finds nothing left to
 * release, and must still not return before that memory is gone (the
 * maintenance thread above a release threshold is such a thread). */
typedef struct trim_run {
  int rc; /* magpie_trim's, then magpie_stats_get's if that failed */
  magpie_stats after;
  _Atomic int done;
} trim_run;

static void *trim_thread(void *arg) {
  trim_run *r = arg;
  r->rc = magpie_trim(0, 0);
  if (r->rc == MAGPIE_OK) r->rc = magpie_stats_get(0, &r->after);
  atomic_store(&r->done, 1);
  return NULL;
}

static void test_trim_waits_for_release_in_flight(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  void *p = magpie_malloc_async(8 * MiB, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  fake_stream_complete(s);
  fake_gate_unmap(1);
  trim_run first = {.done = 0}, second = {.done = 0};
  pthread_t a, b;
  assert_int_equal(pthread_create(&a, NULL, trim_thread, &first), 0);
  while (fake_unmaps_held() == 0) sched_yield(); /* a is in the driver's unmap */
  assert_int_equal(pthread_create(&b, NULL, trim_thread, &second), 0);
  /* b finds nothing to release; give it time to return (it must not). */
  for (int i = 0; i < 200 && !atomic_load(&second.done); i++) usleep(1000);
  fake_gate_unmap(0);
  assert_int_equal(pthread_join(a, NULL), 0);
  assert_int_equal(pthread_join(b, NULL), 0);
  assert_int_equal(first.rc, MAGPIE_OK);
  assert_int_equal(second.rc, MAGPIE_OK);
  assert_int_equal(second.after.reserved_bytes, second.after.in_use_bytes);
  assert_int_equal(first.after.reserved_bytes, first.after.in_use_bytes);
  check_layers(0);
}

typedef struct other_free {
  void *p;
  cudaStream_t s;
  int rc;
} other_free;

static void *other_free_main(void *arg) {
  other_free *f = arg;
  f->rc = magpie_free_async(f->p, f->s);
  return NULL;
}

static int free_on_other_thread(void *p, cudaStream_t s) {
  other_free f = {.p = p, .s = s, .rc = -1};
  run_in_thread(other_free_main, &f);
  return f.rc;
}

static void test_large_stream_rules(void **state) {
  (void)state;
  /* Device 1 holds 24 MiB. */
  fake_set_current_device(1);
  cudaStream_t a = fake_stream_create(1), b = fake_stream_create(1);
  char *p = magpie_malloc_async(8 * MiB, a);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  /* Freeing stream: at once. */
  char *q = magpie_malloc_async(8 * MiB, a);
  assert_ptr_equal(q, p);
  /* Freed by a thread that keeps no block for a (this one would keep it
   * for a, tcache.c): to the large layer, sealed on a. */
  assert_int_equal(free_on_other_thread(q, a), MAGPIE_OK);

  /* Another stream, while A's work is pending and memory is plentiful:
   * new memory, not A's block. */
  char *r = magpie_malloc_async(12 * MiB, b);
  assert_non_null(r);
  assert_ptr_not_equal(r, p);
  /* Under pressure: B takes A's pending block by waiting on its event, not
   * by a host wait. */
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(1, &st0), MAGPIE_OK);
  fake_counters c0, c1;
  fake_get_counters(&c0);
  char *u = magpie_malloc_async(8 * MiB, b);
  fake_get_counters(&c1);
  assert_int_equal(magpie_stats_get(1, &st1), MAGPIE_OK);
  assert_ptr_equal(u, p);
  assert_int_equal(st1.stream_waits - st0.stream_waits, 1);
  assert_int_equal(c1.event_syncs, c0.event_syncs);
  assert_int_equal(c1.device_syncs, c0.device_syncs);
  assert_int_equal(magpie_free_async(u, b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(r, b), MAGPIE_OK);
  fake_stream_complete(a);
  fake_stream_complete(b);
  check_layers(1);
  /* The block this thread keeps for b (u) goes back: a thread keeps one. */
  assert_int_equal(magpie_trim(1, 0), MAGPIE_OK);
  fake_set_current_device(0);
}

/* Blocks freed next to each other on different streams do not merge (a
 * free block carries one stream's event). A request larger than each, on
 * a third stream, takes them together by waiting on both events, rather
 * than mapping more; what it leaves of the last stays free, waiting on its
 * stream. A failed wait leaves them as they were. */
static void test_run_of_blocks_freed_on_different_streams(void **state) {
  (void)state;
  /* Device 1 holds 24 MiB. */
  fake_set_current_device(1);
  cudaStream_t a = fake_stream_create(1), b = fake_stream_create(1), c = fake_stream_create(1);
  char *p1 = magpie_malloc_async(6 * MiB, a);
  char *p2 = magpie_malloc_async(6 * MiB, a);
  char *p3 = magpie_malloc_async(6 * MiB, a);
  assert_non_null(p1);
  assert_ptr_equal(p2, p1 + 6 * MiB);
  assert_ptr_equal(p3, p2 + 6 * MiB);
  assert_int_equal(free_on_other_thread(p1, a), MAGPIE_OK);
  assert_int_equal(free_on_other_thread(p2, b), MAGPIE_OK);
  int free0 = large_free_count(1);

  fake_fail_stream_waits(1);
  assert_null(magpie_malloc_async(10 * MiB, c));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_BACKEND);
  assert_int_equal(large_free_count(1), free0);
  check_layers(1);

  magpie_stats st0, st1;
  fake_counters c0, c1;
  assert_int_equal(magpie_stats_get(1, &st0), MAGPIE_OK);
  fake_get_counters(&c0);
  char *q = magpie_malloc_async(10 * MiB, c);
  fake_get_counters(&c1);
  assert_int_equal(magpie_stats_get(1, &st1), MAGPIE_OK);
  assert_ptr_equal(q, p1);
  assert_int_equal(st1.stream_waits - st0.stream_waits, 2);
  assert_int_equal(c1.stream_waits - c0.stream_waits, 2);
  assert_int_equal(c1.event_syncs, c0.event_syncs);
  assert_int_equal(c1.device_syncs, c0.device_syncs);
  assert_int_equal(c1.maps, c0.maps);
  memset(q, 7, 10 * MiB);
  check_layers(1);
  /* The 2 MiB left of p2 still waits on b, whose next request takes it at
   * once. */
  char *r = magpie_malloc_async(2 * MiB, b);
  assert_ptr_equal(r, p1 + 10 * MiB);
  assert_int_equal(magpie_free_async(r, b), MAGPIE_OK);
  assert_int_equal(magpie_free_async(q, c), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p3, a), MAGPIE_OK);
  fake_stream_complete(a);
  fake_stream_complete(b);
  fake_stream_complete(c);
  check_layers(1);
  assert_int_equal(magpie_trim(1, 0), MAGPIE_OK);
  fake_set_current_device(0);
}

static void check_snapshot(int dev);

/* A thread keeps the large block freed on its stream for that stream's
 * next request it fits within an eighth: the same pointer, no event. The
 * kept block is free for every other purpose: a second free is a double
 * free, block queries and record_stream find no block there, another
 * stream's request does not get it. A request it does not fit leaves it
 * kept. */
/* On a thread that allocates on s alone: a 16 MiB block, then 100 frees
 * each followed by a request the block fits within an eighth, which gets
 * it back with no event. Returns the block, allocated. */
static char *kept_block_cycles(cudaStream_t s) {
  char *p = magpie_malloc_async(16 * MiB, s);
  assert_non_null(p);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  for (int i = 0; i < 100; i++) {
    assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
    char *q = magpie_malloc_async(16 * MiB - (size_t)(i % 3) * 600000, s);
    assert_ptr_equal(q, p);
  }
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded);
  return p;
}

static void *kept_large_block_main(void *arg) {
  (void)arg;
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  char *p = kept_block_cycles(s);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.thread_cached_bytes - st0.thread_cached_bytes, 16 * MiB);
  check_layers(0);
  check_snapshot(0);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_ERR_DOUBLE_FREE);
  assert_int_equal(magpie_usable_size(p), 0);
  assert_int_equal(magpie_record_stream(p, t), MAGPIE_ERR_INVALID_POINTER);
  char *r = magpie_malloc_async(16 * MiB, t);
  assert_non_null(r);
  assert_ptr_not_equal(r, p);
  /* This thread now allocates on two streams: it keeps no other block. */
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_int_equal(magpie_free_async(r, t), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  /* Not fitting within an eighth, and one block kept (fewer than
   * TCACHE_KEEP_MISS): p stays kept, no event; the request gets another
   * block. */
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  char *u = magpie_malloc_async(4 * MiB, s);
  assert_non_null(u);
  assert_true(u < p || u >= p + 16 * MiB);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded);
  assert_int_equal(st1.thread_cached_bytes, st0.thread_cached_bytes);
  assert_int_equal(magpie_free_async(u, s), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
  check_layers(0);
  return NULL;
}

/* A thread on one stream keeps up to TCACHE_KEEP_BLOCKS large blocks
 * (past the first, within TCACHE_KEEP_MORE: 32 MiB) with no event; each
 * request takes the smallest kept block it fits within an eighth, and a
 * request none of TCACHE_KEEP_MISS (4) or more fits lets them all go under
 * one seal. */
static void *kept_large_blocks_main(void *arg) {
  (void)arg;
  cudaStream_t s = fake_stream_create(0);
  const size_t sa = 3 * MiB / 2, sb = 5 * MiB / 4, sc = 9 * MiB / 8, sd = 2 * MiB; /* 5.875 MiB together */
  char *a = magpie_malloc_async(sa, s), *b = magpie_malloc_async(sb, s), *c = magpie_malloc_async(sc, s);
  char *d = magpie_malloc_async(sd, s), *x = magpie_malloc_async(27 * MiB, s);
  assert_true(a && b && c && d && x);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(b, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(c, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(d, s), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded);
  assert_int_equal(st1.thread_cached_bytes - st0.thread_cached_bytes, sa + sb + sc + sd);
  check_layers(0);
  /* A fifth would pass 32 MiB: it goes back to the large layer, sealed. */
  assert_int_equal(magpie_free_async(x, s), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_int_equal(st0.events_recorded, st1.events_recorded + 1);
  assert_int_equal(st0.thread_cached_bytes, st1.thread_cached_bytes);
  assert_int_equal(magpie_free_async(b, s), MAGPIE_ERR_DOUBLE_FREE); /* kept: free already */
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  /* Each request gets the smallest kept block it fits within an eighth. */
  assert_ptr_equal(magpie_malloc_async(sb, s), b);
  assert_ptr_equal(magpie_malloc_async(sa, s), a);
  assert_ptr_equal(magpie_malloc_async(11 * MiB / 10, s), c);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded);
  check_layers(0);
  /* Kept again, four with d; a request none of them fits: one seal for
   * all four. */
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(b, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(c, s), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  char *e = magpie_malloc_async(3 * MiB, s);
  assert_non_null(e);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  assert_int_equal(st0.thread_cached_bytes - st1.thread_cached_bytes, sa + sb + sc + sd);
  assert_int_equal(magpie_free_async(e, s), MAGPIE_OK);
  fake_stream_complete(s);
  check_layers(0);
  check_snapshot(0);
  return NULL;
}

static void test_kept_large_blocks(void **state) {
  (void)state;
  run_in_thread(kept_large_blocks_main, NULL);
}

/* In a thread of its own: a thread keeps blocks only while it allocates
 * on one stream. */
static void test_kept_large_block(void **state) {
  (void)state;
  run_in_thread(kept_large_block_main, NULL);
}

/* A kept block handed out again (lent) is in use like any other: its
 * size is known, and another thread may free it. After that free, the
 * keeping thread's own free of it, which would have kept it again without
 * the large cache's lock, is a double free; its next block is kept as
 * before. */
static void *lent_block_freed_elsewhere_main(void *arg) {
  (void)arg;
  cudaStream_t s = fake_stream_create(0);
  char *p = kept_block_cycles(s);
  assert_int_equal(magpie_usable_size(p), 16 * MiB);
  assert_int_equal(free_on_other_thread(p, fake_stream_create(0)), MAGPIE_OK);
  assert_int_equal(magpie_usable_size(p), 0);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_ERR_DOUBLE_FREE);
  check_layers(0);
  char *q = magpie_malloc_async(16 * MiB, s);
  assert_non_null(q);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.thread_cached_bytes - st0.thread_cached_bytes, 16 * MiB);
  assert_ptr_equal(magpie_malloc_async(16 * MiB, s), q);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_ERR_DOUBLE_FREE);
  fake_stream_complete(s);
  check_layers(0);
  check_snapshot(0);
  return NULL;
}

static void test_lent_block_freed_elsewhere(void **state) {
  (void)state;
  run_in_thread(lent_block_freed_elsewhere_main, NULL);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
}

/* A thread that frees on its stream blocks another thread allocated there
 * (it gave back through its slot more than it took) keeps none of them:
 * only the allocating thread would use them. Its free of a large block
 * seals it back to the large layer, as any large free that keeps nothing.
 * (Its first free, a small block's, makes its slot the one a keep
 * needs.) */
typedef struct two_frees {
  char *small, *big;
  cudaStream_t s;
  int rc;
} two_frees;

static void *two_frees_main(void *arg) {
  two_frees *f = arg;
  f->rc = magpie_free_async(f->small, f->s);
  if (f->rc == MAGPIE_OK) f->rc = magpie_free_async(f->big, f->s);
  return NULL;
}

static void *consumer_keeps_nothing_main(void *arg) {
  (void)arg;
  two_frees f = {.s = fake_stream_create(0), .rc = -1};
  assert_non_null(f.small = magpie_malloc_async(4096, f.s));
  assert_non_null(f.big = magpie_malloc_async(16 * MiB, f.s));
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  run_in_thread(two_frees_main, &f);
  assert_int_equal(f.rc, MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  assert_int_equal(magpie_usable_size(f.big), 0);
  fake_stream_complete(f.s);
  check_layers(0);
  return NULL;
}

static void test_consumer_keeps_nothing(void **state) {
  (void)state;
  run_in_thread(consumer_keeps_nothing_main, NULL);
}

/* The same on the legacy and per-thread default streams (PyTorch's
 * default stream is the legacy one), each in a thread of its own: matched
 * by id, they keep the block too; once the thread's current device has
 * changed, the handle names another device's default stream and the free
 * keeps nothing. */
static void *kept_default_stream_main(void *arg) {
  cudaStream_t s = (cudaStream_t)arg;
  fake_set_current_device(0);
  char *p = kept_block_cycles(s);
  magpie_stats st0, st1;
  fake_set_current_device(2);
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  magpie_free_async(p, s);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.thread_cached_bytes, st0.thread_cached_bytes);
  fake_set_current_device(0);
  return NULL;
}

static void test_kept_large_block_default_streams(void **state) {
  (void)state;
  for (uintptr_t h = 0; h <= 2; h += 2) {
    run_in_thread(kept_default_stream_main, (void *)h);
    assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  }
}

/* ---- an idle thread's magazines ---- */

static pthread_mutex_t idle_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t idle_cv = PTHREAD_COND_INITIALIZER;
static int idle_phase;
static cudaStream_t idle_stream;

/* The calling thread's magazines of device 2 filled: 256 blocks of 32 KiB
 * allocated and freed on idle_stream. Slab blocks: their slabs go back
 * only once every block is free, so the thread's magazines pin them
 * (class blocks would go back one by one). */
static void fill_thread_cache(void) {
  fake_set_current_device(2);
  void *p[256];
  int n = 0;
  while (n < 256 && (p[n] = magpie_malloc_async(32 * 1024, idle_stream)) != NULL) n++;
  for (int i = 0; i < n; i++) magpie_free_async(p[i], idle_stream);
}

static void *idle_worker(void *arg) {
  (void)arg;
  fill_thread_cache();
  pthread_mutex_lock(&idle_mu);
  idle_phase = 1;
  pthread_cond_broadcast(&idle_cv);
  while (idle_phase != 2) pthread_cond_wait(&idle_cv, &idle_mu); /* idle, caches full */
  pthread_mutex_unlock(&idle_mu);
  return NULL;
}

static void test_idle_thread_gives_back(void **state) {
  (void)state;
  /* Device 2 holds 16 MiB; the idle thread's magazines hold some of it. */
  idle_stream = fake_stream_create(2);
  pthread_t t;
  pthread_create(&t, NULL, idle_worker, NULL);
  pthread_mutex_lock(&idle_mu);
  while (idle_phase != 1) pthread_cond_wait(&idle_cv, &idle_mu);
  pthread_mutex_unlock(&idle_mu);
  fake_stream_complete(idle_stream);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(2, &st0), MAGPIE_OK);
  assert_true(st0.thread_cached_bytes > 0);
  /* A block as large as most of the device: only the idle thread's
   * memory makes room for it. */
  fake_set_current_device(2);
  cudaStream_t s = fake_stream_create(2);
  void *big = magpie_malloc_async(15 * MiB, s);
  assert_non_null(big);
  assert_int_equal(magpie_stats_get(2, &st1), MAGPIE_OK);
  assert_true(st1.threads_stolen > st0.threads_stolen || st1.threads_flushed > st0.threads_flushed);
  assert_true(st1.ladder_steps[HEAP_STEP_THREADS] > 0);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s);
  pthread_mutex_lock(&idle_mu);
  idle_phase = 2;
  pthread_cond_broadcast(&idle_cv);
  pthread_mutex_unlock(&idle_mu);
  pthread_join(t, NULL);
  check_layers(2);
  fake_set_current_device(0);
}

/* ---- a busy thread's magazines ---- */

static _Atomic int busy_phase;

/* Fills its magazines as idle_worker does, then allocates and frees one
 * small block on its stream in a loop, every call on the fast paths,
 * until busy_phase is 3. A reclaimer almost always finds it inside
 * magpie: it must ask, and the thread must give back at its next call. */
static void *busy_worker(void *arg) {
  (void)arg;
  fill_thread_cache();
  for (int first = 1; atomic_load(&busy_phase) != 3; first = 0) {
    void *q = magpie_malloc_async(256, idle_stream);
    if (q != NULL) magpie_free_async(q, idle_stream);
    if (first) atomic_store(&busy_phase, 1);
  }
  return NULL;
}

static void test_busy_thread_gives_back(void **state) {
  (void)state;
  idle_stream = fake_stream_create(2);
  atomic_store(&busy_phase, 0);
  pthread_t t;
  pthread_create(&t, NULL, busy_worker, NULL);
  while (atomic_load(&busy_phase) != 1) sched_yield();
  fake_stream_complete(idle_stream);
  magpie_stats st0, st1;
  int rc0 = magpie_stats_get(2, &st0);
  /* Only the busy thread's memory makes room for it (device 2: 16 MiB in
   * 2 MiB granules; the thread's small blocks keep one granule). */
  fake_set_current_device(2);
  cudaStream_t s = fake_stream_create(2);
  void *big = magpie_malloc_async(14 * MiB, s);
  int rc1 = magpie_stats_get(2, &st1);
  atomic_store(&busy_phase, 3);
  pthread_join(t, NULL);
  assert_int_equal(rc0, MAGPIE_OK);
  assert_int_equal(rc1, MAGPIE_OK);
  print_message("busy thread: %zu bytes cached in threads\n", st0.thread_cached_bytes);
  assert_true(st0.thread_cached_bytes > 0);
  assert_non_null(big);
  assert_true(st1.threads_stolen > st0.threads_stolen || st1.threads_flushed > st0.threads_flushed);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s);
  check_layers(2);
  fake_set_current_device(0);
}

/* ---- random sequences, invariants after every step, snapshots ---- */

static char *snapshot_text(int dev) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  assert_int_equal(magpie_snapshot_json(dev, f), MAGPIE_OK);
  fclose(f);
  return buf;
}

/* Parse a snapshot back and check its blocks add up to its statistics. */
static void check_snapshot(int dev) {
  char *text = snapshot_text(dev);
  jm *doc = jm_parse(text);
  if (doc == NULL) fail_msg("snapshot is not valid JSON: %.200s", text);
  assert_int_equal(jm_num(doc, "magpie_snapshot"), 1);
  assert_int_equal(jm_num(doc, "threads_skipped"), 0);
  const jm *st = jm_get(doc, "stats");
  const jm *segs = jm_get(doc, "segments");
  assert_non_null(st);
  assert_non_null(segs);
  size_t in_use = 0, thread = 0, depot = 0, pending = 0, large_free = 0, large_mapped = 0, slabs = 0;
  for (size_t i = 0; i < segs->n; i++) {
    const jm *sg = segs->kids[i];
    if (strcmp(jm_str(sg, "kind"), "slab") == 0) {
      slabs++;
      size_t bs = jm_num(sg, "block_size"), nb = 0;
      const jm *runs = jm_get(sg, "runs");
      for (size_t r = 0; r < runs->n; r++) {
        const char *name = runs->kids[r]->kids[0]->str;
        size_t count = runs->kids[r]->kids[1]->num;
        nb += count;
        if (strcmp(name, "in_use") == 0) in_use += count * bs;
        else if (strcmp(name, "thread") == 0) thread += count * bs;
        else if (strcmp(name, "depot") == 0) depot += count * bs;
        else if (strcmp(name, "pending") == 0 || strcmp(name, "limbo") == 0) pending += count * bs;
        else assert_string_equal(name, "unused");
      }
      assert_int_equal(nb, jm_num(sg, "blocks"));
    } else {
      assert_string_equal(jm_str(sg, "kind"), "large_segment");
      const jm *runs = jm_get(sg, "mapped");
      for (size_t r = 0; r < runs->n; r++) large_mapped += runs->kids[r]->kids[1]->num * jm_num(sg, "granule");
      const jm *blocks = jm_get(sg, "blocks");
      uintptr_t next = jm_num(sg, "base");
      for (size_t k = 0; k < blocks->n; k++) {
        const jm *b = blocks->kids[k];
        assert_int_equal(jm_num(b, "base"), next); /* blocks tile the segment */
        next += jm_num(b, "size");
        const char *state = jm_str(b, "state");
        int cls = jm_get(b, "class") != NULL; /* a class block: where its magazine is */
        /* A large block kept by a thread for its stream: "thread", or
         * "limbo" on its way back. */
        if (strcmp(state, "in_use") == 0) in_use += jm_num(b, "size");
        else if (strcmp(state, "free") == 0 && !cls) large_free += jm_num(b, "mapped");
        else if (strcmp(state, "thread") == 0) thread += jm_num(b, "size");
        else if (strcmp(state, "depot") == 0 && cls) depot += jm_num(b, "size");
        else if (strcmp(state, "limbo") == 0) pending += jm_num(b, "size");
        else assert_string_equal(state, "pending"), pending += jm_num(b, "mapped");
      }
      assert_int_equal(next, jm_num(sg, "base") + jm_num(sg, "size"));
    }
  }
  assert_int_equal(in_use, jm_num(st, "in_use_bytes"));
  assert_int_equal(thread, jm_num(st, "thread_cached_bytes"));
  assert_int_equal(depot, jm_num(st, "depot_bytes"));
  assert_int_equal(pending, jm_num(st, "epoch_pending_bytes"));
  assert_int_equal(large_free, jm_num(st, "large_free_bytes"));
  assert_int_equal(large_mapped, jm_num(st, "large_mapped_bytes"));
  assert_int_equal(slabs, jm_num(st, "slab_count"));
  free(text);
}

/* A thread taking turns on more streams than TDRAIN_SLOTS (front/tdrain.h):
 * what its drains sealed and the blocks it carries between streams count
 * as the thread's in the statistics and show as "thread" in snapshots,
 * taken between visits, while carried magazines sit in no slot. */
static void test_many_streams_snapshot(void **state) {
  (void)state;
  enum { STREAMS = 30, ROUNDS = 3, BLOCKS = 8 };
  cudaStream_t st[STREAMS];
  for (int i = 0; i < STREAMS; i++) st[i] = fake_stream_create(0);
  uint64_t r = 0x2545F4914F6CDD1Dull;
  for (int round = 0; round < ROUNDS; round++) {
    for (int i = 0; i < STREAMS; i++) {
      void *p[BLOCKS];
      for (int k = 0; k < BLOCKS; k++) {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        assert_non_null(p[k] = magpie_malloc_async(4096 + r % (60 * 1024), st[i]));
      }
      for (int k = 0; k < BLOCKS; k++) assert_int_equal(magpie_free_async(p[k], st[i]), MAGPIE_OK);
      if (i % 4 == 3) fake_stream_complete(st[i - 2]); /* some seals complete, some not */
      if (i % 10 == 9) {
        check_layers(0);
        check_snapshot(0);
      }
    }
  }
  for (int i = 0; i < STREAMS; i++) fake_stream_complete(st[i]);
  check_layers(0);
  check_snapshot(0);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static void test_random_sequences_keep_invariants(void **state) {
  (void)state;
  enum { LIVE = 96, STEPS = 3000, STREAMS = 3 };
  cudaStream_t st[STREAMS];
  for (int i = 0; i < STREAMS; i++) st[i] = fake_stream_create(0);
  void *live[LIVE] = {0};
  size_t size[LIVE] = {0};
  size_t expect_in_use = 0;
  magpie_stats base;
  assert_int_equal(magpie_stats_get(0, &base), MAGPIE_OK);
  for (int step = 0; step < STEPS; step++) {
    int k = (int)(rng() % LIVE);
    cudaStream_t s = st[rng() % STREAMS];
    uint64_t op = rng() % 100;
    if (op < 3) {
      fake_stream_complete(s);
    } else if (op < 4) {
      assert_int_equal(magpie_trim(0, (rng() % 4) * MiB), MAGPIE_OK);
    } else if (live[k] == NULL) {
      size_t sz = rng() % 4 == 0 ? MiB + rng() % (24 * MiB) : 1 + rng() % (256 * 1024);
      live[k] = magpie_malloc_async(sz, s);
      assert_non_null(live[k]);
      size[k] = magpie_usable_size(live[k]);
      assert_true(size[k] >= sz);
      expect_in_use += size[k];
    } else {
      assert_int_equal(magpie_free_async(live[k], s), MAGPIE_OK);
      expect_in_use -= size[k];
      live[k] = NULL;
    }
    check_layers(0);
    magpie_stats now;
    assert_int_equal(magpie_stats_get(0, &now), MAGPIE_OK);
    assert_int_equal(now.in_use_bytes - base.in_use_bytes, expect_in_use);
    if (step % 500 == 0) check_snapshot(0);
  }
  for (int k = 0; k < LIVE; k++)
    if (live[k]) assert_int_equal(magpie_free_async(live[k], st[0]), MAGPIE_OK);
  for (int i = 0; i < STREAMS; i++) fake_stream_complete(st[i]);
  check_layers(0);
  check_snapshot(0);
  /* Everything free and complete: trimming to 0 leaves only overhead and
   * what thread caches of exited threads... there are none here. */
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  magpie_stats end;
  assert_int_equal(magpie_stats_get(0, &end), MAGPIE_OK);
  assert_int_equal(end.reserved_bytes, end.in_use_bytes);
  check_snapshot(0);
}

static void test_snapshot_bad_input(void **state) {
  (void)state;
  assert_int_equal(magpie_snapshot_json(0, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  FILE *f = tmpfile();
  assert_int_equal(magpie_snapshot_json(99, f), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(magpie_last_error_message(), "no device 99"));
  fclose(f);
  assert_int_equal(magpie_trim(-1, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  /* A device with nothing allocated yet: an empty, valid snapshot. */
  char *text = snapshot_text(3);
  jm *doc = jm_parse(text);
  assert_non_null(doc);
  assert_int_equal(jm_get(doc, "segments")->n, 0);
  free(text);
}

/* The free-list bins (large.h): every size of whole quanta has a bin,
 * bins never decrease with size (so a block in a bin above a request's
 * own always fits it), and the allocation path's best fit still takes the
 * smallest free block that fits among holes of many sizes. */
static void test_bins_order_and_best_fit(void **state) {
  (void)state;
  unsigned prev = 0;
  for (size_t u = 1; u < (1u << 20); u += 1 + u / 64) {
    unsigned k = large_bin_of(u * LARGE_QUANTUM);
    assert_true(k >= prev && k < LARGE_BINS);
    prev = k;
  }
  for (unsigned e = 12; e < 64; e++) {
    size_t top = (e == 63 ? SIZE_MAX : ((size_t)1 << (e + 1)) - 1) & ~(LARGE_QUANTUM - 1);
    assert_true(large_bin_of(top) < LARGE_BINS);
    assert_true(large_bin_of((size_t)1 << e) <= large_bin_of(top));
  }
  /* Holes of 10, 6, 8, 4 and 12 MiB between blocks of one granule kept in
   * use, on a device no other test allocates on (its segment is carved
   * in order, every block on a granule boundary); a 5 MiB request takes
   * the 6 MiB hole, a 7.5 MiB one the 8 MiB hole, each at its start. */
  cudaStream_t s = fake_stream_create(3);
  const size_t holes[] = {10, 6, 8, 4, 12};
  char *hole[5], *wall[6];
  for (int i = 0; i < 5; i++) {
    wall[i] = magpie_malloc_async(2 * MiB, s);
    hole[i] = magpie_malloc_async(holes[i] * MiB, s);
    assert_non_null(wall[i]);
    assert_ptr_equal(hole[i], wall[i] + 2 * MiB);
    if (i > 0) assert_ptr_equal(wall[i], hole[i - 1] + holes[i - 1] * MiB);
  }
  wall[5] = magpie_malloc_async(2 * MiB, s);
  for (int i = 0; i < 5; i++) assert_int_equal(magpie_free_async(hole[i], s), MAGPIE_OK);
  int before = large_free_count(3);
  char *a = magpie_malloc_async(5 * MiB, s);
  char *b = magpie_malloc_async(7 * MiB + MiB / 2, s);
  assert_ptr_equal(a, hole[1]);
  assert_ptr_equal(b, hole[2]);
  assert_int_equal(large_free_count(3), before); /* each split one hole into a block and a smaller hole */
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(b, s), MAGPIE_OK);
  for (int i = 0; i < 6; i++) assert_int_equal(magpie_free_async(wall[i], s), MAGPIE_OK);
  check_layers(3);
  /* Everything free: a trim leaves nothing mapped (every free neighbour
   * merged, so no granule straddles two free blocks). */
  assert_int_equal(magpie_trim(3, 0), MAGPIE_OK);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(3, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
  assert_int_equal(st.reserved_bytes, 0);
  fake_stream_destroy(s);
}

/* Device 3's large cache, for the tests that call it directly, with a new
 * stream of that device (*s) and its id (*sid). */
static large_cache *device3_cache(cudaStream_t *s, uint64_t *sid) {
  heap *h = heap_get(3);
  assert_non_null(h);
  *s = fake_stream_create(3);
  *sid = 0;
  assert_int_equal(h->ops->stream_id(*s, sid), MAGPIE_OK);
  return &h->large;
}

/* The keeping word's generation (pool/large.h, lblock.kept), on the large
 * cache itself, on device 3 once test_bins_order_and_best_fit has given
 * all of it back (its segment, free and unmapped, is carved in order). A
 * thread lends block A; another thread frees it; the
 * same descriptor is handed out again at another address (the 4 MiB left
 * of A once its first half is carved) and lent by another keeper. The
 * first lender's record is stale: its compare-and-swap must fail, although
 * the descriptor is lent again, or its free of the block now at A's
 * address would keep the other keeper's block. */
static void test_lent_block_generation(void **state) {
  (void)state;
  cudaStream_t s;
  uint64_t sid;
  large_cache *c = device3_cache(&s, &sid);
  uintptr_t x, a, y, first, rest;
  size_t bs;
  /* A between two blocks in use, so that its free merges with nothing. */
  assert_int_equal(large_alloc(c, 8 * MiB, sid, s, LARGE_READY_ONLY, &x, &bs), MAGPIE_OK);
  assert_int_equal(large_alloc(c, 8 * MiB, sid, s, LARGE_READY_ONLY, &a, &bs), MAGPIE_OK);
  assert_int_equal(large_alloc(c, 8 * MiB, sid, s, LARGE_READY_ONLY, &y, &bs), MAGPIE_OK);
  assert_int_equal(a, x + 8 * MiB);
  assert_int_equal(y, a + 8 * MiB);
  lblock *lb = NULL;
  assert_true(large_keep_block(c, a, SIZE_MAX, &lb));
  uint64_t lent = large_lend(lb); /* the first lender's record: (lb, a, lent) */
  /* Freed elsewhere: the free takes it from the lender. */
  assert_int_equal(large_free(c, a, &(epoch_ticket){0}, &bs), MAGPIE_OK);
  assert_int_equal(large_kept_state(lb), 0);
  assert_false(large_rekeep(lb, lent));
  /* Its first half carved off (a new descriptor), then the rest, the same
   * descriptor at another address, handed out and lent by another keeper. */
  assert_int_equal(large_alloc(c, 4 * MiB, sid, s, LARGE_READY_ONLY, &first, &bs), MAGPIE_OK);
  assert_int_equal(first, a);
  assert_int_equal(large_alloc(c, 4 * MiB, sid, s, LARGE_READY_ONLY, &rest, &bs), MAGPIE_OK);
  assert_int_equal(rest, a + 4 * MiB);
  lblock *lb2 = NULL;
  assert_true(large_keep_block(c, rest, SIZE_MAX, &lb2));
  assert_ptr_equal(lb2, lb);
  uint64_t lent2 = large_lend(lb2);
  assert_int_equal(lent2 & LARGE_KEPT_STATE, lent & LARGE_KEPT_STATE);
  assert_true(lent2 != lent);
  /* The stale record fails; the second keeper's takes it back. */
  assert_false(large_rekeep(lb, lent));
  assert_int_equal(large_kept_state(lb2), LARGE_KEPT_OUT);
  assert_true(large_rekeep(lb2, lent2));
  large_unkeep(lb2);
  const uintptr_t all[] = {x, first, rest, y};
  for (int i = 0; i < 4; i++) assert_int_equal(large_free(c, all[i], &(epoch_ticket){0}, &bs), MAGPIE_OK);
  assert_int_equal(large_free(c, rest, &(epoch_ticket){0}, &bs), MAGPIE_ERR_DOUBLE_FREE);
  check_layers(3);
  fake_stream_destroy(s);
}

/* Where a block goes in free memory (large.c, large_consider), on device
 * 3 once the tests before have given all of it back (its segment, free
 * and unmapped, is carved in order from a granule boundary). A block
 * goes where it cuts into no whole free granule; one smaller than a
 * granule, aligned to its size, and between holes of one bin into the
 * granule with the least free memory. */
static void test_placement_keeps_granules_whole(void **state) {
  (void)state;
  cudaStream_t s;
  uint64_t sid;
  large_cache *c = device3_cache(&s, &sid);
  assert_int_equal(magpie_trim(3, 0), MAGPIE_OK);
  const size_t K = 1024;
  size_t bs;
#define PLACE(p, size) assert_int_equal(large_alloc(c, (size), sid, s, LARGE_READY_ONLY, &(p), &bs), MAGPIE_OK)
#define UNPLACE(p) assert_int_equal(large_free(c, (p), &(epoch_ticket){0}, &bs), MAGPIE_OK)
  /* Granule 0: u1 (768 KiB), h1 (1.25 MiB); granule 1: v (512 KiB), h2
   * (1.25 MiB), w (128 KiB), u3 (128 KiB); granule 2: u4. */
  uintptr_t u1, h1, v, h2, w, u3, u4, x;
  PLACE(u1, 768 * K);
  assert_int_equal(u1 % (2 * MiB), 0);
  PLACE(h1, 1280 * K);
  PLACE(v, 512 * K);
  PLACE(h2, 1280 * K);
  PLACE(w, 128 * K);
  PLACE(u3, 128 * K);
  PLACE(u4, 2 * MiB);
  assert_int_equal(h1, u1 + 768 * K);
  assert_int_equal(v, u1 + 2 * MiB);
  assert_int_equal(h2, u1 + 2560 * K);
  assert_int_equal(w, u1 + 3840 * K);
  assert_int_equal(u3, u1 + 3968 * K);
  assert_int_equal(u4, u1 + 4 * MiB);
  /* Holes of 1.25 MiB in granules 0 (1.25 MiB free) and 1 (1.375 MiB
   * free, with u3's): 512 KiB goes into granule 0, aligned to its size
   * (at h1's end), although h2's hole is the newer of the two in their
   * bin. */
  UNPLACE(h1);
  UNPLACE(h2);
  UNPLACE(u3);
  PLACE(x, 512 * K);
  assert_int_equal(x, u1 + 1536 * K);
  const uintptr_t first[] = {x, u1, v, w, u4};
  for (int i = 0; i < 5; i++) UNPLACE(first[i]);
  assert_int_equal(magpie_trim(3, 0), MAGPIE_OK);
  /* A 5 MiB hole from a granule boundary (after a, 2 MiB) into the
   * granule cc fills half of: 3 MiB goes to its end, at 4 MiB, where it
   * cuts into no whole free granule (at the hole's start it would cut
   * into the one at 4 MiB); 2 MiB then takes the granule left. */
  uintptr_t a, hole, cc, y;
  PLACE(a, 2 * MiB);
  PLACE(hole, 5 * MiB);
  PLACE(cc, 3 * MiB);
  assert_int_equal(hole, a + 2 * MiB);
  assert_int_equal(cc, a + 7 * MiB);
  UNPLACE(hole);
  PLACE(x, 3 * MiB);
  assert_int_equal(x, a + 4 * MiB);
  PLACE(y, 2 * MiB);
  assert_int_equal(y, a + 2 * MiB);
  const uintptr_t second[] = {a, cc, x, y};
  for (int i = 0; i < 4; i++) UNPLACE(second[i]);
#undef PLACE
#undef UNPLACE
  check_layers(3);
  fake_stream_destroy(s);
}

int main(void) {
  fake_set_devices(4);
  fake_set_capacity(1, 24 * MiB);
  fake_set_capacity(2, 16 * MiB);
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_split_and_coalesce),
      cmocka_unit_test(test_ready_hole_joins_pending_neighbour),
      cmocka_unit_test(test_segment_grows_and_shrinks),
      cmocka_unit_test(test_trim_waits_for_release_in_flight),
      cmocka_unit_test(test_large_stream_rules),
      cmocka_unit_test(test_kept_large_block),
      cmocka_unit_test(test_kept_large_blocks),
      cmocka_unit_test(test_lent_block_freed_elsewhere),
      cmocka_unit_test(test_consumer_keeps_nothing),
      cmocka_unit_test(test_kept_large_block_default_streams),
      cmocka_unit_test(test_run_of_blocks_freed_on_different_streams),
      cmocka_unit_test(test_idle_thread_gives_back),
      cmocka_unit_test(test_busy_thread_gives_back),
      cmocka_unit_test(test_random_sequences_keep_invariants),
      cmocka_unit_test(test_many_streams_snapshot),
      cmocka_unit_test(test_snapshot_bad_input),
      cmocka_unit_test(test_bins_order_and_best_fit),
      cmocka_unit_test(test_lent_block_generation),
      cmocka_unit_test(test_placement_keeps_granules_whole),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
