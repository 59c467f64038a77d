/* Class blocks (the size classes above 32 KiB, carved from the large
 * segments: src/heap/heap.c with src/pool/large.c) against the
 * deterministic fake device (fake_backend.c): where they go when they
 * leave a thread's slot (back to the segments, or to the depot). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/sizeclass.h"
#include "heap/heap.h"
#include "magpie.h"
#include "pool/depot.h"
#include "tcache/tcache.h"
#include "tests/fake_backend.h"
#include "tests/tcache_util.h"

/* Bytes of class cls in the depot, ready and pending. */
static int64_t depot_class_bytes(heap *h, unsigned cls) {
  return atomic_load_relaxed(&h->depots[cls].ready_bytes) + atomic_load_relaxed(&h->depots[cls].pending_bytes);
}

enum { CLASS_BLOCKS = 6 };

/* The class-block tests' start: device 0's heap, CLASS_BLOCKS blocks of
 * size (a class above 32 KiB) allocated on a new stream into p, and what
 * the depot holds of their class before anything is freed. */
typedef struct class_case {
  heap *h;
  unsigned cls;
  cudaStream_t s;
  int64_t depot0;
} class_case;

static class_case class_case_start(size_t size, void **p) {
  class_case k = {.h = heap_get(0), .cls = sizeclass_of(size), .s = fake_stream_create(0)};
  assert_non_null(k.h);
  /* No budget beyond an eighth of the bytes in use (less than one block
   * here): a slot's surplus goes back to the segments (heap_put). */
  atomic_store_relaxed(&k.h->class_budget_floor, 0);
  assert_true(sizeclass_table[k.cls].seg);
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(size, k.s));
  k.depot0 = depot_class_bytes(k.h, k.cls);
  return k;
}

/* Free the case's blocks on its stream while this thread holds the large
 * cache's lock (a give-back that tries it finds it held): the depot then
 * holds more of their class than before. */
static void class_case_free_locked(const class_case *k, void **p) {
  pthread_mutex_lock(&k->h->large.lock);
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], k->s), MAGPIE_OK);
  pthread_mutex_unlock(&k->h->large.lock);
  assert_true(depot_class_bytes(k->h, k->cls) > k->depot0);
}

/* Class blocks (classes above 32 KiB) that come and go in one thread's
 * slot: what leaves the slot past the depot's budget is the thread's
 * surplus and goes back to the segments (heap_put), not to the depot,
 * where each class kept its own high-water mark. There they coalesce and serve a large block without
 * mapping more; another stream still waits for the freeing stream's work. */
static void test_class_surplus_back_to_segments(void **state) {
  (void)state;
  const size_t size = 600000; /* the 768 KiB class, which no other test here uses */
  void *p[CLASS_BLOCKS];
  class_case k = class_case_start(size, p);
  heap *h = k.h;
  unsigned cls = k.cls;
  cudaStream_t s = k.s, t = fake_stream_create(0);
  int64_t depot0 = k.depot0;
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_true((ts->round_trip >> cls) & 1);
  /* One block stays loaded, one may wait in the outbox; the rest left in
   * sealed outboxes of two (768 KiB each, TCACHE_OUTBOX_BYTES). */
  assert_int_equal(depot_class_bytes(h, cls), depot0);
  /* Another stream: none of them while s may still run. */
  for (int k = 0; k < CLASS_BLOCKS; k++) {
    void *q = magpie_malloc_async(size, t);
    assert_non_null(q);
    for (int i = 0; i < CLASS_BLOCKS; i++) assert_ptr_not_equal(q, p[i]);
    assert_int_equal(magpie_free_async(q, t), MAGPIE_OK);
  }
  /* s itself: a large block in their coalesced room, nothing mapped. */
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *big = magpie_malloc_async((size_t)1400 << 10, s);
  assert_non_null(big);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.reserved_bytes, st0.reserved_bytes);
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (int i = 0; i < CLASS_BLOCKS; i++) {
    if ((uintptr_t)p[i] < lo) lo = (uintptr_t)p[i];
    if ((uintptr_t)p[i] > hi) hi = (uintptr_t)p[i];
  }
  assert_true((uintptr_t)big >= lo && (uintptr_t)big <= hi);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
}

/* Class blocks that only flow out of a slot (another thread allocated
 * them) go to the depot, where the allocating thread takes them back with
 * no lock. */
static void *free_all_thread(void *arg) {
  void **p = arg;
  cudaStream_t s = p[CLASS_BLOCKS];
  for (int i = 0; i < CLASS_BLOCKS; i++)
    if (magpie_free_async(p[i], s) != MAGPIE_OK) return NULL;
  return arg;
}

static void test_class_outflow_to_depot(void **state) {
  (void)state;
  const size_t size = 400000; /* the 512 KiB class, which no other test here uses */
  void *p[CLASS_BLOCKS + 1];
  class_case k = class_case_start(size, p);
  cudaStream_t s = k.s;
  p[CLASS_BLOCKS] = s;
  pthread_t th;
  void *ret = NULL;
  assert_int_equal(pthread_create(&th, NULL, free_all_thread, p), 0);
  assert_int_equal(pthread_join(th, &ret), 0);
  assert_ptr_equal(ret, p);
  /* Two magazines of two blocks (1 MiB each) sealed from its outbox while
   * it ran; what it still held at its exit went to limbo, which the
   * maintenance thread may have drained into the depot since. */
  assert_true(depot_class_bytes(k.h, k.cls) >= k.depot0 + 4 * (int64_t)sizeclass_table[k.cls].size);
  fake_stream_complete(s);
  for (int n = 0; n < 4; n++) {
    void *q = magpie_malloc_async(size, s);
    int found = 0;
    for (int i = 0; i < CLASS_BLOCKS; i++) found |= q == p[i];
    assert_true(found);
    assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  }
}

/* An allocation that would map first sends the slot's cached class blocks
 * back to their segments (with its outbox, under one seal; past the
 * depot's budget, none here), where they coalesce with the free space
 * around them instead of keeping it apart; not to the depot. (Here they
 * still wait on s, and a block waiting on a stream joins no neighbour
 * that is partly unmapped: the large block is mapped anew.) */
static void test_allocation_that_would_map_sends_class_blocks_back(void **state) {
  (void)state;
  const size_t size = 90000; /* the 96 KiB class, which no other test here uses */
  heap *h = heap_get(0);
  atomic_store_relaxed(&h->class_budget_floor, 0);
  unsigned cls = sizeclass_of(size);
  assert_true(sizeclass_table[cls].seg);
  /* No free mapped memory left (the allocation below must map), and the
   * calling thread's caches empty. */
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  cudaStream_t s = fake_stream_create(0);
  void *p[2];
  for (int i = 0; i < 2; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  for (int i = 0; i < 2; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_true(ts->cl[cls].loaded->count + ts->prev[cls]->count > 0);
  int64_t depot0 = depot_class_bytes(h, cls);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *big = magpie_malloc_async((size_t)2 << 20, s);
  assert_non_null(big);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(ts->cl[cls].loaded->count + ts->prev[cls]->count, 0);
  assert_int_equal(depot_class_bytes(h, cls), depot0);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  /* The slot's next block of the class comes from the segments. */
  void *q = magpie_malloc_async(size, s);
  assert_non_null(q);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  atomic_store_relaxed(&h->class_budget_floor, HEAP_CLASS_BUDGET_FLOOR);
  fake_stream_complete(s);
}

/* The round trip's give-back only tries the large cache's lock: while
 * another thread holds it, the surplus goes to the depot instead of
 * waiting, and the next HEAP_PUT_BACKOFF do without trying. */
static void test_class_surplus_to_depot_when_lock_busy(void **state) {
  (void)state;
  const size_t size = 300000; /* the 384 KiB class, which no other test here uses */
  void *p[CLASS_BLOCKS];
  class_case k = class_case_start(size, p);
  uint64_t contended = heap_class_contention(k.h);
  class_case_free_locked(&k, p);
  assert_true(atomic_load_relaxed(&k.h->put_backoff) > 0);
  /* Counted: the thread caches keep a second magazine of class blocks
   * while this rises (tslot.h, seg_two). */
  assert_true(heap_class_contention(k.h) > contended);
  atomic_store_relaxed(&k.h->put_backoff, 0); /* for the tests after this one */
  fake_stream_complete(k.s);
}

/* Within the depot's budget the surplus stays in the depot, with no lock
 * tried, and the slot's next refills take it back from there. */
static void test_class_surplus_in_depot_within_budget(void **state) {
  (void)state;
  /* The 1 MiB class, which no other test here uses: one block a magazine,
   * so that the frees below fill more than the outbox of a thread on
   * several streams holds (1 MiB) and some reach the depot. */
  const size_t size = 1000000;
  void *p[CLASS_BLOCKS];
  class_case k = class_case_start(size, p);
  heap *h = k.h;
  cudaStream_t s = k.s;
  atomic_store_relaxed(&h->class_budget_floor, (size_t)64 << 20);
  /* Held by this thread: a give-back would find it busy (and set the
   * back-off); within the budget none is tried. */
  class_case_free_locked(&k, p);
  assert_int_equal(atomic_load_relaxed(&h->put_backoff), 0);
  int64_t before = depot_class_bytes(h, k.cls);
  for (int n = 0; n < CLASS_BLOCKS; n++) assert_non_null(p[n] = magpie_malloc_async(size, s));
  assert_true(depot_class_bytes(h, k.cls) < before);
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  atomic_store_relaxed(&h->class_budget_floor, HEAP_CLASS_BUDGET_FLOOR);
  fake_stream_complete(s);
}

/* Blocks of class cls in the previous magazine of the calling thread's
 * slot for s (its second one). */
static uint32_t slot_second_blocks(cudaStream_t s, unsigned cls) {
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  return ts->prev[cls]->count;
}

/* A slot keeps one magazine of a class of class blocks while no thread
 * contends on their paths (tslot.h, seg_two), and two, as of every other
 * class, once a refill from the heap finds that threads did, until
 * TCACHE_QUIET_REFILLS refills find that none did; only where its thread
 * is on its stream alone (tcache_keeps_for): here a new thread's. */
typedef struct second_run {
  heap *h;
  cudaStream_t s;
  int ok;
} second_run;

static void *second_magazine_thread(void *arg) {
  second_run *r = arg;
  const size_t size = 150000; /* the 192 KiB class, which no other test here uses */
  unsigned cls = sizeclass_of(size);
  uint32_t cap = sizeclass_table[cls].mag_max;
  cudaStream_t s = r->s;
  enum { N = 3 * 70 };
  static void *p[N];
  /* Quiet: two magazines' worth freed, one kept (the other left). The
   * first refill is a carve of a magazine's worth for a thread on one
   * stream (tcache_seg_cap). */
  assert_true(cap > sizeclass_table[cls].mag_cap);
  assert_non_null(p[0] = magpie_malloc_async(size, s));
  assert_int_equal(own_slot(s)->cl[cls].loaded->cap, cap);
  for (uint32_t i = 1; i < 2 * cap; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  for (uint32_t i = 0; i < 2 * cap; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  assert_int_equal(slot_second_blocks(s, cls), 0);
  /* Another thread found the lock held; the slot's next refill from the
   * heap (past what it holds and its outbox) sees it. */
  atomic_add_relaxed(&r->h->large.class_contended, 1);
  for (uint32_t i = 0; i < 3 * cap; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  for (uint32_t i = 0; i < 3 * cap; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  assert_true(slot_second_blocks(s, cls) > 0);
  assert_int_equal(own_slot(s)->seg_two, 1);
  /* Quiet again: past TCACHE_QUIET_REFILLS refills, one magazine. */
  uint64_t seen = heap_class_contention(r->h);
  size_t n = (size_t)cap * (TCACHE_QUIET_REFILLS + 4);
  assert_true(n <= N);
  for (size_t i = 0; i < n; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  for (size_t i = 0; i < n; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  if (heap_class_contention(r->h) == seen) { /* no lock found held meanwhile (the maintenance thread's) */
    assert_int_equal(own_slot(s)->seg_two, 0);
    assert_int_equal(slot_second_blocks(s, cls), 0);
  }
  r->ok = 1;
  return NULL;
}

static void test_second_magazine_while_contended(void **state) {
  (void)state;
  second_run r = {.h = heap_get(0), .s = fake_stream_create(0)};
  unsigned cls = sizeclass_of(150000);
  assert_true(sizeclass_table[cls].seg && sizeclass_table[cls].mag_max >= 2);
  run_in_thread(second_magazine_thread, &r);
  assert_true(r.ok);
  /* This thread is on several streams: one magazine, contended or not. */
  cudaStream_t s = fake_stream_create(0);
  const size_t size = 150000;
  uint32_t cap = sizeclass_table[cls].mag_cap;
  void *p[8];
  assert_true(1 + 3 * cap <= 8);
  assert_non_null(p[0] = magpie_malloc_async(size, s)); /* the slot's first look */
  atomic_add_relaxed(&r.h->large.class_contended, 1);
  for (uint32_t i = 1; i <= 3 * cap; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  assert_int_equal(own_slot(s)->seg_two, 1);
  for (uint32_t i = 0; i <= 3 * cap; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  assert_int_equal(slot_second_blocks(s, cls), 0);
  fake_stream_complete(r.s);
  fake_stream_complete(s);
}

/* A refill of class blocks that another thread (carve_thread) makes. */
typedef struct carve_run {
  size_t size;
  cudaStream_t s;
  void *p;
  _Atomic int done;
} carve_run;

static void *carve_thread(void *arg) {
  carve_run *r = arg;
  r->p = magpie_malloc_async(r->size, r->s);
  atomic_store(&r->done, 1);
  return NULL;
}

/* A refill of size's class (one no other test here uses) on a new stream,
 * for carve_thread to make: mapped free memory, ready for every stream,
 * and none of the class in the depot. */
static carve_run carve_run_start(heap *h, size_t size) {
  assert_true(sizeclass_table[sizeclass_of(size)].seg);
  cudaStream_t s = fake_stream_create(0);
  void *big = magpie_malloc_async((size_t)4 << 20, s);
  assert_non_null(big);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s);
  assert_int_equal(depot_class_bytes(h, sizeclass_of(size)), 0);
  return (carve_run){.size = size, .s = s, .done = 0};
}

/* The carved block back, once carve_thread ended. */
static void carve_run_end(carve_run *r) {
  assert_non_null(r->p);
  assert_int_equal(magpie_free_async(r->p, r->s), MAGPIE_OK);
  fake_stream_complete(r->s);
}

/* Class blocks from memory mapped already are carved without the class's
 * carve lock (heap.c, heap_carve): another thread holding it does not
 * hold up a refill that needs no mapping. */
static void test_class_carve_without_carve_lock(void **state) {
  (void)state;
  heap *h = heap_get(0);
  unsigned cls = sizeclass_of(120000); /* the 128 KiB class */
  carve_run r = carve_run_start(h, 120000);
  pthread_mutex_lock(&h->depots[cls].carve_lock);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, carve_thread, &r), 0);
  for (int i = 0; i < 5000 && !atomic_load(&r.done); i++) usleep(1000);
  int done = atomic_load(&r.done);
  pthread_mutex_unlock(&h->depots[cls].carve_lock);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_true(done);
  carve_run_end(&r);
}

/* A class carve that finds the large cache's lock held waits for it
 * (large_class.c, large_class_lock): it goes on only once the holder let
 * go, and the contention is counted. */
static void test_class_carve_waits_for_held_lock(void **state) {
  (void)state;
  heap *h = heap_get(0);
  carve_run r = carve_run_start(h, 250000); /* the 256 KiB class */
  pthread_mutex_lock(&h->large.lock);
  uint64_t seen = heap_class_contention(h);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, carve_thread, &r), 0);
  for (int i = 0; i < 50 && heap_class_contention(h) == seen; i++) usleep(1000);
  usleep(30000);
  int early = atomic_load(&r.done);
  uint64_t counted = heap_class_contention(h) - seen;
  pthread_mutex_unlock(&h->large.lock);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_false(early);
  assert_true(counted >= 1); /* the maintenance thread may have found it held too */
  carve_run_end(&r);
}

/* The outbox of a thread on its stream alone while threads contend on
 * the class blocks' paths: up to TCACHE_OUTBOX_CONTENDED_BYTES once
 * TCACHE_OUTBOX_CONTENDED_THREADS or more threads have caches, else
 * TCACHE_OUTBOX_BYTES (tslot.h). Blocks of the 1 MiB class, one a
 * magazine: freed past what the loaded and second magazines hold, they
 * fill the outbox past TCACHE_OUTBOX_BYTES and stay within the larger
 * bound. */
#define OUTBOX_BLOCKS 11

typedef struct outbox_run {
  heap *h;
  size_t out_bytes; /* the slot's outbox after the frees */
  int ok;
} outbox_run;

static void *outbox_thread(void *arg) {
  outbox_run *r = arg;
  const size_t size = (size_t)1 << 20;
  cudaStream_t s = fake_stream_create(0);
  void *p[OUTBOX_BLOCKS];
  assert_non_null(p[0] = magpie_malloc_async(size, s)); /* the slot's first look */
  atomic_add_relaxed(&r->h->large.class_contended, 1);  /* another thread found the lock held */
  for (int i = 1; i < OUTBOX_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  assert_int_equal(own_slot(s)->seg_two, 1);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  r->out_bytes = own_slot(s)->out_bytes;
  fake_stream_complete(s);
  r->ok = 1;
  return NULL;
}

/* Threads that hold a cache (one allocation made) until released. */
typedef struct idle_threads {
  pthread_barrier_t ready, release;
} idle_threads;

static void *idle_thread(void *arg) {
  idle_threads *t = arg;
  cudaStream_t s = fake_stream_create(0);
  void *p = magpie_malloc_async(4096, s);
  if (p != NULL) magpie_free_async(p, s);
  pthread_barrier_wait(&t->ready);
  pthread_barrier_wait(&t->release);
  fake_stream_complete(s);
  return NULL;
}

static void test_outbox_larger_while_contended(void **state) {
  (void)state;
  _Static_assert((OUTBOX_BLOCKS - 2) * ((size_t)1 << 20) >= TCACHE_OUTBOX_BYTES &&
                     OUTBOX_BLOCKS * ((size_t)1 << 20) < TCACHE_OUTBOX_CONTENDED_BYTES,
                 "the frees pass the outbox's bound and stay within the contended one");
  heap *h = heap_get(0);
  assert_int_equal(sizeclass_table[sizeclass_of((size_t)1 << 20)].mag_max, 1);
  /* This thread, the runner's and the maintenance thread's at most: the
   * outbox sealed at TCACHE_OUTBOX_BYTES. */
  assert_true(TCACHE_OUTBOX_CONTENDED_THREADS > 3);
  outbox_run r = {.h = h};
  run_in_thread(outbox_thread, &r);
  assert_true(r.ok);
  assert_true(r.out_bytes < TCACHE_OUTBOX_BYTES);
  /* With TCACHE_OUTBOX_CONTENDED_THREADS more threads holding caches: kept. */
  enum { IDLE = TCACHE_OUTBOX_CONTENDED_THREADS };
  idle_threads t;
  assert_int_equal(pthread_barrier_init(&t.ready, NULL, IDLE + 1), 0);
  assert_int_equal(pthread_barrier_init(&t.release, NULL, IDLE + 1), 0);
  pthread_t th[IDLE];
  for (int i = 0; i < IDLE; i++) assert_int_equal(pthread_create(&th[i], NULL, idle_thread, &t), 0);
  pthread_barrier_wait(&t.ready);
  r = (outbox_run){.h = h};
  run_in_thread(outbox_thread, &r);
  pthread_barrier_wait(&t.release);
  for (int i = 0; i < IDLE; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
  assert_int_equal(pthread_barrier_destroy(&t.ready), 0);
  assert_int_equal(pthread_barrier_destroy(&t.release), 0);
  assert_true(r.ok);
  assert_true(r.out_bytes >= TCACHE_OUTBOX_BYTES);
}

/* The free fast path's classification (large_or_slab_class, which selects
 * without a branch on the descriptor's kind) against the branching one
 * (slab_block_index for a class slab, large_class_of for a segment), at
 * every 256 B step around a slab block, a class block and a large block,
 * the last also while a graph pool marks it. */
static int block_class_ref(const slab *sl, uintptr_t p) {
  uint32_t i;
  if (sl->cls != SLAB_LARGE) return slab_block_index(sl, p, &i) ? (int)sl->cls : -1;
  return large_class_of(sl, p);
}

static int block_class_agree(uintptr_t at, size_t span) {
  int starts = 0;
  for (uintptr_t p = at - span; p < at + span; p += 256) {
    slab *sl = pagemap_lookup(p);
    if (sl == NULL) continue;
    int k = large_or_slab_class(sl, p);
    assert_int_equal(k, block_class_ref(sl, p));
    starts += k >= 0;
  }
  return starts;
}

static void test_block_class_without_branch(void **state) {
  (void)state;
  heap *h = heap_get(0);
  cudaStream_t s = fake_stream_create(0);
  void *small = magpie_malloc_async(1280, s), *cb = magpie_malloc_async(200000, s);
  void *big = magpie_malloc_async((size_t)3 << 20, s);
  assert_non_null(small);
  assert_non_null(cb);
  assert_non_null(big);
  assert_int_equal(large_or_slab_class(pagemap_lookup((uintptr_t)small), (uintptr_t)small), (int)sizeclass_of(1280));
  assert_int_equal(large_or_slab_class(pagemap_lookup((uintptr_t)small), (uintptr_t)small + 256), -1);
  assert_int_equal(large_or_slab_class(pagemap_lookup((uintptr_t)cb), (uintptr_t)cb), (int)sizeclass_of(200000));
  assert_int_equal(large_or_slab_class(pagemap_lookup((uintptr_t)cb), (uintptr_t)cb + 4096), -1);
  assert_int_equal(large_or_slab_class(pagemap_lookup((uintptr_t)big), (uintptr_t)big), -1);
  assert_true(block_class_agree((uintptr_t)small, 16 * 1280) >= 1);
  assert_true(block_class_agree((uintptr_t)cb, 4 * 262144) >= 1);
  block_class_agree((uintptr_t)big, (size_t)1 << 20);
  assert_int_equal(large_graph_mark(&h->large, (uintptr_t)big, 1), 1);
  assert_true(large_is_graph(pagemap_lookup((uintptr_t)big), (uintptr_t)big));
  block_class_agree((uintptr_t)big, (size_t)1 << 20);
  assert_int_equal(large_graph_mark(&h->large, (uintptr_t)big, 0), 1);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(cb, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(small, s), MAGPIE_OK);
  fake_stream_complete(s);
}

int main(void) {
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_class_surplus_back_to_segments),
      cmocka_unit_test(test_class_surplus_in_depot_within_budget),
      cmocka_unit_test(test_allocation_that_would_map_sends_class_blocks_back),
      cmocka_unit_test(test_class_outflow_to_depot),
      cmocka_unit_test(test_class_surplus_to_depot_when_lock_busy),
      cmocka_unit_test(test_second_magazine_while_contended),
      cmocka_unit_test(test_class_carve_without_carve_lock),
      cmocka_unit_test(test_class_carve_waits_for_held_lock),
      cmocka_unit_test(test_outbox_larger_while_contended),
      cmocka_unit_test(test_block_class_without_branch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
