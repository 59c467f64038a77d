/* Peak probe: where magpie's bytes sit at its peak of reserved memory, beside
 * an ideal best fit of the same sequence.
 *
 * One thread on one stream replays workload 2's sequence (magpie_bench
 * -w 2 --spread, thread 0 of seed `seed`: a window of 64 live blocks, a
 * random one replaced per step, sizes 2^e + U[0, 2^e) for 2^e from 256 B
 * to half of `max`; with `mixed`, workload 2's own sizes, powers of two
 * from 256 B to `max`) for `ops` operations through magpie and through
 * bench/bestfit.c (the best-fit reference of magpie_bench) side by side.
 * After every operation it reads magpie's statistics; at each new peak of
 * reserved memory it keeps them, with the bytes the replay holds live
 * then (requested sizes), and with a file name writes magpie_snapshot_json
 * there. It prints both peaks against the peak live bytes and magpie's
 * layers at its peak: the statistics identity splits reserved memory into
 * blocks in use (block sizes: the part above the live bytes is rounding to
 * size classes), the thread's magazines and kept block, the depot,
 * blocks waiting for their stream's work, free large-segment memory and
 * overhead (slab tails, free span chunks).
 *
 * Unlike magpie_bench it runs a fixed number of operations rather than a
 * fixed time, so a seed's figures repeat from run to run on the simulated
 * device (its streams' timing aside); a statistics read per operation makes
 * it no measure of speed.
 *
 *   peak_probe [seed] [ops] [max] [snapshot.json | -] [mixed] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "bench/bestfit.h"
#include "magpie.h"
#include "tools/devshim.h"

enum { WINDOW = 64 };

#define MIB(x) ((double)(x) / (1 << 20))

int main(int argc, char **argv) {
  unsigned long long seedn = argc > 1 ? strtoull(argv[1], NULL, 10) : 1;
  long ops = argc > 2 ? atol(argv[2]) : 400000;
  size_t max = argc > 3 ? (size_t)strtoull(argv[3], NULL, 10) : (size_t)2 << 20;
  const char *snap = argc > 4 && strcmp(argv[4], "-") != 0 ? argv[4] : NULL;
  int mixed = argc > 5 && strcmp(argv[5], "mixed") == 0;
  if (ops <= 0 || max < 512 || (argc > 5 && !mixed)) {
    fprintf(stderr, "usage: peak_probe [seed] [ops > 0] [max bytes >= 512] [snapshot.json | -] [mixed]\n");
    return 2;
  }
  if (devshim_init() != 0) {
    fprintf(stderr, "peak_probe: cannot start the device\n");
    return 1;
  }
  devshim_thread_init();
  cudaStream_t s = devshim_stream_create();
  if (s == NULL) return 1;
  uint64_t seed = bench_thread_seed(seedn, 0); /* magpie_bench -w 2's thread 0 */
  void *live[WINDOW] = {0}, *ref[WINDOW] = {0};
  size_t sz[WINDOW] = {0}, cur = 0, peak_live = 0, live_at = 0;
  long at = -1, failed = 0;
  magpie_stats st, top = {0};
  for (long k = 0; k < ops; k++) {
    int i = (int)(bench_rand(&seed) % WINDOW);
    if (live[i]) {
      magpie_free_async(live[i], s);
      bestfit_free(ref[i]);
      cur -= sz[i];
    }
    sz[i] = mixed ? bench_mixed_size(bench_rand(&seed), 256, max) : bench_spread_size(bench_rand(&seed), 256, max);
    live[i] = magpie_malloc_async(sz[i], s);
    ref[i] = bestfit_alloc(sz[i]);
    if (live[i] == NULL) {
      failed++;
      bestfit_free(ref[i]);
      ref[i] = NULL;
      continue;
    }
    cur += sz[i];
    if (cur > peak_live) peak_live = cur;
    if (magpie_stats_get(0, &st) == MAGPIE_OK && st.reserved_bytes > top.reserved_bytes) {
      top = st;
      at = k;
      live_at = cur;
      FILE *f = snap ? fopen(snap, "w") : NULL;
      if (f != NULL) {
        magpie_snapshot_json(0, f);
        fclose(f);
      }
    }
  }
  for (int i = 0; i < WINDOW; i++)
    if (live[i]) {
      magpie_free_async(live[i], s);
      bestfit_free(ref[i]);
    }
  devshim_synchronize();
  double bf = (double)bestfit_peak_reserved();
  printf("peak_probe on the %s: seed %llu, %ld operations, sizes 256 B-%zu B%s\n",
         devshim_is_cuda() ? "GPU (CUDA backend)" : "simulated device", seedn, ops, max,
         mixed ? " (powers of two)" : " (2^e + U[0, 2^e))");
  printf("peak live %.2f MiB; bestfit %.1f MiB (%.3f); magpie %.1f MiB (%.3f) at operation %ld\n", MIB(peak_live),
         MIB(bf), bf / (double)peak_live, MIB(top.reserved_bytes), (double)top.reserved_bytes / (double)peak_live, at);
  printf(
      "magpie at its peak, MiB: live %.2f, in use %.2f (large %.2f), thread %.2f, depot %.2f, pending %.2f, "
      "large free %.2f, overhead %.2f; large segments %.1f, slabs %llu\n",
      MIB(live_at), MIB(top.in_use_bytes), MIB(top.large_in_use_bytes), MIB(top.thread_cached_bytes),
      MIB(top.depot_bytes), MIB(top.epoch_pending_bytes), MIB(top.large_free_bytes), MIB(top.overhead_bytes),
      MIB(top.large_mapped_bytes), (unsigned long long)top.slab_count);
  if (failed) printf("failed allocations: %ld\n", failed);
  devshim_stream_destroy(s);
  return failed ? 1 : 0;
}
