/* GPU soak: many allocator operations over 16 threads and 64 streams with
 * real kernels stamping and verifying every block, cross-stream hand-offs
 * and stream churn; zero corruptions; memory back to the expected level.
 *
 * Each thread owns 4 streams and works in batches, rotating over its
 * streams. A batch on stream s:
 *   1. waits (cuStreamWaitEvent) for the event of the previous batch, whose
 *      hand-off blocks it inherits;
 *   2. allocates BATCH blocks on s (mixed sizes, 256 B to 64 KiB, and every
 *      64th block a large one of 1-4 MiB);
 *   3. one kernel stamps a unique tag over each new block's probe words
 *      (up to 64, spread over the block); a second checks the tags of the
 *      new and the inherited blocks;
 *   4. frees every block on s, except one in 16 new blocks, which is handed
 *      to the next batch (another stream) through an event.
 * A block handed to a stream while an earlier use is pending shows up as a
 * wrong tag: the early stream's stamp lands before the late stream's check
 * or the other way round. Pointer, tag and size arrays live in host-mapped
 * pinned memory, in a ring of buffers per thread reused once their batch's
 * event completed. Every 64 batches the thread destroys the stream it just
 * used (its work still pending) and creates a new one.
 *
 * At the end: every check counted zero wrong words; nothing is in use; and
 * the device's used memory grew by exactly what magpie reports reserved
 * (within the allowance below), i.e. no device memory escaped accounting.
 *
 * MAGPIE_SOAK_OPS (default 1e9) is the number of allocator operations
 * (allocations + frees) over all threads.
 *
 * MAGPIE_SOAK_DEVICES=2 (a machine with two GPUs) spreads it over both:
 * each thread's streams alternate between the devices (peer access
 * enabled both ways), so every hand-off crosses devices. The batch that
 * inherits blocks from the other device copies each into a new block of
 * its own device (cuMemcpyAsync on its stream, after the event wait: a
 * copy engine), frees the inherited block on its own stream (a free on
 * another device's stream) and checks the copy; the memory check holds
 * per device. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "magpie.h"
#include "tests/gpu/gpu_util.h"

enum { THREADS = 16, STREAMS = 4, BATCH = 1024, HANDOFF_EVERY = 16, RING = 8, CHURN_EVERY = 64 };
enum { MAXN = BATCH + BATCH / HANDOFF_EVERY + 1 };

static gpu_env envs[2];
static int ndev = 1;
static uint64_t target_ops;
static _Atomic uint64_t total_ops;
static _Atomic long errors;
static _Atomic uint64_t batches_done, handoffs_done, streams_churned, large_blocks, copies_done;
static atomic_flag first_error_taken = ATOMIC_FLAG_INIT;
static char first_error[256];

__attribute__((format(printf, 1, 2))) static void note_error(const char *fmt, ...) {
  atomic_fetch_add_explicit(&errors, 1, memory_order_relaxed);
  if (atomic_flag_test_and_set(&first_error_taken)) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(first_error, sizeof first_error, fmt, ap);
  va_end(ap);
}

#define S_TRY(call)                               \
  do {                                            \
    CUresult s_rc = (call);                       \
    if (s_rc != CUDA_SUCCESS) {                   \
      note_error("%s: %s", #call, gpu_err(s_rc)); \
      return -1;                                  \
    }                                             \
  } while (0)

/* One batch's arrays (host-mapped pinned memory) and its completion event. */
typedef struct ring_buf {
  uint64_t *ptrs, *tags, *words; /* host views */
  CUdeviceptr dptrs, dtags, dwords;
  CUevent done;
  int used;
} ring_buf;

typedef struct worker {
  int id;
  CUstream s[STREAMS]; /* s[i] on device dev_of(w, i) */
  ring_buf ring[RING];
  unsigned *bad; /* host view of the thread's wrong-word counter */
  CUdeviceptr dbad;
  /* Blocks handed to the next batch, and the event they wait for. */
  uint64_t inh_p[BATCH], inh_tag[BATCH], inh_words[BATCH];
  unsigned ninh;
  int inh_dev;        /* the device of the batch that handed them */
  CUevent handoff[2]; /* per device: recorded on that device's stream */
  uint64_t copied;    /* inherited blocks copied across devices */
  uint64_t rng;
} worker;

/* The device of stream i of w: alternating with two devices, so that
 * consecutive batches (and so every hand-off) change device. */
static int dev_of(const worker *w, int i) { return (w->id + i) % ndev; }

static size_t soak_size(worker *w, unsigned i) {
  w->rng ^= w->rng << 13;
  w->rng ^= w->rng >> 7;
  w->rng ^= w->rng << 17;
  if (i % 64 == 63) return ((size_t)1 << 20) + (size_t)(w->rng % 3) * ((size_t)1 << 20) + 4096;
  static const size_t base[] = {256, 512, 768, 1024, 4096, 8192, 20480, 65536};
  return base[w->rng % 8] - (size_t)((w->rng >> 8) % 32) * 8;
}

static int ring_alloc(ring_buf *r) {
  size_t bytes = 3 * MAXN * sizeof(uint64_t);
  void *h;
  S_TRY(cudrv.mem_host_alloc(&h, bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  CUdeviceptr d;
  S_TRY(cudrv.mem_host_get_device_pointer(&d, h, 0));
  r->ptrs = h;
  r->tags = r->ptrs + MAXN;
  r->words = r->tags + MAXN;
  r->dptrs = d;
  r->dtags = d + MAXN * sizeof(uint64_t);
  r->dwords = d + 2 * MAXN * sizeof(uint64_t);
  S_TRY(cudrv.event_create(&r->done, CU_EVENT_DISABLE_TIMING));
  r->used = 0;
  return 0;
}

/* Inherited blocks of another device: each copied into a new block of
 * this batch's device on s (after the wait), the original freed on s. */
static int adopt(worker *w, CUstream s, int si) {
  for (unsigned i = 0; i < w->ninh; i++) {
    size_t bytes = w->inh_words[i] * 8;
    void *p = magpie_malloc_async(bytes, s);
    if (p == NULL) {
      note_error("magpie_malloc_async(%zu) for a copy on stream %d: %s", bytes, si, magpie_last_error_message());
      return -1;
    }
    S_TRY(cudrv.memcpy_async((CUdeviceptr)(uintptr_t)p, (CUdeviceptr)w->inh_p[i], bytes, s));
    if (magpie_free_async((void *)(uintptr_t)w->inh_p[i], s) != MAGPIE_OK) {
      note_error("magpie_free_async of another device's block on stream %d: %s", si, magpie_last_error_message());
      return -1;
    }
    w->inh_p[i] = (uint64_t)(uintptr_t)p;
  }
  w->copied += w->ninh;
  atomic_fetch_add_explicit(&total_ops, 2 * (uint64_t)w->ninh, memory_order_relaxed);
  return 0;
}

static int batch(worker *w, uint64_t k) {
  int si = (int)(k % STREAMS), d = dev_of(w, si);
  CUstream s = w->s[si];
  const gpu_env *env = &envs[d];
  S_TRY(gpu_env_bind(env));
  ring_buf *r = &w->ring[k % RING];
  if (r->used) S_TRY(cudrv.event_synchronize(r->done)); /* its kernels read these arrays */
  r->used = 1;
  /* 1. Inherited blocks: ordered after the previous batch's stream; from
   * the other device, copied onto this one. */
  unsigned ninh = w->ninh;
  if (ninh) S_TRY(cudrv.stream_wait_event(s, w->handoff[w->inh_dev], 0));
  if (ninh && w->inh_dev != d && adopt(w, s, si) != 0) return -1;
  /* 2. New blocks. */
  unsigned n = 0;
  uint64_t ops = 0;
  for (unsigned i = 0; i < BATCH; i++) {
    size_t size = soak_size(w, i);
    void *p = magpie_malloc_async(size, s);
    ops++;
    if (p == NULL) {
      note_error("magpie_malloc_async(%zu) on stream %d: %s", size, si, magpie_last_error_message());
      return -1;
    }
    if (size > ((size_t)1 << 20)) atomic_fetch_add_explicit(&large_blocks, 1, memory_order_relaxed);
    r->ptrs[n] = (uint64_t)(uintptr_t)p;
    r->tags[n] = ((uint64_t)w->id << 56) ^ (k << 20) ^ i ^ 0x5A5A000000000000ull;
    r->words[n] = size / 8;
    n++;
  }
  for (unsigned i = 0; i < ninh; i++) {
    r->ptrs[n + i] = w->inh_p[i];
    r->tags[n + i] = w->inh_tag[i];
    r->words[n + i] = w->inh_words[i];
  }
  /* 3. Stamp the new blocks, check new and inherited. */
  S_TRY(gpu_batch_stamp(env, s, r->dptrs, r->dtags, r->dwords, n));
  S_TRY(gpu_batch_check(env, s, r->dptrs, r->dtags, r->dwords, n + ninh, w->dbad));
  S_TRY(cudrv.event_record(r->done, s));
  /* 4. Free on s (the stream of the last use); hand some to the next batch. */
  unsigned nh = 0;
  for (unsigned i = 0; i < n + ninh; i++) {
    if (i < n && i % HANDOFF_EVERY == 7) {
      w->inh_p[nh] = r->ptrs[i];
      w->inh_tag[nh] = r->tags[i];
      w->inh_words[nh] = r->words[i];
      nh++;
      continue;
    }
    ops++;
    if (magpie_free_async((void *)(uintptr_t)r->ptrs[i], s) != MAGPIE_OK) {
      note_error("magpie_free_async on stream %d: %s", si, magpie_last_error_message());
      return -1;
    }
  }
  w->ninh = nh;
  w->inh_dev = d;
  if (nh) {
    S_TRY(cudrv.event_record(w->handoff[d], s));
    atomic_fetch_add_explicit(&handoffs_done, nh, memory_order_relaxed);
  }
  /* Stream churn: destroy the stream with its work pending; the new one
   * usually gets the same handle value. */
  if (k % CHURN_EVERY == CHURN_EVERY - 1) { /* d's context is current */
    S_TRY(cudrv.stream_destroy(w->s[si]));
    S_TRY(cudrv.stream_create(&w->s[si], CU_STREAM_NON_BLOCKING));
    atomic_fetch_add_explicit(&streams_churned, 1, memory_order_relaxed);
  }
  atomic_fetch_add_explicit(&total_ops, ops, memory_order_relaxed);
  atomic_fetch_add_explicit(&batches_done, 1, memory_order_relaxed);
  return 0;
}

static int worker_run(worker *w) {
  for (int i = 0; i < STREAMS; i++) {
    S_TRY(gpu_env_bind(&envs[dev_of(w, i)]));
    S_TRY(cudrv.stream_create(&w->s[i], CU_STREAM_NON_BLOCKING));
  }
  /* Ring buffer j serves the batches of stream j % STREAMS (RING is a
   * multiple of STREAMS): its event is made on that stream's device. */
  for (int i = 0; i < RING; i++) {
    S_TRY(gpu_env_bind(&envs[dev_of(w, i % STREAMS)]));
    if (ring_alloc(&w->ring[i]) != 0) return -1;
  }
  void *h;
  S_TRY(cudrv.mem_host_alloc(&h, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  w->bad = h;
  *w->bad = 0;
  S_TRY(cudrv.mem_host_get_device_pointer(&w->dbad, h, 0));
  for (int d = 0; d < ndev; d++) {
    S_TRY(gpu_env_bind(&envs[d]));
    S_TRY(cudrv.event_create(&w->handoff[d], CU_EVENT_DISABLE_TIMING));
  }
  w->rng = 0x9E3779B97F4A7C15ull * (uint64_t)(w->id + 1);
  uint64_t k = 0;
  while (atomic_load_explicit(&total_ops, memory_order_relaxed) < target_ops && atomic_load(&errors) == 0) {
    if (batch(w, k++) != 0) return -1;
  }
  /* The last hand-off: its blocks are freed on a stream ordered after it. */
  if (w->ninh) {
    CUstream s = w->s[k % STREAMS];
    S_TRY(cudrv.stream_wait_event(s, w->handoff[w->inh_dev], 0));
    for (unsigned i = 0; i < w->ninh; i++)
      if (magpie_free_async((void *)(uintptr_t)w->inh_p[i], s) != MAGPIE_OK) {
        note_error("final free: %s", magpie_last_error_message());
        return -1;
      }
    w->ninh = 0;
  }
  for (int i = 0; i < STREAMS; i++) S_TRY(cudrv.stream_synchronize(w->s[i]));
  atomic_fetch_add_explicit(&copies_done, w->copied, memory_order_relaxed);
  if (*(volatile unsigned *)w->bad != 0) note_error("thread %d: %u wrong words", w->id, *w->bad);
  for (int i = 0; i < STREAMS; i++) S_TRY(cudrv.stream_destroy(w->s[i]));
  for (int i = 0; i < RING; i++) {
    S_TRY(cudrv.event_destroy(w->ring[i].done));
    S_TRY(cudrv.mem_free_host(w->ring[i].ptrs));
  }
  for (int d = 0; d < ndev; d++) S_TRY(cudrv.event_destroy(w->handoff[d]));
  return 0;
}

static worker workers[THREADS];

static void *worker_main(void *arg) {
  worker *w = arg;
  if (worker_run(w) != 0 && atomic_load(&errors) == 0) note_error("thread %d failed", w->id);
  return NULL;
}

/* Free bytes of device d (its context made current). */
static size_t device_free(int d) {
  size_t f = 0, t = 0;
  GPU_CHECK(gpu_env_bind(&envs[d]));
  GPU_CHECK(cudrv.mem_get_info(&f, &t));
  return f;
}

static void test_soak(void **state) {
  (void)state;
  size_t free0[2];
  for (int d = 0; d < ndev; d++) free0[d] = device_free(d);
  uint64_t t0 = gpu_now_ns();
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) {
    workers[i].id = i;
    assert_int_equal(pthread_create(&t[i], NULL, worker_main, &workers[i]), 0);
  }
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  double secs = (double)(gpu_now_ns() - t0) / 1e9;
  unsigned long bad = 0;
  for (int i = 0; i < THREADS; i++)
    if (workers[i].bad) bad += *workers[i].bad;
  print_message(
      "soak: %llu allocator operations in %.1f s (%.1f M/s), %d threads, %d streams on %d device%s, %llu batches, "
      "%llu hand-offs (%llu copied to the other device), %llu streams re-created, %llu large blocks\n",
      (unsigned long long)atomic_load(&total_ops), secs, (double)atomic_load(&total_ops) / secs / 1e6, THREADS,
      THREADS * STREAMS, ndev, ndev > 1 ? "s" : "", (unsigned long long)atomic_load(&batches_done),
      (unsigned long long)atomic_load(&handoffs_done), (unsigned long long)atomic_load(&copies_done),
      (unsigned long long)atomic_load(&streams_churned), (unsigned long long)atomic_load(&large_blocks));
  if (atomic_load(&errors)) print_error("first error: %s\n", first_error);
  assert_int_equal(atomic_load(&errors), 0);
  assert_int_equal(bad, 0);
  assert_true(atomic_load(&total_ops) >= target_ops);
  for (int d = 0; d < ndev; d++) {
    magpie_stats st;
    assert_int_equal(magpie_stats_get(d, &st), MAGPIE_OK);
    GPU_CHECK(gpu_env_bind(&envs[d]));
    GPU_CHECK(cudrv.ctx_synchronize());
    long long grew = (long long)free0[d] - (long long)device_free(d);
    print_message(
        "soak: device %d: wrong words %lu; in use %zu; reserved %zu (peak %zu); device memory used grew by %lld; "
        "events %llu, cross-stream migrations %llu, limbo %llu\n",
        d, bad, st.in_use_bytes, st.reserved_bytes, st.peak_reserved_bytes, grew,
        (unsigned long long)st.events_recorded, (unsigned long long)st.cross_stream_migrations,
        (unsigned long long)st.limbo_magazines);
    assert_int_equal(st.in_use_bytes, 0);
    /* Every byte the device lost is magpie's reserve (the allowance covers
     * the driver's own allocations for streams, events and peer mappings,
     * a few MiB). */
    long long diff = grew - (long long)st.reserved_bytes;
    assert_true(diff >= -((long long)64 << 20) && diff <= ((long long)64 << 20));
  }
  if (ndev > 1) assert_true(atomic_load(&copies_done) > 0);
}

int main(void) {
  const char *v = getenv("MAGPIE_SOAK_OPS");
  target_ops = v ? strtoull(v, NULL, 10) : 1000000000ull;
  if (target_ops == 0) target_ops = 1000000000ull;
  if (gpu_env_init(&envs[0]) != 0) return 1;
  v = getenv("MAGPIE_SOAK_DEVICES");
  int n = 0;
  if (v != NULL && atoi(v) == 2) {
    if (cudrv.device_get_count(&n) != CUDA_SUCCESS || n < 2 || gpu_env_init_device(&envs[1], 1) != 0) {
      fprintf(stderr, "gpu_soak_test: MAGPIE_SOAK_DEVICES=2 needs two GPUs (%d found)\n", n);
      return 1;
    }
    ndev = 2;
  }
  if (magpie_active_backend() != MAGPIE_BACKEND_CUDA) {
    fprintf(stderr, "gpu_soak_test: magpie is not on the CUDA backend: %s\n", magpie_last_error_message());
    return 1;
  }
  for (int d = 0; d < ndev && ndev > 1; d++)
    if (magpie_device_enable_peer_access(d, 1 - d) != MAGPIE_OK) {
      fprintf(stderr, "gpu_soak_test: %s\n", magpie_last_error_message());
      return 1;
    }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_soak)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
