/* libFuzzer target: bytes become a sequence of allocator operations on the
 * simulated device (two devices, peer access granted both ways), with the
 * stream-order checker on; invariants are checked after every step, and
 * any breach aborts (a crash for libFuzzer).
 *
 * Streams: four created on device 0, two on device 1, and the main
 * thread's per-thread default stream (device 0). Operations (one opcode
 * byte, then arguments):
 *   alloc size-class/size on stream k (on k's device); free block i on its
 *   stream, which may be another device's (a cross-device free); hand
 *   block i to stream j (j waits for its stream, as an application does
 *   with an event); enqueue a use of block i; free block i from a new
 *   thread; destroy stream k (its blocks are handed to another stream
 *   first) and create a new one (usually getting the same handle);
 *   synchronize a stream; trim either device; magpie_record_stream of
 *   block i on stream j (j waits for its stream and uses it, as PyTorch's
 *   record_stream is used; refused for another device's stream); a
 *   cross-device free (the block handed to the other device's stream,
 *   used and freed there), optionally followed by a trim of the block's
 *   device; a captured step on stream k, the per-thread stream included
 *   (a CUDA graph of the simulated device, announced with
 *   magpie_capture_begin into the device's graph pool): allocations, uses
 *   and frees inside the capture, frees of blocks allocated before it
 *   (on their own stream, which may be recorded on the capturing one, or
 *   on the capturing stream), the blocks still held kept as graph
 *   outputs, then one replay on stream j; two threads capturing at once on
 *   their per-thread streams, each into a pool of its own, whose pools
 *   must each hold exactly their own thread's blocks; a capture on the
 *   legacy default stream, which is refused without harm.
 * After every operation, on each device: magpie's in-use bytes equal the
 * usable sizes of the blocks the input holds plus what the graph pools
 * hold; in use + cached = reserved; reserved equals the device memory in
 * use; no stream-order violation; no call the simulator forbids during a
 * capture. At the end of each input everything is freed and the pools
 * released, and nothing may stay in use.
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
#include "tests/turns.h"

/* magpie_trim comes with the memory-pressure work; call it once it exists. */
#pragma weak magpie_trim

#define NDEV 2
#define NCREATED 6        /* streams 0-3 on device 0, 4-5 on device 1 */
#define NSTREAMS 7        /* and the per-thread default stream */
#define PT (NSTREAMS - 1) /* its index */
#define MAXLIVE 64

typedef struct blk {
  uint64_t *p;
  size_t size;
  int stream;
  int dev;
  int pooled; /* a block of a graph pool (counted in its bytes) */
  /* The stream it was last recorded on (magpie_record_stream), -1 if none:
   * its use there may still run when the block is freed on `stream`, as
   * record_stream allows; every later use waits for it, so that the
   * input's own uses never race each other. */
  int rec;
} blk;

static cudaStream_t streams[NSTREAMS];
static blk live[MAXLIVE];
static int nlive;
static uint64_t pools[NDEV]; /* the input's graph pools, 0 before a capture needs one */

static int stream_dev(int k) { return k >= 4 && k < NCREATED ? 1 : 0; }

static void fuzz_fail(const char *what) {
  char msg[512];
  magpie_sim_check_message(msg, sizeof msg);
  fprintf(stderr, "alloc_fuzz: invariant broken: %s\n  last error: %s\n  simulator: %s\n  checker: %s\n", what,
          magpie_last_error_message(), magpie_sim_last_error_message(), msg);
  abort();
}

static cudaStream_t stream_new(int k) {
  if (magpie_sim_set_device(stream_dev(k)) != MAGPIE_OK) fuzz_fail("set device");
  cudaStream_t s = magpie_sim_stream_create();
  if (s == NULL || magpie_sim_set_device(0) != MAGPIE_OK) fuzz_fail("stream create");
  return s;
}

static void fuzz_setup(void) {
  static int done;
  if (done) return;
  done = 1;
  setenv("MAGPIE_SIM_DEVICES", "2", 1);
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  cfg.check_streams = 1;
  cfg.magazine_bytes = 16384; /* small magazines: seals and depot traffic */
  if (magpie_init(&cfg) != MAGPIE_OK) fuzz_fail("magpie_init");
  if (magpie_device_enable_peer_access(0, 1) != MAGPIE_OK || magpie_device_enable_peer_access(1, 0) != MAGPIE_OK)
    fuzz_fail("peer access");
  for (int i = 0; i < NCREATED; i++) streams[i] = stream_new(i);
  streams[PT] = MAGPIE_SIM_STREAM_PER_THREAD;
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

/* A use of b on stream k (checked for access: peer access is granted). */
static void order(int j, int i);

static void enqueue_use_on(blk *b, int k, uint64_t tag) {
  if (b->rec >= 0 && b->rec != k) order(k, b->rec);
  use_arg *u = malloc(sizeof *u);
  if (u == NULL) return;
  *u = (use_arg){b->p, b->size / 8, tag};
  if (magpie_sim_launch_access(streams[k], use_block, u, b->p, b->size) != MAGPIE_OK) fuzz_fail("launch");
}

static void enqueue_use(blk *b, uint64_t tag) { enqueue_use_on(b, b->stream, tag); }

static void check_device(int d) {
  magpie_stats st;
  size_t dev_free, dev_total;
  if (magpie_stats_get(d, &st) != MAGPIE_OK) fuzz_fail("magpie_stats_get");
  if (magpie_sim_mem_info(d, &dev_free, &dev_total) != MAGPIE_OK) fuzz_fail("mem_info");
  size_t want = st.graph_pool_bytes;
  for (int i = 0; i < nlive; i++)
    if (!live[i].pooled && live[i].dev == d) want += magpie_usable_size(live[i].p);
  if (st.in_use_bytes != want) fuzz_fail("in_use_bytes differs from the blocks held");
  if (st.in_use_bytes + st.cached_bytes != st.reserved_bytes) fuzz_fail("in use + cached != reserved");
  if (st.reserved_bytes != dev_total - dev_free) fuzz_fail("reserved differs from device memory in use");
  if (st.peak_reserved_bytes < st.reserved_bytes || st.peak_in_use_bytes < st.in_use_bytes) fuzz_fail("peaks");
}

static void check_invariants(void) {
  if (magpie_sim_capture_violations() != 0) fuzz_fail("a call the simulator forbids during a capture");
  for (int d = 0; d < NDEV; d++) check_device(d);
  if (magpie_sim_check_violations() != 0) fuzz_fail("stream-order violation");
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

/* j waits for all work enqueued on i so far. */
static void order(int j, int i) {
  if (i != j && magpie_sim_stream_wait(streams[j], streams[i]) != MAGPIE_OK) fuzz_fail("stream wait");
}

static void free_block(int i) {
  if (magpie_free_async(live[i].p, streams[live[i].stream]) != MAGPIE_OK) fuzz_fail("free");
  live[i] = live[--nlive];
}

static uint64_t pool_of(int d) {
  if (pools[d] == 0 && magpie_graph_pool_create(d, &pools[d]) != MAGPIE_OK) fuzz_fail("graph pool create");
  return pools[d];
}

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

/* A captured step on stream k (see the top), replayed once on stream j of
 * the same device. */
static void captured_step(int k, int j, const uint8_t *ops, int nops, uint64_t *tag) {
  cudaStream_t s = streams[k];
  int d = stream_dev(k);
  if (stream_dev(j) != d) j = k;
  uint64_t pool = pool_of(d);
  if (magpie_capture_begin(pool, s) != MAGPIE_OK) fuzz_fail("magpie_capture_begin");
  if (magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_GLOBAL) != MAGPIE_OK) fuzz_fail("begin capture");
  blk tmp[8];
  int ntmp = 0;
  for (int o = 0; o + 1 < nops; o += 2) {
    uint8_t a = ops[o], b = ops[o + 1];
    int older = -1; /* a block allocated before the capture, not a pool's */
    if (nlive > 0 && !live[b % nlive].pooled) older = b % nlive;
    if ((a & 3) == 2 && older >= 0 && live[older].stream != k) {
      /* Freed on its own stream, which does not capture (the block may be
       * recorded on the capturing one). */
      free_block(older);
    } else if ((a & 3) == 3 && older >= 0) {
      /* Freed on the capturing stream: it waits for a synchronisation. */
      if (magpie_free_async(live[older].p, s) != MAGPIE_OK) fuzz_fail("free of an older block inside a capture");
      live[older] = live[--nlive];
    } else if ((a & 1) && ntmp > 0) { /* free a temporary inside the capture */
      int i = b % ntmp;
      if (magpie_free_async(tmp[i].p, s) != MAGPIE_OK) fuzz_fail("free inside a capture");
      tmp[i] = tmp[--ntmp];
    } else if (ntmp < 8 && ncapture_uses < CAPTURE_USES) {
      size_t size = pick_size(a >> 1, b);
      uint64_t *p = magpie_malloc_async(size, s);
      if (p == NULL) fuzz_fail("allocation inside a capture");
      tmp[ntmp] = (blk){p, magpie_usable_size(p), k, d, 1, -1};
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

/* ---- two threads capturing at once on their per-thread streams ----
 * The steps run in turn: A announces and begins, then B, then A
 * allocates, then B, then A ends, then B; each pool must hold exactly its
 * own thread's blocks (the per-thread handle names another stream in each
 * thread); then both free theirs. */
typedef struct pt_side {
  uint64_t pool;
  size_t sizes[4];
  int n, first;
  size_t got; /* usable bytes of its blocks */
  int bad;
} pt_side;

static turns pt_turns = TURNS_INIT;

static void *pt_side_main(void *arg) {
  pt_side *x = arg;
  cudaStream_t s = MAGPIE_SIM_STREAM_PER_THREAD;
  void *p[4] = {0};
  turn_wait(&pt_turns, x->first);
  x->bad |= magpie_capture_begin(x->pool, s) != MAGPIE_OK;
  x->bad |= magpie_sim_stream_begin_capture(s, MAGPIE_SIM_CAPTURE_THREAD_LOCAL) != MAGPIE_OK;
  turn_next(&pt_turns);
  turn_wait(&pt_turns, 2 + x->first);
  for (int i = 0; i < x->n; i++) {
    p[i] = magpie_malloc_async(x->sizes[i], s);
    x->bad |= p[i] == NULL;
    if (p[i] != NULL) x->got += magpie_usable_size(p[i]);
  }
  turn_next(&pt_turns);
  turn_wait(&pt_turns, 4 + x->first);
  magpie_sim_graph g = NULL;
  x->bad |= magpie_sim_stream_end_capture(s, &g) != MAGPIE_OK;
  if (g != NULL) x->bad |= magpie_sim_graph_destroy(g) != MAGPIE_OK;
  x->bad |= magpie_capture_end(x->pool, s) != MAGPIE_OK;
  x->bad |= magpie_graph_pool_bytes(x->pool) != x->got; /* checked before B may free its own */
  turn_next(&pt_turns);
  turn_wait(&pt_turns, 6);
  for (int i = 0; i < x->n; i++)
    if (p[i] != NULL) x->bad |= magpie_free_async(p[i], s) != MAGPIE_OK;
  x->bad |= magpie_sim_stream_synchronize(s) != MAGPIE_OK;
  return NULL;
}

static void per_thread_captures(const uint8_t *arg) {
  pt_side x[2] = {{.first = 0}, {.first = 1}};
  for (int t = 0; t < 2; t++) {
    if (magpie_graph_pool_create(0, &x[t].pool) != MAGPIE_OK) fuzz_fail("graph pool create");
    x[t].n = 1 + arg[t] % 4;
    for (int i = 0; i < x[t].n; i++) x[t].sizes[i] = pick_size(arg[2 + t], (uint8_t)(arg[4] + 37 * i + 101 * t));
  }
  turn_reset(&pt_turns);
  pthread_t th[2];
  for (int t = 0; t < 2; t++)
    if (pthread_create(&th[t], NULL, pt_side_main, &x[t]) != 0) fuzz_fail("thread create");
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  for (int t = 0; t < 2; t++) {
    if (x[t].bad) fuzz_fail("per-thread captures: a pool holds another thread's blocks, or a call failed");
    if (magpie_graph_pool_release(x[t].pool) != MAGPIE_OK) fuzz_fail("graph pool release");
  }
}

/* The legacy default stream cannot capture: both refusals are clean. */
static void legacy_capture(void) {
  uint64_t pool = pool_of(0);
  if (magpie_capture_begin(pool, (cudaStream_t)1) != MAGPIE_ERR_INVALID_STREAM) fuzz_fail("legacy announcement");
  if (magpie_sim_stream_begin_capture((cudaStream_t)0, MAGPIE_SIM_CAPTURE_GLOBAL) != MAGPIE_ERR_CAPTURE ||
      magpie_sim_stream_begin_capture((cudaStream_t)1, MAGPIE_SIM_CAPTURE_GLOBAL) != MAGPIE_ERR_CAPTURE)
    fuzz_fail("a capture on the legacy stream");
  void *p = magpie_malloc_async(4096, (cudaStream_t)0);
  if (p == NULL || magpie_free_async(p, (cudaStream_t)0) != MAGPIE_OK) fuzz_fail("legacy stream alloc");
}

static void *free_thread(void *arg) {
  blk *b = arg;
  return (void *)(intptr_t)magpie_free_async(b->p, streams[b->stream]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
  fuzz_setup();
  size_t at = 0;
  uint64_t tag = 1;
#define NEXT() (at < n ? data[at++] : 0)
  while (at < n) {
    uint8_t op = NEXT();
    switch (op % 14) {
    case 0:
    case 1: { /* alloc */
      uint8_t a = NEXT(), b = NEXT(), k = NEXT() % NSTREAMS;
      if (nlive == MAXLIVE) break;
      size_t size = pick_size(a, b);
      uint64_t *p = magpie_malloc_async(size, streams[k]);
      if (p == NULL) fuzz_fail("allocation failed on a 4 GiB device");
      int dev = -1;
      if (magpie_block_info(p, NULL, &dev) != MAGPIE_OK || dev != stream_dev(k)) fuzz_fail("block of another device");
      live[nlive] = (blk){p, magpie_usable_size(p), k, dev, 0, -1};
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
      if (live[i].stream == PT) break; /* another thread's per-thread stream is another stream */
      pthread_t t;
      void *rc;
      if (pthread_create(&t, NULL, free_thread, &live[i]) != 0) break;
      pthread_join(t, &rc);
      if ((intptr_t)rc != MAGPIE_OK) fuzz_fail("free from another thread");
      live[i] = live[--nlive];
      break;
    }
    case 6: { /* destroy and re-create a stream */
      int k = NEXT() % NCREATED, to = (k + 1) % NCREATED;
      for (int i = 0; i < nlive; i++) {
        if (live[i].stream == k) {
          order(to, k);
          live[i].stream = to;
        }
        if (live[i].rec == k) { /* its use there is ordered before the block's stream now */
          order(live[i].stream, k);
          live[i].rec = -1;
        }
      }
      if (magpie_sim_stream_destroy(streams[k]) != MAGPIE_OK) fuzz_fail("stream destroy");
      streams[k] = stream_new(k);
      break;
    }
    case 7: /* the host waits for a stream */
      if (magpie_sim_stream_synchronize(streams[NEXT() % NSTREAMS]) != MAGPIE_OK) fuzz_fail("synchronize");
      break;
    case 8: { /* trim */
      uint8_t a = NEXT();
      if (magpie_trim != NULL && magpie_trim(a & 1, (size_t)(a >> 1) << 20) != MAGPIE_OK) fuzz_fail("trim");
      break;
    }
    case 9: { /* a captured step */
      int k = NEXT() % NSTREAMS, j = NEXT() % NSTREAMS, nops = NEXT() % 17;
      uint8_t ops[16];
      for (int o = 0; o < nops; o++) ops[o] = NEXT();
      captured_step(k, j, ops, nops, &tag);
      break;
    }
    case 10: { /* record_stream: j waits for the block's stream, uses it, records it */
      uint8_t i = NEXT(), j = NEXT() % NSTREAMS;
      if (nlive == 0) break;
      blk *b = &live[i % nlive];
      if (b->pooled) break;
      int rc = magpie_record_stream(b->p, streams[j]);
      if (j == PT) {
        if (rc != MAGPIE_ERR_INVALID_STREAM) fuzz_fail("record on the per-thread stream not refused");
      } else if (stream_dev(j) != b->dev) {
        if (rc != MAGPIE_ERR_INVALID_STREAM) fuzz_fail("record on another device's stream not refused");
      } else {
        if (rc != MAGPIE_OK) fuzz_fail("magpie_record_stream");
        order(j, b->stream);
        enqueue_use_on(b, j, tag++);
        b->rec = j;
      }
      break;
    }
    case 11: { /* a cross-device free, then maybe a trim of the block's device */
      uint8_t i = NEXT(), j = NEXT(), a = NEXT();
      if (nlive == 0) break;
      blk *b = &live[i % nlive];
      int to = b->dev == 0 ? 4 + j % 2 : j % 4;
      order(to, b->stream);
      b->stream = to;
      enqueue_use(b, tag++);
      int dev = b->dev;
      free_block(i % nlive);
      if ((a & 1) && magpie_trim != NULL && magpie_trim(dev, (size_t)(a >> 1) << 16) != MAGPIE_OK) fuzz_fail("trim");
      break;
    }
    case 12: { /* two threads capturing at once on their per-thread streams */
      uint8_t arg[5];
      for (int k = 0; k < 5; k++) arg[k] = NEXT();
      per_thread_captures(arg);
      break;
    }
    default: /* a capture on the legacy default stream */ legacy_capture(); break;
    }
    check_invariants();
  }
#undef NEXT
  while (nlive > 0) free_block(nlive - 1);
  for (int d = 0; d < NDEV; d++)
    if (pools[d] != 0) {
      if (magpie_graph_pool_release(pools[d]) != MAGPIE_OK) fuzz_fail("graph pool release");
      pools[d] = 0;
    }
  check_invariants();
  /* Bound the streams' queues between inputs. */
  for (int d = 0; d < NDEV; d++)
    if (magpie_sim_set_device(d) != MAGPIE_OK || magpie_sim_device_synchronize() != MAGPIE_OK)
      fuzz_fail("device synchronize");
  magpie_sim_set_device(0);
  return 0;
}
