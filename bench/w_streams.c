/* Workload 6: many streams, one thread. The thread visits N streams in
 * turn (--rot-streams, a list of N), --rot-rounds times over all of them
 * (more for few streams: at least 25,600 visits are timed, after an
 * untimed round);
 * on each visit it allocates --rot-blocks blocks of 4-64 KiB (2^e + U[0,
 * 2^e)) on that stream and frees them there, so at most that many blocks
 * are live. Per N: operations (allocs + frees) per second, the reserved
 * memory (the allocator's peak since its reset; magpie's restarted with
 * magpie_stats_reset_peaks: sampling it every 16 visits, as before, put a
 * statistics call into the measured loop), and
 * for magpie the magazines sent to limbo and the device-wide
 * synchronisations it made. A thread cache keyed by stream that forgets
 * streams (magpie's 32 slots per thread) shows here as a cliff past its
 * size. A point stops after the round that passes ROT_MAX_SECONDS (its
 * figure is then over the rounds that ran, marked "capped"):
 * cudaMallocAsync ran 0.08 M ops/s at 256 streams on an H100 and would take
 * tens of minutes at 4,096. With --rot-touch, each visit enqueues one
 * kernel per 4 blocks that writes them before they are freed, so a visit's
 * blocks are freed behind work in flight: what a thread holds then
 * depends on how far its streams' work lags behind its visits (docs/design.md,
 * "Many streams per thread"). */
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

/* Longest a point runs before it stops at the end of a round. */
#define ROT_MAX_SECONDS 20.0

typedef struct rot_result {
  int capped; /* stopped by ROT_MAX_SECONDS */
  double ops_per_s;
  size_t reserved;
  uint64_t limbo, syncs;
  uint64_t failures;
} rot_result;

static rot_result run(const suite_opts *o, bench_alloc *a, int is_magpie, cudaStream_t *streams, int n) {
  rot_result r = {0};
  int B = o->rot_blocks;
  void **p = calloc((size_t)B, sizeof *p);
  size_t *sz = calloc((size_t)B, sizeof *sz);
  if (p == NULL || sz == NULL) return r;
  uint64_t seed = bench_seed_mix(o->seed, 0xD6E8FEB86659FD93ull, (uint64_t)n);
  magpie_stats s0 = {0}, s1 = {0};
  if (is_magpie) {
    magpie_stats_get(0, &s0);
    magpie_stats_reset_peaks(0);
  }
  uint64_t ops = 0;
  /* At least rot_rounds rounds and 25,600 visits (100 rounds of 256
   * streams), after one untimed round. */
  int rounds = o->rot_rounds > 25600 / n ? o->rot_rounds : 25600 / n;
  double t0 = 0;
  for (int round = -1; round < rounds; round++) {
    if (round == 0) t0 = suite_now();
    for (int i = 0; i < n; i++) {
      cudaStream_t s = streams[i];
      for (int k = 0; k < B; k++) {
        sz[k] = suite_spread_size(suite_rand(&seed), 4096, 65536);
        if ((p[k] = a->alloc(sz[k], s)) == NULL) r.failures++;
      }
      for (int k = 0; o->rot_touch && k < B; k += 4) {
        int m = B - k < 4 ? B - k : 4, ok = 1;
        for (int j = 0; j < m; j++) ok &= p[k + j] != NULL;
        if (ok && bench_touch(s, &p[k], &sz[k], m, (uint32_t)round) != 0) r.failures++;
      }
      for (int k = 0; k < B; k++)
        if (p[k]) a->free(p[k], sz[k], s);
      if (round >= 0) ops += 2 * (uint64_t)B; /* the untimed round is not counted */
    }
    if (round >= 0 && round + 1 < rounds && suite_now() - t0 >= ROT_MAX_SECONDS) {
      r.capped = 1;
      break;
    }
  }
  double el = suite_now() - t0;
  r.ops_per_s = (double)ops / el;
  if (is_magpie) {
    magpie_stats_get(0, &s1);
    r.reserved = s1.peak_reserved_bytes;
    r.limbo = s1.limbo_magazines - s0.limbo_magazines;
    r.syncs = s1.device_syncs - s0.device_syncs;
  } else {
    r.reserved = (size_t)a->peak_reserved();
  }
  free(p);
  free(sz);
  return r;
}

void workload_streams(const suite_opts *o) {
  bench_alloc *a = bench_allocs();
  int maxn = 0;
  for (int i = 0; i < o->rot_points; i++)
    if (o->rot_streams[i] > maxn) maxn = o->rot_streams[i];
  cudaStream_t *streams = calloc((size_t)maxn, sizeof *streams);
  if (streams == NULL) return;
  for (int i = 0; i < maxn; i++)
    if ((streams[i] = bench_stream_create()) == NULL) return;
  printf(
      "\n== 6 streams: one thread visits N streams in turn, >= %d rounds; per visit %d blocks of 4KiB-64KiB "
      "(2^e+U[0,2^e)) allocated, %sthen freed on that stream\n",
      o->rot_rounds, o->rot_blocks, o->rot_touch ? "used by a kernel, " : "");
  suite_magpie_peak_note();
  printf("%7s %-16s %10s %9s %14s %9s %12s\n", "streams", "allocator", "Mops/s", "x 1 str", "reserved MiB", "limbo",
         "device syncs");
  double one[BA_COUNT] = {0};
  for (int pt = 0; pt < o->rot_points; pt++) {
    int n = o->rot_streams[pt];
    char x[16];
    snprintf(x, sizeof x, "%d", n);
    for (int w = 0; w < BA_COUNT; w++) {
      if (!o->use[w] || w == BA_CUDA_MALLOC || !bench_alloc_touchable(w)) continue;
      a[w].reset();
      if (w == BA_MAGPIE) magpie_trim(0, 0);
      rot_result r = run(o, &a[w], w == BA_MAGPIE, streams, n);
      if (pt == 0) one[w] = r.ops_per_s;
      printf("%7d %-16s %10.2f %9.2f", n, a[w].name, r.ops_per_s / 1e6, one[w] > 0 ? r.ops_per_s / one[w] : 0);
      if (r.reserved) printf(" %14.1f", (double)r.reserved / (1 << 20));
      else printf(" %14s", "n/a");
      if (w == BA_MAGPIE) printf(" %9llu %12llu", (unsigned long long)r.limbo, (unsigned long long)r.syncs);
      if (r.failures) printf("  (%llu failed)", (unsigned long long)r.failures);
      if (r.capped) printf("  (capped at %.0f s)", ROT_MAX_SECONDS);
      printf("\n");
      suite_row("streams", a[w].name, x, "ops_per_s", r.ops_per_s);
      if (r.reserved) suite_row("streams", a[w].name, x, "reserved_bytes", (double)r.reserved);
      if (w == BA_MAGPIE) {
        suite_row("streams", a[w].name, x, "limbo_magazines", (double)r.limbo);
        suite_row("streams", a[w].name, x, "device_syncs", (double)r.syncs);
        if (n > 32) {
          char what[96], d[96];
          snprintf(what, sizeof what, "magpie at %d streams: reserved <= 16 MiB, no device sync, >= 0.5x of 1 stream",
                   n);
          snprintf(d, sizeof d, "%.1f MiB, %llu syncs, %.2fx", (double)r.reserved / (1 << 20),
                   (unsigned long long)r.syncs, one[w] > 0 ? r.ops_per_s / one[w] : 0);
          suite_target("streams", what, r.reserved <= ((size_t)16 << 20) && r.syncs == 0 && r.ops_per_s * 2 >= one[w],
                       d);
        }
      }
    }
  }
  suite_magpie_stats("streams", "after its last point");
  bench_device_sync();
  for (int i = 0; i < maxn; i++) bench_stream_destroy(streams[i]);
  free(streams);
}
