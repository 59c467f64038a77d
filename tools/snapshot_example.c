/* Writes a magpie snapshot of a small, mixed workload: blocks in use, in
 * the thread's magazines, in the depot, waiting on streams, and large
 * blocks with holes. On the GPU when there is one, else on the simulated
 * device. The input for tools/snapshot_png.py's example picture and test.
 *
 *   snapshot_example OUT.json
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "magpie.h"
#include "tools/devshim.h"

#define MiB ((size_t)1 << 20)
#define SMALL 3000
#define LARGE 16

static uint64_t rng(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT.json\n", argv[0]);
    return 2;
  }
  if (devshim_init() != 0) return 1;
  devshim_thread_init();
  cudaStream_t a = devshim_stream_create(), b = devshim_stream_create();
  static void *small[SMALL];
  void *large[LARGE];
  uint64_t seed = 42;
  for (int i = 0; i < SMALL; i++) {
    size_t sz = 256 + rng(&seed) % (rng(&seed) % 8 == 0 ? 512 * 1024 : 16 * 1024);
    small[i] = magpie_malloc_async(sz, i % 3 ? a : b);
    if (small[i] == NULL || devshim_fill(small[i], 256, (uint32_t)i, i % 3 ? a : b) != 0) {
      fprintf(stderr, "allocation %d failed: %s\n", i, magpie_last_error_message());
      return 1;
    }
  }
  for (int i = 0; i < LARGE; i++) {
    size_t sz = MiB + rng(&seed) % (48 * MiB);
    large[i] = magpie_malloc_async(sz, b);
    if (large[i] == NULL || devshim_fill(large[i], sz, 7, b) != 0) {
      fprintf(stderr, "large allocation %d failed: %s\n", i, magpie_last_error_message());
      return 1;
    }
  }
  /* Free some on stream a once its work completed (ready for any stream),
   * then some on b while its work may still run (waiting on b). */
  devshim_stream_synchronize(a);
  for (int i = 0; i < SMALL; i += 2) magpie_free_async(small[i], i % 3 ? a : b);
  for (int i = 0; i < LARGE; i += 3) magpie_free_async(large[i], b);
  FILE *f = fopen(argv[1], "w");
  if (f == NULL) {
    perror(argv[1]);
    return 1;
  }
  int rc = magpie_snapshot_json(0, f);
  fclose(f);
  if (rc != MAGPIE_OK) {
    fprintf(stderr, "snapshot failed: %s\n", magpie_last_error_message());
    return 1;
  }
  magpie_stats st;
  magpie_stats_get(0, &st);
  printf("snapshot of device 0 (%s) written to %s: reserved %zu, in use %zu\n", devshim_is_cuda() ? "GPU" : "simulated",
         argv[1], st.reserved_bytes, st.in_use_bytes);
  devshim_synchronize();
  return 0;
}
