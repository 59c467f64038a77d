/* Latency of one alloc+free pair: one thread, warm, one stream.
 *
 * magpie against glibc malloc+free of the same sizes in the same run; on a
 * GPU also against CUDA's stream-ordered pool (cudaMallocAsync's driver
 * entry points, release threshold at maximum so it caches).
 *
 *   pair_bench [pairs_per_trial] [trials]
 * Prints the median ns per pair over the trials and the ratios. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "magpie.h"
#include "tools/devshim.h"

static const size_t sizes[] = {256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304};
#define NSIZES (sizeof sizes / sizeof sizes[0])

typedef double (*pair_fn)(size_t size, long pairs, cudaStream_t s);

static double time_magpie(size_t size, long pairs, cudaStream_t s) {
  double t0 = bench_now();
  for (long i = 0; i < pairs; i++) {
    void *p = magpie_malloc_async(size, s);
    bench_escape(p);
    magpie_free_async(p, s);
  }
  return (bench_now() - t0) / (double)pairs * 1e9;
}

static double time_glibc(size_t size, long pairs, cudaStream_t s) {
  (void)s;
  double t0 = bench_now();
  for (long i = 0; i < pairs; i++) {
    void *p = malloc(size);
    bench_escape(p);
    free(p);
  }
  return (bench_now() - t0) / (double)pairs * 1e9;
}

static double time_pool(size_t size, long pairs, cudaStream_t s) {
  double t0 = bench_now();
  for (long i = 0; i < pairs; i++) {
    void *p = devshim_pool_alloc(size, s);
    bench_escape(p);
    devshim_pool_free(p, s);
  }
  return (bench_now() - t0) / (double)pairs * 1e9;
}

static double measure(pair_fn fn, size_t size, long pairs, int trials, cudaStream_t s) {
  double v[64];
  fn(size, pairs / 10 + 1, s); /* warm */
  for (int t = 0; t < trials; t++) v[t] = fn(size, pairs, s);
  return bench_median(v, trials);
}

int main(int argc, char **argv) {
  long pairs = argc > 1 ? atol(argv[1]) : 2000000;
  int trials = argc > 2 ? atoi(argv[2]) : 5;
  if (pairs < 1 || trials < 1 || trials > 64) {
    fprintf(stderr, "usage: pair_bench [pairs_per_trial] [trials 1-64]\n");
    return 2;
  }
  if (devshim_init() != 0) return 1;
  int cuda = devshim_is_cuda();
  cudaStream_t s = devshim_stream_create();
  if (s == NULL) return 1;
  int pool = cuda && devshim_pool_prepare() == 0;
  printf("pair_bench: one thread, one stream, warm; median of %d trials x %ld pairs; device: %s\n", trials, pairs,
         cuda ? "GPU (CUDA backend)" : "simulated");
  printf("%10s %12s %12s %10s", "size", "magpie ns", "glibc ns", "glibc/mp");
  if (pool) printf(" %14s %10s", "cudaMallocAsync", "pool/mp");
  printf("\n");
  for (size_t i = 0; i < NSIZES; i++) {
    double m = measure(time_magpie, sizes[i], pairs, trials, s);
    double g = measure(time_glibc, sizes[i], pairs, trials, s);
    printf("%10zu %12.1f %12.1f %10.2f", sizes[i], m, g, g / m);
    if (pool) {
      double p = measure(time_pool, sizes[i], pairs / 20 + 1, trials, s);
      printf(" %14.1f %10.1f", p, p / m);
    }
    printf("\n");
  }
  devshim_synchronize();
  devshim_stream_destroy(s);
  return 0;
}
