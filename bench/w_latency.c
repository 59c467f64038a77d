/* Workload 1: latency of one alloc+free pair, one thread, one stream, warm,
 * for sizes from --lat-sizes MIN to MAX (powers of 4).
 *
 * The mean comes from untimed loops (total time / pairs), so no clock read
 * sits inside them: five trials of a fifth of the pairs each, the median of
 * the five means reported, so that one disturbed trial does not move it. The percentiles come from a second pass that times
 * each pair alone with CLOCK_MONOTONIC, less the clock's own median cost
 * (measured first and printed): they resolve tens of nanoseconds, not one.
 * On a GPU, the row before magpie's times cuStreamGetId alone, the driver
 * call inside every magpie allocation, right before magpie's own trials. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

static uint64_t clock_cost(void) {
  enum { N = 20001 };
  uint64_t *v = malloc(N * sizeof *v);
  if (v == NULL) return 0;
  for (int i = 0; i < N; i++) {
    uint64_t t0 = now_ns();
    v[i] = now_ns() - t0;
  }
  qsort(v, N, sizeof *v, cmp_u64);
  uint64_t c = v[N / 2];
  free(v);
  return c;
}

/* Pairs per measurement: the fast allocators get o->lat_pairs, the ones
 * that take microseconds per pair fewer, enough for a p99.9. */
static long pairs_for(int which, long pairs) {
  if (which == BA_CUDA_MALLOC) return pairs / 400 > 1000 ? pairs / 400 : 1000;
  if (which == BA_CUDA_ASYNC || which == BA_TORCH) return pairs / 20 > 5000 ? pairs / 20 : 5000;
  return pairs;
}

typedef struct lat {
  double mean, p50, p99, p999;
  int ok;
} lat;

static lat measure(bench_alloc *a, int which, size_t size, long pairs, cudaStream_t s, uint64_t clock) {
  lat r = {0};
  uint64_t fails0 = bench_alloc_failures(which);
  for (long i = 0; i < pairs / 10 + 1; i++) { /* warm */
    void *p = a->alloc(size, s);
    if (p) a->free(p, size, s);
  }
  double means[SUITE_TRIALS];
  long per = pairs / SUITE_TRIALS > 0 ? pairs / SUITE_TRIALS : 1;
  for (int k = 0; k < SUITE_TRIALS; k++) {
    double t0 = suite_now();
    for (long i = 0; i < per; i++) {
      void *p = a->alloc(size, s);
      bench_escape(p);
      if (p) a->free(p, size, s);
    }
    means[k] = (suite_now() - t0) / (double)per * 1e9;
  }
  r.mean = suite_median_of_trials(means);
  uint64_t *v = malloc((size_t)pairs * sizeof *v);
  if (v == NULL) return r;
  for (long i = 0; i < pairs; i++) {
    uint64_t t = now_ns();
    void *p = a->alloc(size, s);
    bench_escape(p);
    if (p) a->free(p, size, s);
    t = now_ns() - t;
    v[i] = t > clock ? t - clock : 0;
  }
  qsort(v, (size_t)pairs, sizeof *v, cmp_u64);
  r.p50 = (double)v[pairs / 2];
  r.p99 = (double)v[(long)(pairs * 0.99)];
  r.p999 = (double)v[(long)(pairs * 0.999)];
  free(v);
  r.ok = bench_alloc_failures(which) == fails0;
  return r;
}

void workload_latency(const suite_opts *o) {
  bench_alloc *a = bench_allocs();
  cudaStream_t s = bench_stream_create();
  if (s == NULL) return;
  uint64_t clock = clock_cost();
  printf(
      "\n== 1 latency: one alloc+free pair, one thread, one stream, warm (ns; magpie/noop %ld pairs per size; "
      "mean: median of %d trials; clock read %llu ns, subtracted from the percentiles)\n",
      o->lat_pairs, (int)SUITE_TRIALS, (unsigned long long)clock);
  suite_magpie_peak_note();
  printf("%8s %-16s %9s %9s %9s %9s %10s\n", "size", "allocator", "mean", "p50", "p99", "p99.9", "mean/magpie");
  double worst_small = 0, worst_id = 0;
  size_t worst_size = 0;
  for (size_t size = o->lat_min; size <= o->lat_max; size *= 4) {
    char sz[32];
    suite_size_name(size, sz, sizeof sz);
    double mp = 0;
    for (int w = 0; w < BA_COUNT; w++) {
      if (!o->use[w] || !bench_alloc_touchable(w)) continue;
      if (w == BA_MAGPIE) {
        double id_ns = suite_stream_id_ns(s, o->lat_pairs);
        if (id_ns >= 0) {
          printf("%8s %-16s %9.1f   (the driver call in each magpie allocation, alone)\n", sz, "cuStreamGetId", id_ns);
          char x[32];
          snprintf(x, sizeof x, "%zu", size);
          suite_row("latency", "cuStreamGetId", x, "mean_ns", id_ns);
          if (size <= (1u << 20) && id_ns > worst_id) worst_id = id_ns;
        }
      }
      lat r = measure(&a[w], w, size, pairs_for(w, o->lat_pairs), s, clock);
      if (w == BA_MAGPIE) mp = r.mean;
      printf("%8s %-16s %9.1f %9.0f %9.0f %9.0f", sz, a[w].name, r.mean, r.p50, r.p99, r.p999);
      if (w != BA_MAGPIE && mp > 0) printf(" %10.2f", r.mean / mp);
      printf("%s\n", r.ok ? "" : "  (allocations failed)");
      char x[32];
      snprintf(x, sizeof x, "%zu", size);
      suite_row("latency", a[w].name, x, "mean_ns", r.mean);
      suite_row("latency", a[w].name, x, "p50_ns", r.p50);
      suite_row("latency", a[w].name, x, "p99_ns", r.p99);
      suite_row("latency", a[w].name, x, "p999_ns", r.p999);
    }
    if (o->use[BA_MAGPIE] && size <= (1u << 20) && mp > worst_small) {
      worst_small = mp;
      worst_size = size;
    }
  }
  if (o->use[BA_MAGPIE] && worst_size) {
    char d[160], sz[32];
    int n = snprintf(d, sizeof d, "highest mean up to 1 MiB: %.1f ns at %s", worst_small,
                     suite_size_name(worst_size, sz, sizeof sz));
    if (worst_id > 0 && n > 0 && (size_t)n < sizeof d)
      snprintf(d + n, sizeof d - (size_t)n, " (cuStreamGetId alone: up to %.1f ns)", worst_id);
    suite_target("latency", "magpie mean <= 25 ns per pair up to 1 MiB", worst_small <= 25.0, d);
  }
  bench_device_sync();
  bench_stream_destroy(s);
}
