/* Timing helpers shared by the benchmarks. */
#ifndef MAGPIE_BENCH_UTIL_H
#define MAGPIE_BENCH_UTIL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static inline double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Keep the compiler from eliding an allocation whose result is unused. */
static inline void bench_escape(void *p) { __asm__ volatile("" : : "g"(p) : "memory"); }

static int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static inline double bench_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Arithmetic that wraps on purpose (hashes, the generator below): the
 * sanitizer build checks unsigned overflow. */
#if defined(__clang__)
#define BENCH_WRAPS __attribute__((no_sanitize("unsigned-integer-overflow")))
#else
#define BENCH_WRAPS
#endif

/* xorshift64*: cheap, thread-local randomness. */
BENCH_WRAPS static inline uint64_t bench_rand(uint64_t *s) {
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 0x2545F4914F6CDD1Dull;
}

/* seed * mult + add, wrapping: a workload's generator seed from the run's
 * seed, a per-thread or per-point multiplier and an index. */
BENCH_WRAPS static inline uint64_t bench_seed_mix(uint64_t seed, uint64_t mult, uint64_t add) {
  return seed * mult + add;
}

/* Thread index's generator seed for a run's seed (workload 2 and
 * peak_probe, which replays its thread 0). */
static inline uint64_t bench_thread_seed(uint64_t seed, int index) {
  return bench_seed_mix(seed, 0x9E3779B97F4A7C15ull, (uint64_t)index + 1);
}

/* A power of 2 from min to max (min * 2^k <= max), picked by r. */
static inline size_t bench_mixed_size(uint64_t r, size_t min, size_t max) {
  int span = 0;
  while ((min << (span + 1)) <= max) span++;
  return min << (r % (uint64_t)(span + 1));
}

/* 2^e + U[0, 2^e) for 2^e from min to max / 2, picked by r. */
static inline size_t bench_spread_size(uint64_t r, size_t min, size_t max) {
  size_t base = bench_mixed_size(r & 0xffffffffu, min, max / 2);
  return base + (size_t)((r >> 32) % base);
}

/* Bytes live across a workload's threads and their peak (workloads 5 and
 * 7). Relaxed: the peak is read after the threads are joined. */
typedef struct bench_live {
  atomic_ullong now, peak;
} bench_live;

static inline void bench_live_add(bench_live *l, uint64_t bytes) {
  unsigned long long now = atomic_fetch_add_explicit(&l->now, bytes, memory_order_relaxed) + bytes;
  unsigned long long peak = atomic_load_explicit(&l->peak, memory_order_relaxed);
  while (now > peak &&
         !atomic_compare_exchange_weak_explicit(&l->peak, &peak, now, memory_order_relaxed, memory_order_relaxed)) {
  }
}

static inline void bench_live_sub(bench_live *l, uint64_t bytes) {
  atomic_fetch_sub_explicit(&l->now, bytes, memory_order_relaxed);
}

static inline void bench_live_reset(bench_live *l) {
  atomic_store(&l->now, 0);
  atomic_store(&l->peak, 0);
}

#endif
