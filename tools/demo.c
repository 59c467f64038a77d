/* magpie demo: a many-thread, many-stream allocation workload.
 *
 * Each thread owns a few streams. A step allocates temporaries of mixed
 * sizes on one stream, enqueues work that writes them, and frees them on
 * that stream; every few steps a block produced on one stream is handed to
 * another (event + stream wait) and freed there. At the end it prints the
 * throughput and what magpie holds: bytes in use and reserved, peaks,
 * events recorded, magazines released across streams.
 *
 * Runs on the GPU when magpie picks the CUDA backend (the driver is loaded
 * with dlopen, no CUDA toolkit needed), else on the simulated device.
 *
 *   demo [threads] [streams_per_thread] [seconds]
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "magpie.h"
#include "tools/demo_workload.h"
#include "tools/devshim.h"

/* ---- the workload (tools/demo_workload.h) ---- */

enum { MAX_STREAMS = 16 };

typedef struct worker {
  int id, nstreams;
  double seconds;
  cudaStream_t streams[MAX_STREAMS];
  uint64_t ops, handoffs, failures;
} worker;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *worker_main(void *arg) {
  worker *w = arg;
  devshim_thread_init();
  unsigned seed = demo_seed(w->id);
  double end = now_s() + w->seconds;
  uint64_t step = 0;
  while ((step & 63) != 0 || now_s() < end) {
    cudaStream_t s = w->streams[step % (uint64_t)w->nstreams];
    void *tmp[DEMO_TEMPS];
    size_t sz[DEMO_TEMPS];
    for (int i = 0; i < DEMO_TEMPS; i++) {
      sz[i] = demo_pick_size(&seed);
      tmp[i] = magpie_malloc_async(sz[i], s);
      if (tmp[i] == NULL) {
        w->failures++;
        continue;
      }
      /* Small blocks get device work every time on the simulated device;
       * on the GPU one memset per step keeps the launch rate realistic. */
      if ((!devshim_is_cuda() || i == 0) && devshim_fill(tmp[i], sz[i] < 65536 ? sz[i] : 65536, (uint32_t)step, s) != 0)
        w->failures++;
    }
    for (int i = 0; i < DEMO_TEMPS; i++)
      if (tmp[i] && magpie_free_async(tmp[i], s) != MAGPIE_OK) w->failures++;
    w->ops += 2 * DEMO_TEMPS;
    if (w->nstreams > 1 && step % DEMO_HANDOFF_EVERY == DEMO_HANDOFF_EVERY - 1) {
      /* Hand a block from producer stream s to consumer stream c. */
      cudaStream_t c = w->streams[(step + 1) % (uint64_t)w->nstreams];
      void *p = magpie_malloc_async(DEMO_HANDOFF_BYTES, s);
      if (p && devshim_fill(p, DEMO_HANDOFF_BYTES, 7, s) == 0 && devshim_order(c, s) == 0 &&
          devshim_fill(p, DEMO_HANDOFF_BYTES, 9, c) == 0 && magpie_free_async(p, c) == MAGPIE_OK) {
        w->handoffs++;
        w->ops += 2;
      } else {
        w->failures++;
      }
    }
    step++;
  }
  return NULL;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 8;
  int per = argc > 2 ? atoi(argv[2]) : 2;
  double seconds = argc > 3 ? atof(argv[3]) : 2.0;
  if (threads < 1 || threads > 256 || per < 1 || per > MAX_STREAMS || seconds <= 0) {
    fprintf(stderr, "usage: demo [threads 1-256] [streams_per_thread 1-%d] [seconds]\n", MAX_STREAMS);
    return 2;
  }
  if (devshim_init() != 0) {
    fprintf(stderr, "demo: cannot start the device\n");
    return 1;
  }
  printf("magpie %s demo on the %s: %d threads x %d streams, %.1f s\n", magpie_version(),
         devshim_is_cuda() ? "GPU (CUDA backend)" : "simulated device", threads, per, seconds);
  worker *w = calloc((size_t)threads, sizeof *w);
  pthread_t *t = calloc((size_t)threads, sizeof *t);
  if (w == NULL || t == NULL) return 1;
  devshim_thread_init();
  for (int i = 0; i < threads; i++) {
    w[i] = (worker){.id = i, .nstreams = per, .seconds = seconds};
    for (int k = 0; k < per; k++)
      if ((w[i].streams[k] = devshim_stream_create()) == NULL) {
        fprintf(stderr, "demo: stream creation failed\n");
        return 1;
      }
  }
  double t0 = now_s();
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker_main, &w[i]);
  uint64_t ops = 0, handoffs = 0, failures = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(t[i], NULL);
    ops += w[i].ops;
    handoffs += w[i].handoffs;
    failures += w[i].failures;
  }
  double el = now_s() - t0;
  devshim_synchronize();
  magpie_stats st;
  magpie_stats_get(0, &st);
  printf("operations:           %llu allocs+frees in %.2f s = %.2f M ops/s\n", (unsigned long long)ops, el,
         ops / el / 1e6);
  printf("cross-stream handoffs: %llu (event + stream wait, freed on the consumer)\n", (unsigned long long)handoffs);
  printf("bytes in use:         %zu (peak %zu)\n", st.in_use_bytes, st.peak_in_use_bytes);
  printf("bytes reserved:       %zu (peak %zu), cached %zu\n", st.reserved_bytes, st.peak_reserved_bytes,
         st.cached_bytes);
  printf("slabs %llu, depot exchanges %llu, events recorded %llu\n", (unsigned long long)st.slab_count,
         (unsigned long long)st.depot_exchanges, (unsigned long long)st.events_recorded);
  printf("magazines released across streams %llu, reused on their own stream %llu, limbo %llu\n",
         (unsigned long long)st.cross_stream_migrations, (unsigned long long)st.same_stream_reuses,
         (unsigned long long)st.limbo_magazines);
  printf("failures:             %llu\n", (unsigned long long)failures);
  for (int i = 0; i < threads; i++)
    for (int k = 0; k < per; k++) devshim_stream_destroy(w[i].streams[k]);
  free(w);
  free(t);
  return failures ? 1 : 0;
}
