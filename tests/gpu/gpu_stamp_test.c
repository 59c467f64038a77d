/* The stamp test of gpu_alloc_test (see gpu_alloc_test.c for the whole).
 *
 * Lock order: mailbox.lock is the only lock here, never held while calling
 * magpie or waiting on the GPU.
 *
 * Each worker thread owns two streams and a few live blocks. A block gets a
 * unique tag stamped by a kernel when allocated; before it is freed, handed
 * to the other stream, or handed to another thread, a checker kernel
 * verifies the tag (and a hand-off restamps it with a new one). A delay
 * kernel before each final check leaves a window in which an early reuse
 * by another stream would overwrite the tag. Frees go to the stream of last
 * use; hand-offs order the new stream after the old with an event and
 * cuStreamWaitEvent. Every few hundred iterations a worker destroys one of
 * its streams with work pending and creates a new one (usually with the
 * same handle value).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "magpie.h"
#include "tests/gpu/gpu_util.h"

enum { THREADS = 4, STREAMS = 2, SLOTS = 8, ITERS = 3000, RECYCLE_EVERY = 400, MAILBOX = 64 };

static const size_t stamp_sizes[] = {256, 768, 4096, 65536, (size_t)1 << 20, (size_t)3 << 20};
#define NSIZES (sizeof stamp_sizes / sizeof stamp_sizes[0])

typedef struct slot {
  void *p; /* NULL: empty */
  size_t bytes;
  uint64_t tag;
  int stream; /* index of the stream of last use */
} slot;

typedef struct parcel {
  void *p;
  size_t bytes;
  uint64_t tag;
  CUevent ready; /* recorded after the sender's last use */
  int from;
} parcel;

/* Blocks in transit between threads; q and count under lock. */
static struct {
  pthread_mutex_t lock;
  parcel q[MAILBOX];
  int count;
} mailbox = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* errors: added to by any worker (relaxed; read after the joins). The first
 * error's text goes to first_error, written by the worker that wins
 * first_error_taken and read after the joins, which order it. */
static _Atomic long errors;
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

#define W_TRY(call)                               \
  do {                                            \
    CUresult w_rc = (call);                       \
    if (w_rc != CUDA_SUCCESS) {                   \
      note_error("%s: %s", #call, gpu_err(w_rc)); \
      return -1;                                  \
    }                                             \
  } while (0)

typedef struct worker {
  int id;
  const gpu_env *env;
  CUstream s[STREAMS];
  slot slots[SLOTS];
  uint64_t next_tag, rng;
  CUdeviceptr bad; /* mismatching words seen by this worker's checks */
  long allocs, handoffs, sent, taken, recycles;
} worker;

static uint64_t rnd(worker *w) {
  w->rng ^= w->rng << 13;
  w->rng ^= w->rng >> 7;
  w->rng ^= w->rng << 17;
  return w->rng;
}

static uint64_t new_tag(worker *w) { return ((uint64_t)(w->id + 1) << 56) | ++w->next_tag; }

static CUdeviceptr dptr(void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* Sends the block in sl to another thread; 0 if the mailbox is full. */
static int mailbox_post(worker *w, slot *sl) {
  CUevent ev;
  W_TRY(cudrv.event_create(&ev, CU_EVENT_DISABLE_TIMING));
  W_TRY(cudrv.event_record(ev, w->s[sl->stream]));
  int sent = 0;
  pthread_mutex_lock(&mailbox.lock);
  if (mailbox.count < MAILBOX) {
    mailbox.q[mailbox.count++] = (parcel){sl->p, sl->bytes, sl->tag, ev, w->id};
    sent = 1;
  }
  pthread_mutex_unlock(&mailbox.lock);
  if (!sent) W_TRY(cudrv.event_destroy(ev));
  return sent;
}

/* Takes a parcel from another thread (any thread if from < 0). */
static int mailbox_take(int not_from, parcel *out) {
  int got = 0;
  pthread_mutex_lock(&mailbox.lock);
  for (int i = 0; i < mailbox.count && !got; i++)
    if (mailbox.q[i].from != not_from) {
      *out = mailbox.q[i];
      mailbox.q[i] = mailbox.q[--mailbox.count];
      got = 1;
    }
  pthread_mutex_unlock(&mailbox.lock);
  return got;
}

/* The last use: wait a little, check the tag, free on the stream. */
static int finish(worker *w, slot *sl) {
  CUstream s = w->s[sl->stream];
  W_TRY(gpu_delay(w->env, s, (rnd(w) % 20) * 1000));
  W_TRY(gpu_check_stamp(w->env, s, dptr(sl->p), sl->bytes / 8, sl->tag, 0, 0, w->bad));
  int rc = magpie_free_async(sl->p, s);
  if (rc != MAGPIE_OK) {
    note_error("magpie_free_async(%p): %s", sl->p, magpie_last_error_message());
    return -1;
  }
  sl->p = NULL;
  return 0;
}

/* Ends a slot's block: hand it to the other stream first, send it to
 * another thread, or finish it here. */
static int retire(worker *w, slot *sl) {
  uint64_t r = rnd(w) % 8;
  if (r == 0) {
    int j = 1 - sl->stream;
    CUevent ev;
    W_TRY(cudrv.event_create(&ev, CU_EVENT_DISABLE_TIMING));
    W_TRY(cudrv.event_record(ev, w->s[sl->stream]));
    W_TRY(cudrv.stream_wait_event(w->s[j], ev, 0));
    W_TRY(cudrv.event_destroy(ev));
    uint64_t t2 = new_tag(w);
    W_TRY(gpu_check_stamp(w->env, w->s[j], dptr(sl->p), sl->bytes / 8, sl->tag, t2, 1, w->bad));
    sl->tag = t2;
    sl->stream = j;
    w->handoffs++;
  } else if (r == 1) {
    int sent = mailbox_post(w, sl);
    if (sent < 0) return -1;
    if (sent) {
      sl->p = NULL;
      w->sent++;
      return 0;
    }
  }
  return finish(w, sl);
}

static int fill(worker *w, slot *sl) {
  parcel pc;
  if (rnd(w) % 8 == 0 && mailbox_take(w->id, &pc)) {
    int k = (int)(rnd(w) % STREAMS);
    W_TRY(cudrv.stream_wait_event(w->s[k], pc.ready, 0));
    W_TRY(cudrv.event_destroy(pc.ready));
    uint64_t t2 = new_tag(w);
    W_TRY(gpu_check_stamp(w->env, w->s[k], dptr(pc.p), pc.bytes / 8, pc.tag, t2, 1, w->bad));
    *sl = (slot){pc.p, pc.bytes, t2, k};
    w->taken++;
    return 0;
  }
  size_t bytes = stamp_sizes[rnd(w) % NSIZES];
  int k = (int)(rnd(w) % STREAMS);
  void *p = magpie_malloc_async(bytes, w->s[k]);
  if (p == NULL) {
    note_error("magpie_malloc_async(%zu): %s", bytes, magpie_last_error_message());
    return -1;
  }
  *sl = (slot){p, bytes, new_tag(w), k};
  W_TRY(gpu_stamp(w->env, w->s[k], dptr(p), bytes / 8, sl->tag));
  w->allocs++;
  return 0;
}

/* Destroys stream 0 with its blocks' last uses pending, and replaces it. */
static int recycle(worker *w) {
  for (int i = 0; i < SLOTS; i++)
    if (w->slots[i].p != NULL && w->slots[i].stream == 0 && finish(w, &w->slots[i]) != 0) return -1;
  W_TRY(cudrv.stream_destroy(w->s[0]));
  W_TRY(cudrv.stream_create(&w->s[0], CU_STREAM_NON_BLOCKING));
  w->recycles++;
  return 0;
}

static int work(worker *w) {
  W_TRY(gpu_env_bind(w->env));
  for (int k = 0; k < STREAMS; k++) W_TRY(cudrv.stream_create(&w->s[k], CU_STREAM_NON_BLOCKING));
  for (int it = 0; it < ITERS; it++) {
    slot *sl = &w->slots[rnd(w) % SLOTS];
    if (sl->p != NULL && retire(w, sl) != 0) return -1;
    if (fill(w, sl) != 0) return -1;
    if (it % RECYCLE_EVERY == RECYCLE_EVERY - 1 && recycle(w) != 0) return -1;
  }
  for (int i = 0; i < SLOTS; i++)
    if (w->slots[i].p != NULL && finish(w, &w->slots[i]) != 0) return -1;
  for (int k = 0; k < STREAMS; k++) {
    W_TRY(cudrv.stream_synchronize(w->s[k]));
    W_TRY(cudrv.stream_destroy(w->s[k]));
  }
  return 0;
}

static void *worker_main(void *arg) {
  work(arg);
  return NULL;
}

/* Blocks still in the mailbox: finish them on a stream of this thread. */
static int drain(const gpu_env *e, CUdeviceptr bad) {
  CUstream s;
  W_TRY(cudrv.stream_create(&s, CU_STREAM_NON_BLOCKING));
  parcel pc;
  int n = 0;
  while (mailbox_take(-1, &pc)) {
    W_TRY(cudrv.stream_wait_event(s, pc.ready, 0));
    W_TRY(cudrv.event_destroy(pc.ready));
    W_TRY(gpu_check_stamp(e, s, dptr(pc.p), pc.bytes / 8, pc.tag, 0, 0, bad));
    if (magpie_free_async(pc.p, s) != MAGPIE_OK)
      note_error("magpie_free_async(%p): %s", pc.p, magpie_last_error_message());
    n++;
  }
  W_TRY(cudrv.stream_synchronize(s));
  W_TRY(cudrv.stream_destroy(s));
  return n;
}

/* 0 if every check passed; else why. */
int gpu_stamp_test_run(const gpu_env *e, char *why, size_t why_len) {
  static worker ws[THREADS];
  pthread_t t[THREADS];
  CUdeviceptr bad;
  CUresult r = cudrv.mem_alloc(&bad, THREADS * sizeof(unsigned int));
  if (r == CUDA_SUCCESS) r = cudrv.memset_d32(bad, 0, THREADS);
  if (r != CUDA_SUCCESS) {
    snprintf(why, why_len, "counters: %s", gpu_err(r));
    return -1;
  }
  uint64_t t0 = gpu_now_ns();
  int started = 0;
  for (int i = 0; i < THREADS; i++) {
    ws[i] = (worker){
        .id = i, .env = e, .rng = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1), .bad = bad + i * sizeof(unsigned int)};
    if (pthread_create(&t[i], NULL, worker_main, &ws[i]) != 0) {
      note_error("pthread_create failed");
      break;
    }
    started++;
  }
  for (int i = 0; i < started; i++) pthread_join(t[i], NULL);
  int drained = drain(e, bad);
  unsigned int counts[THREADS] = {0};
  r = cudrv.ctx_synchronize();
  if (r == CUDA_SUCCESS) r = cudrv.memcpy_dtoh(counts, bad, sizeof counts);
  if (r != CUDA_SUCCESS) note_error("reading the counters: %s", gpu_err(r));
  cudrv.mem_free(bad);

  long allocs = 0, handoffs = 0, sent = 0, taken = 0, recycles = 0;
  unsigned long mismatches = 0;
  for (int i = 0; i < THREADS; i++) {
    allocs += ws[i].allocs;
    handoffs += ws[i].handoffs;
    sent += ws[i].sent;
    taken += ws[i].taken;
    recycles += ws[i].recycles;
    mismatches += counts[i];
  }
  printf(
      "  stamps: %d threads, %ld allocations, %ld stream hand-offs, %ld thread hand-offs "
      "(%ld taken, %d drained), %ld streams re-created, %.2f s; mismatching words: %lu\n",
      THREADS, allocs, handoffs, sent, taken, drained, recycles, (gpu_now_ns() - t0) / 1e9, mismatches);
  long nerr = atomic_load(&errors);
  if (nerr != 0) {
    snprintf(why, why_len, "%ld error(s); first: %s", nerr, first_error);
    return -1;
  }
  if (mismatches != 0) {
    snprintf(why, why_len, "%lu words did not hold their owner's tag: a block was reused while in use", mismatches);
    return -1;
  }
  return 0;
}
