/* Thread scaling: T threads, each on its own stream, each keeping a window
 * of live blocks of mixed sizes (256 B - 64 KiB, or up to max_kib drawn as
 * 2^e + U[0, 2^e), issue 47's pattern) and replacing a random one
 * per step (free + alloc). Aggregate operations per second for magpie and,
 * in the same run, glibc malloc (and CUDA's pool on a GPU); magpie's
 * reserved memory against the sum of live bytes. Thread i runs pinned to
 * CPU i (mod the CPU count).
 *
 * With rounds > 1 each point runs magpie and glibc alternately that many
 * times and prints the medians (a shared machine's noise). events/op:
 * events magpie recorded per operation (magpie_stats.events_recorded),
 * the mechanism behind most of a mixed workload's slow paths.
 *
 *   scaling_bench [max_threads] [seconds_per_point] [window] [max_kib] [rounds]
 *
 * SCALING_BENCH_POW2=1 draws powers of 2 from 256 B to max_kib instead
 * (magpie_bench's workload 2 with --mix 256,MAX). */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "magpie.h"
#include "tools/devshim.h"

enum { ALLOC_MAGPIE, ALLOC_GLIBC, ALLOC_POOL };

static unsigned spread_top; /* log2 of the largest size when spread, else 0 */
static int pow2_sizes;      /* SCALING_BENCH_POW2=1: powers of 2 from 256 B to max_kib (workload 2's --mix) */

typedef struct worker {
  int index, kind, window;
  double seconds;
  cudaStream_t stream;
  uint64_t ops;
  size_t peak_live;
  pthread_barrier_t *start;
} worker;

static void *alloc_one(int kind, size_t size, cudaStream_t s) {
  if (kind == ALLOC_MAGPIE) return magpie_malloc_async(size, s);
  if (kind == ALLOC_GLIBC) return malloc(size);
  return devshim_pool_alloc(size, s);
}

static void free_one(int kind, void *p, cudaStream_t s) {
  if (kind == ALLOC_MAGPIE) magpie_free_async(p, s);
  else if (kind == ALLOC_GLIBC) free(p);
  else devshim_pool_free(p, s);
}

static void *worker_main(void *arg) {
  worker *w = arg;
  /* One thread per CPU, pinned: a scaling figure should not depend on the
   * scheduler putting two threads on one CPU for part of the run. */
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu > 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)(w->index % ncpu), &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
  devshim_thread_init();
  uint64_t seed = 0x9E3779B97F4A7C15ull ^ (uint64_t)(uintptr_t)w;
  void **live = calloc((size_t)w->window, sizeof *live);
  size_t *sz = calloc((size_t)w->window, sizeof *sz);
  size_t cur = 0;
  pthread_barrier_wait(w->start);
  double end = bench_now() + w->seconds;
  uint64_t ops = 0;
  while (1) {
    for (int k = 0; k < 256; k++) {
      uint64_t r = bench_rand(&seed);
      int i = (int)(r % (uint64_t)w->window);
      if (live[i]) {
        free_one(w->kind, live[i], w->stream);
        cur -= sz[i];
        ops++;
      }
      if (spread_top == 0) {
        sz[i] = (size_t)256 << ((r >> 32) % 9);
      } else if (pow2_sizes) {
        sz[i] = (size_t)256 << ((r >> 32) % (spread_top - 7)); /* 256 B .. max */
      } else {
        size_t e = (size_t)1 << (8 + (r >> 32) % (spread_top - 8)); /* 256 B .. max/2 */
        sz[i] = e + (size_t)((r >> 8) & 0xFFFFFF) % e;
      }
      live[i] = alloc_one(w->kind, sz[i], w->stream);
      if (live[i]) {
        cur += sz[i];
        if (cur > w->peak_live) w->peak_live = cur;
      }
      ops++;
    }
    if (bench_now() >= end) break;
  }
  for (int i = 0; i < w->window; i++)
    if (live[i]) free_one(w->kind, live[i], w->stream);
  w->ops = ops;
  free(live);
  free(sz);
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double run_point(int kind, int threads, double seconds, int window, cudaStream_t *streams, size_t *sum_peaks,
                        uint64_t *total_ops) {
  worker *w = calloc((size_t)threads, sizeof *w);
  pthread_t *t = calloc((size_t)threads, sizeof *t);
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, (unsigned)threads);
  for (int i = 0; i < threads; i++) {
    w[i] =
        (worker){.index = i, .kind = kind, .window = window, .seconds = seconds, .stream = streams[i], .start = &start};
    pthread_create(&t[i], NULL, worker_main, &w[i]);
  }
  double t0 = bench_now();
  uint64_t ops = 0;
  size_t peaks = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(t[i], NULL);
    ops += w[i].ops;
    peaks += w[i].peak_live;
  }
  double el = bench_now() - t0;
  pthread_barrier_destroy(&start);
  free(w);
  free(t);
  if (sum_peaks) *sum_peaks = peaks;
  if (total_ops) *total_ops = ops;
  return (double)ops / el;
}

int main(int argc, char **argv) {
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  int max_threads = argc > 1 ? atoi(argv[1]) : (int)ncpu;
  double seconds = argc > 2 ? atof(argv[2]) : 1.0;
  int window = argc > 3 ? atoi(argv[3]) : 64;
  long max_kib = argc > 4 ? atol(argv[4]) : 0;
  int rounds = argc > 5 ? atoi(argv[5]) : 1;
  if (max_threads < 1 || max_threads > 256 || seconds <= 0 || window < 1 || max_kib < 0 || rounds < 1 || rounds > 99 ||
      (max_kib != 0 && (max_kib < 1 || (max_kib & (max_kib - 1)) != 0 || max_kib > (1L << 20)))) {
    fprintf(stderr,
            "usage: scaling_bench [max_threads] [seconds_per_point] [window] [max_kib: a power of 2] [rounds]\n");
    return 2;
  }
  if (max_kib != 0)
    while (((size_t)1 << spread_top) < (size_t)max_kib << 10) spread_top++;
  if (spread_top != 0 && spread_top < 10) spread_top = 10;
  if (devshim_init() != 0) return 1;
  int cuda = devshim_is_cuda();
  int pool = cuda && devshim_pool_prepare() == 0;
  const char *only_env = getenv("SCALING_BENCH_MAGPIE_ONLY");
  int only = only_env != NULL && only_env[0] == '1';
  const char *pow2_env = getenv("SCALING_BENCH_POW2");
  pow2_sizes = spread_top != 0 && pow2_env != NULL && pow2_env[0] == '1';
  cudaStream_t *streams = calloc((size_t)max_threads, sizeof *streams);
  for (int i = 0; i < max_threads; i++)
    if ((streams[i] = devshim_stream_create()) == NULL) return 1;
  if (spread_top == 0) printf("scaling_bench: window %d live blocks/thread, 256 B-64 KiB", window);
  else
    printf("scaling_bench: window %d live blocks/thread, 256 B-%ld KiB %s", window, max_kib,
           pow2_sizes ? "powers of 2" : "spread");
  printf(", %.1f s per point, %ld cpus, device: %s", seconds, ncpu, cuda ? "GPU (CUDA backend)" : "simulated");
  if (rounds > 1) printf(", medians of %d rounds", rounds);
  printf("\n");
  printf("%7s %14s %9s %14s %9s", "threads", "magpie Mops/s", "x 1 thr", "glibc Mops/s", "mp/glibc");
  if (pool) printf(" %14s %9s", "pool Mops/s", "mp/pool");
  printf(" %16s %10s %11s\n", "reserved/peaks", "events/op", "queries/op");
  double base = 0;
  double *mv = calloc((size_t)rounds, sizeof *mv), *gv = calloc((size_t)rounds, sizeof *gv);
  for (int th = 1; th <= max_threads; th *= 2) {
    size_t peaks = 0;
    uint64_t events = 0, queries = 0, ops_all = 0;
    magpie_stats st;
    for (int r = 0; r < rounds; r++) {
      size_t pk = 0;
      uint64_t ops = 0;
      magpie_stats_get(0, &st);
      uint64_t ev0 = st.events_recorded, q0 = st.event_queries;
      mv[r] = run_point(ALLOC_MAGPIE, th, seconds, window, streams, &pk, &ops);
      magpie_stats_get(0, &st);
      events += st.events_recorded - ev0;
      queries += st.event_queries - q0;
      ops_all += ops;
      if (pk > peaks) peaks = pk;
      gv[r] = only ? 0 : run_point(ALLOC_GLIBC, th, seconds, window, streams, NULL, NULL);
    }
    double m = median(mv, rounds), g = median(gv, rounds);
    if (th == 1) base = m;
    printf("%7d %14.2f %9.2f %14.2f %9.2f", th, m / 1e6, m / base, g / 1e6, g > 0 ? m / g : 0.0);
    if (pool && !only) {
      double p = run_point(ALLOC_POOL, th, seconds, window, streams, NULL, NULL);
      printf(" %14.2f %9.1f", p / 1e6, m / p);
    }
    printf(" %16.2f %10.4f %11.4f\n", peaks ? (double)st.peak_reserved_bytes / (double)peaks : 0.0,
           ops_all ? (double)events / (double)ops_all : 0.0, ops_all ? (double)queries / (double)ops_all : 0.0);
    if (th < max_threads && th * 2 > max_threads) th = max_threads / 2; /* end on max_threads */
  }
  free(mv);
  free(gv);
  devshim_synchronize();
  return 0;
}
