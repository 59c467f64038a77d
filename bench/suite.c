/* magpie_bench: the comparative benchmark suite (see bench/README.md).
 *
 *   magpie_bench [-w 1,2,3,4,5,6,7] [--csv FILE] [--torch SHIM.so] [options]
 *
 * Every workload runs each available allocator in this one process:
 * magpie, cudaMalloc, cudaMallocAsync, PyTorch's caching allocator (with
 * --torch) and the no-op reference. On the simulated device
 * (MAGPIE_BACKEND=sim, or no GPU) only magpie and the no-op reference run. */
#include <getopt.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

static FILE *csv;

void suite_row(const char *workload, const char *alloc, const char *x, const char *metric, double value) {
  if (csv) fprintf(csv, "%s,%s,%s,%s,%.6g\n", workload, alloc, x, metric, value);
}

void suite_target(const char *workload, const char *what, int met, const char *detail) {
  printf("  target %s: %s (%s)\n", what, met ? "met" : "MISSED", detail);
  suite_row(workload, "magpie", what, "target_met", met);
}

void suite_memory_header(void) {
  printf("%-16s %14s %14s %16s %10s %9s\n", "allocator", "peak live MiB", "peak resv MiB", "reserved/live", "M ops/s",
         "failures");
}

double suite_memory_row(const char *workload, const char *alloc, uint64_t peak_live, uint64_t reserved,
                        double ops_per_s, uint64_t failures) {
  double ratio = reserved && peak_live ? (double)reserved / (double)peak_live : 0;
  printf("%-16s %14.1f", alloc, peak_live / 1048576.0);
  if (reserved) printf(" %14.1f %16.3f", reserved / 1048576.0, ratio);
  else printf(" %14s %16s", "n/a", "n/a");
  printf(" %10.2f %9llu\n", ops_per_s / 1e6, (unsigned long long)failures);
  suite_row(workload, alloc, "", "peak_live_bytes", (double)peak_live);
  if (reserved) {
    suite_row(workload, alloc, "", "peak_reserved_bytes", (double)reserved);
    suite_row(workload, alloc, "", "reserved_over_live", ratio);
  }
  suite_row(workload, alloc, "", "ops_per_s", ops_per_s);
  suite_row(workload, alloc, "", "failures", (double)failures);
  return ratio;
}

void suite_magpie_stats(const char *workload, const char *when) {
  magpie_stats st;
  if (magpie_stats_get(0, &st) != 0) return;
  double M = 1 << 20;
  uint64_t hits = 0, misses = 0;
  for (int i = 0; i < MAGPIE_STATS_CLASSES; i++) {
    hits += st.class_hits[i];
    misses += st.class_misses[i];
  }
  printf(
      "  magpie %s: reserved %.1f MiB (peak %.1f), in use %.1f (peak %.1f), large in use %.1f; per layer: "
      "thread-cached %.1f, depot %.1f, epoch-pending %.1f, large free %.1f, overhead %.1f MiB; %llu slabs, "
      "%llu large segments, %llu depot exchanges, %llu events recorded (%llu queries, %llu found pending), %llu stream "
      "waits, "
      "%llu magazine hits / %llu misses\n",
      when, st.reserved_bytes / M, st.peak_reserved_bytes / M, st.in_use_bytes / M, st.peak_in_use_bytes / M,
      st.large_in_use_bytes / M, st.thread_cached_bytes / M, st.depot_bytes / M, st.epoch_pending_bytes / M,
      st.large_free_bytes / M, st.overhead_bytes / M, (unsigned long long)st.slab_count,
      (unsigned long long)st.large_segment_count, (unsigned long long)st.depot_exchanges,
      (unsigned long long)st.events_recorded, (unsigned long long)st.event_queries,
      (unsigned long long)st.event_queries_pending, (unsigned long long)st.stream_waits, (unsigned long long)hits,
      (unsigned long long)misses);
  suite_row(workload, "magpie", when, "stat_reserved_bytes", (double)st.reserved_bytes);
  suite_row(workload, "magpie", when, "stat_slabs", (double)st.slab_count);
  suite_row(workload, "magpie", when, "stat_depot_exchanges", (double)st.depot_exchanges);
  suite_row(workload, "magpie", when, "stat_events_recorded", (double)st.events_recorded);
  suite_row(workload, "magpie", when, "stat_event_queries", (double)st.event_queries);
  suite_row(workload, "magpie", when, "stat_event_queries_pending", (double)st.event_queries_pending);
}

static int workloads_run;

void suite_magpie_peak_note(void) {
  if (workloads_run++ > 0)
    printf(
        "  (magpie's reserved-memory figures below include earlier workloads of this process: magpie's peak "
        "cannot be restarted; run one workload per process, as run_gpu.sh does, for figures of its own)\n");
}

double suite_now(void) { return bench_now(); }

double suite_median_of_trials(double means[SUITE_TRIALS]) {
  for (int k = 1; k < SUITE_TRIALS; k++)
    for (int j = k; j > 0 && means[j] < means[j - 1]; j--) {
      double x = means[j];
      means[j] = means[j - 1];
      means[j - 1] = x;
    }
  return means[SUITE_TRIALS / 2];
}

double suite_stream_id_ns(cudaStream_t s, long calls) {
  unsigned long long id = 0;
  if (bench_stream_get_id(s, &id) != 0) return -1;
  double means[SUITE_TRIALS];
  long per = calls / SUITE_TRIALS > 0 ? calls / SUITE_TRIALS : 1;
  for (int k = 0; k < SUITE_TRIALS; k++) {
    double t0 = suite_now();
    for (long i = 0; i < per; i++) {
      bench_stream_get_id(s, &id);
      bench_escape(&id);
    }
    means[k] = (suite_now() - t0) / (double)per * 1e9;
  }
  return suite_median_of_trials(means);
}

uint64_t suite_rand(uint64_t *s) { return bench_rand(s); }

void suite_pin(int i) {
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu <= 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)(i % ncpu), &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

const char *suite_size_name(size_t b, char *buf, size_t n) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) snprintf(buf, n, "%zuMiB", b >> 20);
  else if (b >= 1024 && b % 1024 == 0) snprintf(buf, n, "%zuKiB", b >> 10);
  else snprintf(buf, n, "%zuB", b);
  return buf;
}

size_t suite_mixed_size(uint64_t r, size_t min, size_t max) { return bench_mixed_size(r, min, max); }

size_t suite_spread_size(uint64_t r, size_t min, size_t max) { return bench_spread_size(r, min, max); }

size_t suite_size_pick(const suite_opts *o, uint64_t r) {
  return o->mix_spread ? suite_spread_size(r, o->mix_min, o->mix_max) : suite_mixed_size(r, o->mix_min, o->mix_max);
}

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  switch (*end) {
  case 'k':
  case 'K': v *= 1024; break;
  case 'm':
  case 'M': v *= 1024 * 1024; break;
  case 'g':
  case 'G': v *= 1024.0 * 1024 * 1024; break;
  default: break;
  }
  return v < 0 ? 0 : (size_t)v;
}

static void usage(void) {
  fprintf(stderr,
          "usage: magpie_bench [options]\n"
          "  -w LIST            workloads to run, e.g. 1,2,5 (default 1,2,3,4,5,6,7)\n"
          "  --csv FILE         write every figure as CSV (workload,allocator,x,metric,value)\n"
          "  --torch SHIM.so    PyTorch's allocator through bench/torch_shim.cpp (built by run_gpu.sh)\n"
          "  --allocs LIST      allocators to run (magpie,cudaMalloc,cudaMallocAsync,pytorch,noop,bestfit)\n"
          "  --seed N           seed of every random choice (default 1)\n"
          "  --noop-arena SIZE  the no-op reference's arena (default 8g on a GPU, 2g simulated)\n"
          " 1 latency:   --lat-sizes MIN,MAX (256,64m)  --lat-pairs N (200000)\n"
          " 2 scaling:   --threads LIST (1,2,4,8,16)  --seconds S (0.5)  --window N (64)\n"
          "              --mix MIN,MAX (256,64k: sizes of workloads 2 and 4)\n"
          "              --spread (sizes 2^e + U[0, 2^e) for 2^e in MIN..MAX/2, not powers of 2 alone)\n"
          " 3 pipeline:  --pipe THREADS,STREAMS (8,32)  --pipe-seconds S (1)  --pipe-temps N (4)\n"
          "              --pipe-handoff N (every 4 steps)  --pipe-sizes MIN,MAX (4k,1m)  --pipe-rounds N (3)\n"
          " 4 crossfree: --cross-pairs N (4)  --cross-seconds S (1)\n"
          " 5 trace:     --trace THREADS,STREAMS_PER_THREAD,REQUESTS (4,2,400)\n"
          "              --trace-hidden N (4096)  --trace-layers N (8)\n"
          " 6 streams:   --rot-streams LIST (1,32,33,256,4096)  --rot-rounds N (100)  --rot-blocks N (8)  --rot-touch "
          "(a kernel per visit uses its blocks)\n"
          " 7 demo:      --demo THREADS,STREAMS_PER_THREAD,STEPS (8,2,20000)\n");
  exit(2);
}

static int parse_pair(const char *s, size_t *a, size_t *b) {
  const char *c = strchr(s, ',');
  if (c == NULL) return -1;
  *a = parse_size(s);
  *b = parse_size(c + 1);
  return *a > 0 && *b >= *a ? 0 : -1;
}

int main(int argc, char **argv) {
  suite_opts o = {
      .seed = 1,
      .lat_min = 256,
      .lat_max = 64u << 20,
      .lat_pairs = 200000,
      .scale_threads = {1, 2, 4, 8, 16},
      .scale_points = 5,
      .scale_seconds = 0.5,
      .scale_window = 64,
      .mix_min = 256,
      .mix_max = 65536,
      .pipe_threads = 8,
      .pipe_streams = 32,
      .pipe_temps = 4,
      .pipe_handoff_every = 4,
      .pipe_rounds = 3,
      .pipe_seconds = 1.0,
      .pipe_min = 4096,
      .pipe_max = 1u << 20,
      .cross_pairs = 4,
      .cross_seconds = 1.0,
      .trace_threads = 4,
      .trace_streams = 2,
      .trace_requests = 400,
      .trace_hidden = 4096,
      .trace_layers = 8,
      .rot_streams = {1, 32, 33, 256, 4096},
      .rot_points = 5,
      .rot_rounds = 100,
      .rot_blocks = 8,
      .demo_threads = 8,
      .demo_streams = 2,
      .demo_steps = 20000,
  };
  int run[8] = {0, 1, 1, 1, 1, 1, 1, 1};
  const char *csv_path = NULL, *torch = NULL, *allocs = NULL;
  size_t arena = 0;
  enum {
    O_CSV = 256,
    O_TORCH,
    O_ALLOCS,
    O_SEED,
    O_ARENA,
    O_LSIZES,
    O_LPAIRS,
    O_THREADS,
    O_SECONDS,
    O_WINDOW,
    O_MIX,
    O_SPREAD,
    O_PIPE,
    O_PSEC,
    O_PTEMPS,
    O_PHAND,
    O_PSIZES,
    O_PROUNDS,
    O_CPAIRS,
    O_CSEC,
    O_TRACE,
    O_THIDDEN,
    O_TLAYERS,
    O_RSTREAMS,
    O_RROUNDS,
    O_RBLOCKS,
    O_RTOUCH,
    O_DEMO
  };
  static const struct option longs[] = {{"csv", 1, 0, O_CSV},
                                        {"torch", 1, 0, O_TORCH},
                                        {"allocs", 1, 0, O_ALLOCS},
                                        {"seed", 1, 0, O_SEED},
                                        {"noop-arena", 1, 0, O_ARENA},
                                        {"lat-sizes", 1, 0, O_LSIZES},
                                        {"lat-pairs", 1, 0, O_LPAIRS},
                                        {"threads", 1, 0, O_THREADS},
                                        {"seconds", 1, 0, O_SECONDS},
                                        {"window", 1, 0, O_WINDOW},
                                        {"mix", 1, 0, O_MIX},
                                        {"spread", 0, 0, O_SPREAD},
                                        {"pipe", 1, 0, O_PIPE},
                                        {"pipe-seconds", 1, 0, O_PSEC},
                                        {"pipe-temps", 1, 0, O_PTEMPS},
                                        {"pipe-handoff", 1, 0, O_PHAND},
                                        {"pipe-sizes", 1, 0, O_PSIZES},
                                        {"pipe-rounds", 1, 0, O_PROUNDS},
                                        {"cross-pairs", 1, 0, O_CPAIRS},
                                        {"cross-seconds", 1, 0, O_CSEC},
                                        {"trace", 1, 0, O_TRACE},
                                        {"trace-hidden", 1, 0, O_THIDDEN},
                                        {"trace-layers", 1, 0, O_TLAYERS},
                                        {"rot-streams", 1, 0, O_RSTREAMS},
                                        {"rot-rounds", 1, 0, O_RROUNDS},
                                        {"rot-blocks", 1, 0, O_RBLOCKS},
                                        {"rot-touch", 0, 0, O_RTOUCH},
                                        {"demo", 1, 0, O_DEMO},
                                        {"help", 0, 0, 'h'},
                                        {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "w:h", longs, NULL)) != -1) {
    switch (c) {
    case 'w': {
      memset(run, 0, sizeof run);
      for (const char *p = optarg; *p; p++) {
        if (*p >= '1' && *p <= '7') run[*p - '0'] = 1;
        else if (*p != ',') usage();
      }
      break;
    }
    case O_CSV: csv_path = optarg; break;
    case O_TORCH: torch = optarg; break;
    case O_ALLOCS: allocs = optarg; break;
    case O_SEED: o.seed = strtoull(optarg, NULL, 0); break;
    case O_ARENA: arena = parse_size(optarg); break;
    case O_LSIZES:
      if (parse_pair(optarg, &o.lat_min, &o.lat_max)) usage();
      break;
    case O_LPAIRS: o.lat_pairs = atol(optarg); break;
    case O_THREADS: {
      o.scale_points = 0;
      for (char *p = optarg; *p && o.scale_points < 16;) {
        int t = (int)strtol(p, &p, 10);
        if (t < 1 || t > 256) usage();
        o.scale_threads[o.scale_points++] = t;
        if (*p == ',') p++;
        else if (*p) usage();
      }
      break;
    }
    case O_SECONDS: o.scale_seconds = atof(optarg); break;
    case O_WINDOW: o.scale_window = atoi(optarg); break;
    case O_MIX:
      if (parse_pair(optarg, &o.mix_min, &o.mix_max)) usage();
      break;
    case O_SPREAD: o.mix_spread = 1; break;
    case O_PIPE:
      if (sscanf(optarg, "%d,%d", &o.pipe_threads, &o.pipe_streams) != 2) usage();
      break;
    case O_PSEC: o.pipe_seconds = atof(optarg); break;
    case O_PTEMPS: o.pipe_temps = atoi(optarg); break;
    case O_PHAND: o.pipe_handoff_every = atoi(optarg); break;
    case O_PSIZES:
      if (parse_pair(optarg, &o.pipe_min, &o.pipe_max)) usage();
      break;
    case O_PROUNDS: o.pipe_rounds = atoi(optarg); break;
    case O_CPAIRS: o.cross_pairs = atoi(optarg); break;
    case O_CSEC: o.cross_seconds = atof(optarg); break;
    case O_TRACE:
      if (sscanf(optarg, "%d,%d,%d", &o.trace_threads, &o.trace_streams, &o.trace_requests) != 3) usage();
      break;
    case O_THIDDEN: o.trace_hidden = parse_size(optarg); break;
    case O_TLAYERS: o.trace_layers = atoi(optarg); break;
    case O_RSTREAMS: {
      o.rot_points = 0;
      for (char *p = optarg; *p && o.rot_points < 16;) {
        int n = (int)strtol(p, &p, 10);
        if (n < 1 || n > 65536) usage();
        o.rot_streams[o.rot_points++] = n;
        if (*p == ',') p++;
        else if (*p) usage();
      }
      break;
    }
    case O_RROUNDS: o.rot_rounds = atoi(optarg); break;
    case O_RBLOCKS: o.rot_blocks = atoi(optarg); break;
    case O_RTOUCH: o.rot_touch = 1; break;
    case O_DEMO:
      if (sscanf(optarg, "%d,%d,%ld", &o.demo_threads, &o.demo_streams, &o.demo_steps) != 3) usage();
      break;
    default: usage();
    }
  }
  if (optind != argc || o.lat_pairs < 1 || o.scale_seconds <= 0 || o.scale_window < 1 || o.pipe_threads < 1 ||
      o.pipe_streams < o.pipe_threads || o.pipe_temps < 1 || o.pipe_temps > 4 || o.pipe_handoff_every < 1 ||
      o.pipe_rounds < 1 || o.pipe_rounds > 16 || o.pipe_seconds <= 0 || o.cross_pairs < 1 || o.cross_seconds <= 0 ||
      o.trace_threads < 1 || o.trace_streams < 1 || o.trace_requests < 1 || o.trace_hidden < 64 || o.trace_layers < 1 ||
      o.rot_points < 1 || o.rot_rounds < 1 || o.rot_blocks < 1 || o.demo_threads < 1 || o.demo_threads > 256 ||
      o.demo_streams < 1 || o.demo_streams > 16 || o.demo_steps < 1)
    usage();

  if (bench_dev_init() != 0) return 1;
  if (arena == 0) arena = bench_dev_is_cuda() ? (size_t)8 << 30 : (size_t)2 << 30;
  bench_allocs_init(torch, arena);
  bench_alloc *a = bench_allocs();
  for (int i = 0; i < BA_COUNT; i++) {
    int asked = 1;
    if (allocs) {
      size_t n = strlen(a[i].name);
      asked = 0;
      for (const char *p = allocs; (p = strstr(p, a[i].name)) != NULL; p += n)
        if ((p == allocs || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) asked = 1;
    }
    o.use[i] = asked && a[i].available;
  }
  if (csv_path) {
    csv = fopen(csv_path, "w");
    if (csv == NULL) {
      perror(csv_path);
      return 1;
    }
    fprintf(csv, "workload,allocator,x,metric,value\n");
  }

  char host[128] = "?";
  gethostname(host, sizeof host);
  time_t now = time(NULL);
  char date[64];
  strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&now));
  printf("magpie_bench %s: %s, %ld cpus, host %s, %s, seed %llu\n", magpie_version(), bench_dev_name(),
         sysconf(_SC_NPROCESSORS_ONLN), host, date, (unsigned long long)o.seed);
  for (int i = 0; i < BA_COUNT; i++) {
    if (o.use[i]) printf("  %-16s runs\n", a[i].name);
    else printf("  %-16s skipped: %s\n", a[i].name, a[i].available ? "not in --allocs" : a[i].why_not);
  }
  if (o.use[BA_CUDA_MALLOC] || o.use[BA_CUDA_ASYNC]) printf("  runtime: %s\n", bench_cudart_path());
  if (bench_dev_is_cuda() && !bench_have_kernel())
    printf("  no kernel built in (nvcc was missing at build time): workload 3 is skipped\n");

  /* The trace and the demo first: magpie's peak of reserved memory cannot
   * be restarted, so a memory figure is only its workload's own when nothing
   * ran before (run_gpu.sh runs each workload in a process of its own). */
  if (run[5]) workload_trace(&o);
  if (run[7]) workload_demo(&o);
  if (run[1]) workload_latency(&o);
  if (run[2]) workload_scaling(&o);
  if (run[3]) workload_pipeline(&o);
  if (run[4]) workload_crossfree(&o);
  if (run[6]) workload_streams(&o);

  bench_device_sync();
  uint64_t errs = bench_dev_errors();
  printf("failed CUDA calls: %llu;", (unsigned long long)errs);
  for (int i = 0; i < BA_COUNT; i++)
    if (o.use[i]) printf(" %s failed allocations: %llu;", a[i].name, (unsigned long long)bench_alloc_failures(i));
  printf("\n");
  if (csv) fclose(csv);
  return errs ? 1 : 0;
}
