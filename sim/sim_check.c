/* The stream-order checker of the simulated device.
 *
 * It decides, from CUDA's happens-before edges alone, whether a block handed
 * out for stream R may still be in use by earlier work. Time plays no part:
 * a premature reuse is reported even if the earlier work happened to finish
 * first, so a broken allocator fails every run, not the unlucky ones.
 *
 * The model (vector clocks, all kept on host threads at enqueue time):
 *   - every stream S has a clock VC_S: stream id -> operation count; VC_S[S]
 *     counts the work enqueued on S (launches, event records, stream
 *     synchronize markers); (S, n) names "the work enqueued on S up to n";
 *   - a stream wait (S waits for T, or for an event recorded on T) joins
 *     VC_T (as of the record) into VC_S;
 *   - a host observation of completion (event query that reports it, event
 *     or stream synchronize, device synchronize) joins the observed clock
 *     into G, the clock of everything known complete. A completion seen by
 *     any host thread is a fact about the device, so G is process-wide;
 *   - freeing a block on F records (F, VC_F[F]) over the block's bytes: the
 *     free's stream is the stream of the last use (cudaFreeAsync's rule);
 *   - handing a block out for R checks every recorded use (F, n) of its
 *     bytes: max(VC_R[F], G[F]) >= n, i.e. the use is ordered before R's
 *     future work through stream order and waits, or was observed complete.
 *     Otherwise it is a violation: counted, reported on stderr (the first
 *     few), kept for magpie_sim_check_message.
 * Records of freed bytes live in 2 MiB chunks (the map granularity), as
 * sorted, disjoint intervals; a newer free over the same bytes replaces the
 * older record, whose use the newer one's is ordered after.
 *
 * Threads: all state is under sim_check_lock, a leaf lock taken only by host
 * threads inside magpie_sim_* and magpie_* calls, never by stream workers
 * (which would add edges CUDA does not have). Under ThreadSanitizer the
 * lock and the checker's own memory are hidden from the race detector, so
 * the checker adds no happens-before edge between host threads that would
 * mask a race in the allocator.
 *
 * Lock order: sim_check_lock is innermost: taken under an event's lock
 * (sim_event.c), never held while calling out of this file.
 */
#include "sim/sim_check.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/sim_internal.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SIM_CHECK_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SIM_CHECK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SIM_CHECK_ASAN 1
#endif
#endif
#ifdef SIM_CHECK_ASAN
#include <sanitizer/asan_interface.h>
#endif
#ifdef SIM_CHECK_TSAN
void AnnotateIgnoreSyncBegin(const char *file, int line);
void AnnotateIgnoreSyncEnd(const char *file, int line);
void AnnotateIgnoreReadsBegin(const char *file, int line);
void AnnotateIgnoreReadsEnd(const char *file, int line);
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
#endif

backend_observer sim_check_observer = {
    .on_handout = sim_check_handout,
    .on_free = sim_check_free,
    .on_record = sim_check_record_stream,
};

/* ---------------------------------------------------------------- clocks */

struct sim_vc_entry {
  uint64_t id;
  uint64_t n;
};

/* INVARIANT: e[0..len) sorted by id, ids distinct, n > 0. */
struct sim_vc {
  uint32_t len, cap;
  struct sim_vc_entry e[];
};

static struct sim_vc *sim_vc_new(uint32_t cap) {
  if (cap < 4) cap = 4;
  struct sim_vc *v = malloc(sizeof *v + (size_t)cap * sizeof(struct sim_vc_entry));
  if (v == NULL) return NULL;
  v->len = 0;
  v->cap = cap;
  return v;
}

void sim_vc_free(struct sim_vc *v) { free(v); }

static uint64_t sim_vc_get(const struct sim_vc *v, uint64_t id) {
  if (v == NULL) return 0;
  uint32_t lo = 0, hi = v->len;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (v->e[mid].id < id) lo = mid + 1;
    else hi = mid;
  }
  return lo < v->len && v->e[lo].id == id ? v->e[lo].n : 0;
}

/* *dst = max(*dst, src) entrywise. Returns 0, or -1 out of host memory
 * (dst unchanged). */
static int sim_vc_join(struct sim_vc **dst, const struct sim_vc *src) {
  if (src == NULL || src->len == 0) return 0;
  struct sim_vc *d = *dst;
  uint32_t dl = d ? d->len : 0;
  struct sim_vc *r = sim_vc_new(dl + src->len);
  if (r == NULL) return -1;
  uint32_t i = 0, j = 0;
  while (i < dl || j < src->len) {
    if (j == src->len || (i < dl && d->e[i].id < src->e[j].id)) {
      r->e[r->len++] = d->e[i++];
    } else if (i == dl || src->e[j].id < d->e[i].id) {
      r->e[r->len++] = src->e[j++];
    } else {
      struct sim_vc_entry x = d->e[i++];
      if (src->e[j].n > x.n) x.n = src->e[j].n;
      j++;
      r->e[r->len++] = x;
    }
  }
  free(d);
  *dst = r;
  return 0;
}

/* VC[id] = n (n larger than before). */
static int sim_vc_set(struct sim_vc **dst, uint64_t id, uint64_t n) {
  struct sim_vc one = {.len = 1, .cap = 1};
  struct sim_vc *tmp = malloc(sizeof one + sizeof(struct sim_vc_entry));
  if (tmp == NULL) return -1;
  *tmp = one;
  tmp->e[0] = (struct sim_vc_entry){id, n};
  int rc = sim_vc_join(dst, tmp);
  free(tmp);
  return rc;
}

static struct sim_vc *sim_vc_copy(const struct sim_vc *v) {
  struct sim_vc *c = sim_vc_new(v ? v->len : 0);
  if (c != NULL && v != NULL) {
    memcpy(c->e, v->e, (size_t)v->len * sizeof v->e[0]);
    c->len = v->len;
  }
  return c;
}

/* ---------------------------------------------------------------- state */

/* The checker's view of one stream. Created on the stream's first checked
 * operation; unlinked and freed when the stream is destroyed, after its
 * clock was joined into its device's `retired`. Under sim_check_lock. */
struct sim_check_stream {
  uint64_t id;
  int device;
  struct sim_vc *vc;
  struct sim_check_stream *next, *prev; /* the device's list */
};

/* A use of freed bytes: work n of a stream (its uid). */
struct sim_check_use {
  uint64_t stream;
  uint64_t n;
};

/* The freeing stream and the streams the block was recorded on
 * (magpie_record_stream): a recorded block's free covers their work
 * enqueued before it too. */
#define SIM_CHECK_RECORDED 4
#define SIM_CHECK_USES (1 + SIM_CHECK_RECORDED)

/* A freed byte range and the last uses recorded by its free. */
struct sim_check_rec {
  uintptr_t lo, hi; /* [lo, hi), inside one chunk */
  uint32_t nuse;
  struct sim_check_use use[SIM_CHECK_USES];
};

#define SIM_CHECK_CHUNK_SHIFT 21 /* 2 MiB */

/* INVARIANT: recs sorted by lo and pairwise disjoint. */
struct sim_check_chunk {
  uintptr_t key; /* address >> SIM_CHECK_CHUNK_SHIFT, + 1 (0 = empty slot) */
  uint32_t n, cap;
  struct sim_check_rec *recs;
};

/* A block handed out and not yet freed: its size, for the free. */
struct sim_check_live {
  uintptr_t p; /* 0 empty, 1 deleted */
  size_t size;
  /* Streams (uids) the block was recorded on since its hand-out. */
  uint32_t nrec;
  uint64_t rec[SIM_CHECK_RECORDED];
};

static pthread_mutex_t sim_check_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sim_vc *sim_check_g; /* everything observed complete */
static struct sim_check_stream *sim_check_streams[SIM_MAX_DEVICES];
static struct sim_vc *sim_check_retired[SIM_MAX_DEVICES]; /* destroyed streams' final clocks */
static struct sim_check_chunk *sim_check_chunks;          /* open addressing */
static size_t sim_check_nchunks, sim_check_chunk_cap;
static struct sim_check_live *sim_check_live_tab; /* open addressing */
static size_t sim_check_live_used, sim_check_live_cap;
static char sim_check_first_msg[512];

/* Read without the lock by the public counters (relaxed: statistics). */
static _Atomic uint64_t sim_check_violation_count, sim_check_handout_count, sim_check_oom_count;

static void sim_check_lock_take(void) {
#ifdef SIM_CHECK_TSAN
  AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
  pthread_mutex_lock(&sim_check_lock);
}

static void sim_check_lock_drop(void) {
  pthread_mutex_unlock(&sim_check_lock);
#ifdef SIM_CHECK_TSAN
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
#endif
}

static int sim_check_active(void) { return atomic_load_explicit(&sim_check_observer.enabled, memory_order_relaxed); }

static void sim_check_oom(void) { atomic_fetch_add_explicit(&sim_check_oom_count, 1, memory_order_relaxed); }

/* The checker's state of s, created on first use (lock held). */
static struct sim_check_stream *sim_check_stream_of(struct sim_stream *s) {
  struct sim_check_stream **slot = sim_stream_check_state(s);
  if (*slot != NULL) return *slot;
  struct sim_check_stream *c = calloc(1, sizeof *c);
  if (c == NULL) return NULL;
  c->id = sim_stream_uid(s);
  c->device = sim_stream_device(s);
  c->next = sim_check_streams[c->device];
  if (c->next) c->next->prev = c;
  sim_check_streams[c->device] = c;
  *slot = c;
  return c;
}

/* A new point on s: VC_s[s] + 1. Returns the stream's state or NULL. */
static struct sim_check_stream *sim_check_tick(struct sim_stream *s) {
  struct sim_check_stream *c = sim_check_stream_of(s);
  if (c == NULL || sim_vc_set(&c->vc, c->id, sim_vc_get(c->vc, c->id) + 1) != 0) {
    sim_check_oom();
    return NULL;
  }
  return c;
}

/* ---------------------------------------------------------------- device hooks */

void sim_check_launch(struct sim_stream *s) {
  if (!sim_check_active()) return;
  sim_check_lock_take();
  sim_check_tick(s);
  sim_check_lock_drop();
}

struct sim_vc *sim_check_mark(struct sim_stream *s) {
  if (!sim_check_active()) return NULL;
  sim_check_lock_take();
  struct sim_check_stream *c = sim_check_tick(s);
  struct sim_vc *snap = c ? sim_vc_copy(c->vc) : NULL;
  if (c != NULL && snap == NULL) sim_check_oom();
  sim_check_lock_drop();
  return snap;
}

void sim_check_join_stream(struct sim_stream *waiter, struct sim_stream *waited) {
  if (!sim_check_active()) return;
  sim_check_lock_take();
  struct sim_check_stream *a = sim_check_stream_of(waiter), *b = sim_check_stream_of(waited);
  if (a == NULL || b == NULL || sim_vc_join(&a->vc, b->vc) != 0) sim_check_oom();
  sim_check_lock_drop();
}

void sim_check_join_vc(struct sim_stream *waiter, const struct sim_vc *vc) {
  if (!sim_check_active() || vc == NULL) return;
  sim_check_lock_take();
  struct sim_check_stream *a = sim_check_stream_of(waiter);
  if (a == NULL || sim_vc_join(&a->vc, vc) != 0) sim_check_oom();
  sim_check_lock_drop();
}

void sim_check_observe(const struct sim_vc *vc) {
  if (vc == NULL) return;
  sim_check_lock_take();
  if (sim_vc_join(&sim_check_g, vc) != 0) sim_check_oom();
  sim_check_lock_drop();
}

struct sim_vc *sim_check_device_snapshot(int device) {
  if (!sim_check_active()) return NULL;
  sim_check_lock_take();
  struct sim_vc *v = sim_vc_copy(sim_check_retired[device]);
  for (struct sim_check_stream *c = sim_check_streams[device]; c && v; c = c->next)
    if (sim_vc_join(&v, c->vc) != 0) {
      free(v);
      v = NULL;
    }
  if (v == NULL) sim_check_oom();
  sim_check_lock_drop();
  return v;
}

void sim_check_stream_retire(struct sim_stream *s) {
  sim_check_lock_take();
  struct sim_check_stream **slot = sim_stream_check_state(s);
  struct sim_check_stream *c = *slot;
  if (c != NULL) {
    if (sim_vc_join(&sim_check_retired[c->device], c->vc) != 0) sim_check_oom();
    if (c->prev) c->prev->next = c->next;
    else sim_check_streams[c->device] = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c->vc);
    free(c);
    *slot = NULL;
  }
  sim_check_lock_drop();
}

/* ---------------------------------------------------------------- block records */

SIM_WRAPS static size_t sim_check_hash(uintptr_t k) {
  uint64_t x = (uint64_t)k * 0x9E3779B97F4A7C15ull;
  return (size_t)(x >> 17);
}

static struct sim_check_chunk *sim_check_chunk_find(uintptr_t key, int create) {
  if (sim_check_chunk_cap == 0 || (create && 2 * (sim_check_nchunks + 1) > sim_check_chunk_cap)) {
    if (!create) return NULL;
    size_t ncap = sim_check_chunk_cap ? 2 * sim_check_chunk_cap : 1024;
    struct sim_check_chunk *t = calloc(ncap, sizeof *t);
    if (t == NULL) return NULL;
    for (size_t i = 0; i < sim_check_chunk_cap; i++) {
      if (sim_check_chunks[i].key == 0) continue;
      size_t h = sim_check_hash(sim_check_chunks[i].key) & (ncap - 1);
      while (t[h].key != 0) h = (h + 1) & (ncap - 1);
      t[h] = sim_check_chunks[i];
    }
    free(sim_check_chunks);
    sim_check_chunks = t;
    sim_check_chunk_cap = ncap;
  }
  size_t h = sim_check_hash(key) & (sim_check_chunk_cap - 1);
  while (sim_check_chunks[h].key != 0) {
    if (sim_check_chunks[h].key == key) return &sim_check_chunks[h];
    h = (h + 1) & (sim_check_chunk_cap - 1);
  }
  if (!create) return NULL;
  sim_check_chunks[h].key = key;
  sim_check_nchunks++;
  return &sim_check_chunks[h];
}

/* Index of the first record of ch whose hi > lo. */
static uint32_t sim_check_first_overlap(const struct sim_check_chunk *ch, uintptr_t lo) {
  uint32_t a = 0, b = ch->n;
  while (a < b) {
    uint32_t mid = a + (b - a) / 2;
    if (ch->recs[mid].hi <= lo) a = mid + 1;
    else b = mid;
  }
  return a;
}

/* Record the uses u[0..nu) over [lo, hi) of one chunk, replacing what
 * older records say about those bytes. */
static int sim_check_record(struct sim_check_chunk *ch, uintptr_t lo, uintptr_t hi, const struct sim_check_use *u,
                            uint32_t nu) {
  if (ch->n + 2 > ch->cap) {
    uint32_t ncap = ch->cap ? 2 * ch->cap : 8;
    struct sim_check_rec *r = realloc(ch->recs, (size_t)ncap * sizeof *r);
    if (r == NULL) return -1;
    ch->recs = r;
    ch->cap = ncap;
  }
  uint32_t i = sim_check_first_overlap(ch, lo), j = i;
  struct sim_check_rec keep[2];
  int nkeep = 0;
  /* Overlapped records: keep the parts outside [lo, hi). */
  while (j < ch->n && ch->recs[j].lo < hi) {
    struct sim_check_rec r = ch->recs[j++];
    if (r.lo < lo) {
      keep[nkeep] = r;
      keep[nkeep++].hi = lo;
    }
    if (r.hi > hi) {
      keep[nkeep] = r;
      keep[nkeep++].lo = hi;
    }
  }
  struct sim_check_rec repl[3];
  int nr = 0;
  if (nkeep > 0 && keep[0].lo < lo) repl[nr++] = keep[0];
  repl[nr] = (struct sim_check_rec){.lo = lo, .hi = hi, .nuse = nu};
  memcpy(repl[nr++].use, u, nu * sizeof *u);
  for (int k = 0; k < nkeep; k++)
    if (keep[k].lo >= hi) repl[nr++] = keep[k];
  uint32_t removed = j - i;
  memmove(&ch->recs[i + (uint32_t)nr], &ch->recs[j], (size_t)(ch->n - j) * sizeof ch->recs[0]);
  memcpy(&ch->recs[i], repl, (size_t)nr * sizeof repl[0]);
  ch->n = ch->n - removed + (uint32_t)nr;
  return 0;
}

/* ---------------------------------------------------------------- live blocks */

static struct sim_check_live *sim_check_live_slot(uintptr_t p, int create) {
  if (create && 2 * (sim_check_live_used + 1) > sim_check_live_cap) {
    size_t ncap = sim_check_live_cap ? 2 * sim_check_live_cap : 4096;
    struct sim_check_live *t = calloc(ncap, sizeof *t);
    if (t == NULL) return NULL;
    size_t used = 0;
    for (size_t i = 0; i < sim_check_live_cap; i++) {
      if (sim_check_live_tab[i].p <= 1) continue;
      size_t h = sim_check_hash(sim_check_live_tab[i].p) & (ncap - 1);
      while (t[h].p != 0) h = (h + 1) & (ncap - 1);
      t[h] = sim_check_live_tab[i];
      used++;
    }
    free(sim_check_live_tab);
    sim_check_live_tab = t;
    sim_check_live_cap = ncap;
    sim_check_live_used = used;
  }
  if (sim_check_live_cap == 0) return NULL;
  size_t h = sim_check_hash(p) & (sim_check_live_cap - 1);
  struct sim_check_live *tomb = NULL;
  while (sim_check_live_tab[h].p != 0) {
    if (sim_check_live_tab[h].p == p) return &sim_check_live_tab[h];
    if (sim_check_live_tab[h].p == 1 && tomb == NULL) tomb = &sim_check_live_tab[h];
    h = (h + 1) & (sim_check_live_cap - 1);
  }
  if (!create) return NULL;
  if (tomb != NULL) return tomb;
  sim_check_live_used++;
  return &sim_check_live_tab[h];
}

/* ---------------------------------------------------------------- ASan poisoning */

/* Under AddressSanitizer, free blocks are poisoned so that stream work
 * touching a cached block is reported. Frees are stream-ordered, so the
 * poisoning is too: a closure on the freeing stream poisons the block after
 * the work enqueued before the free, and one on the receiving stream
 * unpoisons it before the work enqueued after the hand-out. A correct reuse
 * orders the first before the second (the allocator's event for the block
 * is recorded after the free); a premature one lets work run on poisoned
 * memory. No-ops in other builds. */
#ifdef SIM_CHECK_ASAN
struct sim_check_poison {
  uintptr_t p;
  size_t n;
  int poison;
  int kept; /* recorded into a capture: run once per replay, never freed */
};

static void sim_check_poison_run(void *arg) {
  struct sim_check_poison *x = arg;
  if (x->poison) ASAN_POISON_MEMORY_REGION((void *)x->p, x->n);
  else ASAN_UNPOISON_MEMORY_REGION((void *)x->p, x->n);
  if (!x->kept) free(x);
}
#endif

/* Lock not held (the launch ticks the stream's clock). The closure is the
 * simulator's, not the user's: it bypasses the capture rules (no refusal,
 * no invalidation, also on the default stream). On a capturing stream it
 * is recorded into the capture, where the block's work is, and then runs
 * once per replay and is never freed (a replay may still be pending when
 * its graph is destroyed; a few bytes per captured hand-out or free). On a
 * stream whose capture was invalidated no graph will run it: dropped. */
static void sim_check_poison(cudaStream_t h, uintptr_t p, size_t n, int poison) {
#ifdef SIM_CHECK_ASAN
  struct sim_stream *s;
  if (sim_stream_resolve(h, &s) != MAGPIE_OK) return;
  struct sim_check_poison *x = malloc(sizeof *x);
  if (x == NULL) return;
  *x = (struct sim_check_poison){p, n, poison, 1};
  struct sim_closure work = {sim_check_poison_run, x};
  int captured = sim_capture_any() ? sim_capture_adopt(s, &work) : 0;
  if (captured > 0) return;
  x->kept = 0; /* still private: not recorded */
  if (captured < 0 || sim_stream_enqueue_launches(s, &work, 1) != MAGPIE_OK) free(x);
#else
  (void)h;
  (void)p;
  (void)n;
  (void)poison;
#endif
}

/* ---------------------------------------------------------------- allocator hooks */

/* Lock held. The newest work of the stream with uid id: its own clock
 * while it lives, its final one once destroyed. */
static uint64_t sim_check_clock_of(uint64_t id) {
  uint64_t n = 0;
  for (int d = 0; d < SIM_MAX_DEVICES; d++) {
    for (struct sim_check_stream *c = sim_check_streams[d]; c != NULL; c = c->next)
      if (c->id == id) return sim_vc_get(c->vc, id);
    uint64_t r = sim_vc_get(sim_check_retired[d], id);
    if (r > n) n = r;
  }
  return n;
}

static void sim_check_violation(uintptr_t p, size_t size, const struct sim_check_rec *r, const struct sim_check_use *u,
                                const struct sim_check_stream *c, uint64_t known, uint64_t seen) {
  char msg[512];
  snprintf(msg, sizeof msg,
           "magpie_sim: stream-order violation: block %p (%zu bytes) handed out for stream %llu while "
           "bytes [%p, %p) were last used by work %llu of stream %llu, which is neither ordered before "
           "stream %llu (it waited for work %llu of that stream) nor observed complete (up to %llu)",
           (void *)p, size, (unsigned long long)c->id, (void *)r->lo, (void *)r->hi, (unsigned long long)u->n,
           (unsigned long long)u->stream, (unsigned long long)c->id, (unsigned long long)known,
           (unsigned long long)seen);
  uint64_t k = atomic_fetch_add_explicit(&sim_check_violation_count, 1, memory_order_relaxed);
  if (k == 0) snprintf(sim_check_first_msg, sizeof sim_check_first_msg, "%s", msg);
  if (k < 8) fprintf(stderr, "%s\n", msg);
  else if (k == 8) fprintf(stderr, "magpie_sim: further stream-order violations are only counted\n");
}

void sim_check_handout(void *ptr, size_t size, cudaStream_t h) {
  struct sim_stream *s;
  if (size == 0) size = 1;
  if (sim_stream_resolve(h, &s) != MAGPIE_OK) return; /* the allocator refused it */
  uintptr_t p = (uintptr_t)ptr;
  sim_check_lock_take();
  atomic_fetch_add_explicit(&sim_check_handout_count, 1, memory_order_relaxed);
  struct sim_check_stream *c = sim_check_stream_of(s);
  struct sim_check_live *l = sim_check_live_slot(p, 1);
  if (c == NULL || l == NULL) {
    sim_check_oom();
  } else {
    l->p = p;
    l->size = size;
    l->nrec = 0;
    int reported = 0;
    for (uintptr_t a = p; a < p + size && !reported;) {
      uintptr_t key = (a >> SIM_CHECK_CHUNK_SHIFT) + 1;
      uintptr_t end = ((a >> SIM_CHECK_CHUNK_SHIFT) + 1) << SIM_CHECK_CHUNK_SHIFT;
      if (end > p + size) end = p + size;
      struct sim_check_chunk *ch = sim_check_chunk_find(key, 0);
      for (uint32_t i = ch ? sim_check_first_overlap(ch, a) : 0; ch && i < ch->n && ch->recs[i].lo < end && !reported;
           i++) {
        const struct sim_check_rec *r = &ch->recs[i];
        for (uint32_t k = 0; k < r->nuse; k++) {
          const struct sim_check_use *u = &r->use[k];
          uint64_t known = sim_vc_get(c->vc, u->stream), seen = sim_vc_get(sim_check_g, u->stream);
          if (known < u->n && seen < u->n) {
            sim_check_violation(p, size, r, u, c, known, seen);
            reported = 1; /* one report per hand-out */
            break;
          }
        }
      }
      a = end;
    }
  }
  sim_check_lock_drop();
  sim_check_poison(h, p, size, 0);
}

void sim_check_free(void *ptr, cudaStream_t h) {
  struct sim_stream *s;
  if (ptr == NULL || sim_stream_resolve(h, &s) != MAGPIE_OK) return; /* the free will fail */
  uintptr_t p = (uintptr_t)ptr;
  sim_check_lock_take();
  struct sim_check_live *l = sim_check_live_slot(p, 0);
  struct sim_check_stream *c = sim_check_stream_of(s);
  size_t poison = 0;
  if (l != NULL && c != NULL) {
    /* The entry stays: if this free fails (the block stays allocated), a
     * later free records again. The next hand-out of p replaces it. */
    size_t size = l->size;
    struct sim_check_use u[SIM_CHECK_USES];
    uint32_t nu = 0;
    u[nu++] = (struct sim_check_use){c->id, sim_vc_get(c->vc, c->id)};
    for (uint32_t k = 0; k < l->nrec; k++)
      if (l->rec[k] != c->id) u[nu++] = (struct sim_check_use){l->rec[k], sim_check_clock_of(l->rec[k])};
    /* A recorded block may still be used by its recorded streams after
     * the freeing stream's poisoning would run: not poisoned. */
    poison = l->nrec == 0 ? size : 0;
    for (uintptr_t a = p; a < p + size;) {
      uintptr_t key = (a >> SIM_CHECK_CHUNK_SHIFT) + 1;
      uintptr_t end = ((a >> SIM_CHECK_CHUNK_SHIFT) + 1) << SIM_CHECK_CHUNK_SHIFT;
      if (end > p + size) end = p + size;
      struct sim_check_chunk *ch = sim_check_chunk_find(key, 1);
      if (ch == NULL || sim_check_record(ch, a, end, u, nu) != 0) sim_check_oom();
      a = end;
    }
  } else if (c == NULL) {
    sim_check_oom();
  }
  sim_check_lock_drop();
  if (poison) sim_check_poison(h, p, poison, 1);
}

void sim_check_record_stream(void *ptr, cudaStream_t h) {
  struct sim_stream *s;
  if (ptr == NULL || sim_stream_resolve(h, &s) != MAGPIE_OK) return; /* the record was refused */
  sim_check_lock_take();
  struct sim_check_live *l = sim_check_live_slot((uintptr_t)ptr, 0);
  struct sim_check_stream *c = sim_check_stream_of(s);
  if (l == NULL || c == NULL) {
    sim_check_oom();
  } else {
    uint32_t k = 0;
    while (k < l->nrec && l->rec[k] != c->id) k++;
    if (k == l->nrec && k < SIM_CHECK_RECORDED) l->rec[l->nrec++] = c->id;
    else if (k == l->nrec) sim_check_oom(); /* more streams than tracked: verdicts may miss some */
  }
  sim_check_lock_drop();
}

/* ---------------------------------------------------------------- public API */

MAGPIE_API int magpie_sim_check_enable(int on) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return sim_public_result("magpie_sim_check_enable", rc);
  backend_observer_set(&sim_check_observer, on);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_sim_check_enabled(void) { return sim_check_active(); }

MAGPIE_API uint64_t magpie_sim_check_violations(void) {
  return atomic_load_explicit(&sim_check_violation_count, memory_order_relaxed);
}

MAGPIE_API uint64_t magpie_sim_check_handouts(void) {
  return atomic_load_explicit(&sim_check_handout_count, memory_order_relaxed);
}

MAGPIE_API uint64_t magpie_sim_check_incomplete(void) {
  return atomic_load_explicit(&sim_check_oom_count, memory_order_relaxed);
}

MAGPIE_API size_t magpie_sim_check_message(char *buf, size_t len) {
  sim_check_lock_take();
  size_t n = strlen(sim_check_first_msg);
  if (buf != NULL && len > 0) snprintf(buf, len, "%s", sim_check_first_msg);
  sim_check_lock_drop();
  return n;
}
