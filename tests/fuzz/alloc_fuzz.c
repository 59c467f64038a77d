/* libFuzzer target: bytes become a sequence of allocator operations on the
 * simulated device, with the stream-order checker on; invariants are checked
 * after every step, and any breach aborts (a crash for libFuzzer).
 *
 * Operations (one opcode byte, then arguments):
 *   alloc size-class/size on stream k; free block i on its stream; hand
 *   block i to stream j (j waits for its stream, as an application does with
 *   an event); enqueue a use of block i; free block i from a new thread;
 *   destroy stream k (its blocks are handed to another stream first) and
 *   create a new one (usually getting the same handle); synchronize a
 *   stream; trim (when the library has magpie_trim); a captured step on
 *   stream k (a CUDA graph of the simulated device, announced with
 *   magpie_capture_begin into the input's graph pool): allocations, uses
 *   and frees inside the capture, the blocks still held kept as graph
 *   outputs, then one replay on stream j.
 * After every operation: magpie's in-use bytes equal the usable sizes of the
 * blocks the input holds plus what the graph pool holds; in use + cached =
 * reserved; reserved equals the device memory in use; no stream-order
 * violation; no call the simulator forbids during a capture. At the end of
 * each input everything is freed and the pool released, and nothing may
 * stay in use.
 *
 * Build and run (also done by tools/test.sh for 60 s):
 *   bazel build --config=fuzz //tests/fuzz:alloc_fuzz
 *   mkdir -p /tmp/corpus && bazel-bin/tests/fuzz/alloc_fuzz -max_total_time=60 /tmp/corpus tests/fuzz/corpus
 * Without libFuzzer, //tests/fuzz:alloc_fuzz_replay_test runs every seed of
 * the corpus through the same function (plain, tsan and asan builds). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "magpie.h"
#include "magpie_sim.h"

/* magpie_trim comes with the memory-pressure work; call it once it exists. */
#pragma weak magpie_trim

#define NSTREAMS 6
#define MAXLIVE 64

typedef struct blk {
  uint64_t *p;
  size_t size;
  int stream;
  int pooled; /* a block of the graph pool (counted in its bytes) */
} blk;

static cudaStream_t streams[NSTREAMS];
static blk live[MAXLIVE];
static int nlive;
static uint64_t pool; /* the input's graph pool, 0 before its first capture */

static void fuzz_fail(const char *what) {
  char msg[512];
  magpie_sim_check_message(msg, sizeof msg);
  fprintf(stderr, "alloc_fuzz: invariant broken: %s\n  last error: %s\n  simulator: %s\n  checker: %s\n", what,
          magpie_last_error_message(), magpie_sim_last_error_message(), msg);
  abort();
}

static void fuzz_setup(void) {
  static int done;
  if (done) return;
  done = 1;
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  cfg.check_streams = 1;
  cfg.magazine_bytes = 16384; /* small magazines: seals and depot traffic */
  if (magpie_init(&cfg) != MAGPIE_OK) fuzz_fail("magpie_init");
  for (int i = 0; i < NSTREAMS; i++)
    if ((streams[i] = magpie_sim_stream_create()) == NULL) fuzz_fail("stream create");
}

typedef struct use_arg {
  uint64_t *p;
  size_t words;
  uint64_t tag;
} use_arg;

/* Device work on a block: stamp its ends, read them back. */
static void use_block(void *a) {
  use_arg *u = a;
  u->p[0] = u->tag;
  u->p[u->words - 1] = u->tag;
  if (u->p[0] != u->tag || u->p[u->words - 1] != u->tag) fuzz_fail("a block's stamp changed under its own use");
  free(u);
}

static void enqueue_use(blk *b, uint64_t tag) {
  use_arg *u = malloc(sizeof *u);
  if (u == NULL) return;
  *u = (use_arg){b->p, b->size / 8, tag};
  if (magpie_sim_launch(streams[b->stream], use_block, u) != MAGPIE_OK) fuzz_fail("launch");
}

static void check_invariants(void) {
  magpie_stats st;
  size_t dev_free, dev_total;
  if (magpie_stats_get(0, &st) != MAGPIE_OK) fuzz_fail("magpie_stats_get");
  if (magpie_sim_mem_info(0, &dev_free, &dev_total) != MAGPIE_OK) fuzz_fail("mem_info");
  size_t want = st.graph_pool_bytes;
  for (int i = 0; i < nlive; i++)
    if (!live[i].pooled) want += magpie_usable_size(live[i].p);
  if (magpie_sim_capture_violations() != 0) fuzz_fail("a call the simulator forbids during a capture");
  if (st.in_use_bytes != want) fuzz_fail("in_use_bytes differs from the blocks held");
  if (st.in_use_bytes + st.cached_bytes != st.reserved_bytes) fuzz_fail("in use + cached != reserved");
  if (st.reserved_bytes != dev_total - dev_free) fuzz_fail("reserved differs from device memory in use");
  if (st.peak_reserved_bytes < st.reserved_bytes || st.peak_in_use_bytes < st.in_use_bytes) fuzz_fail("peaks");
  if (magpie_sim_check_violations() != 0) fuzz_fail("stream-order violation");
}

static void order(int j, int i);
static size_t pick_size(uint8_t a, uint8_t b);

/* Device work a graph replays: the same stamp and check as use_block, on
 * an argument that lives as long as the input's replays (use_block frees
 * its own; a graph's closure runs once per replay). */
#define CAPTURE_USES 64
static use_arg capture_uses[CAPTURE_USES];
static int ncapture_uses;

static void use_block_replayed(void *a) {
  use_arg *u = a;
  u->p[0] = u->tag;
  u->p[u->words - 1] = u->tag;
  if (u->p[0] != u->tag || u->p[u->words - 1] != u->tag) fuzz_fail("a graph block's stamp changed under a replay");
}

/* A captured step on stream k (see the top), replayed once on stream j. */
static void captured_step(int k, int j, const uint8_t *ops, int nops, uint64_t *tag) {
  cudaStream_t s = streams[k];
  if (pool == 0 && magpie_graph_pool_create(0, &pool) != MAGPIE_OK) fuzz_fail("graph pool create");
  if (magpie_capture_begin(pool, s) != MAGPIE_OK) fuzz_fail("magpie_capture_begin");
  if (magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL) != MAGPIE_OK) fuzz_fail("begin capture");
  blk tmp[8];
  int ntmp = 0;
  for (int o = 0; o + 1 < nops; o += 2) {
    uint8_t a = ops[o], b = ops[o + 1];
    if ((a & 1) && ntmp > 0) { /* free a temporary inside the capture */
      int i = b % ntmp;
      if (magpie_free_async(tmp[i].p, s) != MAGPIE_OK) fuzz_fail("free inside a capture");
      tmp[i] = tmp[--ntmp];
    } else if (ntmp < 8 && ncapture_uses < CAPTURE_USES) {
      size_t size = pick_size(a >> 1, b);
      uint64_t *p = magpie_malloc_async(size, s);
      if (p == NULL) fuzz_fail("allocation inside a capture");
      tmp[ntmp] = (blk){p, magpie_usable_size(p), k, 1};
      if (tmp[ntmp].size < size || tmp[ntmp].size < 8) fuzz_fail("a graph block smaller than requested");
      use_arg *u = &capture_uses[ncapture_uses++];
      *u = (use_arg){p, tmp[ntmp].size / 8, (*tag)++};
      if (magpie_sim_launch(s, use_block_replayed, u) != MAGPIE_OK) fuzz_fail("launch inside a capture");
      ntmp++;
    }
  }
  magpie_sim_graph g = NULL;
  if (magpie_sim_stream_end_capture(s, &g) != MAGPIE_OK) fuzz_fail("the capture was invalidated");
  if (magpie_capture_end(pool, s) != MAGPIE_OK) fuzz_fail("magpie_capture_end");
  /* What the capture did not free is its output: held, or freed now. */
  for (int i = 0; i < ntmp; i++) {
    if (nlive < MAXLIVE) live[nlive++] = tmp[i];
    else if (magpie_free_async(tmp[i].p, s) != MAGPIE_OK) fuzz_fail("free of a graph's output");
  }
  order(j, k);
  if (magpie_sim_graph_launch(g, streams[j]) != MAGPIE_OK) fuzz_fail("graph launch");
  if (magpie_sim_graph_destroy(g) != MAGPIE_OK) fuzz_fail("graph destroy");
  /* The replay's arguments are reused by the next capture: let it finish,
   * and order the outputs' holders after it. */
  if (magpie_sim_stream_synchronize(streams[j]) != MAGPIE_OK) fuzz_fail("synchronize after a replay");
  ncapture_uses = 0;
}

static void free_block(int i) {
  if (magpie_free_async(live[i].p, streams[live[i].stream]) != MAGPIE_OK) fuzz_fail("free");
  live[i] = live[--nlive];
}

static void *free_thread(void *arg) {
  blk *b = arg;
  return (void *)(intptr_t)magpie_free_async(b->p, streams[b->stream]);
}

/* j waits for all work enqueued on i so far. */
static void order(int j, int i) {
  if (i != j && magpie_sim_stream_wait(streams[j], streams[i]) != MAGPIE_OK) fuzz_fail("stream wait");
}

static size_t pick_size(uint8_t a, uint8_t b) {
  switch (a & 7) {
  case 0: return b;                                     /* 0..255, including 0 */
  case 1: return 256 + (size_t)b * 61;                  /* small classes */
  case 2: return (size_t)b << 10;                       /* up to 255 KiB */
  case 3: return ((size_t)b << 12) + (a >> 3);          /* up to 1 MiB, odd sizes */
  case 4: return ((size_t)1 << 20) + ((size_t)b << 14); /* just above the small limit */
  case 5: return ((size_t)(b % 24) + 1) << 20;          /* large, MiB multiples */
  case 6: return (size_t)1 << (b % 21);                 /* powers of two */
  default: return 4096;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
  fuzz_setup();
  size_t at = 0;
  uint64_t tag = 1;
#define NEXT() (at < n ? data[at++] : 0)
  while (at < n) {
    uint8_t op = NEXT();
    switch (op % 10) {
    case 0:
    case 1: { /* alloc */
      uint8_t a = NEXT(), b = NEXT(), k = NEXT() % NSTREAMS;
      if (nlive == MAXLIVE) break;
      size_t size = pick_size(a, b);
      uint64_t *p = magpie_malloc_async(size, streams[k]);
      if (p == NULL) fuzz_fail("allocation failed on a 4 GiB device");
      live[nlive] = (blk){p, magpie_usable_size(p), k, 0};
      if (live[nlive].size < size || live[nlive].size < 256) fuzz_fail("usable size smaller than requested");
      enqueue_use(&live[nlive++], tag++);
      break;
    }
    case 2: /* free on its stream */
      if (nlive > 0) free_block(NEXT() % nlive);
      break;
    case 3: { /* hand-off */
      uint8_t i = NEXT(), j = NEXT() % NSTREAMS;
      if (nlive == 0) break;
      blk *b = &live[i % nlive];
      order(j, b->stream);
      b->stream = j;
      enqueue_use(b, tag++);
      break;
    }
    case 4: /* another use */
      if (nlive > 0) enqueue_use(&live[NEXT() % nlive], tag++);
      break;
    case 5: { /* free from another (short-lived) thread */
      if (nlive == 0) break;
      int i = NEXT() % nlive;
      pthread_t t;
      void *rc;
      if (pthread_create(&t, NULL, free_thread, &live[i]) != 0) break;
      pthread_join(t, &rc);
      if ((intptr_t)rc != MAGPIE_OK) fuzz_fail("free from another thread");
      live[i] = live[--nlive];
      break;
    }
    case 6: { /* destroy and re-create a stream */
      int k = NEXT() % NSTREAMS, to = (k + 1) % NSTREAMS;
      for (int i = 0; i < nlive; i++)
        if (live[i].stream == k) {
          order(to, k);
          live[i].stream = to;
        }
      if (magpie_sim_stream_destroy(streams[k]) != MAGPIE_OK) fuzz_fail("stream destroy");
      if ((streams[k] = magpie_sim_stream_create()) == NULL) fuzz_fail("stream create");
      break;
    }
    case 7: /* the host waits for a stream */
      if (magpie_sim_stream_synchronize(streams[NEXT() % NSTREAMS]) != MAGPIE_OK) fuzz_fail("synchronize");
      break;
    case 8: /* trim */
      if (magpie_trim != NULL && magpie_trim(0, (size_t)NEXT() << 20) != MAGPIE_OK) fuzz_fail("trim");
      break;
    default: { /* a captured step */
      int k = NEXT() % NSTREAMS, j = NEXT() % NSTREAMS, nops = NEXT() % 17;
      uint8_t ops[16];
      for (int o = 0; o < nops; o++) ops[o] = NEXT();
      captured_step(k, j, ops, nops, &tag);
      break;
    }
    }
    check_invariants();
  }
#undef NEXT
  while (nlive > 0) free_block(nlive - 1);
  if (pool != 0) {
    if (magpie_graph_pool_release(pool) != MAGPIE_OK) fuzz_fail("graph pool release");
    pool = 0;
  }
  check_invariants();
  /* Bound the streams' queues between inputs. */
  if (magpie_sim_device_synchronize() != MAGPIE_OK) fuzz_fail("device synchronize");
  return 0;
}
