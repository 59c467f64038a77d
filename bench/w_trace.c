/* Workload 5: fragmentation under an inference-like trace.
 *
 * The trace is generated here from --seed, then replayed against each
 * allocator. --trace THREADS,STREAMS,REQUESTS: each thread is a serving
 * worker with STREAMS streams and up to four requests in flight, taking
 * them in turn one step at a time; REQUESTS requests in all. A request has
 * a batch size (1-16), a prompt length (log-uniform, 32-4096 tokens) and a
 * number of generated tokens (16-256), and runs on one of its worker's
 * streams. Per layer (--trace-layers) it holds a KV cache block of
 * batch x tokens x hidden/4 x 2 (K and V) x 2 bytes (fp16, grouped-query
 * attention with a quarter of the heads), allocated for the prompt and 64
 * more tokens and reallocated 64 tokens larger whenever it fills up (copy,
 * then free the old one), freed when the request ends: long-lived blocks of
 * many sizes. Short-lived activations: prefill in chunks of 512 tokens, each
 * chunk a residual stream (chunk x hidden) for the whole chunk and per layer
 * an attention output (chunk x hidden) and an MLP intermediate
 * (chunk x 4 hidden), freed at the layer's end; a decode step is the same
 * with one token per sequence, plus logits (batch x 32000 x 2 bytes).
 * --trace-hidden sets hidden (default 4096: a 7B-class model's width).
 *
 * Reported: peak reserved bytes / peak live bytes, where live bytes are the
 * sum of requested sizes of blocks allocated and not freed (counted by the
 * replay, the same way for every allocator) and reserved bytes are each
 * allocator's own figure: magpie_stats peak_reserved_bytes,
 * cudaMemPoolAttrReservedMemHigh, PyTorch's reserved_bytes peak. cudaMalloc
 * reports no reserved figure and would take minutes (tens of microseconds
 * per call), so it does not replay the trace. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_dev.h"
#include "bench/bench_util.h"
#include "bench/suite.h"

typedef struct op {
  uint32_t id; /* block slot in the thread's table */
  uint8_t is_free;
  uint8_t stream; /* index into the thread's streams */
  uint64_t size;
} op;

typedef struct tthread {
  op *ops;
  size_t n, cap;
  uint32_t ids; /* block slots used */
} tthread;

static int push(tthread *t, uint32_t id, int is_free, int stream, uint64_t size) {
  if (t->n == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 4096;
    op *p = realloc(t->ops, cap * sizeof *p);
    if (p == NULL) return -1;
    t->ops = p;
    t->cap = cap;
  }
  t->ops[t->n++] = (op){id, (uint8_t)is_free, (uint8_t)stream, size};
  return 0;
}

enum { MAX_INFLIGHT = 4, CHUNK = 512, KV_STEP = 64, VOCAB = 32000, MAX_LAYERS = 128 };

typedef struct request {
  int active, stream, batch, prompt, gen, done_prompt, done_gen;
  uint64_t kv_cap; /* tokens the KV blocks hold */
  uint32_t kv[MAX_LAYERS];
} request;

/* Free block slots are reused, so a thread's table stays small. */
typedef struct ids {
  uint32_t *free;
  size_t n, cap;
  uint32_t next;
} ids;

static uint32_t id_get(ids *d) { return d->n ? d->free[--d->n] : d->next++; }

static int id_put(ids *d, uint32_t id) {
  if (d->n == d->cap) {
    size_t cap = d->cap ? 2 * d->cap : 1024;
    uint32_t *p = realloc(d->free, cap * sizeof *p);
    if (p == NULL) return -1;
    d->free = p;
    d->cap = cap;
  }
  d->free[d->n++] = id;
  return 0;
}

typedef struct gen {
  tthread *t;
  ids d;
  int err;
} gen;

static uint32_t g_alloc(gen *g, int stream, uint64_t size) {
  uint32_t id = id_get(&g->d);
  g->err |= push(g->t, id, 0, stream, size);
  return id;
}

static void g_free(gen *g, int stream, uint32_t id) {
  g->err |= push(g->t, id, 1, stream, 0);
  g->err |= id_put(&g->d, id);
}

/* One step of request r: a prefill chunk or one decode token. Returns 1
 * when the request has finished (its KV blocks freed). */
static int step(gen *g, request *r, const suite_opts *o) {
  uint64_t H = o->trace_hidden, L = (uint64_t)o->trace_layers, b = (uint64_t)r->batch;
  uint64_t kv_per_token = b * (H / 4) * 2 * 2;
  uint64_t tokens, seq_after;
  if (r->done_prompt < r->prompt) {
    tokens = (uint64_t)(r->prompt - r->done_prompt < CHUNK ? r->prompt - r->done_prompt : CHUNK);
    seq_after = (uint64_t)r->done_prompt + tokens;
  } else {
    tokens = 1;
    seq_after = (uint64_t)r->prompt + (uint64_t)r->done_gen + 1;
  }
  if (r->kv_cap == 0) { /* first step: KV blocks for the prompt and 64 more */
    r->kv_cap = (uint64_t)r->prompt + KV_STEP;
    for (uint64_t l = 0; l < L; l++) r->kv[l] = g_alloc(g, r->stream, r->kv_cap * kv_per_token);
  }
  uint32_t resid = g_alloc(g, r->stream, b * tokens * H * 2);
  int grow = seq_after > r->kv_cap;
  for (uint64_t l = 0; l < L; l++) {
    if (grow) { /* a larger block, the cache copied in, the old one freed */
      uint32_t n = g_alloc(g, r->stream, (r->kv_cap + KV_STEP) * kv_per_token);
      g_free(g, r->stream, r->kv[l]);
      r->kv[l] = n;
    }
    uint32_t attn = g_alloc(g, r->stream, b * tokens * H * 2);
    uint32_t mlp = g_alloc(g, r->stream, b * tokens * 4 * H * 2);
    g_free(g, r->stream, mlp);
    g_free(g, r->stream, attn);
  }
  if (grow) r->kv_cap += KV_STEP;
  if (r->done_prompt >= r->prompt) {
    uint32_t logits = g_alloc(g, r->stream, b * VOCAB * 2);
    g_free(g, r->stream, logits);
    r->done_gen++;
  } else {
    r->done_prompt += (int)tokens;
  }
  g_free(g, r->stream, resid);
  if (r->done_gen < r->gen) return 0;
  for (uint64_t l = 0; l < L; l++) g_free(g, r->stream, r->kv[l]);
  return 1;
}

static int generate(const suite_opts *o, tthread *t, int thread, int requests) {
  static const int batches[] = {1, 1, 1, 2, 2, 4, 4, 8, 16};
  uint64_t seed = bench_seed_mix(o->seed, 0x9FB21C651E98DF25ull, (uint64_t)thread + 1);
  gen g = {t, {0}, 0};
  request rq[MAX_INFLIGHT] = {{0}};
  int started = 0, live = 0, turn = 0;
  do {
    for (int i = 0; i < MAX_INFLIGHT; i++) {
      if (rq[i].active || started == requests) continue;
      uint64_t r = suite_rand(&seed);
      double u = (double)(r >> 11) / 9007199254740992.0; /* [0, 1) */
      rq[i] = (request){.active = 1,
                        .stream = (started + thread) % o->trace_streams,
                        .batch = batches[(r >> 3) % (sizeof batches / sizeof batches[0])],
                        .prompt = (int)(32.0 * __builtin_exp2(u * 7.0)), /* 32-4096 */
                        .gen = 16 + (int)(suite_rand(&seed) % 241)};
      started++;
      live++;
    }
    request *r = &rq[turn++ % MAX_INFLIGHT];
    if (r->active && step(&g, r, o)) {
      r->active = 0;
      live--;
    }
  } while (live > 0 || started < requests);
  t->ids = g.d.next;
  free(g.d.free);
  return g.err;
}

typedef struct replay {
  const tthread *t;
  bench_alloc *a;
  cudaStream_t *streams;
  int index;
  pthread_barrier_t *start;
  uint64_t failures;
} replay;

static bench_live live;

static void *replay_main(void *arg) {
  replay *r = arg;
  suite_pin(r->index);
  bench_dev_thread_init();
  void **ptr = calloc(r->t->ids, sizeof *ptr);
  uint64_t *size = calloc(r->t->ids, sizeof *size);
  pthread_barrier_wait(r->start);
  if (ptr == NULL || size == NULL) {
    r->failures++;
    goto out;
  }
  for (size_t i = 0; i < r->t->n; i++) {
    const op *o = &r->t->ops[i];
    cudaStream_t s = r->streams[o->stream];
    if (o->is_free) {
      if (ptr[o->id] == NULL) continue;
      r->a->free(ptr[o->id], size[o->id], s);
      bench_live_sub(&live, size[o->id]);
      ptr[o->id] = NULL;
      continue;
    }
    ptr[o->id] = r->a->alloc(o->size, s);
    if (ptr[o->id] == NULL) {
      r->failures++;
      continue;
    }
    size[o->id] = o->size;
    bench_live_add(&live, o->size);
  }
out:
  free(ptr);
  free(size);
  return NULL;
}

void workload_trace(const suite_opts *o) {
  int T = o->trace_threads, S = o->trace_streams;
  if (S > 255 || o->trace_layers > MAX_LAYERS) {
    printf("\n== 5 trace: skipped (at most 255 streams per thread and %d layers)\n", MAX_LAYERS);
    return;
  }
  tthread *t = calloc((size_t)T, sizeof *t);
  cudaStream_t *streams = calloc((size_t)(T * S), sizeof *streams);
  if (t == NULL || streams == NULL) return;
  size_t nops = 0, nallocs = 0;
  uint64_t total = 0, largest = 0;
  for (int i = 0; i < T; i++) {
    int share = o->trace_requests / T + (i < o->trace_requests % T);
    if (generate(o, &t[i], i, share) != 0) {
      printf("\n== 5 trace: out of host memory generating the trace\n");
      return;
    }
    nops += t[i].n;
    for (size_t k = 0; k < t[i].n; k++)
      if (!t[i].ops[k].is_free) {
        nallocs++;
        total += t[i].ops[k].size;
        if (t[i].ops[k].size > largest) largest = t[i].ops[k].size;
      }
  }
  for (int i = 0; i < T * S; i++)
    if ((streams[i] = bench_stream_create()) == NULL) return;
  printf(
      "\n== 5 trace: inference-like fragmentation trace, %d threads x %d streams, %d requests, hidden %zu, "
      "%d layers: %zu operations, %zu allocations of %.1f GiB in all, largest %.1f MiB\n",
      T, S, o->trace_requests, o->trace_hidden, o->trace_layers, nops, nallocs, total / 1073741824.0,
      largest / 1048576.0);
  suite_magpie_peak_note();
  suite_memory_header();
  double mp_ratio = 0;
  for (int w = 0; w < BA_COUNT; w++) {
    if (!o->use[w]) continue;
    bench_alloc *a = &bench_allocs()[w];
    if (w == BA_CUDA_MALLOC) {
      printf("%-16s (not replayed: no reserved-memory figure, tens of microseconds per call)\n", a->name);
      continue;
    }
    a->reset();
    bench_live_reset(&live);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)T + 1);
    replay *r = calloc((size_t)T, sizeof *r);
    pthread_t *th = calloc((size_t)T, sizeof *th);
    for (int i = 0; i < T; i++) {
      r[i] = (replay){&t[i], a, &streams[i * S], i, &start, 0};
      pthread_create(&th[i], NULL, replay_main, &r[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = suite_now();
    uint64_t failures = 0;
    for (int i = 0; i < T; i++) {
      pthread_join(th[i], NULL);
      failures += r[i].failures;
    }
    double el = suite_now() - t0;
    bench_device_sync();
    double ratio = suite_memory_row("trace", a->name, atomic_load(&live.peak), a->peak_reserved(), nops / el, failures);
    if (w == BA_MAGPIE) mp_ratio = ratio;
    if (w == BA_MAGPIE) suite_magpie_stats("trace", "after the trace");
    free(r);
    free(th);
    pthread_barrier_destroy(&start);
  }
  if (o->use[BA_MAGPIE] && mp_ratio > 0) {
    char d[64];
    snprintf(d, sizeof d, "peak reserved / peak live = %.3f", mp_ratio);
    suite_target("trace", "magpie peak reserved <= 1.15x peak live", mp_ratio <= 1.15, d);
  }
  for (int i = 0; i < T * S; i++) bench_stream_destroy(streams[i]);
  for (int i = 0; i < T; i++) free(t[i].ops);
  free(t);
  free(streams);
}
