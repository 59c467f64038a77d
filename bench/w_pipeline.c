/* Workload 3: a many-stream pipeline. --pipe THREADS,STREAMS: thread t owns
 * the streams j with j % THREADS == t and takes them in turn, one per step.
 * A step allocates --pipe-temps temporaries (--pipe-sizes), launches one
 * small kernel writing all of them, and frees them on the stream. Every
 * --pipe-handoff steps the thread also produces a block: allocated on its
 * stream, written by a kernel, an event recorded after it, and the block
 * posted to the next thread, which at its next step makes its own stream
 * wait for the event, launches a kernel on the block and frees it on its
 * own stream (the allocator's cross-stream free: see allocators.h). Steps
 * per second over all threads, the final device synchronisation included,
 * and the peak of reserved memory. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_dev.h"
#include "bench/suite.h"

enum { MAILBOX = 1024, EVENTS = 256 };

typedef struct item {
  void *p;
  size_t size;
  cudaStream_t stream; /* where it was allocated */
  bench_event event;
  int producer;
} item;

typedef struct lane {
  pthread_mutex_t lock; /* guards the mailbox and the event pool */
  item box[MAILBOX];
  int head, count;
  bench_event pool[EVENTS]; /* this thread's free events */
  int pool_count;
  /* worker */
  const suite_opts *o;
  bench_alloc *a;
  struct lane *lanes;
  int index;
  cudaStream_t *streams;
  int nstreams;
  uint64_t steps, handoffs, failures;
  pthread_barrier_t *barrier;
} lane;

static int take_mail(lane *l, item *out) {
  pthread_mutex_lock(&l->lock);
  int got = l->count > 0;
  if (got) {
    *out = l->box[l->head];
    l->head = (l->head + 1) % MAILBOX;
    l->count--;
  }
  pthread_mutex_unlock(&l->lock);
  return got;
}

static int post_mail(lane *l, const item *it) {
  pthread_mutex_lock(&l->lock);
  int ok = l->count < MAILBOX;
  if (ok) {
    l->box[(l->head + l->count) % MAILBOX] = *it;
    l->count++;
  }
  pthread_mutex_unlock(&l->lock);
  return ok;
}

static bench_event take_event(lane *l) {
  pthread_mutex_lock(&l->lock);
  bench_event e = l->pool_count ? l->pool[--l->pool_count] : NULL;
  pthread_mutex_unlock(&l->lock);
  return e;
}

static void give_event(lane *l, bench_event e) {
  pthread_mutex_lock(&l->lock);
  l->pool[l->pool_count++] = e;
  pthread_mutex_unlock(&l->lock);
}

/* Consume one posted block on stream s. */
static void consume(lane *l, item *it, cudaStream_t s) {
  if (bench_stream_wait_event(s, it->event) != 0) l->failures++;
  /* The wait captured the event: it may be recorded again. */
  give_event(&l->lanes[it->producer], it->event);
  if (bench_touch(s, &it->p, &it->size, 1, 0xC0) != 0) l->failures++;
  l->a->free_cross(it->p, it->size, it->stream, s);
}

static void *lane_main(void *arg) {
  lane *l = arg;
  const suite_opts *o = l->o;
  suite_pin(l->index);
  bench_dev_thread_init();
  uint64_t seed = o->seed * 0xD1B54A32D192ED03ull + (uint64_t)l->index + 1;
  lane *next = &l->lanes[(l->index + 1) % o->pipe_threads];
  pthread_barrier_wait(l->barrier);
  double end = suite_now() + o->pipe_seconds;
  uint64_t steps = 0;
  while (suite_now() < end) {
    for (int k = 0; k < 16; k++, steps++) {
      cudaStream_t s = l->streams[steps % (uint64_t)l->nstreams];
      item it;
      while (take_mail(l, &it)) consume(l, &it, s);
      void *p[4];
      size_t sz[4];
      int n = 0;
      for (int i = 0; i < o->pipe_temps; i++) {
        sz[n] = suite_mixed_size(suite_rand(&seed), o->pipe_min, o->pipe_max);
        p[n] = l->a->alloc(sz[n], s);
        if (p[n]) n++;
        else l->failures++;
      }
      if (n && bench_touch(s, p, sz, n, (uint32_t)steps) != 0) l->failures++;
      for (int i = 0; i < n; i++) l->a->free(p[i], sz[i], s);
      if (steps % (uint64_t)o->pipe_handoff_every == 0) {
        it = (item){.size = suite_mixed_size(suite_rand(&seed), o->pipe_min, o->pipe_max), .stream = s,
                    .producer = l->index};
        it.p = l->a->alloc(it.size, s);
        if (it.p == NULL) {
          l->failures++;
          continue;
        }
        it.event = take_event(l);
        if (bench_touch(s, &it.p, &it.size, 1, 0xB0) != 0) l->failures++;
        if (it.event == NULL || bench_event_record(it.event, s) != 0 || !post_mail(next, &it)) {
          if (it.event) give_event(l, it.event);
          l->a->free(it.p, it.size, s); /* no hand-off this time */
        } else {
          l->handoffs++;
        }
      }
    }
  }
  /* Everyone has stopped producing: consume what is left. */
  pthread_barrier_wait(l->barrier);
  item it;
  while (take_mail(l, &it)) consume(l, &it, l->streams[0]);
  l->steps = steps;
  return NULL;
}

static double run(const suite_opts *o, bench_alloc *a, lane *lanes, cudaStream_t *streams, uint64_t *handoffs,
                  uint64_t *failures) {
  int T = o->pipe_threads;
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, (unsigned)T + 1);
  pthread_t *t = calloc((size_t)T, sizeof *t);
  for (int i = 0; i < T; i++) {
    lanes[i].a = a;
    lanes[i].steps = lanes[i].handoffs = lanes[i].failures = 0;
    lanes[i].head = lanes[i].count = 0;
    lanes[i].barrier = &barrier;
    pthread_create(&t[i], NULL, lane_main, &lanes[i]);
  }
  pthread_barrier_wait(&barrier);
  double t0 = suite_now();
  pthread_barrier_wait(&barrier);
  uint64_t steps = 0;
  *handoffs = *failures = 0;
  for (int i = 0; i < T; i++) {
    pthread_join(t[i], NULL);
    steps += lanes[i].steps;
    *handoffs += lanes[i].handoffs;
    *failures += lanes[i].failures;
  }
  bench_device_sync();
  double el = suite_now() - t0;
  pthread_barrier_destroy(&barrier);
  free(t);
  (void)streams;
  return (double)steps / el;
}

void workload_pipeline(const suite_opts *o) {
  if (!bench_have_kernel()) {
    printf("\n== 3 pipeline: skipped (no kernel built in)\n");
    return;
  }
  bench_alloc *a = bench_allocs();
  int T = o->pipe_threads, S = o->pipe_streams;
  cudaStream_t *streams = calloc((size_t)S, sizeof *streams);
  lane *lanes = calloc((size_t)T, sizeof *lanes);
  if (streams == NULL || lanes == NULL) return;
  for (int j = 0; j < S; j++)
    if ((streams[j] = bench_stream_create()) == NULL) return;
  for (int i = 0; i < T; i++) {
    lane *l = &lanes[i];
    pthread_mutex_init(&l->lock, NULL);
    l->o = o;
    l->lanes = lanes;
    l->index = i;
    l->streams = calloc((size_t)(S / T + 1), sizeof *l->streams);
    for (int j = i; j < S; j += T) l->streams[l->nstreams++] = streams[j];
    for (int e = 0; e < EVENTS; e++)
      if ((l->pool[l->pool_count] = bench_event_create()) != NULL) l->pool_count++;
  }
  char lo[32], hi[32];
  printf("\n== 3 pipeline: %d threads over %d streams, %.2f s; a step = %d temporaries of %s-%s + 1 kernel + "
         "frees; a cross-stream hand-off every %d steps\n",
         T, S, o->pipe_seconds, o->pipe_temps, suite_size_name(o->pipe_min, lo, sizeof lo),
         suite_size_name(o->pipe_max, hi, sizeof hi), o->pipe_handoff_every);
  suite_magpie_peak_note();
  printf("%-16s %12s %10s %10s %14s %9s\n", "allocator", "k steps/s", "x noop", "hand-offs", "peak reserved", "failures");
  double rate[BA_COUNT] = {0};
  /* The floor first, so every row can be read against it. */
  static const int order[] = {BA_NOOP, BA_MAGPIE, BA_CUDA_ASYNC, BA_TORCH, BA_CUDA_MALLOC};
  for (int k = 0; k < BA_COUNT; k++) {
    int w = order[k];
    if (!o->use[w]) continue;
    a[w].reset();
    uint64_t handoffs = 0, failures = 0;
    rate[w] = run(o, &a[w], lanes, streams, &handoffs, &failures);
    uint64_t reserved = a[w].peak_reserved();
    printf("%-16s %12.1f", a[w].name, rate[w] / 1e3);
    if (rate[BA_NOOP] > 0) printf(" %10.3f", rate[w] / rate[BA_NOOP]);
    else printf(" %10s", "");
    printf(" %10llu", (unsigned long long)handoffs);
    if (reserved) printf(" %11.1f MiB", (double)reserved / (1 << 20));
    else printf(" %14s", "n/a");
    printf(" %9llu\n", (unsigned long long)failures);
    suite_row("pipeline", a[w].name, "", "steps_per_s", rate[w]);
    suite_row("pipeline", a[w].name, "", "handoffs", (double)handoffs);
    suite_row("pipeline", a[w].name, "", "failures", (double)failures);
    if (reserved) suite_row("pipeline", a[w].name, "", "peak_reserved_bytes", (double)reserved);
    if (w == BA_MAGPIE) suite_magpie_stats("pipeline", "after its run");
  }
  if (o->use[BA_MAGPIE] && rate[BA_NOOP] > 0) {
    char d[96];
    snprintf(d, sizeof d, "%.1f%% of the no-op reference's steps/s", 100 * rate[BA_MAGPIE] / rate[BA_NOOP]);
    suite_target("pipeline", "magpie >= 97% of no-op steps/s", rate[BA_MAGPIE] >= 0.97 * rate[BA_NOOP], d);
  }
  for (int i = 0; i < T; i++) {
    for (int e = 0; e < lanes[i].pool_count; e++) bench_event_destroy(lanes[i].pool[e]);
    free(lanes[i].streams);
    pthread_mutex_destroy(&lanes[i].lock);
  }
  for (int j = 0; j < S; j++) bench_stream_destroy(streams[j]);
  free(streams);
  free(lanes);
}
