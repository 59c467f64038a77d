/* The comparative benchmark suite: options, result rows, workloads.
 *
 * Each workload runs every available allocator (bench/allocators.h) in this
 * one process, prints a table and the target for magpie, and writes
 * its figures as CSV rows: workload,allocator,x,metric,value. */
#ifndef MAGPIE_BENCH_SUITE_H
#define MAGPIE_BENCH_SUITE_H

#include <stddef.h>
#include <stdint.h>

#include "bench/allocators.h"

typedef struct suite_opts {
  uint64_t seed;
  int use[BA_COUNT]; /* allocators asked for (and available) */
  /* 1: latency */
  size_t lat_min, lat_max; /* sizes: powers of 4 from min to max */
  long lat_pairs;          /* timed pairs per size for magpie and noop */
  /* 2: scaling */
  int scale_threads[16], scale_points;
  double scale_seconds;
  int scale_window;
  size_t mix_min, mix_max; /* mixed sizes, powers of 2 */
  int mix_spread;          /* 1: 2^e + U[0, 2^e) rather than 2^e */
  /* 3: pipeline */
  int pipe_threads, pipe_streams, pipe_temps, pipe_handoff_every, pipe_rounds;
  double pipe_seconds;
  size_t pipe_min, pipe_max;
  /* 4: cross-thread frees */
  int cross_pairs;
  double cross_seconds;
  /* 5: trace */
  int trace_threads, trace_streams, trace_requests;
  size_t trace_hidden; /* model width: scales every block of the trace */
  int trace_layers;
  /* 6: many streams, one thread */
  int rot_streams[16], rot_points;
  int rot_rounds, rot_blocks;
  int rot_touch; /* workload 6: a kernel per visit touches its blocks before they are freed */
  /* 7: the demo's workload */
  int demo_threads, demo_streams;
  long demo_steps;
} suite_opts;

/* One CSV row (no-op without --csv). */
void suite_row(const char *workload, const char *alloc, const char *x, const char *metric, double value);
/* A target line: "target ...: met|MISSED (detail)", also a CSV row. */
void suite_target(const char *workload, const char *what, int met, const char *detail);

/* Memory workloads (5, 7): the table's header, then one allocator's row
 * and its CSV rows (reserved 0: the allocator gave no figure). Returns
 * reserved / peak live, or 0. */
void suite_memory_header(void);
double suite_memory_row(const char *workload, const char *alloc, uint64_t peak_live, uint64_t reserved,
                        double ops_per_s, uint64_t failures);

double suite_now(void);
uint64_t suite_rand(uint64_t *s); /* xorshift64* */
/* Pins the calling thread to CPU i modulo the CPUs present. */
void suite_pin(int i);
const char *suite_size_name(size_t bytes, char *buf, size_t n);
/* Mixed sizes: a power of two from min to max, uniformly over exponents. */
size_t suite_mixed_size(uint64_t r, size_t min, size_t max);
/* 2^e + U[0, 2^e), 2^e a power of 2 from min to below max, from r. */
size_t suite_spread_size(uint64_t r, size_t min, size_t max);
/* A mixed size as the options ask (--mix, --spread). */
size_t suite_size_pick(const suite_opts *o, uint64_t r);

/* Timed means come from SUITE_TRIALS untimed trials; the median is
 * reported, so that one disturbed trial does not move it (sorts means in
 * place). */
enum { SUITE_TRIALS = 5 };
double suite_median_of_trials(double means[SUITE_TRIALS]);

/* The one driver call magpie makes per allocation (cuStreamGetId on s),
 * alone: ns per call, the median of SUITE_TRIALS trials sharing calls, in
 * the calling thread. It shows how much of magpie's time is the driver's
 * and the CPU's state at the time (on a shared host it moves by half).
 * Negative without CUDA. */
double suite_stream_id_ns(cudaStream_t s, long calls);

/* magpie's statistics as one line (and CSV rows): where its reserved
 * memory sits, for reading a figure, not a measurement of its own. */
void suite_magpie_stats(const char *workload, const char *when);
/* Called at the start of each workload: says when magpie's peak of reserved
 * memory already holds an earlier workload's (it cannot be restarted). */
void suite_magpie_peak_note(void);

void workload_latency(const suite_opts *o);
void workload_scaling(const suite_opts *o);
void workload_pipeline(const suite_opts *o);
void workload_crossfree(const suite_opts *o);
void workload_streams(const suite_opts *o);
void workload_trace(const suite_opts *o);
void workload_demo(const suite_opts *o);

#endif
