/* Throughput per device with both devices busy, against one device alone
 * (peer-bench style): T threads per device, each on a stream of its own
 * device, alloc+free pairs of mixed sizes (256 B .. 1 MiB, 2^e + U[0, 2^e)),
 * keeping 64 live blocks and replacing a random one per step, for a fixed
 * time. Three phases in one run: device 0 alone, device 1 alone, both at
 * once; M ops/s per device and the ratio both/alone.
 *
 *   multi_gpu_bench [threads_per_device] [seconds_per_phase]
 *
 * Needs two GPUs (CUDA); says so and exits 0 otherwise. magpie only: the
 * question is whether its per-device heaps and thread caches let the
 * devices run as if alone. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_util.h"
#include "device/cuda_driver.h"
#include "magpie.h"

#define LIVE 64
#define MAX_THREADS 64

static cudrv_context ctx[2];
static atomic_int go, stop;

typedef struct runner {
  int device;
  uint64_t seed;
  long ops;
  int failed;
} runner;

static void *run(void *arg) {
  runner *r = arg;
  cudrv_stream s = NULL;
  if (cudrv.ctx_set_current(ctx[r->device]) != 0 || cudrv.stream_create(&s, 1 /* non-blocking */) != 0) {
    r->failed = 1;
    return NULL;
  }
  void *live[LIVE];
  uint64_t x = r->seed;
  for (int i = 0; i < LIVE; i++) live[i] = magpie_malloc_async(256, s);
  while (!atomic_load(&go)) {
  }
  long ops = 0;
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
    for (int k = 0; k < 256; k++) {
      uint64_t v = bench_rand(&x);
      int i = (int)(v % LIVE);
      unsigned e = 8 + (unsigned)(v >> 32) % 13; /* 256 B .. 1 MiB */
      size_t size = ((size_t)1 << e) + (size_t)((v >> 8) & (((size_t)1 << e) - 1));
      if (magpie_free_async(live[i], s) != MAGPIE_OK) r->failed = 1;
      live[i] = magpie_malloc_async(size, s);
      if (live[i] == NULL) {
        r->failed = 1;
        live[i] = magpie_malloc_async(256, s);
      }
    }
    ops += 512;
  }
  r->ops = ops;
  for (int i = 0; i < LIVE; i++) magpie_free_async(live[i], s);
  cudrv.stream_synchronize(s);
  cudrv.stream_destroy(s);
  return NULL;
}

/* One phase: threads on each device whose bit is in mask; M ops/s per
 * device into mops[]. */
static int phase(int mask, int threads, double seconds, double mops[2]) {
  runner r[2 * MAX_THREADS];
  pthread_t t[2 * MAX_THREADS];
  int n = 0;
  atomic_store(&go, 0);
  atomic_store(&stop, 0);
  for (int d = 0; d < 2; d++)
    for (int i = 0; (mask >> d & 1) && i < threads; i++) {
      r[n] = (runner){.device = d, .seed = bench_seed_mix((uint64_t)(n + 1), 0x9E3779B97F4A7C15ull, (uint64_t)mask)};
      if (pthread_create(&t[n], NULL, run, &r[n]) != 0) return -1;
      n++;
    }
  double t0 = bench_now();
  atomic_store(&go, 1);
  while (bench_now() - t0 < seconds) {
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
  }
  atomic_store(&stop, 1);
  double el = bench_now() - t0;
  long per[2] = {0, 0};
  int failed = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(t[i], NULL);
    per[r[i].device] += r[i].ops;
    failed |= r[i].failed;
  }
  for (int d = 0; d < 2; d++) mops[d] = per[d] / el / 1e6;
  return failed ? -1 : 0;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 4;
  double seconds = argc > 2 ? atof(argv[2]) : 2.0;
  if (threads < 1 || threads > MAX_THREADS) threads = 4;
  const char *why = NULL;
  int n = 0;
  if (cudrv_load(CUDRV_LOAD_ALL, &why) != 0 || cudrv.init(0) != 0 || cudrv.device_get_count(&n) != 0 || n < 2) {
    printf("multi_gpu_bench: needs two GPUs (%s)\n", why ? why : n < 2 ? "fewer than two devices" : "driver");
    return 0;
  }
  for (int d = 0; d < 2; d++) {
    cudrv_device dev;
    if (cudrv.device_get(&dev, d) != 0 || cudrv.primary_ctx_retain(&ctx[d], dev) != 0) return 1;
  }
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_CUDA;
  if (magpie_init(&cfg) != MAGPIE_OK) {
    fprintf(stderr, "magpie_init: %s\n", magpie_last_error_message());
    return 1;
  }
  double warm[2], a0[2], a1[2], both[2];
  if (phase(3, threads, 0.5, warm) != 0 || phase(1, threads, seconds, a0) != 0 || phase(2, threads, seconds, a1) != 0 ||
      phase(3, threads, seconds, both) != 0) {
    fprintf(stderr, "a phase failed: %s\n", magpie_last_error_message());
    return 1;
  }
  printf("multi_gpu_bench: %d threads per device, %.1f s per phase, mixed 256 B-1 MiB, 64 live per thread\n", threads,
         seconds);
  printf("  device 0 alone  %8.2f M ops/s\n", a0[0]);
  printf("  device 1 alone  %8.2f M ops/s\n", a1[1]);
  printf("  both at once    %8.2f + %8.2f M ops/s (device 0 %.2f of alone, device 1 %.2f)\n", both[0], both[1],
         both[0] / a0[0], both[1] / a1[1]);
  return 0;
}
