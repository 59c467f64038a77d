/* Multi-thread, multi-stream stress on the simulated device.
 *
 * Threads allocate blocks of mixed sizes on shared streams, enqueue work
 * that stamps and re-checks each block (some of it slow), free blocks on the
 * stream of their last use (sometimes from another thread), hand blocks
 * from stream to stream through magpie_sim_stream_wait, and destroy and
 * re-create streams that still have work pending.
 *
 * The checker: every use of a block is (stream, sequence number). When
 * magpie hands a block out for stream S, the block's last use (X, n) must be
 * ordered before S's future work: X is S, or X's work has really completed
 * up to n (read from the stream's own completion counter), or S was made to
 * wait for X at or after n (a vector clock of the waits the test enqueued).
 * Otherwise the block was handed out while an earlier, unordered use was
 * still pending, and the test fails. The work itself also re-checks its
 * stamps, catching two uses running at once. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "magpie.h"
#include "magpie_sim.h"

#define THREADS 6
#define SLOTS 8
#define MAX_RECS 1024
#define OPS_PER_THREAD 12000
#define LIVE_MAX 48

/* A stream incarnation, as the checker sees it. */
typedef struct srec {
  cudaStream_t handle;
  /* Highest sequence number whose work completed. Written (relaxed) by the
   * stream's own work; read (relaxed) by the checker: it reports real time,
   * and must not add ordering the allocator does not have. */
  _Atomic uint64_t done;
  uint64_t enqueued;     /* under its slot's lock */
  uint64_t vc[MAX_RECS]; /* work enqueued from now on follows rec r's vc[r]; under the slot lock */
} srec;

static srec recs[MAX_RECS];
static _Atomic int nrecs;
static pthread_mutex_t slot_mu[SLOTS];
static int slot_rec[SLOTS]; /* under slot_mu */
static _Atomic long violations, stamp_errors, handouts_checked;
static char violation_msg[256];

/* Last use of each handed-out block, by address. */
typedef struct track {
  void *p;
  int rec;
  uint64_t seq;
} track;
#define TRACK_BUCKETS 65536
static pthread_mutex_t track_mu = PTHREAD_MUTEX_INITIALIZER;
static track tracks[TRACK_BUCKETS]; /* open addressing; under track_mu */

static track *track_find(void *p, int create) {
  uintptr_t a = (uintptr_t)p >> 8; /* blocks are 256-byte aligned */
  size_t h = (size_t)(a ^ (a >> 16) ^ (a >> 32));
  for (size_t i = 0; i < TRACK_BUCKETS; i++) {
    track *t = &tracks[(h + i) & (TRACK_BUCKETS - 1)];
    if (t->p == p) return t;
    if (t->p == NULL) {
      if (!create) return NULL;
      t->p = p;
      t->rec = -1;
      return t;
    }
  }
  return NULL;
}

static int new_rec(cudaStream_t h) {
  int r = atomic_fetch_add(&nrecs, 1);
  if (r >= MAX_RECS) return -1;
  recs[r].handle = h;
  return r;
}

typedef struct use_arg {
  srec *rec;
  uint64_t seq;
  uint64_t *blk;
  size_t words;
  uint64_t token;
  int slow;
} use_arg;

static void use_block(void *a) {
  use_arg *u = a;
  uint64_t *b = u->blk;
  size_t mid = u->words / 2, last = u->words - 1;
  b[0] = u->token;
  b[mid] = u->token;
  b[last] = u->token;
  if (u->slow) usleep(1500);
  if (b[0] != u->token || b[mid] != u->token || b[last] != u->token) atomic_fetch_add(&stamp_errors, 1);
  atomic_store_explicit(&u->rec->done, u->seq, memory_order_relaxed);
  free(u);
}

/* Is the last use of p ordered before future work of rec `cur`? Call with
 * track_mu and the slot lock of cur held. */
static void check_handout(void *p, int cur) {
  track *t = track_find(p, 0);
  atomic_fetch_add(&handouts_checked, 1);
  if (t == NULL || t->rec < 0) return;
  int x = t->rec;
  if (x == cur) return;
  if (atomic_load_explicit(&recs[x].done, memory_order_relaxed) >= t->seq) return;
  if (recs[cur].vc[x] >= t->seq) return;
  if (atomic_fetch_add(&violations, 1) == 0)
    snprintf(violation_msg, sizeof violation_msg,
             "block %p handed to stream rec %d while use %llu on rec %d was pending", p, cur,
             (unsigned long long)t->seq, x);
}

/* Enqueue a use of p on stream rec ri (the caller holds what guards ri's
 * bookkeeping: its slot's lock, or nothing for a thread's private stream). */
static int enqueue_use_rec(int ri, void *p, size_t size, uint64_t token, int slow) {
  srec *r = &recs[ri];
  use_arg *u = malloc(sizeof *u);
  if (u == NULL) return -1;
  *u = (use_arg){r, ++r->enqueued, p, size / 8, token, slow};
  pthread_mutex_lock(&track_mu);
  track *t = track_find(p, 1);
  t->rec = ri;
  t->seq = u->seq;
  pthread_mutex_unlock(&track_mu);
  return magpie_sim_launch(r->handle, use_block, u);
}

/* Enqueue a use of p on slot s (slot lock held). */
static int enqueue_use(int s, void *p, size_t size, uint64_t token, int slow) {
  return enqueue_use_rec(slot_rec[s], p, size, token, slow);
}

/* A private stream: blocks allocated, used (one use slow) and freed on it,
 * then the stream is destroyed with that work pending and a new stream is
 * created, which usually gets the same handle value, and allocates. */
static long ephemeral_stream(uint64_t seed) {
  long errors = 0;
  for (int round = 0; round < 2; round++) {
    cudaStream_t h = magpie_sim_stream_create();
    int ri = h ? new_rec(h) : -1;
    if (ri < 0) return 1;
    void *p[8];
    for (int i = 0; i < 8; i++) {
      size_t size = 3000 + (size_t)i * 9000;
      if ((p[i] = magpie_malloc_async(size, h)) == NULL) {
        errors++;
        continue;
      }
      pthread_mutex_lock(&track_mu);
      check_handout(p[i], ri);
      pthread_mutex_unlock(&track_mu);
      if (enqueue_use_rec(ri, p[i], size, seed | 1, i == 0) != 0) errors++;
    }
    for (int i = 0; i < 8; i++)
      if (p[i] && magpie_free_async(p[i], h) != MAGPIE_OK) errors++;
    if (magpie_sim_stream_destroy(h) != MAGPIE_OK) errors++;
  }
  return errors;
}

typedef struct live {
  void *p;
  size_t size;
  int slot;
} live;

/* Blocks handed to another thread to free. */
static pthread_mutex_t xfer_mu = PTHREAD_MUTEX_INITIALIZER;
static live xfer[1024];
static int nxfer;

static int free_block(live *b) {
  pthread_mutex_lock(&slot_mu[b->slot]);
  int rc = magpie_free_async(b->p, recs[slot_rec[b->slot]].handle);
  pthread_mutex_unlock(&slot_mu[b->slot]);
  return rc;
}

static void *stress_thread(void *arg) {
  uint64_t seed = 0x51ED2701ull + (uintptr_t)arg * 7919;
  live mine[LIVE_MAX];
  int n = 0;
  long errors = 0;
  for (int op = 0; op < OPS_PER_THREAD; op++) {
    if (op % 256 == 255) {
      /* Now and then wait for a stream, as applications do: the host
       * enqueues far faster than the simulated streams execute, and without
       * this the streams' queues (and so every epoch) would only grow. */
      int s = (int)(seed % SLOTS);
      pthread_mutex_lock(&slot_mu[s]);
      if (magpie_sim_stream_synchronize(recs[slot_rec[s]].handle) != MAGPIE_OK) errors++;
      pthread_mutex_unlock(&slot_mu[s]);
    }
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    unsigned r = (unsigned)(seed % 1000);
    if (r < 450 && n < LIVE_MAX) {
      int s = (int)((seed >> 20) % SLOTS);
      /* A few size classes, large enough that slabs run out and magazines
       * cycle through the depot between streams; now and then a large
       * block. */
      static const size_t sizes[] = {700, 3000, 30000, 60000, 200000, 500000};
      size_t size = (seed >> 32) % 50 == 0 ? ((size_t)1 << 20) + ((seed >> 40) % 3) * 700000
                                           : sizes[(seed >> 32) % 6] - (size_t)((seed >> 44) % 64);
      pthread_mutex_lock(&slot_mu[s]);
      cudaStream_t h = recs[slot_rec[s]].handle;
      void *p = magpie_malloc_async(size, h);
      if (p == NULL) {
        errors++;
        pthread_mutex_unlock(&slot_mu[s]);
        continue;
      }
      pthread_mutex_lock(&track_mu);
      check_handout(p, slot_rec[s]);
      pthread_mutex_unlock(&track_mu);
      if (enqueue_use(s, p, size, seed | 1, (seed >> 50) % 25 == 0) != 0) errors++;
      pthread_mutex_unlock(&slot_mu[s]);
      mine[n++] = (live){p, size, s};
    } else if (r < 800 && n > 0) {
      int i = (int)((seed >> 24) % (unsigned)n);
      if (free_block(&mine[i]) != MAGPIE_OK) errors++;
      mine[i] = mine[--n];
    } else if (r < 900 && n > 0) {
      /* Hand-off: the block's next use is on another stream, which first
       * waits for the stream of its last use. */
      int i = (int)((seed >> 24) % (unsigned)n);
      int from = mine[i].slot, to = (int)((seed >> 36) % SLOTS);
      if (to == from) continue;
      int lo = from < to ? from : to, hi = from < to ? to : from;
      pthread_mutex_lock(&slot_mu[lo]);
      pthread_mutex_lock(&slot_mu[hi]);
      srec *rf = &recs[slot_rec[from]], *rt = &recs[slot_rec[to]];
      if (magpie_sim_stream_wait(rt->handle, rf->handle) != MAGPIE_OK) errors++;
      for (int k = 0; k < MAX_RECS; k++)
        if (rf->vc[k] > rt->vc[k]) rt->vc[k] = rf->vc[k];
      rt->vc[slot_rec[from]] = rf->enqueued;
      if (enqueue_use(to, mine[i].p, mine[i].size, seed | 1, 0) != 0) errors++;
      mine[i].slot = to;
      pthread_mutex_unlock(&slot_mu[hi]);
      pthread_mutex_unlock(&slot_mu[lo]);
    } else if (r < 970 && n > 0) {
      /* Cross-thread free: leave the block for another thread. */
      pthread_mutex_lock(&xfer_mu);
      if (nxfer < 1024) {
        xfer[nxfer++] = mine[--n];
      }
      pthread_mutex_unlock(&xfer_mu);
    } else if (r < 990) {
      pthread_mutex_lock(&xfer_mu);
      live b = {0};
      if (nxfer > 0) b = xfer[--nxfer];
      pthread_mutex_unlock(&xfer_mu);
      if (b.p && free_block(&b) != MAGPIE_OK) errors++;
    } else if (r < 995) {
      errors += ephemeral_stream(seed);
    }
  }
  while (n > 0)
    if (free_block(&mine[--n]) != MAGPIE_OK) errors++;
  return (void *)errors;
}

static void test_stress(void **state) {
  (void)state;
  for (int s = 0; s < SLOTS; s++) {
    pthread_mutex_init(&slot_mu[s], NULL);
    cudaStream_t h = magpie_sim_stream_create();
    assert_non_null(h);
    slot_rec[s] = new_rec(h);
  }
  pthread_t t[THREADS];
  for (intptr_t i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, stress_thread, (void *)i);
  long errors = 0;
  for (int i = 0; i < THREADS; i++) {
    void *rv;
    pthread_join(t[i], &rv);
    errors += (long)rv;
  }
  for (int i = 0; i < nxfer; i++) assert_int_equal(free_block(&xfer[i]), MAGPIE_OK);
  assert_int_equal(magpie_sim_device_synchronize(), MAGPIE_OK);
  if (atomic_load(&violations)) print_message("%s\n", violation_msg);
  assert_int_equal(atomic_load(&violations), 0);
  assert_int_equal(atomic_load(&stamp_errors), 0);
  assert_int_equal(errors, 0);
  assert_true(atomic_load(&handouts_checked) > THREADS * OPS_PER_THREAD / 4);
  magpie_stats st;
  assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
  assert_int_equal(st.in_use_bytes, 0);
  print_message(
      "handouts %ld, streams %d, events %llu, migrations %llu, same-stream %llu, limbo %llu, "
      "reserved %zu\n",
      atomic_load(&handouts_checked), atomic_load(&nrecs), (unsigned long long)st.events_recorded,
      (unsigned long long)st.cross_stream_migrations, (unsigned long long)st.same_stream_reuses,
      (unsigned long long)st.limbo_magazines, st.reserved_bytes);
  assert_true(st.events_recorded > 0);
  assert_true(st.cross_stream_migrations > 0);
  /* The simulated device's own checker (vector clocks, no timing) agrees. */
  char msg[512];
  magpie_sim_check_message(msg, sizeof msg);
  if (magpie_sim_check_violations() != 0) print_message("%s\n", msg);
  assert_int_equal(magpie_sim_check_violations(), 0);
  assert_true(magpie_sim_check_handouts() >= (uint64_t)atomic_load(&handouts_checked));
  assert_int_equal(magpie_sim_check_incomplete(), 0);
}

int main(void) {
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  cfg.check_streams = 1;
  /* This checker sees the waits the test enqueues, not the ones magpie
   * adds itself to reuse another stream's large block (reuse_wait), which
   * the simulated device's own stream-order checker covers: off here. */
  cfg.reuse_wait = 0;
  if (magpie_init(&cfg) != MAGPIE_OK) {
    fprintf(stderr, "magpie_init: %s\n", magpie_last_error_message());
    return 1;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_stress)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
