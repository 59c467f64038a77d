/* What sharing costs: mapping exportable memory, and an export + import +
 * close round trip.
 *
 *   ipc_bench [rounds]
 *
 * 1. Mapping: one 2 MiB granule mapped and unmapped through the device
 *    table, created plain (MAGPIE_CONF=ipc=0) and exportable (ipc=1, the
 *    default), interleaved round by round in one run: the only place
 *    exportable memory costs anything (nothing on the allocation and free
 *    paths changes; bench/pair_bench with ipc=0 and ipc=1 shows the pairs).
 * 2. Sharing: magpie_ipc_export, magpie_ipc_import and magpie_ipc_close of
 *    one block, small and large, imported by this same process (the export
 *    server answers it over its socket as it answers another process).
 * Prints the median microseconds of each over the rounds. Uses the device
 * magpie picks (a GPU if present, else the simulated device). */
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_util.h"
#include "front/global.h"
#include "magpie.h"

#define MAX_ROUNDS 1000

static double map_round(const backend_ops *ops, uintptr_t base, size_t g, unsigned flags) {
  double t0 = bench_now();
  if (ops->map(0, base, g, flags, 0) != MAGPIE_OK || ops->unmap(0, base, g) != MAGPIE_OK) {
    fprintf(stderr, "map/unmap failed: %s\n", magpie_last_error_message());
    exit(1);
  }
  return (bench_now() - t0) * 1e6;
}

static void share_round(size_t size, double *export_us, double *import_us, double *close_us) {
  void *p = magpie_malloc(size), *q = NULL;
  magpie_ipc_handle h;
  double t0 = bench_now();
  int rc = magpie_ipc_export(p, 0, &h);
  double t1 = bench_now();
  if (rc == MAGPIE_OK) rc = magpie_ipc_import(&h, &q, NULL);
  double t2 = bench_now();
  if (rc == MAGPIE_OK) rc = magpie_ipc_close(q, 0);
  double t3 = bench_now();
  if (rc != MAGPIE_OK) {
    fprintf(stderr, "sharing failed: %s\n", magpie_last_error_message());
    exit(1);
  }
  magpie_free(p);
  *export_us = (t1 - t0) * 1e6;
  *import_us = (t2 - t1) * 1e6;
  *close_us = (t3 - t2) * 1e6;
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 200;
  if (rounds < 1 || rounds > MAX_ROUNDS) rounds = 200;
  if (global_ensure() != MAGPIE_OK) {
    fprintf(stderr, "magpie: %s\n", magpie_last_error_message());
    return 1;
  }
  const backend_ops *ops = global_ops();
  size_t g = 0;
  uintptr_t base = 0;
  if (ops->granularity(0, &g) != MAGPIE_OK || ops->reserve(0, g, &base) != MAGPIE_OK) {
    fprintf(stderr, "no virtual memory management on device 0\n");
    return 1;
  }
  static double plain[MAX_ROUNDS], exportable[MAX_ROUNDS];
  for (int i = 0; i < rounds; i++) {
    plain[i] = map_round(ops, base, g, 0);
    exportable[i] = map_round(ops, base, g, BACKEND_MAP_EXPORTABLE);
  }
  ops->unreserve(0, base, g);
  double mp = bench_median(plain, rounds), me = bench_median(exportable, rounds);
  printf("device: %s, granule %zu bytes, %d rounds\n", ops->name, g, rounds);
  printf("map+unmap of one granule, median us: plain %.1f, exportable %.1f (ratio %.3f)\n", mp, me, me / mp);
  static const size_t sizes[] = {4096, (size_t)64 << 20};
  static double ex[MAX_ROUNDS], im[MAX_ROUNDS], cl[MAX_ROUNDS];
  for (int s = 0; s < 2; s++) {
    for (int i = 0; i < rounds; i++) share_round(sizes[s], &ex[i], &im[i], &cl[i]);
    printf("%zu-byte block, median us: export %.1f, import %.1f, close %.1f\n", sizes[s], bench_median(ex, rounds),
           bench_median(im, rounds), bench_median(cl, rounds));
  }
  return 0;
}
