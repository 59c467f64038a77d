/* Spans (src/pool/span.c) against the deterministic fake device
 * (fake_backend.c), through their internal interface: threads that find
 * every span full together share one new span, and a span takes memory
 * lent by the large segments instead of mapping a granule: a piece of a
 * hole in a used granule, else a whole free granule. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "base/pagemap.h"
#include "heap/heap.h"
#include "magpie.h"
#include "pool/slab.h"
#include "pool/span.h"
#include "tests/fake_backend.h"

/* Threads of different small classes that find every span full at once
 * share one new span: the first maps it (slowly here) while the others
 * wait and take its spare chunks, instead of each mapping a granule. */
enum { SPAN_THREADS = 4, SPAN_HOLD_MAX = 1024 };
typedef struct span_got {
  uintptr_t base;
  span *sp;
  int rc;
} span_got;
static pthread_barrier_t span_start;
static void *span_thread(void *arg) {
  span_got *g = arg;
  pthread_barrier_wait(&span_start);
  g->rc = span_chunk_get(&heap_get(0)->spans, 1, 1, &g->base, &g->sp);
  return NULL;
}

/* Take every free chunk of h's spans into held (so that the next
 * span_chunk_get needs a new span); returns how many. */
static int hold_free_chunks(heap *h, span_got *held) {
  pthread_mutex_lock(&h->spans.span_lock);
  int free_chunks = 0;
  for (span *sp = h->spans.list; sp; sp = sp->next) free_chunks += (int)sp->nchunks - __builtin_popcountll(sp->used);
  pthread_mutex_unlock(&h->spans.span_lock);
  assert_true(free_chunks <= SPAN_HOLD_MAX);
  for (int i = 0; i < free_chunks; i++)
    assert_int_equal(span_chunk_get(&h->spans, 1, 1, &held[i].base, &held[i].sp), MAGPIE_OK);
  return free_chunks;
}

static void test_concurrent_span_maps_share_a_span(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  assert_true(h->region.gran / SPAN_CHUNK >= SPAN_THREADS);
  /* Fill every span there is, so that the threads below find none free. */
  static span_got held[SPAN_HOLD_MAX];
  fake_counters before, after;
  fake_get_counters(&before);
  int free_chunks = hold_free_chunks(h, held);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);

  span_got got[SPAN_THREADS];
  pthread_t t[SPAN_THREADS];
  fake_set_map_delay_us(20000);
  pthread_barrier_init(&span_start, NULL, SPAN_THREADS);
  for (int i = 0; i < SPAN_THREADS; i++) assert_int_equal(pthread_create(&t[i], NULL, span_thread, &got[i]), 0);
  for (int i = 0; i < SPAN_THREADS; i++) assert_int_equal(pthread_join(t[i], NULL), 0);
  pthread_barrier_destroy(&span_start);
  fake_set_map_delay_us(0);
  fake_get_counters(&after);
  assert_int_equal(after.maps - before.maps, 1);
  for (int i = 0; i < SPAN_THREADS; i++) {
    assert_int_equal(got[i].rc, MAGPIE_OK);
    assert_ptr_equal(got[i].sp, got[0].sp);
    for (int j = 0; j < i; j++) assert_true(got[j].base != got[i].base);
  }
  for (int i = 0; i < SPAN_THREADS; i++) span_chunk_put(&h->spans, got[i].sp, got[i].base, 1);
  for (int i = 0; i < free_chunks; i++) span_chunk_put(&h->spans, held[i].sp, held[i].base, 1);
}

/* test_span_takes_a_granule_lent_by_the_segments frees its 8 MiB block
 * to the large segments: a thread that allocates on one stream only would
 * keep it for that stream instead (tcache_keep_large). So the calling
 * thread first allocates on a stream of device 0 too. */
static int allocate_on_another_stream(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  void *p = magpie_malloc_async(256, s);
  if (p == NULL || magpie_free_async(p, s) != MAGPIE_OK) return -1;
  fake_stream_complete(s);
  return 0;
}

/* A span the set needs takes a whole mapped granule of a free block of
 * the large segments, ready for every stream once its seal completed,
 * instead of mapping a granule; the granule goes back to the segments,
 * free and ready, when the span is empty. On device 1 (24 MiB), which no
 * other test here uses. */
static void test_span_takes_a_granule_lent_by_the_segments(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(1);
  void *big = magpie_malloc_async((size_t)8 << 20, s);
  assert_non_null(big);
  heap *h = heap_get(1);
  assert_non_null(h);
  size_t g = h->region.gran;
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s); /* the free's seal completed; no query asked yet */
  /* Every chunk of the spans there are (if any) is taken, so that a new
   * span is needed. */
  static span_got held[SPAN_HOLD_MAX];
  int free_chunks = hold_free_chunks(h, held);
  fake_counters before, after;
  fake_get_counters(&before);
  size_t reserved = atomic_load(&h->region.mapped);
  int64_t overhead = atomic_load(&h->region.overhead);
  uintptr_t base = 0;
  span *sp = NULL;
  /* may_map 0: lent memory maps nothing, so the ladder's first pass may take it. */
  assert_int_equal(span_chunk_get(&h->spans, 1, 0, &base, &sp), MAGPIE_OK);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);
  assert_int_equal(atomic_load(&h->region.mapped), reserved);
  assert_true(sp->lent);
  assert_true(base >= (uintptr_t)big && base + g <= (uintptr_t)big + ((size_t)8 << 20));
  assert_int_equal(base % g, 0);
  assert_int_equal(atomic_load(&h->large.lent_bytes), g);
  assert_int_equal(atomic_load(&h->region.overhead), overhead + (int64_t)(g - SPAN_CHUNK));
  assert_null(pagemap_lookup(base)); /* no slab claimed its page yet */
  magpie_stats st;
  assert_int_equal(magpie_stats_get(1, &st), MAGPIE_OK);
  assert_int_equal(st.large_in_use_bytes, 0);
  /* Empty again: the granule is the segments' free memory. */
  span_chunk_put(&h->spans, sp, base, 1);
  assert_int_equal(atomic_load(&h->large.lent_bytes), 0);
  assert_int_equal(atomic_load(&h->region.overhead), overhead);
  slab *d = pagemap_lookup(base);
  assert_non_null(d);
  assert_int_equal(d->cls, SLAB_LARGE);
  for (int i = 0; i < free_chunks; i++) span_chunk_put(&h->spans, held[i].sp, held[i].base, 1);
  /* The whole 8 MiB serves one stream again, with no new mapping. */
  fake_get_counters(&before);
  void *again = magpie_malloc_async((size_t)8 << 20, s);
  assert_ptr_equal(again, big);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);
  assert_int_equal(magpie_free_async(again, s), MAGPIE_OK);
  fake_stream_complete(s);
}

/* A new span takes a piece of SPAN_LENT_PIECE bytes, aligned to its size,
 * of a hole in a used granule (a free block holding no whole granule),
 * not the edge of a free run that holds whole granules, which large blocks
 * grow into: there it takes a whole granule of the run. The piece's pages
 * are the span's, the rest of the hole's the segment's, and it merges
 * back into the hole when the span is empty. */
static void test_span_takes_a_piece_of_a_hole(void **state) {
  (void)state;
  heap *h = heap_get(1);
  assert_non_null(h);
  size_t g = h->region.gran;
  assert_true(SPAN_LENT_PIECE < g / 2 && g % SPAN_LENT_PIECE == 0);
  cudaStream_t s = fake_stream_create(1);
  /* A large block of a granule and a half where the previous test's 8 MiB
   * were: the second granule's other half is free, at the edge of a free
   * run of two whole granules. */
  size_t a_size = g + g / 2;
  char *a = magpie_malloc_async(a_size, s);
  assert_non_null(a);
  assert_int_equal((uintptr_t)a % g, 0);
  static span_got held[SPAN_HOLD_MAX];
  int free_chunks = hold_free_chunks(h, held);
  fake_counters before, after;
  fake_get_counters(&before);
  int64_t overhead = atomic_load(&h->region.overhead);
  size_t lent = atomic_load(&h->large.lent_bytes);
  uintptr_t base = 0;
  span *sp = NULL;
  assert_int_equal(span_chunk_get(&h->spans, 1, 0, &base, &sp), MAGPIE_OK);
  assert_true(sp->lent);
  assert_int_equal(sp->size, g); /* the edge of the run stays free */
  assert_int_equal(base % g, 0);
  assert_true(base >= (uintptr_t)a + 2 * g);
  span_chunk_put(&h->spans, sp, base, 1);
  assert_int_equal(atomic_load(&h->large.lent_bytes), lent);
  /* A block of two granules closes the run: half a granule after a is a
   * hole now. */
  char *b = magpie_malloc_async(2 * g, s);
  assert_ptr_equal(b, a + 2 * g);
  assert_int_equal(span_chunk_get(&h->spans, 1, 0, &base, &sp), MAGPIE_OK);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);
  assert_true(sp->lent);
  assert_int_equal(sp->size, SPAN_LENT_PIECE);
  assert_int_equal(sp->nchunks, SPAN_LENT_PIECE / SPAN_CHUNK);
  assert_true(base >= (uintptr_t)a + a_size && base + SPAN_LENT_PIECE <= (uintptr_t)b);
  assert_int_equal(base % SPAN_LENT_PIECE, 0);
  assert_int_equal(atomic_load(&h->large.lent_bytes), lent + SPAN_LENT_PIECE);
  assert_int_equal(atomic_load(&h->region.overhead), overhead + (int64_t)(SPAN_LENT_PIECE - SPAN_CHUNK));
  assert_null(pagemap_lookup(base));
  assert_null(pagemap_lookup(base + SPAN_LENT_PIECE - SPAN_CHUNK));
  /* A page of the hole outside the piece. */
  uintptr_t other = base > (uintptr_t)a + a_size ? (uintptr_t)a + a_size : base + SPAN_LENT_PIECE;
  slab *d = pagemap_lookup(other);
  assert_non_null(d);
  assert_int_equal(d->cls, SLAB_LARGE);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(1, &st), MAGPIE_OK);
  assert_int_equal(st.large_in_use_bytes, a_size + 2 * g);
  /* Empty again: the piece is the hole's again, and the same piece is
   * what the next span is lent. */
  span_chunk_put(&h->spans, sp, base, 1);
  assert_int_equal(atomic_load(&h->large.lent_bytes), lent);
  assert_int_equal(atomic_load(&h->region.overhead), overhead);
  d = pagemap_lookup(base);
  assert_non_null(d);
  assert_int_equal(d->cls, SLAB_LARGE);
  uintptr_t again = 0;
  assert_int_equal(span_chunk_get(&h->spans, 1, 0, &again, &sp), MAGPIE_OK);
  assert_int_equal(again, base);
  span_chunk_put(&h->spans, sp, again, 1);
  for (int i = 0; i < free_chunks; i++) span_chunk_put(&h->spans, held[i].sp, held[i].base, 1);
  assert_int_equal(magpie_free_async(a, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(b, s), MAGPIE_OK);
  fake_stream_complete(s);
}

int main(void) {
  fake_set_devices(2);
  fake_set_capacity(1, (size_t)24 << 20);
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_concurrent_span_maps_share_a_span),
      cmocka_unit_test_setup(test_span_takes_a_granule_lent_by_the_segments, allocate_on_another_stream),
      cmocka_unit_test(test_span_takes_a_piece_of_a_hole),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
