/* Allocator core against the deterministic fake device (fake_backend.c),
 * through the public API: stream-ordered reuse, handle reuse, large
 * blocks, memory pressure, bad input, statistics and thread exit. The
 * layers below it one module at a time: base_test.c, epoch_test.c,
 * depot_test.c, tcache_test.c, class_blocks_test.c, carve_test.c,
 * span_test.c, region_test.c. */
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/error.h"
#include "base/meta.h"
#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "base/stack.h"
#include "front/init.h"
#include "heap/heap.h"
#include "magpie.h"
#include "pool/depot.h"
#include "pool/epoch.h"
#include "pool/magazine.h"
#include "pool/slab.h"
#include "pool/span.h"
#include "tcache/tcache.h"
#include "tests/fake_backend.h"

#define N_BLOCKS 400

static int contains(void *const *set, int n, const void *p) {
  for (int i = 0; i < n; i++)
    if (set[i] == p) return 1;
  return 0;
}

static void test_same_stream_reuse(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  void *p = magpie_malloc_async(1000, s);
  assert_non_null(p);
  assert_int_equal((uintptr_t)p % 256, 0);
  assert_int_equal(magpie_usable_size(p), 1024);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  void *q = magpie_malloc_async(1000, s);
  assert_ptr_equal(q, p); /* the freeing stream reuses at once */
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
}

/* The default stream (handle 0) names the current device's stream: a free
 * on it is reused at once by that stream, but after the device changes the
 * same handle is another stream, and the block must not go back to the
 * first device's stream, which has not waited for the second's work. */
static void test_default_stream_free_follows_device(void **state) {
  (void)state;
  fake_set_current_device(0);
  void *p = magpie_malloc_async(1000, 0);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p, 0), MAGPIE_OK);
  void *q = magpie_malloc_async(1000, 0);
  assert_ptr_equal(q, p);
  fake_set_current_device(1);
  assert_int_equal(magpie_free_async(q, 0), MAGPIE_OK); /* on device 1's stream */
  fake_set_current_device(0);
  void *r = magpie_malloc_async(1000, 0);
  assert_non_null(r);
  assert_ptr_not_equal(r, q);
  assert_int_equal(magpie_free_async(r, 0), MAGPIE_OK);
}

/* Blocks freed on A go through the depot sealed; B must not receive any of
 * them until A's work completed; after that, B may. The thread allocates
 * on both streams from the start: on one stream alone its outbox would
 * keep all of them (tcache_outbox_full). */
static void test_cross_stream_waits_for_epoch(void **state) {
  (void)state;
  cudaStream_t a = fake_stream_create(0), b = fake_stream_create(0);
  static void *pa[N_BLOCKS], *pb[N_BLOCKS];
  void *first = magpie_malloc_async(3000, b);
  assert_non_null(first);
  assert_int_equal(magpie_free_async(first, b), MAGPIE_OK);
  for (int i = 0; i < N_BLOCKS; i++) assert_non_null(pa[i] = magpie_malloc_async(3000, a));
  for (int i = 0; i < N_BLOCKS; i++) assert_int_equal(magpie_free_async(pa[i], a), MAGPIE_OK);
  magpie_stats before;
  assert_int_equal(magpie_stats_get(0, &before), MAGPIE_OK);
  assert_true(before.events_recorded > 0);
  for (int i = 0; i < N_BLOCKS; i++) {
    assert_non_null(pb[i] = magpie_malloc_async(3000, b));
    assert_false(contains(pa, N_BLOCKS, pb[i]));
  }
  for (int i = 0; i < N_BLOCKS; i++) assert_int_equal(magpie_free_async(pb[i], b), MAGPIE_OK);
  fake_stream_complete(a);
  /* A's sealed magazines are now reusable by B. Allocate more than a slab
   * holds, so the depot's fresh magazines run out and its pending ones are
   * scanned. */
  int reused = 0;
  int more = (int)sizeclass_table[sizeclass_of(3000)].blocks * 2 + N_BLOCKS;
  for (int i = 0; i < more; i++) {
    void *p = magpie_malloc_async(3000, b);
    assert_non_null(p);
    reused += contains(pa, N_BLOCKS, p);
    pb[i % N_BLOCKS] = p;
  }
  assert_true(reused > 0);
  magpie_stats after;
  assert_int_equal(magpie_stats_get(0, &after), MAGPIE_OK);
  assert_true(after.cross_stream_migrations > before.cross_stream_migrations);
  /* Nothing but a query can have told magpie that A's work completed. */
  assert_true(after.event_queries > before.event_queries);
  assert_true(after.event_queries_pending - before.event_queries_pending < after.event_queries - before.event_queries);
  fake_stream_complete(b);
}

static int wait_device_synced(uint64_t before) {
  for (int i = 0; i < 5000; i++) {
    fake_counters c;
    fake_get_counters(&c);
    if (c.device_syncs > before) return 1;
    usleep(1000);
  }
  return 0;
}

/* A destroyed stream's handle comes back for a new stream: the new stream
 * must not inherit the old one's cached, possibly pending blocks, until the
 * device has drained (the reaper's synchronisation). */
static void test_handle_reuse(void **state) {
  (void)state;
  int blocks = (int)sizeclass_table[sizeclass_of(5000)].blocks;
  cudaStream_t a = fake_stream_create(0);
  static void *pa[N_BLOCKS];
  for (int i = 0; i < N_BLOCKS; i++) assert_non_null(pa[i] = magpie_malloc_async(5000, a));
  for (int i = 0; i < N_BLOCKS; i++) assert_int_equal(magpie_free_async(pa[i], a), MAGPIE_OK);
  fake_counters c0;
  fake_get_counters(&c0);
  fake_gate_device_sync(1);
  fake_stream_destroy(a);
  cudaStream_t b = fake_stream_create(0);
  assert_ptr_equal(b, a); /* same handle value, new stream */
  for (int i = 0; i < 2 * blocks + N_BLOCKS; i++) {
    void *p = magpie_malloc_async(5000, b);
    assert_non_null(p);
    assert_false(contains(pa, N_BLOCKS, p));
  }
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_true(st.limbo_magazines > 0); /* the old slot's magazines */
  fake_gate_device_sync(0);
  assert_true(wait_device_synced(c0.device_syncs));
  int reused = 0;
  for (int i = 0; i < 2 * blocks + N_BLOCKS && !reused; i++) {
    void *p = magpie_malloc_async(5000, b);
    assert_non_null(p);
    reused += contains(pa, N_BLOCKS, p);
  }
  assert_true(reused > 0); /* after the drain they are everyone's again */
}

/* The same with the recycled handle's first use a free while the thread's
 * last stream is another: the free finds the old slot by handle (no id
 * lookup on that path), and the new stream's first allocation must still
 * not receive the old stream's cached blocks. */
static void test_handle_reuse_free_first(void **state) {
  (void)state;
  cudaStream_t a = fake_stream_create(0), c = fake_stream_create(0);
  void *x = magpie_malloc_async(7000, a);
  assert_non_null(x);
  assert_int_equal(magpie_free_async(x, a), MAGPIE_OK);
  void *y = magpie_malloc_async(7000, c); /* the last stream is now c */
  assert_non_null(y);
  assert_ptr_not_equal(y, x);
  fake_gate_device_sync(1);
  fake_stream_destroy(a);
  cudaStream_t b = fake_stream_create(0);
  assert_ptr_equal(b, a);
  assert_int_equal(magpie_free_async(y, b), MAGPIE_OK); /* y's last use is on b */
  void *z[2];
  for (int i = 0; i < 2; i++) {
    assert_non_null(z[i] = magpie_malloc_async(7000, b));
    assert_ptr_not_equal(z[i], x); /* old a's work on x may still run */
  }
  for (int i = 0; i < 2; i++) assert_int_equal(magpie_free_async(z[i], b), MAGPIE_OK);
  fake_gate_device_sync(0);
  fake_stream_complete(b);
  fake_stream_complete(c);
}

static void test_bad_input(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  int local;
  assert_int_equal(magpie_free_async(&local, s), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_INVALID_POINTER);
  assert_non_null(strstr(magpie_last_error_message(), "not a pointer returned by magpie"));
  char *p = magpie_malloc_async(4096, s);
  assert_non_null(p);
  assert_int_equal(magpie_free_async(p + 256, s), MAGPIE_ERR_INVALID_POINTER);
  assert_non_null(strstr(magpie_last_error_message(), "points 256 bytes into a block"));
  assert_int_equal(magpie_usable_size(p + 256), 0);
  assert_null(magpie_malloc_async(SIZE_MAX, s));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_SIZE_OVERFLOW);
  assert_null(magpie_malloc_async(SIZE_MAX - 255, s));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_SIZE_OVERFLOW);
  assert_null(magpie_malloc_async((size_t)2 << 30, s)); /* device has 1 GiB */
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_TOO_LARGE);
  assert_non_null(strstr(magpie_last_error_message(), "in total"));
  assert_int_equal(magpie_free_async(NULL, s), MAGPIE_OK);
  void *z = magpie_malloc_async(0, s);
  void *z2 = magpie_malloc_async(0, s);
  assert_non_null(z);
  assert_ptr_not_equal(z, z2);
  assert_int_equal(magpie_usable_size(z), 256);
  assert_int_equal(magpie_free_async(z, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(z2, s), MAGPIE_OK);
  /* A destroyed stream: allocation fails; a free on it fails and keeps the
   * block allocated, so a later free on a valid stream succeeds. */
  cudaStream_t dead = fake_stream_create(0);
  fake_stream_destroy(dead);
  assert_null(magpie_malloc_async(100, dead));
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_free_async(p, dead), MAGPIE_ERR_INVALID_STREAM);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  assert_string_equal(magpie_error_string(MAGPIE_ERR_DOUBLE_FREE), "block freed twice");
  assert_string_equal(magpie_error_string(-5), "unknown magpie error code");
  magpie_config cfg;
  magpie_config_default(&cfg);
  assert_int_equal(magpie_init(&cfg), MAGPIE_ERR_ALREADY_INITIALIZED);
}

static void test_large_blocks(void **state) {
  (void)state;
  cudaStream_t a = fake_stream_create(0), b = fake_stream_create(0);
  char *p = magpie_malloc_async((size_t)3 << 20, a);
  assert_non_null(p);
  assert_int_equal(magpie_usable_size(p), (size_t)3 << 20); /* 4 KiB quantum */
  assert_int_equal(magpie_free_async(p + 4096, a), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_OK);
  assert_int_equal(magpie_free_async(p, a), MAGPIE_ERR_DOUBLE_FREE); /* always caught for large */
  void *q = magpie_malloc_async((size_t)3 << 20, b);
  assert_ptr_not_equal(q, p); /* A's work may still use p */
  void *r = magpie_malloc_async((size_t)3 << 20, a);
  assert_ptr_equal(r, p); /* same stream: at once */
  assert_int_equal(magpie_free_async(r, a), MAGPIE_OK);
  fake_stream_complete(a);
  assert_int_equal(magpie_free_async(q, b), MAGPIE_OK);
  void *t = magpie_malloc_async((size_t)3 << 20, b);
  assert_true(t == p || t == q);
  assert_int_equal(magpie_free_async(t, b), MAGPIE_OK);
  fake_stream_complete(b);
}

/* magpie_block_info: a small block's start, its interior, a large block
 * handed out and freed, an address magpie does not hold; no error state. */
static void test_block_info(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  char *p = magpie_malloc_async(1000, s);
  char *big = magpie_malloc_async((size_t)3 << 20, s);
  assert_non_null(p);
  assert_non_null(big);
  error_clear();
  size_t size = 0;
  int dev = -2;
  assert_int_equal(magpie_block_info(p, &size, &dev), MAGPIE_OK);
  assert_int_equal(size, 1024);
  assert_int_equal(dev, 0);
  assert_int_equal(magpie_block_info(p, NULL, NULL), MAGPIE_OK);
  dev = -2;
  assert_int_equal(magpie_block_info(p + 256, &size, &dev), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(dev, 0); /* inside magpie's memory */
  assert_int_equal(magpie_block_info(big, &size, &dev), MAGPIE_OK);
  assert_int_equal(size, (size_t)3 << 20);
  assert_int_equal(magpie_block_info(big + 4096, &size, &dev), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(dev, 0);
  int local = 0;
  assert_int_equal(magpie_block_info(&local, &size, &dev), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(dev, -1);
  assert_int_equal(magpie_block_info(NULL, NULL, &dev), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(dev, -1);
  assert_int_equal(magpie_last_error(), MAGPIE_OK); /* a query sets no error */
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  dev = -2;
  assert_int_equal(magpie_block_info(big, &size, &dev), MAGPIE_ERR_INVALID_POINTER); /* freed large */
  assert_int_equal(dev, 0);
  assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  fake_stream_complete(s);
}

/* Device 1 is small: fill it, free everything on one stream with its work
 * pending, then allocate on another stream: the refills must order it
 * after the epochs and succeed; past the device, fail with a full
 * message. */
static void test_memory_pressure(void **state) {
  (void)state;
  fake_set_current_device(1);
  cudaStream_t a = fake_stream_create(1), b = fake_stream_create(1);
  enum { MAX = 64 };
  void *held[MAX];
  int n = 0;
  void *p;
  while (n < MAX && (p = magpie_malloc_async((size_t)1 << 20, a)) != NULL) held[n++] = p;
  assert_true(n > 0 && n < MAX);
  assert_int_equal(magpie_last_error(), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_non_null(strstr(magpie_last_error_message(), "out of memory on device 1 allocating 1048576 bytes"));
  assert_non_null(strstr(magpie_last_error_message(), "magpie reserved"));
  for (int i = 0; i < n; i++) assert_int_equal(magpie_free_async(held[i], a), MAGPIE_OK);
  fake_counters c0, c1;
  fake_get_counters(&c0);
  int got = 0;
  for (int i = 0; i < n - 4; i++) {
    held[i] = magpie_malloc_async((size_t)1 << 20, b);
    if (held[i]) got++;
  }
  fake_get_counters(&c1);
  assert_int_equal(got, n - 4);
  /* A's pending magazines came through stream waits (B ordered after A's
   * work), tried before any host-side wait. */
  assert_true(c1.stream_waits > c0.stream_waits);
  for (int i = 0; i < got; i++) assert_int_equal(magpie_free_async(held[i], b), MAGPIE_OK);
  fake_stream_complete(b);
  fake_set_current_device(0);
}

/* Slabs are runs of chunks of shared granules: the first slabs of four
 * small classes on a fresh device map one granule between them. Classes
 * above 32 KiB have no slabs: their blocks are class blocks of a large
 * segment, whose first granule they share. When every block is back and
 * trimmed, both granules are unmapped. */
static void test_small_classes_share_a_granule(void **state) {
  (void)state;
  fake_set_current_device(2);
  cudaStream_t s = fake_stream_create(2);
  fake_counters c0, c1, c2;
  fake_get_counters(&c0);
  const size_t sizes[] = {256, 4096, 16384, 32768};
  enum { N = sizeof sizes / sizeof sizes[0] };
  void *p[N];
  slab *sl[N];
  for (int i = 0; i < N; i++) {
    assert_int_equal(sizeclass_table[sizeclass_of(sizes[i])].slab_size, SPAN_CHUNK);
    assert_non_null(p[i] = magpie_malloc_async(sizes[i], s));
  }
  fake_get_counters(&c1);
  assert_int_equal(c1.mapped_bytes[2] - c0.mapped_bytes[2], (size_t)2 << 20);
  for (int i = 0; i < N; i++) {
    sl[i] = pagemap_lookup((uintptr_t)p[i]);
    assert_non_null(sl[i]);
    assert_non_null(sl[i]->span);
    assert_ptr_equal(sl[i]->span, sl[0]->span);
    assert_int_equal(sl[i]->size, SPAN_CHUNK);
    assert_true((uintptr_t)p[i] >= sl[i]->base && (uintptr_t)p[i] < sl[i]->base + SPAN_CHUNK);
    for (int j = 0; j < i; j++) assert_true(sl[j]->base != sl[i]->base);
  }
  /* A 96 KiB block (a magazine of two carved) and a 512 KiB one (one)
   * are class blocks of one segment granule. */
  const size_t bigger[] = {(size_t)96 << 10, (size_t)512 << 10};
  void *q[2];
  for (int i = 0; i < 2; i++) {
    unsigned cls = sizeclass_of(bigger[i]);
    assert_true(sizeclass_table[cls].seg);
    assert_non_null(q[i] = magpie_malloc_async(bigger[i], s));
    slab *qs = pagemap_lookup((uintptr_t)q[i]);
    assert_non_null(qs);
    assert_int_equal(qs->cls, SLAB_LARGE);
    assert_int_equal(large_class_of(qs, (uintptr_t)q[i]), (int)cls);
    assert_int_equal(large_class_of(qs, (uintptr_t)q[i] + LARGE_QUANTUM), -1);
    size_t bs = 0;
    assert_int_equal(magpie_block_info(q[i], &bs, NULL), MAGPIE_OK);
    assert_int_equal(bs, sizeclass_table[cls].size);
  }
  fake_get_counters(&c1);
  assert_int_equal(c1.mapped_bytes[2] - c0.mapped_bytes[2], (size_t)4 << 20);
  for (int i = 0; i < 2; i++) assert_int_equal(magpie_free_async(q[i], s), MAGPIE_OK);
  for (int i = 0; i < N; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  fake_stream_complete(s);
  assert_int_equal(magpie_trim(2, 0), MAGPIE_OK);
  fake_get_counters(&c2);
  assert_int_equal(c2.mapped_bytes[2], c0.mapped_bytes[2]);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(2, &st), MAGPIE_OK);
  assert_int_equal(st.reserved_bytes, 0);
  assert_int_equal(st.overhead_bytes, 0);
  fake_set_current_device(0);
}

static void test_stats_invariants(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *p[10];
  for (int i = 0; i < 10; i++) p[i] = magpie_malloc_async(10000, s); /* 10240-byte class */
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.in_use_bytes - st0.in_use_bytes, 10 * 10240);
  assert_int_equal(st1.in_use_bytes + st1.cached_bytes, st1.reserved_bytes);
  assert_true(st1.peak_in_use_bytes >= st1.in_use_bytes);
  assert_true(st1.peak_reserved_bytes >= st1.reserved_bytes);
  fake_counters c;
  fake_get_counters(&c);
  assert_int_equal(c.mapped_bytes[0], st1.reserved_bytes);
  for (int i = 0; i < 10; i++) magpie_free_async(p[i], s);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.in_use_bytes, st0.in_use_bytes);
  assert_int_equal(magpie_stats_get(99, &st1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_stats_get(0, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
}

static cudaStream_t churn_stream;
static void *churn_worker(void *arg) {
  (void)arg;
  void *p[100];
  for (int i = 0; i < 100; i++) p[i] = magpie_malloc_async(700 + i * 13, churn_stream);
  for (int i = 0; i < 100; i++) magpie_free_async(p[i], churn_stream);
  p[0] = magpie_malloc_async(512, churn_stream); /* left allocated on purpose */
  return p[0];
}

/* A dead thread's magazines reach the depot once the background thread's
 * device synchronisation drained limbo (the fake's is instant): wait for
 * that, bounded, so the next thread can reuse them. */
static void wait_limbo_drained(void) {
  heap *h = heap_peek(0);
  for (int i = 0; i < 10000; i++) {
    if (stack_count(&h->limbo) == 0 && atomic_load(&h->reaping) == 0) return;
    usleep(100);
  }
  fail_msg("limbo not drained within 1 s");
}

/* Threads that exit give their magazines back; nothing leaks, and bytes
 * still allocated by dead threads stay counted as in use. */
static void test_thread_exit(void **state) {
  (void)state;
  churn_stream = fake_stream_create(0);
  magpie_stats st0, st1, st2;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *left[200];
  for (int round = 0; round < 200; round++) {
    pthread_t t;
    pthread_create(&t, NULL, churn_worker, NULL);
    pthread_join(t, &left[round]);
    assert_non_null(left[round]);
    wait_limbo_drained();
    if (round == 20) assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  }
  assert_int_equal(magpie_stats_get(0, &st2), MAGPIE_OK);
  assert_int_equal(st2.in_use_bytes - st0.in_use_bytes, 200 * 512);
  /* After warm-up, churn maps nothing new beyond what the 180 blocks left
   * allocated need: returned magazines are reused. */
  assert_true(st2.reserved_bytes - st1.reserved_bytes <= ((size_t)2 << 20));
  for (int i = 0; i < 200; i++) assert_int_equal(magpie_free_async(left[i], churn_stream), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st2), MAGPIE_OK);
  assert_int_equal(st2.in_use_bytes, st0.in_use_bytes);
}

static void test_private_metadata_heap(void **state) {
  (void)state;
  /* magpie's jemalloc is private: the process's malloc is still libc's. */
  Dl_info info;
  assert_true(dladdr((void *)&malloc, &info) != 0);
  assert_non_null(info.dli_fname);
  /* Under a sanitizer, its runtime (linked into the test) owns malloc. */
  int sanitized = dlsym(RTLD_DEFAULT, "__tsan_init") != NULL || dlsym(RTLD_DEFAULT, "__asan_init") != NULL;
  if (!sanitized) assert_non_null(strstr(info.dli_fname, "libc"));
  assert_null(dlsym(RTLD_DEFAULT, "mallocx"));
  assert_null(dlsym(RTLD_DEFAULT, "je_malloc"));
  assert_true(meta_arena() >= 0);
  void *m = meta_alloc(100);
  assert_non_null(m);
  meta_free(m);
}

int main(void) {
  fake_set_devices(3);
  fake_set_capacity(1, (size_t)24 << 20);
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_same_stream_reuse),
      cmocka_unit_test(test_default_stream_free_follows_device),
      cmocka_unit_test(test_cross_stream_waits_for_epoch),
      cmocka_unit_test(test_handle_reuse),
      cmocka_unit_test(test_handle_reuse_free_first),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_large_blocks),
      cmocka_unit_test(test_block_info),
      cmocka_unit_test(test_memory_pressure),
      cmocka_unit_test(test_small_classes_share_a_granule),
      cmocka_unit_test(test_stats_invariants),
      cmocka_unit_test(test_thread_exit),
      cmocka_unit_test(test_private_metadata_heap),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
