/* Workload 4: cross-thread frees. --cross-pairs producer/consumer pairs,
 * each pair on its own stream and its own two CPUs: the producer allocates
 * blocks of mixed sizes (--mix) and passes them through a single-producer
 * single-consumer ring to the consumer, which frees them on the same
 * stream. Pairs (alloc + free) per second over all pairs; the no-op
 * reference shows what the ring itself costs. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

enum { RING = 4096, BATCH = 32 };

typedef struct slot {
  void *p;
  size_t size;
} slot;

/* INVARIANT: tail - head <= RING; slots [head, tail) hold blocks posted
 * and not yet taken. tail: written by the producer (release, after the
 * slots it publishes; every BATCH slots, when the ring is full and at the
 * end), read by the consumer (acquire). head: written by the consumer
 * (release, after reading the slots; every BATCH slots and whenever it has
 * caught up), read by the producer (acquire). */
typedef struct pair {
  _Alignas(64) atomic_size_t tail;
  _Alignas(64) atomic_size_t head;
  _Alignas(64) slot ring[RING];
  const suite_opts *o;
  bench_alloc *a;
  cudaStream_t stream;
  int index;
  atomic_int done;
  uint64_t freed;
  pthread_barrier_t *start;
} pair;

static void *producer(void *arg) {
  pair *p = arg;
  suite_pin(2 * p->index);
  bench_dev_thread_init();
  uint64_t seed = bench_seed_mix(p->o->seed, 0xA0761D6478BD642Full, (uint64_t)p->index + 1);
  size_t tail = 0, head = 0;
  pthread_barrier_wait(p->start);
  double end = suite_now() + p->o->cross_seconds;
  for (;;) {
    for (int k = 0; k < 256; k++) {
      size_t size = suite_size_pick(p->o, suite_rand(&seed));
      void *b = p->a->alloc(size, p->stream);
      if (b == NULL) continue;
      while (tail - head == RING) {
        atomic_store_explicit(&p->tail, tail, memory_order_release);
        head = atomic_load_explicit(&p->head, memory_order_acquire);
        if (tail - head == RING) sched_yield();
      }
      p->ring[tail % RING] = (slot){b, size};
      /* Published in batches: one shared cache line written per BATCH. */
      if (++tail % BATCH == 0) atomic_store_explicit(&p->tail, tail, memory_order_release);
    }
    if (suite_now() >= end) break;
  }
  atomic_store_explicit(&p->tail, tail, memory_order_release);
  atomic_store_explicit(&p->done, 1, memory_order_release);
  return NULL;
}

static void *consumer(void *arg) {
  pair *p = arg;
  suite_pin(2 * p->index + 1);
  bench_dev_thread_init();
  size_t head = 0, tail = 0;
  uint64_t freed = 0;
  pthread_barrier_wait(p->start);
  for (;;) {
    if (head == tail) {
      atomic_store_explicit(&p->head, head, memory_order_release);
      tail = atomic_load_explicit(&p->tail, memory_order_acquire);
      if (head == tail) {
        /* done is set after the last tail store: check tail once more. */
        if (atomic_load_explicit(&p->done, memory_order_acquire)) {
          tail = atomic_load_explicit(&p->tail, memory_order_acquire);
          if (head == tail) break;
        }
        continue;
      }
    }
    slot s = p->ring[head % RING];
    if (++head % BATCH == 0) atomic_store_explicit(&p->head, head, memory_order_release);
    p->a->free(s.p, s.size, p->stream);
    freed++;
  }
  p->freed = freed;
  return NULL;
}

static double run(const suite_opts *o, bench_alloc *a, pair *pairs, cudaStream_t *streams) {
  int P = o->cross_pairs;
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, (unsigned)(2 * P + 1));
  pthread_t *t = calloc((size_t)(2 * P), sizeof *t);
  for (int i = 0; i < P; i++) {
    pair *p = &pairs[i];
    atomic_init(&p->tail, 0);
    atomic_init(&p->head, 0);
    atomic_init(&p->done, 0);
    p->o = o;
    p->a = a;
    p->stream = streams[i];
    p->index = i;
    p->freed = 0;
    p->start = &start;
    pthread_create(&t[2 * i], NULL, producer, p);
    pthread_create(&t[2 * i + 1], NULL, consumer, p);
  }
  pthread_barrier_wait(&start);
  double t0 = suite_now();
  uint64_t freed = 0;
  for (int i = 0; i < 2 * P; i++) pthread_join(t[i], NULL);
  double el = suite_now() - t0;
  for (int i = 0; i < P; i++) freed += pairs[i].freed;
  pthread_barrier_destroy(&start);
  free(t);
  return (double)freed / el;
}

void workload_crossfree(const suite_opts *o) {
  bench_alloc *a = bench_allocs();
  int P = o->cross_pairs;
  pair *pairs = aligned_alloc(64, sizeof(pair) * (size_t)P);
  cudaStream_t *streams = calloc((size_t)P, sizeof *streams);
  if (pairs == NULL || streams == NULL) return;
  for (int i = 0; i < P; i++)
    if ((streams[i] = bench_stream_create()) == NULL) return;
  char lo[32], hi[32];
  printf("\n== 4 cross-thread frees: %d producer/consumer pairs, one stream per pair, %s-%s, %.2f s\n", P,
         suite_size_name(o->mix_min, lo, sizeof lo), suite_size_name(o->mix_max, hi, sizeof hi), o->cross_seconds);
  suite_magpie_peak_note();
  printf("%-16s %12s %11s %14s\n", "allocator", "M pairs/s", "magpie/x", "peak reserved");
  double mp = 0;
  for (int w = 0; w < BA_COUNT; w++) {
    if (!o->use[w] || !bench_alloc_touchable(w)) continue;
    a[w].reset();
    double r = run(o, &a[w], pairs, streams);
    uint64_t reserved = a[w].peak_reserved();
    if (w == BA_MAGPIE) mp = r;
    printf("%-16s %12.2f", a[w].name, r / 1e6);
    if (w != BA_MAGPIE && mp > 0) printf(" %11.1f", mp / r);
    else printf(" %11s", "");
    if (reserved) printf(" %10.1f MiB\n", (double)reserved / (1 << 20));
    else printf(" %14s\n", "n/a");
    suite_row("crossfree", a[w].name, "", "pairs_per_s", r);
    if (reserved) suite_row("crossfree", a[w].name, "", "peak_reserved_bytes", (double)reserved);
    if (w == BA_MAGPIE) suite_magpie_stats("crossfree", "after its run");
  }
  if (o->use[BA_MAGPIE] && P == 4) {
    char d[64];
    snprintf(d, sizeof d, "%.2f M pairs/s", mp / 1e6);
    suite_target("crossfree", "magpie >= 20 M pairs/s with 4 pairs", mp >= 20e6, d);
  }
  bench_device_sync();
  for (int i = 0; i < P; i++) bench_stream_destroy(streams[i]);
  free(streams);
  free(pairs);
}
