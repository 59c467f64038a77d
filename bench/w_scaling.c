/* Workload 2: thread scaling. T threads (--threads), each pinned to its own
 * CPU and using its own stream, each keeping a window of --window live
 * blocks of mixed sizes (--mix) and replacing a random one per step (free +
 * alloc). Aggregate operations (allocs + frees) per second, and reserved
 * memory against the sum of the threads' peak live bytes (requested
 * sizes). On a GPU, magpie's rows also give the figure with each thread's
 * cuStreamGetId calls (one per allocation, timed alone right after its
 * loop) taken out of its time: its latency is judged without that one
 * driver call. Every allocator is reset before each point; magpie's peak
 * cannot be restarted, so its figure is its peak over the workload so far
 * (the points run from fewest threads to most). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

typedef struct worker {
  const suite_opts *o;
  bench_alloc *a;
  int index;
  cudaStream_t stream;
  int time_id; /* 1: time the stream's id call after the loop (magpie's points) */
  uint64_t ops, allocs;
  double end;   /* when its loop and its last frees were done */
  double id_ns; /* ns per cuStreamGetId on this thread's stream after that; < 0: none */
  size_t peak_live;
  pthread_barrier_t *start;
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  const suite_opts *o = w->o;
  suite_pin(w->index);
  bench_dev_thread_init();
  uint64_t seed = bench_thread_seed(o->seed, w->index);
  int window = o->scale_window;
  void **live = calloc((size_t)window, sizeof *live);
  size_t *sz = calloc((size_t)window, sizeof *sz);
  size_t cur = 0;
  uint64_t ops = 0, allocs = 0;
  pthread_barrier_wait(w->start);
  if (live == NULL || sz == NULL) goto out;
  double end = suite_now() + o->scale_seconds;
  for (;;) {
    for (int k = 0; k < 256; k++) {
      uint64_t r = suite_rand(&seed);
      int i = (int)(r % (uint64_t)window);
      if (live[i]) {
        w->a->free(live[i], sz[i], w->stream);
        cur -= sz[i];
        ops++;
      }
      sz[i] = suite_size_pick(o, suite_rand(&seed));
      live[i] = w->a->alloc(sz[i], w->stream);
      allocs++;
      if (live[i]) {
        cur += sz[i];
        if (cur > w->peak_live) w->peak_live = cur;
      }
      ops++;
    }
    if (suite_now() >= end) break;
  }
  for (int i = 0; i < window; i++)
    if (live[i]) w->a->free(live[i], sz[i], w->stream);
out:
  w->end = suite_now();
  /* Then, outside the timed span, on the same CPU and stream: what the
   * driver call in each of magpie's allocations costs now (the host's
   * speed moves from one second to the next). */
  w->id_ns = w->time_id ? suite_stream_id_ns(w->stream, 100000) : -1;
  w->ops = ops;
  w->allocs = allocs;
  free(live);
  free(sz);
  return NULL;
}

/* Operations per second of one point; *less_id (if the threads timed their
 * stream's id call) the same with each thread's allocations' driver calls
 * taken out of its time, else 0. */
static double run_point(const suite_opts *o, bench_alloc *a, int threads, cudaStream_t *streams, int time_id,
                        size_t *sum_peaks, double *less_id) {
  worker *w = calloc((size_t)threads, sizeof *w);
  pthread_t *t = calloc((size_t)threads, sizeof *t);
  if (w == NULL || t == NULL) return 0;
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
  for (int i = 0; i < threads; i++) {
    w[i] = (worker){.o = o, .a = a, .index = i, .stream = streams[i], .time_id = time_id, .start = &start};
    pthread_create(&t[i], NULL, worker_main, &w[i]);
  }
  pthread_barrier_wait(&start);
  double t0 = suite_now(), end = t0, less = 0;
  uint64_t ops = 0;
  size_t peaks = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(t[i], NULL);
    ops += w[i].ops;
    peaks += w[i].peak_live;
    if (w[i].end > end) end = w[i].end;
  }
  double el = end - t0;
  /* A thread's operations over its span less its allocations' driver
   * calls (each timed as that thread's own calls just after its loop). */
  for (int i = 0; i < threads && less >= 0; i++) {
    double own = (w[i].end - t0) - (double)w[i].allocs * w[i].id_ns * 1e-9;
    less = w[i].id_ns >= 0 && own > 0 ? less + (double)w[i].ops / own : -1;
  }
  pthread_barrier_destroy(&start);
  free(w);
  free(t);
  *sum_peaks = peaks;
  *less_id = less > 0 ? less : 0;
  return el > 0 ? (double)ops / el : 0;
}

void workload_scaling(const suite_opts *o) {
  bench_alloc *a = bench_allocs();
  int maxt = 0;
  for (int i = 0; i < o->scale_points; i++)
    if (o->scale_threads[i] > maxt) maxt = o->scale_threads[i];
  cudaStream_t *streams = calloc((size_t)maxt, sizeof *streams);
  if (streams == NULL) return;
  for (int i = 0; i < maxt; i++)
    if ((streams[i] = bench_stream_create()) == NULL) return;
  char lo[32], hi[32];
  printf(
      "\n== 2 scaling: each thread on its own stream, window %d live blocks of %s%s-%s, random frees, %.2f s "
      "per point\n",
      o->scale_window, o->mix_spread ? "2^e+U[0,2^e) over " : "", suite_size_name(o->mix_min, lo, sizeof lo),
      suite_size_name(o->mix_max, hi, sizeof hi), o->scale_seconds);
  suite_magpie_peak_note();
  printf("%7s %-16s %12s %9s %11s %14s %12s %12s\n", "threads", "allocator", "Mops/s", "x 1 thr", "magpie/x",
         "reserved/peaks", "peaks MiB", "less id");
  double base[BA_COUNT] = {0}, mp16 = 0, mp1 = 0, ratio16 = 0;
  int top = 0, memory_ok = 1, any_less = 0;
  char memory_missed[96] = "";
  for (int pi = 0; pi < o->scale_points; pi++) {
    int th = o->scale_threads[pi];
    double mp = 0;
    for (int w = 0; w < BA_COUNT; w++) {
      if (!o->use[w]) continue;
      a[w].reset();
      size_t peaks = 0;
      double less_id = 0;
      double r = run_point(o, &a[w], th, streams, w == BA_MAGPIE, &peaks, &less_id);
      uint64_t reserved = a[w].peak_reserved();
      if (base[w] == 0) base[w] = r;
      if (w == BA_MAGPIE) mp = r;
      double ratio = peaks && reserved ? (double)reserved / (double)peaks : 0;
      printf("%7d %-16s %12.2f %9.2f", th, a[w].name, r / 1e6, base[w] ? r / base[w] : 0);
      if (w != BA_MAGPIE && mp > 0) printf(" %11.1f", mp / r);
      else printf(" %11s", "");
      if (ratio > 0) printf(" %14.2f", ratio);
      else printf(" %14s", "n/a");
      printf(" %12.1f", (double)peaks / (1 << 20));
      if (less_id > 0) printf(" %12.2f", less_id / 1e6);
      printf("\n");
      /* The memory bound: 1.3x the sum of the threads' peaks; at one or
       * two threads the sum plus 8 MiB a thread where that is more. */
      if (w == BA_MAGPIE && peaks && reserved) {
        double bound = 1.3 * (double)peaks, floor = (double)peaks + (double)th * 8.0 * (1 << 20);
        if (th <= 2 && floor > bound) bound = floor;
        if ((double)reserved > bound && memory_ok) {
          memory_ok = 0;
          snprintf(memory_missed, sizeof memory_missed, "%d threads: reserved %.1f MiB, bound %.1f MiB", th,
                   (double)reserved / (1 << 20), bound / (1 << 20));
        }
      }
      char x[16];
      snprintf(x, sizeof x, "%d", th);
      suite_row("scaling", a[w].name, x, "ops_per_s", r);
      suite_row("scaling", a[w].name, x, "sum_peak_live_bytes", (double)peaks);
      if (reserved) suite_row("scaling", a[w].name, x, "peak_reserved_bytes", (double)reserved);
      if (less_id > 0) {
        suite_row("scaling", a[w].name, x, "ops_per_s_less_stream_id", less_id);
        any_less = 1;
      }
      if (w == BA_MAGPIE) {
        if (th == 1) mp1 = r;
        if (th >= top) {
          top = th;
          mp16 = r;
          ratio16 = ratio;
        }
      }
    }
  }
  if (any_less)
    printf(
        "  less id: magpie's M ops/s with its allocations' cuStreamGetId calls taken out of each thread's time "
        "(each thread times its own calls right after its loop), as its latency is judged\n");
  if (o->use[BA_MAGPIE]) suite_magpie_stats("scaling", "after the last point");
  if (o->use[BA_MAGPIE] && top >= 16) {
    char d[160];
    snprintf(d, sizeof d, "%.1f M ops/s at %d threads", mp16 / 1e6, top);
    suite_target("scaling", "magpie >= 300 M ops/s at 16 threads", mp16 >= 300e6, d);
    if (mp1 > 0) {
      snprintf(d, sizeof d, "%.2fx its own 1-thread %.1f M ops/s", mp16 / mp1, mp1 / 1e6);
      suite_target("scaling", "magpie 16 threads >= 8x 1 thread", mp16 >= 8 * mp1, d);
    }
    snprintf(d, sizeof d, "peak reserved / sum of per-thread peak live bytes = %.2f", ratio16);
    suite_target("scaling", "magpie reserved <= 1.3x sum of per-thread peaks", ratio16 > 0 && ratio16 <= 1.3, d);
  }
  if (o->use[BA_MAGPIE])
    suite_target("scaling",
                 "magpie reserved at every point <= 1.3x sum of peaks, or at 1-2 threads sum + 8 MiB a thread",
                 memory_ok, memory_ok ? "every point within" : memory_missed);
  bench_device_sync();
  for (int i = 0; i < maxt; i++) bench_stream_destroy(streams[i]);
  free(streams);
}
