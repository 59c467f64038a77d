/* magpie_snapshot_json: every segment, slab and block of a device with its
 * state, for a person (tools/snapshot_png.py draws it) or a program.
 *
 * Format (one JSON object; addresses and sizes are decimal integers):
 *   {"magpie_snapshot": 1, "device": D, "granule": G, "threads_skipped": N,
 *    "stats": {<every scalar field of magpie_stats>},
 *    "segments": [
 *      {"kind": "slab", "base": A, "size": S, "class": C, "block_size": B,
 *       "blocks": N, "overhead": O,
 *       "runs": [[STATE, COUNT], ..., ["pending", COUNT, STREAM_ID], ...]},
 *      {"kind": "large_segment", "base": A, "size": S, "vmm": 0|1,
 *       "granule": G, "mapped": [[FIRST_GRANULE, COUNT], ...],
 *       "blocks": [{"base": A, "size": S, "mapped": M,
 *                   "state": "in_use"|"free"|"pending"|"span", "stream": ID}]}]}
 *   A "span" block is memory the segment lent to the small classes' spans
 *   (pool/span.h): its slabs are listed as segments of their own.
 *   A class block of a segment (a block of a size class above 64 KiB,
 *   pool/large.h) has "class": C and a slab block's state ("in_use",
 *   "thread", "depot", "pending" with "stream", "limbo").
 * Slab block states, in address order as runs: "in_use" (handed out),
 * "thread" (in a thread's magazine), "depot" (ready for any stream),
 * "pending" (waiting on STREAM_ID's epoch), "limbo" (its stream is gone;
 * waiting for a device synchronisation), "unused" (no magazine holds it).
 * threads_skipped counts thread caches whose owner was inside magpie
 * throughout: their blocks show as in_use. Taken while the program runs,
 * the figures are a near-instant picture, not an atomic one.
 *
 * Blocks freed but parked by magpie_record_stream are "pending" (stream:
 * one they wait for; 0 when only a device synchronisation will do).
 *
 * Lock order: heap.reclaim_lock -> heap.slab_lock (as in slab release);
 * heap.reclaim_lock -> record_table.lock (a leaf); large.c takes its own
 * lock alone. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/meta.h"
#include "front/global.h"
#include "front/stats.h"
#include "heap/heap.h"
#include "pool/large.h"
#include "pool/record.h"
#include "tcache/tcache.h"

enum { SNAP_IN_USE = 0, SNAP_THREAD, SNAP_DEPOT, SNAP_PENDING, SNAP_LIMBO, SNAP_UNUSED };
static const char *const snap_names[] = {"in_use", "thread", "depot", "pending", "limbo", "unused"};

/* Per slab being described: its fields, copied under the reclaim lock (a
 * descriptor may be given back and reused for another class once the lock
 * is dropped, while the snapshot is being written), its block states and,
 * for pending blocks, the stream each waits on. s is only compared after
 * the lock is dropped, never followed. */
typedef struct snap_slab {
  const slab *s;
  uintptr_t base;
  size_t size, bsize, overhead;
  uint32_t cls, nblocks;
  uint8_t *state;
  uint64_t *stream;
} snap_slab;

/* A class block of a large segment found in a magazine, and its state. */
typedef struct snap_cblock {
  uintptr_t p;
  uint64_t stream;
  uint8_t state;
} snap_cblock;

typedef struct snap_ctx {
  snap_slab *slabs;
  size_t n;
  /* Class blocks seen in magazines, sorted by address before the large
   * segments are written (not found there: in use). */
  snap_cblock *cb;
  size_t ncb, cbcap;
  int oom;
} snap_ctx;

static void snap_note_class_block(snap_ctx *cx, uintptr_t p, int state, uint64_t stream) {
  if (cx->ncb == cx->cbcap) {
    size_t cap = cx->cbcap ? 2 * cx->cbcap : 256;
    snap_cblock *n = meta_alloc(cap * sizeof *n);
    if (n == NULL) {
      cx->oom = 1;
      return;
    }
    if (cx->ncb) memcpy(n, cx->cb, cx->ncb * sizeof *n);
    meta_free(cx->cb);
    cx->cb = n;
    cx->cbcap = cap;
  }
  cx->cb[cx->ncb++] = (snap_cblock){.p = p, .stream = stream, .state = (uint8_t)state};
}

static int snap_cblock_cmp(const void *a, const void *b) {
  uintptr_t x = ((const snap_cblock *)a)->p, y = ((const snap_cblock *)b)->p;
  return x < y ? -1 : x > y;
}

/* large_snapshot's question: the state of the class block at p. */
static const char *snap_class_state(void *ctx, uintptr_t p, uint64_t *stream) {
  const snap_ctx *cx = ctx;
  size_t lo = 0, hi = cx->ncb;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (cx->cb[mid].p < p) lo = mid + 1;
    else hi = mid;
  }
  if (lo == cx->ncb || cx->cb[lo].p != p) return "in_use";
  *stream = cx->cb[lo].stream;
  return snap_names[cx->cb[lo].state];
}

static snap_slab *snap_find(snap_ctx *cx, const slab *s) {
  /* slabs is sorted by descriptor address: binary search. */
  size_t lo = 0, hi = cx->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if ((uintptr_t)cx->slabs[mid].s < (uintptr_t)s) lo = mid + 1;
    else hi = mid;
  }
  return lo < cx->n && cx->slabs[lo].s == s ? &cx->slabs[lo] : NULL;
}

/* A block parked by record_stream (freed, waiting for a recorded stream):
 * pending. Large blocks join the class blocks' list, which state_of reads
 * for both. */
static void snap_mark_parked(void *ctx, uintptr_t p, slab *s, uint64_t stream) {
  snap_ctx *cx = ctx;
  if (s->cls == SLAB_LARGE) {
    snap_note_class_block(cx, p, SNAP_PENDING, stream);
    return;
  }
  snap_slab *ss = snap_find(cx, s);
  uint32_t bi = 0;
  if (ss == NULL || !slab_block_index(s, p, &bi)) return;
  ss->state[bi] = SNAP_PENDING;
  ss->stream[bi] = stream;
}

static void snap_mark(snap_ctx *cx, const magazine *m, int state, uint64_t stream) {
  for (uint32_t i = 0; i < m->count; i++) {
    uintptr_t p = (uintptr_t)m->slots[i];
    slab *s = pagemap_lookup(p);
    if (s != NULL && s->cls == SLAB_LARGE && large_class_of(s, p) >= 0) {
      snap_note_class_block(cx, p, state, stream);
      continue;
    }
    snap_slab *ss = s ? snap_find(cx, s) : NULL;
    uint32_t bi = 0;
    if (ss == NULL || !slab_block_index(s, p, &bi)) continue; /* a slab newer than the snapshot */
    ss->state[bi] = (uint8_t)state;
    if (state == SNAP_PENDING && ss->stream) ss->stream[bi] = stream;
  }
}

static void snap_mark_thread(void *ctx, const magazine *m, int loaded) {
  (void)loaded;
  snap_mark(ctx, m, SNAP_THREAD, 0);
}

/* Mark every magazine on a stack, then put them back. */
static void snap_mark_stack(snap_ctx *cx, stack *st, int state) {
  registry_link *chain = stack_take_all(st, &magazine_st.registry);
  if (chain == NULL) return;
  registry_link *last = chain;
  int64_t n = 0;
  for (registry_link *l = chain; l; l = stack_next(&magazine_st.registry, l)) {
    const magazine *m = (const magazine *)l;
    snap_mark(cx, m, state, m->ticket.rec ? m->ticket.rec->id : 0);
    last = l;
    n++;
  }
  stack_push_chain(st, &magazine_st.registry, chain, last, n);
}

static int snap_cmp(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const snap_slab *)a)->s, y = (uintptr_t)((const snap_slab *)b)->s;
  return x < y ? -1 : x > y;
}

static void snap_write_slab(FILE *out, const snap_slab *ss) {
  fprintf(out,
          "{\"kind\":\"slab\",\"base\":%llu,\"size\":%zu,\"class\":%u,\"block_size\":%zu,\"blocks\":%u,"
          "\"overhead\":%zu,\"runs\":[",
          (unsigned long long)ss->base, ss->size, ss->cls, ss->bsize, ss->nblocks, ss->overhead);
  for (uint32_t i = 0; i < ss->nblocks;) {
    uint32_t j = i + 1;
    while (j < ss->nblocks && ss->state[j] == ss->state[i] &&
           (ss->state[i] != SNAP_PENDING || ss->stream[j] == ss->stream[i]))
      j++;
    fprintf(out, "%s[\"%s\",%u", i ? "," : "", snap_names[ss->state[i]], j - i);
    if (ss->state[i] == SNAP_PENDING) fprintf(out, ",%llu", (unsigned long long)ss->stream[i]);
    fputc(']', out);
    i = j;
  }
  fputs("]}", out);
}

static void snap_write_stats(FILE *out, const magpie_stats *st) {
  fprintf(out,
          "{\"in_use_bytes\":%zu,\"reserved_bytes\":%zu,\"peak_in_use_bytes\":%zu,\"peak_reserved_bytes\":%zu,"
          "\"cached_bytes\":%zu,\"large_in_use_bytes\":%zu,\"slab_count\":%llu,\"thread_cached_bytes\":%zu,"
          "\"depot_bytes\":%zu,\"epoch_pending_bytes\":%zu,\"large_free_bytes\":%zu,\"overhead_bytes\":%zu,"
          "\"large_mapped_bytes\":%zu,\"limit_bytes\":%zu,\"large_segment_count\":%llu}",
          st->in_use_bytes, st->reserved_bytes, st->peak_in_use_bytes, st->peak_reserved_bytes, st->cached_bytes,
          st->large_in_use_bytes, (unsigned long long)st->slab_count, st->thread_cached_bytes, st->depot_bytes,
          st->epoch_pending_bytes, st->large_free_bytes, st->overhead_bytes, st->large_mapped_bytes, st->limit_bytes,
          (unsigned long long)st->large_segment_count);
}

static void snap_free(snap_ctx *cx) {
  for (size_t i = 0; i < cx->n; i++) {
    meta_free(cx->slabs[i].state);
    meta_free(cx->slabs[i].stream);
  }
  meta_free(cx->slabs);
  meta_free(cx->cb);
}

MAGPIE_API int magpie_snapshot_json(int device, FILE *out) {
  if (out == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_snapshot_json: out is NULL");
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  int ndev = 0;
  if (global_ops()->device_count(&ndev) != MAGPIE_OK || device < 0 || device >= ndev)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_snapshot_json: no device %d (the backend has %d)", device,
                     ndev);
  heap *h = heap_peek(device);
  magpie_stats st;
  memset(&st, 0, sizeof st);
  if (h == NULL) {
    fprintf(out, "{\"magpie_snapshot\":1,\"device\":%d,\"granule\":0,\"threads_skipped\":0,\"stats\":", device);
    snap_write_stats(out, &st);
    fputs(",\"segments\":[]}\n", out);
    return ferror(out) ? error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_snapshot_json: write failed") : MAGPIE_OK;
  }

  snap_ctx cx = {0};
  rc = MAGPIE_OK;
  /* Slab release borrows the depot's magazines: keep it out meanwhile. */
  pthread_mutex_lock(&h->slabs.reclaim_lock);
  pthread_mutex_lock(&h->slabs.slab_lock);
  for (slab *s = h->slabs.list; s; s = s->lnext) cx.n++;
  cx.slabs = cx.n ? meta_alloc(cx.n * sizeof *cx.slabs) : NULL;
  size_t k = 0;
  for (slab *s = h->slabs.list; s && cx.slabs; s = s->lnext, k++) {
    cx.slabs[k] = (snap_slab){.s = s,
                              .base = s->base,
                              .size = s->size,
                              .bsize = s->bsize,
                              .overhead = slab_overhead(s),
                              .cls = s->cls,
                              .nblocks = s->nblocks};
    cx.slabs[k].state = meta_alloc(s->nblocks);
    cx.slabs[k].stream = meta_alloc((size_t)s->nblocks * sizeof(uint64_t));
    /* Zeroed: in_use until found in a magazine. Blocks no magazine took
     * at carving are the lowest ones. */
    if (cx.slabs[k].state == NULL || cx.slabs[k].stream == NULL) rc = MAGPIE_ERR_OUT_OF_MEMORY;
    else memset(cx.slabs[k].state, SNAP_UNUSED, s->stranded / s->bsize);
  }
  pthread_mutex_unlock(&h->slabs.slab_lock);
  if (cx.n && cx.slabs == NULL) rc = MAGPIE_ERR_OUT_OF_MEMORY;
  int skipped = 0;
  if (rc == MAGPIE_OK) {
    if (cx.n) qsort(cx.slabs, cx.n, sizeof *cx.slabs, snap_cmp);
    skipped = tcache_inspect(h, snap_mark_thread, &cx);
    for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
      atomic_add_relaxed(&h->depots[c].scanners, 1); /* others wait rather than map */
      snap_mark_stack(&cx, &h->depots[c].full, SNAP_DEPOT);
      snap_mark_stack(&cx, &h->depots[c].pending, SNAP_PENDING);
      atomic_sub_relaxed(&h->depots[c].scanners, 1);
    }
    snap_mark_stack(&cx, &h->limbo, SNAP_LIMBO);
    record_parked_each(&h->records, snap_mark_parked, &cx);
    stats_collect(h, &st);
    if (cx.oom) rc = MAGPIE_ERR_OUT_OF_MEMORY;
    else if (cx.ncb) qsort(cx.cb, cx.ncb, sizeof *cx.cb, snap_cblock_cmp);
  }
  pthread_mutex_unlock(&h->slabs.reclaim_lock);
  if (rc != MAGPIE_OK) {
    snap_free(&cx);
    return error_set(rc, "magpie_snapshot_json: out of host memory");
  }

  fprintf(out, "{\"magpie_snapshot\":1,\"device\":%d,\"granule\":%zu,\"threads_skipped\":%d,\"stats\":", device,
          h->region.gran, skipped);
  snap_write_stats(out, &st);
  fputs(",\"segments\":[", out);
  for (size_t i = 0; i < cx.n; i++) {
    if (i) fputc(',', out);
    snap_write_slab(out, &cx.slabs[i]);
  }
  int first = cx.n == 0;
  large_snapshot(&h->large, out, &first, snap_class_state, &cx);
  fputs("]}\n", out);
  snap_free(&cx);
  if (ferror(out)) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_snapshot_json: writing failed");
  return MAGPIE_OK;
}
