/* What one magpie alloc+free pair costs against the driver call inside it,
 * CPU by CPU (a GPU only).
 *
 *   stream_id_probe time [ROUNDS]   # where the scheduler puts the thread
 *   stream_id_probe cpu [ROUNDS]    # pinned to each CPU in turn
 *
 * Each round prints, in ns per call or pair over 10^6 of them: the driver's
 * cuStreamGetId alone (the exported symbol, from dlsym on the driver
 * loader's handle, and the loader's table entry from cuGetProcAddress, which
 * magpie calls), cuCtxGetCurrent, a magpie pair of 256 B on a created stream and on
 * stream 0, and a no-op pair (a bump pointer) for the floor. On a shared
 * machine the CPUs differ by half and change over seconds: this shows which
 * state a workload 1 figure came from. Run two builds of the library on the
 * same CPUs (LD_LIBRARY_PATH, taskset) to compare them. */
#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "device/cuda_driver.h"
#include "magpie.h"
#include "tools/devshim.h"

typedef cudrv_pfn_stream_get_id getid_fn;
typedef cudrv_pfn_ctx_get_current getctx_fn;

enum { N = 1000000 };

static getid_fn getid_dlsym, getid_gpa;
static getctx_fn getctx;
static char arena[1 << 20];
static size_t bump;

static double time_getid(getid_fn f, cudaStream_t s) {
  unsigned long long v = 0;
  double t0 = bench_now();
  for (int i = 0; i < N; i++) {
    f(s, &v);
    bench_escape(&v);
  }
  return (bench_now() - t0) / N * 1e9;
}

static double time_ctx(void) {
  cudrv_context c = NULL;
  double t0 = bench_now();
  for (int i = 0; i < N; i++) {
    getctx(&c);
    bench_escape(c);
  }
  return (bench_now() - t0) / N * 1e9;
}

static double time_magpie(cudaStream_t s) {
  double t0 = bench_now();
  for (int i = 0; i < N; i++) {
    void *p = magpie_malloc_async(256, s);
    bench_escape(p);
    magpie_free_async(p, s);
  }
  return (bench_now() - t0) / N * 1e9;
}

static __attribute__((noinline)) void *noop_alloc(size_t size) {
  void *p = arena + (bump & ((sizeof arena >> 1) - 1));
  bump += size + 64;
  return p;
}

static __attribute__((noinline)) void noop_free(void *p) { bench_escape(p); }

static double time_noop(void) {
  double t0 = bench_now();
  for (int i = 0; i < N; i++) {
    void *p = noop_alloc(256);
    bench_escape(p);
    noop_free(p);
  }
  return (bench_now() - t0) / N * 1e9;
}

static void round_once(cudaStream_t s, const char *tag) {
  double a = time_getid(getid_dlsym, s), b = time_getid(getid_gpa, s), c = time_ctx();
  double d = time_magpie(s), e = time_magpie(0), f = time_noop();
  printf("%s cpu %2d  getid %5.1f  getid_gpa %5.1f  ctxcur %5.1f  magpie %5.1f  magpie_s0 %5.1f  noop %4.1f\n", tag,
         sched_getcpu(), a, b, c, d, e, f);
  fflush(stdout);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "time";
  int rounds = argc > 2 ? atoi(argv[2]) : 20;
  if ((strcmp(mode, "time") != 0 && strcmp(mode, "cpu") != 0) || rounds < 1) {
    fprintf(stderr, "usage: stream_id_probe time|cpu [ROUNDS]\n");
    return 2;
  }
  if (devshim_init() != 0 || !devshim_is_cuda()) {
    fprintf(stderr, "stream_id_probe: needs a GPU (magpie chose the simulated device)\n");
    return 1;
  }
  /* The driver as magpie loaded it (devshim_init loaded it for all). */
  const char *why = NULL;
  if (cudrv_load(CUDRV_LOAD_LIBRARY, &why) != 0) {
    fprintf(stderr, "stream_id_probe: %s\n", why);
    return 1;
  }
  getid_gpa = cudrv.stream_get_id;
  getctx = cudrv.ctx_get_current;
  void *sym = dlsym(cudrv.library, "cuStreamGetId");
  memcpy(&getid_dlsym, &sym, sizeof sym);
  if (getid_dlsym == NULL) {
    fprintf(stderr, "stream_id_probe: libcuda.so.1 exports no cuStreamGetId (CUDA 12.0+)\n");
    return 1;
  }
  devshim_thread_init();
  cudaStream_t s = devshim_stream_create();
  if (s == NULL) return 1;
  round_once(s, "warm");
  if (strcmp(mode, "cpu") == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (int r = 0; r < rounds; r++)
      for (long c = 0; c < n; c++) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)c, &set);
        if (sched_setaffinity(0, sizeof set, &set) == 0) round_once(s, "pin");
      }
  } else {
    for (int r = 0; r < rounds; r++) round_once(s, "free");
  }
  devshim_synchronize();
  devshim_stream_destroy(s);
  return 0;
}
