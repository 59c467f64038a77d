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
 * and the peak of reserved memory. The allocators take turns over
 * --pipe-rounds rounds (each round in a rotated order) and the median of
 * each one's rounds is reported. A last probe pass runs magpie and the
 * no-op reference again with every allocator call timed, to show how much
 * of a step is spent inside the allocator and the longest single call. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

enum { MAILBOX = 1024, EVENTS = 256, RING = 8 };

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
  int probe; /* 1: time every allocator call; 2: the completion probe */
  uint64_t call_ns, max_call_ns;
  /* Probe: calls and their time by kind (allocation, free, cross-stream
   * free) and duration (< 100 ns, < 1 us, < 10 us, longer). */
  uint64_t band_n[3][4], band_ns[3][4];
  /* Completion probe (probe == 2, CUDA, the no-op allocator): at each
   * visit to its k-th stream the lane asks whether the work of its last
   * visit there is done, by querying the event recorded then and by
   * reading the host word the stream wrote then, and records and writes
   * anew. Per kind (query, record, write): calls and ns; and how often
   * each signal said done. */
  bench_event ring[RING];
  volatile uint64_t *word; /* RING words of pinned host memory */
  uint64_t word_dev, written[RING];
  uint64_t cp_n[3], cp_ns[3], cp_done_event, cp_done_word, cp_checks;
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

static inline uint64_t probe_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

enum { K_ALLOC, K_FREE, K_CROSS };

static inline void probe_end(lane *l, int kind, uint64_t t0) {
  uint64_t d = probe_now() - t0;
  l->call_ns += d;
  if (d > l->max_call_ns) l->max_call_ns = d;
  int b = d < 100 ? 0 : d < 1000 ? 1 : d < 10000 ? 2 : 3;
  l->band_n[kind][b]++;
  l->band_ns[kind][b] += d;
}

/* An allocator call, timed in the probe pass. */
#define CALL(l, k, expr)                                  \
  do {                                                    \
    uint64_t call_t0 = (l)->probe == 1 ? probe_now() : 0; \
    expr;                                                 \
    if ((l)->probe == 1) probe_end((l), (k), call_t0);    \
  } while (0)

/* The completion probe's work at one step on the lane's k-th stream. */
static void completion_step(lane *l, cudaStream_t s, int k, uint64_t step) {
  uint64_t t0 = probe_now();
  int q = bench_event_query(l->ring[k]);
  uint64_t t1 = probe_now();
  int w = l->written[k] != 0 && l->word[k] >= l->written[k];
  if (bench_event_record(l->ring[k], s) != 0) l->failures++;
  uint64_t t2 = probe_now();
  if (bench_stream_write_value(s, l->word_dev + 8 * (uint64_t)k, step + 1) != 0) l->failures++;
  uint64_t t3 = probe_now();
  if (l->written[k] != 0) {
    l->cp_checks++;
    l->cp_done_event += q == 0;
    l->cp_done_word += w;
  }
  l->written[k] = step + 1;
  uint64_t d[3] = {t1 - t0, t2 - t1, t3 - t2};
  for (int i = 0; i < 3; i++) {
    l->cp_n[i]++;
    l->cp_ns[i] += d[i];
  }
}

/* Consume one posted block on stream s. */
static void consume(lane *l, item *it, cudaStream_t s) {
  if (bench_stream_wait_event(s, it->event) != 0) l->failures++;
  /* The wait captured the event: it may be recorded again. */
  give_event(&l->lanes[it->producer], it->event);
  if (bench_touch(s, &it->p, &it->size, 1, 0xC0) != 0) l->failures++;
  CALL(l, K_CROSS, l->a->free_cross(it->p, it->size, it->stream, s));
}

static void *lane_main(void *arg) {
  lane *l = arg;
  const suite_opts *o = l->o;
  suite_pin(l->index);
  bench_dev_thread_init();
  uint64_t seed = bench_seed_mix(o->seed, 0xD1B54A32D192ED03ull, (uint64_t)l->index + 1);
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
        CALL(l, K_ALLOC, p[n] = l->a->alloc(sz[n], s));
        if (p[n]) n++;
        else l->failures++;
      }
      if (n && bench_touch(s, p, sz, n, (uint32_t)steps) != 0) l->failures++;
      for (int i = 0; i < n; i++) CALL(l, K_FREE, l->a->free(p[i], sz[i], s));
      if (l->probe == 2) completion_step(l, s, (int)(steps % (uint64_t)l->nstreams), steps);
      if (steps % (uint64_t)o->pipe_handoff_every == 0) {
        it = (item){
            .size = suite_mixed_size(suite_rand(&seed), o->pipe_min, o->pipe_max), .stream = s, .producer = l->index};
        CALL(l, K_ALLOC, it.p = l->a->alloc(it.size, s));
        if (it.p == NULL) {
          l->failures++;
          continue;
        }
        it.event = take_event(l);
        if (bench_touch(s, &it.p, &it.size, 1, 0xB0) != 0) l->failures++;
        if (it.event == NULL || bench_event_record(it.event, s) != 0 || !post_mail(next, &it)) {
          if (it.event) give_event(l, it.event);
          CALL(l, K_FREE, l->a->free(it.p, it.size, s)); /* no hand-off this time */
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

static double run(const suite_opts *o, bench_alloc *a, lane *lanes, int probe, uint64_t *handoffs, uint64_t *failures,
                  uint64_t *call_ns, uint64_t *max_call_ns) {
  int T = o->pipe_threads;
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, (unsigned)T + 1);
  pthread_t *t = calloc((size_t)T, sizeof *t);
  for (int i = 0; i < T; i++) {
    lanes[i].a = a;
    lanes[i].steps = lanes[i].handoffs = lanes[i].failures = 0;
    lanes[i].probe = probe;
    memset(lanes[i].cp_n, 0, sizeof lanes[i].cp_n);
    memset(lanes[i].cp_ns, 0, sizeof lanes[i].cp_ns);
    memset(lanes[i].written, 0, sizeof lanes[i].written);
    lanes[i].cp_done_event = lanes[i].cp_done_word = lanes[i].cp_checks = 0;
    lanes[i].call_ns = lanes[i].max_call_ns = 0;
    memset(lanes[i].band_n, 0, sizeof lanes[i].band_n);
    memset(lanes[i].band_ns, 0, sizeof lanes[i].band_ns);
    lanes[i].head = lanes[i].count = 0;
    lanes[i].barrier = &barrier;
    pthread_create(&t[i], NULL, lane_main, &lanes[i]);
  }
  pthread_barrier_wait(&barrier);
  double t0 = suite_now();
  pthread_barrier_wait(&barrier);
  uint64_t steps = 0;
  *handoffs = *failures = *call_ns = *max_call_ns = 0;
  for (int i = 0; i < T; i++) {
    pthread_join(t[i], NULL);
    steps += lanes[i].steps;
    *handoffs += lanes[i].handoffs;
    *failures += lanes[i].failures;
    *call_ns += lanes[i].call_ns;
    if (lanes[i].max_call_ns > *max_call_ns) *max_call_ns = lanes[i].max_call_ns;
  }
  bench_device_sync();
  double el = suite_now() - t0;
  pthread_barrier_destroy(&barrier);
  free(t);
  *call_ns = steps ? *call_ns / steps : 0; /* per step */
  return (double)steps / el;
}

/* What the two ways of learning that a stream's work is done cost under
 * this load: an event query, or a host word the stream writes (the
 * candidate to replace magpie's event per sealed magazine). */
static void completion_report(const suite_opts *o, bench_alloc *noop, lane *lanes) {
  int T = o->pipe_threads;
  uint64_t h = 0, f = 0, call_ns = 0, max_ns = 0;
  double r = run(o, noop, lanes, 2, &h, &f, &call_ns, &max_ns);
  uint64_t n[3] = {0}, ns[3] = {0}, de = 0, dw = 0, checks = 0;
  for (int i = 0; i < T; i++) {
    for (int k = 0; k < 3; k++) {
      n[k] += lanes[i].cp_n[k];
      ns[k] += lanes[i].cp_ns[k];
    }
    de += lanes[i].cp_done_event;
    dw += lanes[i].cp_done_word;
    checks += lanes[i].cp_checks;
  }
  static const char *const kind[3] = {"cuEventQuery", "cuEventRecord", "cuStreamWriteValue64"};
  printf("  probe completion (noop, each step also queries, records and writes): %.1f k steps/s, %llu failures;",
         r / 1e3, (unsigned long long)f);
  for (int k = 0; k < 3; k++) {
    double us = n[k] ? (double)ns[k] / (double)n[k] / 1e3 : 0;
    printf(" %s %.3f us", kind[k], us);
    suite_row("pipeline", "noop", "completion", kind[k], us * 1e3);
  }
  printf("; last visit's work done by the event %.1f%%, by the host word %.1f%%\n",
         checks ? 100.0 * (double)de / (double)checks : 0, checks ? 100.0 * (double)dw / (double)checks : 0);
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
  int completion = bench_dev_is_cuda() && S / T <= RING && o->use[BA_NOOP];
  for (int i = 0; i < T && completion; i++) {
    lane *l = &lanes[i];
    if (bench_host_word(&l->word, &l->word_dev) != 0) completion = 0;
    for (int k = 0; k < l->nstreams && completion; k++)
      if ((l->ring[k] = bench_event_create()) == NULL) completion = 0;
  }
  char lo[32], hi[32];
  printf(
      "\n== 3 pipeline: %d threads over %d streams, %.2f s; a step = %d temporaries of %s-%s + 1 kernel + "
      "frees; a cross-stream hand-off every %d steps\n",
      T, S, o->pipe_seconds, o->pipe_temps, suite_size_name(o->pipe_min, lo, sizeof lo),
      suite_size_name(o->pipe_max, hi, sizeof hi), o->pipe_handoff_every);
  suite_magpie_peak_note();
  printf("%-16s %12s %10s %10s %14s %9s  (median of %d rounds)\n", "allocator", "k steps/s", "x noop", "hand-offs",
         "peak reserved", "failures", o->pipe_rounds);
  double rate[BA_COUNT] = {0}, rounds[BA_COUNT][16];
  uint64_t handoffs[BA_COUNT] = {0}, failures[BA_COUNT] = {0}, reserved[BA_COUNT] = {0}, call_ns, max_ns;
  /* The floor first in the first round, so that every row can be read
   * against it; later rounds rotate the order. */
  /* Not bestfit: its addresses name no memory for the kernels. */
  static const int order[] = {BA_NOOP, BA_MAGPIE, BA_CUDA_ASYNC, BA_TORCH, BA_CUDA_MALLOC};
  enum { NORDER = sizeof order / sizeof order[0] };
  int R = o->pipe_rounds;
  for (int r = 0; r < R; r++) {
    for (int k = 0; k < NORDER; k++) {
      int w = order[(k + r) % NORDER];
      if (!o->use[w]) continue;
      a[w].reset();
      rounds[w][r] = run(o, &a[w], lanes, 0, &handoffs[w], &failures[w], &call_ns, &max_ns);
      reserved[w] = a[w].peak_reserved();
      if (w == BA_MAGPIE && r == R - 1) suite_magpie_stats("pipeline", "after its last round");
    }
  }
  for (int k = 0; k < NORDER; k++) {
    int w = order[k];
    if (!o->use[w]) continue;
    double v[16];
    for (int r = 0; r < R; r++) {
      v[r] = rounds[w][r];
      for (int j = r; j > 0 && v[j] < v[j - 1]; j--) {
        double x = v[j];
        v[j] = v[j - 1];
        v[j - 1] = x;
      }
    }
    rate[w] = R % 2 ? v[R / 2] : 0.5 * (v[R / 2 - 1] + v[R / 2]);
    printf("%-16s %12.1f", a[w].name, rate[w] / 1e3);
    if (rate[BA_NOOP] > 0) printf(" %10.3f", rate[w] / rate[BA_NOOP]);
    else printf(" %10s", "");
    printf(" %10llu", (unsigned long long)handoffs[w]);
    if (reserved[w]) printf(" %10.1f MiB", (double)reserved[w] / (1 << 20));
    else printf(" %14s", "n/a");
    printf(" %9llu  rounds:", (unsigned long long)failures[w]);
    for (int r = 0; r < R; r++) printf(" %.1f", rounds[w][r] / 1e3);
    printf("\n");
    suite_row("pipeline", a[w].name, "", "steps_per_s", rate[w]);
    for (int r = 0; r < R; r++) {
      char x[16];
      snprintf(x, sizeof x, "round%d", r);
      suite_row("pipeline", a[w].name, x, "steps_per_s", rounds[w][r]);
    }
    suite_row("pipeline", a[w].name, "", "handoffs", (double)handoffs[w]);
    suite_row("pipeline", a[w].name, "", "failures", (double)failures[w]);
    if (reserved[w]) suite_row("pipeline", a[w].name, "", "peak_reserved_bytes", (double)reserved[w]);
  }
  for (int k = 0; k < 2; k++) {
    int w = k ? BA_MAGPIE : BA_NOOP;
    if (!o->use[w]) continue;
    uint64_t h = 0, f = 0;
    double r = run(o, &a[w], lanes, 1, &h, &f, &call_ns, &max_ns);
    printf(
        "  probe %-8s %.1f k steps/s with every call timed: %.2f us per step inside the allocator "
        "(a step takes %.1f us of a thread), longest call %.1f us, %llu hand-offs\n",
        a[w].name, r / 1e3, call_ns / 1e3, T / r * 1e6, max_ns / 1e3, (unsigned long long)h);
    uint64_t steps = 0, bn[3][4] = {{0}}, bns[3][4] = {{0}};
    for (int i = 0; i < T; i++) {
      steps += lanes[i].steps;
      for (int c = 0; c < 3; c++)
        for (int b = 0; b < 4; b++) {
          bn[c][b] += lanes[i].band_n[c][b];
          bns[c][b] += lanes[i].band_ns[c][b];
        }
    }
    double per = steps ? 1.0 / (double)steps : 0;
    static const char *const band[4] = {"< 0.1 us", "0.1-1 us", "1-10 us", ">= 10 us"};
    printf("    calls by duration (calls per step, us per step):");
    for (int b = 0; b < 4; b++)
      printf(" %s %.3f, %.3f;", band[b], (double)(bn[0][b] + bn[1][b] + bn[2][b]) * per,
             (double)(bns[0][b] + bns[1][b] + bns[2][b]) / 1e3 * per);
    printf("\n");
    /* Which calls the longer ones are. */
    static const char *const kind[3] = {"allocations", "frees", "cross-stream frees"};
    printf("    calls of 0.1 us or more per step:");
    for (int c = 0; c < 3; c++)
      printf(" %s %.3f (%.3f us);", kind[c], (double)(bn[c][1] + bn[c][2] + bn[c][3]) * per,
             (double)(bns[c][1] + bns[c][2] + bns[c][3]) / 1e3 * per);
    printf("\n");
    suite_row("pipeline", a[w].name, "probe", "alloc_ns_per_step", (double)call_ns);
    suite_row("pipeline", a[w].name, "probe", "longest_call_ns", (double)max_ns);
  }
  if (completion) completion_report(o, &a[BA_NOOP], lanes);
  if (o->use[BA_MAGPIE] && rate[BA_NOOP] > 0) {
    char d[96];
    snprintf(d, sizeof d, "%.1f%% of the no-op reference's steps/s", 100 * rate[BA_MAGPIE] / rate[BA_NOOP]);
    suite_target("pipeline", "magpie >= 97% of no-op steps/s", rate[BA_MAGPIE] >= 0.97 * rate[BA_NOOP], d);
  }
  for (int i = 0; i < T; i++) {
    for (int e = 0; e < lanes[i].pool_count; e++) bench_event_destroy(lanes[i].pool[e]);
    for (int k = 0; k < RING; k++)
      if (lanes[i].ring[k]) bench_event_destroy(lanes[i].ring[k]);
    free(lanes[i].streams);
    pthread_mutex_destroy(&lanes[i].lock);
  }
  for (int j = 0; j < S; j++) bench_stream_destroy(streams[j]);
  if (completion) bench_device_sync(); /* the words' last writes */
  for (int i = 0; i < T; i++) bench_host_word_free(lanes[i].word);
  free(streams);
  free(lanes);
}
