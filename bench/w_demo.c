/* Workload 7: the demo's workload (tools/demo.c, tools/demo_workload.h)
 * under every allocator, so that the demo's memory target has references.
 *
 * --demo THREADS,STREAMS,STEPS (8,2,20000): each thread owns STREAMS
 * streams and runs STEPS steps, step k on stream k % STREAMS: eight
 * temporaries of demo_pick_size's sizes (one in 64 a 2, 4 or 6 MiB block,
 * the others 256 B-64 KiB), one small kernel writing the first four of
 * them (the demo's one memset per step on a GPU), the eight freed on that
 * stream. Every eighth step, with two streams or more, a 4 KiB block
 * written on the step's stream is handed to the next stream (event and
 * stream wait), written there and freed with the allocator's cross-stream
 * pattern (bench/allocators.h). The demo itself runs for a time; here each
 * thread runs a fixed number of steps, so that a slower allocator meets the
 * same sequence of sizes rather than fewer of them.
 *
 * Reported: peak reserved / peak live bytes, live bytes being the sum of
 * the requested sizes of the threads' blocks (counted per step, after a
 * step's allocations, which is when a step's bytes peak); for magpie also
 * peak reserved / its own peak of bytes in use (blocks at their block
 * sizes), the figure the demo prints and its target names; M ops/s. The
 * best-fit reference's addresses name no memory: it runs the same
 * sequence without the kernels and the stream waits. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"
#include "tools/demo_workload.h"

typedef struct dworker {
  const suite_opts *o;
  bench_alloc *a;
  int index, touch;
  cudaStream_t *streams;
  pthread_barrier_t *start;
  uint64_t ops, failures;
} dworker;

static bench_live live;

/* The every-eighth-step handoff from stream s to stream c. */
static void handoff(dworker *w, bench_event ev, cudaStream_t s, cudaStream_t c, uint32_t tag) {
  void *p = w->a->alloc(DEMO_HANDOFF_BYTES, s);
  if (p == NULL) {
    w->failures++;
    return;
  }
  bench_live_add(&live, DEMO_HANDOFF_BYTES);
  if (w->touch) {
    size_t n = DEMO_HANDOFF_BYTES;
    if (bench_touch(s, &p, &n, 1, tag) != 0 || bench_event_record(ev, s) != 0 || bench_stream_wait_event(c, ev) != 0 ||
        bench_touch(c, &p, &n, 1, tag + 1) != 0)
      w->failures++;
  }
  w->a->free_cross(p, DEMO_HANDOFF_BYTES, s, c);
  bench_live_sub(&live, DEMO_HANDOFF_BYTES);
  w->ops += 2;
}

static void *dworker_main(void *arg) {
  dworker *w = arg;
  const suite_opts *o = w->o;
  suite_pin(w->index);
  bench_dev_thread_init();
  unsigned seed = demo_seed(w->index);
  bench_event ev = w->touch && o->demo_streams > 1 ? bench_event_create() : NULL;
  pthread_barrier_wait(w->start);
  if (w->touch && o->demo_streams > 1 && ev == NULL) {
    w->failures++;
    return NULL;
  }
  for (long step = 0; step < o->demo_steps; step++) {
    cudaStream_t s = w->streams[step % o->demo_streams];
    void *tmp[DEMO_TEMPS];
    size_t sz[DEMO_TEMPS];
    uint64_t bytes = 0;
    for (int i = 0; i < DEMO_TEMPS; i++) {
      sz[i] = demo_pick_size(&seed);
      tmp[i] = w->a->alloc(sz[i], s);
      if (tmp[i] == NULL) w->failures++;
      else bytes += sz[i];
    }
    bench_live_add(&live, bytes);
    if (w->touch) {
      void *p[4];
      size_t n[4];
      int k = 0;
      for (int i = 0; i < DEMO_TEMPS && k < 4; i++)
        if (tmp[i]) {
          p[k] = tmp[i];
          n[k++] = sz[i];
        }
      if (k > 0 && bench_touch(s, p, n, k, (uint32_t)step) != 0) w->failures++;
    }
    for (int i = 0; i < DEMO_TEMPS; i++)
      if (tmp[i]) w->a->free(tmp[i], sz[i], s);
    bench_live_sub(&live, bytes);
    w->ops += 2 * DEMO_TEMPS;
    if (o->demo_streams > 1 && step % DEMO_HANDOFF_EVERY == DEMO_HANDOFF_EVERY - 1)
      handoff(w, ev, s, w->streams[(step + 1) % o->demo_streams], (uint32_t)step);
  }
  if (ev) {
    bench_event_sync(ev);
    bench_event_destroy(ev);
  }
  return NULL;
}

void workload_demo(const suite_opts *o) {
  int T = o->demo_threads, S = o->demo_streams;
  cudaStream_t *streams = calloc((size_t)(T * S), sizeof *streams);
  dworker *w = calloc((size_t)T, sizeof *w);
  pthread_t *th = calloc((size_t)T, sizeof *th);
  if (streams == NULL || w == NULL || th == NULL) return;
  for (int i = 0; i < T * S; i++)
    if ((streams[i] = bench_stream_create()) == NULL) return;
  printf(
      "\n== 7 demo: the demo's workload (tools/demo.c), %d threads x %d streams, %ld steps each: per step %d "
      "temporaries (1 in 64 of 2-6 MiB, else 256 B-64 KiB), one kernel, a 4 KiB handoff every %d steps\n",
      T, S, o->demo_steps, DEMO_TEMPS, DEMO_HANDOFF_EVERY);
  suite_magpie_peak_note();
  suite_memory_header();
  double mp_ratio = 0;
  for (int a = 0; a < BA_COUNT; a++) {
    if (!o->use[a]) continue;
    bench_alloc *al = &bench_allocs()[a];
    if (a == BA_CUDA_MALLOC || a == BA_NOOP) {
      printf("%-16s (not run: no reserved-memory figure)\n", al->name);
      continue;
    }
    al->reset();
    bench_live_reset(&live);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)T + 1);
    for (int i = 0; i < T; i++) {
      w[i] = (dworker){
          .o = o, .a = al, .index = i, .touch = bench_alloc_touchable(a), .streams = &streams[i * S], .start = &start};
      pthread_create(&th[i], NULL, dworker_main, &w[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = suite_now();
    uint64_t ops = 0, failures = 0;
    for (int i = 0; i < T; i++) {
      pthread_join(th[i], NULL);
      ops += w[i].ops;
      failures += w[i].failures;
    }
    double el = suite_now() - t0;
    pthread_barrier_destroy(&start);
    bench_device_sync();
    suite_memory_row("demo", al->name, atomic_load(&live.peak), al->peak_reserved(), ops / el, failures);
    if (a == BA_MAGPIE) {
      magpie_stats st;
      if (magpie_stats_get(0, &st) == 0 && st.peak_in_use_bytes > 0) {
        mp_ratio = (double)st.peak_reserved_bytes / (double)st.peak_in_use_bytes;
        printf("  magpie: peak in use %.1f MiB (blocks at their sizes): peak reserved / peak in use = %.3f\n",
               st.peak_in_use_bytes / 1048576.0, mp_ratio);
        suite_row("demo", "magpie", "", "reserved_over_in_use", mp_ratio);
      }
      suite_magpie_stats("demo", "after the demo");
    }
  }
  if (o->use[BA_MAGPIE] && mp_ratio > 0) {
    char d[80];
    snprintf(d, sizeof d, "peak reserved / peak in use = %.3f", mp_ratio);
    suite_target("demo", "magpie peak reserved <= 1.3x peak in use", mp_ratio <= 1.3, d);
  }
  bench_device_sync();
  for (int i = 0; i < T * S; i++) bench_stream_destroy(streams[i]);
  free(streams);
  free(w);
  free(th);
}
