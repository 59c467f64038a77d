/* Large blocks: requests above the largest size class.
 *
 * They are carved best-fit out of *segments* (free blocks in bins by size,
 * large_bin_of) and split and coalesced there, like PyTorch's expandable
 * segments:
 *   - with VMM, a segment is a stretch of the device's reserved virtual range
 *     whose 2 MiB granules are mapped only while some block needs them: a
 *     segment grows by mapping granules under a new block and shrinks by
 *     unmapping granules that lie wholly inside free blocks, so a free hole
 *     never strands a whole segment;
 *   - without VMM, a segment is one plain device allocation, given back when
 *     it is wholly free.
 *
 * Stream rules are those of small blocks. A free block carries the ticket
 * of the free that made it (the freeing stream and one event): the freeing
 * stream may reuse it at once, any stream once the event completed, and,
 * under memory pressure, another stream after being made to wait on that
 * event (stream_wait_event), never after a host-side synchronisation.
 * Neighbouring free blocks are merged when both are ready for every stream,
 * both wait on the same stream (the later ticket covers the earlier), or
 * one waits on a stream and the other is ready and wholly mapped (the
 * merged block waits on that stream: large_bins.c, large_mergeable). Where a
 * stream may be made to wait, a request no single free block serves may
 * take a run of adjacent free blocks waiting on different streams, its
 * stream waiting on each one's event (large_run.c, large_run_take).
 *
 * Lock order: large_cache.lock is a leaf; no driver call is made while it
 * is held. Mapping and unmapping happen outside it; a granule being mapped
 * or unmapped is marked so in the segment and waited for on granule_cv.
 * Small-block traffic never takes this lock. */
#ifndef MAGPIE_LARGE_H
#define MAGPIE_LARGE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/atomic.h"
#include "device/backend.h"
#include "pool/epoch.h"
#include "pool/magazine.h"
#include "pool/region.h"
#include "pool/slab.h"

struct heap;
struct slab;

/* Large block sizes are multiples of this. */
#define LARGE_QUANTUM ((size_t)4096)

/* A free's ticket shared by the free blocks it covers (a split keeps it on
 * both parts). refs counts those blocks plus threads querying or waiting on
 * its event outside the lock; under the lock. The ticket (and its event)
 * is released when refs drops to 0. */
typedef struct lticket {
  epoch_ticket t;
  uint32_t refs;
  struct lticket *dnext; /* deferred-release list */
} lticket;

/* LBLOCK_DEAD: absorbed by a neighbour while large_settle_locked works;
 * freed when it is done. */
enum { LBLOCK_FREE = 0, LBLOCK_USED = 1, LBLOCK_DEAD = 2 };

/* INVARIANT: the blocks of a segment tile [seg->base, seg->base+seg->size)
 *            in address order without gap or overlap.
 * INVARIANT: every granule under a USED block is mapped; a free block's
 *            granules may be mapped or not.
 * INVARIANT: a FREE block is on the free list; a USED block that has been
 *            handed out is in the hash (one being mapped is in neither). */
typedef struct lblock {
  uintptr_t base;
  size_t size;
  struct lseg *seg;
  struct lblock *prev, *next;   /* address order within the segment */
  struct lblock *fprev, *fnext; /* free list */
  struct lblock *hnext;         /* hash chain of handed-out blocks */
  struct lblock *wnext;         /* large_settle_locked's work list */
  lticket *ticket;              /* free: the free's epoch (NULL: ready) */
  int state;
  uint32_t klass; /* USED: 0 for a large block, cls + 1 for a class block, LARGE_KLASS_LENT */
  /* A USED large block's keeping: a state in the low byte
   * (LARGE_KEPT_STATE) and a generation above it.
   *   0: handed out (a free block's state is 0 too);
   *   LARGE_KEPT: freed by its user and kept by a thread for its stream
   *     (tcache/tcache_free.c); LARGE_KEPT_LIMBO once the thread let it go to
   *     wait for a device synchronisation (heap.c);
   *   LARGE_KEPT_OUT: handed out again by the thread that kept it, which
   *     may keep it again at its free without the lock (large_rekeep).
   * 0 -> LARGE_KEPT_OUT at a hand-out to a thread that may keep it (under
   * the lock, large_alloc_lent);
   * 0 or LARGE_KEPT_OUT -> LARGE_KEPT: under the lock (large_keep_block),
   * or LARGE_KEPT_OUT -> LARGE_KEPT by the lending thread without it
   * (compare-and-swap, acq_rel); LARGE_KEPT -> LARGE_KEPT_OUT, 0 or
   * LARGE_KEPT_LIMBO by the holder (release); LARGE_KEPT_OUT -> 0 by a
   * free under the lock (compare-and-swap: one of it and the lender's
   * wins). The generation grows by one at every hand-out (under the
   * lock), so while it is unchanged the descriptor names the same block:
   * a block's base and size change only while it is free, and only a
   * hand-out leads from free to kept or lent. Descriptors are never given
   * back to the host allocator (large_desc.c, large_block_drop) and their
   * recycling leaves this word alone, so a lender's stale word fails its
   * compare-and-swap on a descriptor still. Read under the lock (acquire)
   * by large_free (a free of a kept block is a double free), lookups and
   * snapshots. A kept block's lblock stays put (it is USED). Last field:
   * recycling clears the fields before it. */
  _Atomic uint64_t kept;
} lblock;

enum { LARGE_KEPT = 1, LARGE_KEPT_LIMBO = 2, LARGE_KEPT_OUT = 3 };
#define LARGE_KEPT_STATE ((uint64_t)0xff)

/* Granule states. MAPPING and UNMAPPING belong to one thread working
 * outside the lock; others wait on granule_cv. */
enum { GRAN_UNMAPPED = 0, GRAN_MAPPED = 1, GRAN_MAPPING = 2, GRAN_UNMAPPING = 3 };

typedef struct lseg {
  uintptr_t base;
  size_t size;
  int vmm;       /* 0: one device allocation, all mapped */
  uintptr_t raw; /* without VMM: what the region allocated */
  size_t raw_size;
  size_t ngran;
  uint8_t *gran; /* per granule state (VMM) */
  /* Per LARGE_QUANTUM unit: cls + 1 at the start of a class block (of
   * size class cls), else 0; LARGE_CLASS_USED added while a checked-mode
   * thread holds the block. Written (relaxed) under the lock when a
   * class block is carved or given back, and by checked-mode marks; read
   * (relaxed) by frees without the lock: a free of a block is ordered
   * after the allocation that handed it out, which is after the carve. */
  _Atomic uint8_t *ucls;
  struct slab *desc; /* page-map descriptor (cls SLAB_LARGE) */
  lblock *first;
  struct lseg *next;
} lseg;

/* Most spare ticket descriptors a large cache keeps (large_cache). */
#define LARGE_SPARES 256

/* Free-list bins: sizes of 1-7 quanta exactly, then four bins per power
 * of two (TLSF's layout), so that every block of a bin above a size's own
 * is at least that size. 4 KiB quanta up to 2^64 bytes need 204 bins. */
#define LARGE_BINS 256

static inline unsigned large_bin_of(size_t size) {
  size_t u = size / LARGE_QUANTUM;
  if (u < 8) return (unsigned)u;
  unsigned fl = 63u - (unsigned)__builtin_clzll((unsigned long long)u);
  return 8u + (fl - 3u) * 4u + ((unsigned)(u >> (fl - 2u)) & 3u);
}

typedef struct large_cache {
  /* Set once by large_init. */
  region *region;         /* maps segments and granules */
  const backend_ops *ops; /* stream waits */
  size_t total_mem;       /* the device's memory (segment reach) */
  int reuse_wait;         /* magpie_config.reuse_wait */
  struct heap *owner;     /* stored in segment descriptors (slab.heap) */
  pthread_mutex_t lock;
  pthread_cond_t granule_cv;
  lseg *segs; /* under lock */
  /* Free blocks, in lists by size (large_bin_of): a best fit looks at the
   * request's own list and, past it, only lists of blocks large enough.
   * binmap has bit k set while bins[k] is not empty. Under lock. */
  lblock *bins[LARGE_BINS];
  uint64_t binmap[LARGE_BINS / 64];
  lblock **hash; /* under lock */
  size_t hash_cap, hash_count;
  int growing; /* a thread is adding a segment; under lock */
  /* Threads mapping granules under a block now (large_map_under, lock
   * dropped around the driver calls); under lock. An allocation that
   * would map waits for them first (large.c, LARGE_MAP_WAITS). */
  int mapping;
  /* Descriptors kept for reuse: free lblocks (linked through hnext; all
   * of them: lblock.kept) and ltickets (through dnext; at most
   * LARGE_SPARES). Under lock. Splits, merges and frees make and drop one
   * or two descriptors per operation; from the host allocator (one arena,
   * no thread cache, meta.c) each pair cost about 60 ns under the lock. */
  lblock *spare_blocks;
  lticket *spare_tickets;
  uint32_t nspare_tickets;
  /* Statistics: written under the lock (relaxed), read without it. */
  _Atomic size_t in_use_bytes;
  _Atomic size_t mapped_bytes; /* granules mapped in segments (raw size without VMM) */
  _Atomic size_t class_bytes;  /* class blocks (counted in in_use_bytes too) */
  _Atomic size_t lent_bytes;   /* bytes lent to the span set (counted in in_use_bytes too) */
  _Atomic uint64_t segments;
  _Atomic uint64_t stream_waits;
  _Atomic uint64_t bytes_unmapped;
  /* Times a class carve or a class give-back found the lock held: raised
   * (relaxed) by that thread, read (relaxed) by the thread caches'
   * refills, which keep a second magazine of class blocks while it rises
   * (heap_class_contention). A heuristic: publishes nothing. */
  _Atomic uint64_t class_contended;
} large_cache;

/* Helpers shared by the large*.c files (lock held by the caller). */

/* The first non-empty bin at or after k; LARGE_BINS if none. */
static inline unsigned large_bin_next(const large_cache *c, unsigned k) {
  while (k < LARGE_BINS) {
    uint64_t w = c->binmap[k / 64] & (~(uint64_t)0 << (k % 64));
    if (w != 0) return (k & ~63u) + (unsigned)__builtin_ctzll(w);
    k = (k & ~63u) + 64;
  }
  return LARGE_BINS;
}

/* Every free block, bin by bin: for (b = large_free_first(c); b; b =
 * large_free_next(c, b)). The list must not change under the walk. */
static inline lblock *large_free_first(const large_cache *c) {
  unsigned k = large_bin_next(c, 0);
  return k < LARGE_BINS ? c->bins[k] : NULL;
}

static inline lblock *large_free_next(const large_cache *c, const lblock *b) {
  if (b->fnext) return b->fnext;
  unsigned k = large_bin_next(c, large_bin_of(b->size) + 1);
  return k < LARGE_BINS ? c->bins[k] : NULL;
}

/* Complete by a comparison (no driver call)? */
static inline int lticket_done(const lticket *lt) {
  return lt == NULL || atomic_load_acquire(&lt->t.rec->done) >= lt->t.seq;
}

/* Mapped bytes of [a, a+n) in segment sg with granule g (granules shared
 * with a neighbour count for the part inside the range). */
static inline size_t lseg_mapped_in(const lseg *sg, size_t g, uintptr_t a, size_t n) {
  if (!sg->vmm) return n;
  size_t sum = 0;
  for (size_t i = (a - sg->base) / g, last = (a + n - 1 - sg->base) / g; i <= last; i++) {
    if (sg->gran[i] != GRAN_MAPPED) continue;
    uintptr_t gs = sg->base + i * g, ge = gs + g;
    uintptr_t s = gs > a ? gs : a, e = ge < a + n ? ge : a + n;
    sum += e - s;
  }
  return sum;
}

/* Flags of large_alloc. */
#define LARGE_MAY_WAIT_EVENT 1 /* pressure: reuse another stream's block via stream_wait_event */
#define LARGE_NO_MAP 2         /* only mapped memory: else LARGE_WOULD_MAP */
#define LARGE_READY_ONLY 4     /* never a stream wait, not even under a reserve (graph pools) */
#define LARGE_WOULD_MAP 1      /* a return value, as SPAN_WOULD_MAP */

/* A request's block size: size rounded up to LARGE_QUANTUM (size at most
 * SIZE_MAX - LARGE_QUANTUM). */
static inline size_t large_round(size_t size) { return (size + LARGE_QUANTUM - 1) & ~(LARGE_QUANTUM - 1); }

void large_init(large_cache *c, region *r, const backend_ops *ops, size_t total_mem, int reuse_wait,
                struct heap *owner);
/* A block of at least size bytes usable by stream_id (handle `stream`) now.
 * Sets *out and *bsize (the block's size). MAGPIE_ERR_OUT_OF_MEMORY when it
 * needs memory that cannot be mapped. */
int large_alloc(large_cache *c, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                size_t *bsize);
/* A block handed out lent (LARGE_KEPT_OUT) to the allocating thread, which
 * may keep it at its free on its stream without the lock (large_rekeep
 * with word); a free elsewhere frees it as any block. */
typedef struct large_lent {
  lblock *b;
  uint64_t word;
} large_lent;
/* As large_alloc; with lent non-NULL the block is handed out lent to the
 * caller (*lent set on success). */
int large_alloc_lent(large_cache *c, size_t size, uint64_t stream_id, cudaStream_t stream, int flags, uintptr_t *out,
                     size_t *bsize, large_lent *lent);
/* Is p the start of a handed-out large block (not kept)? Sets *bsize. */
int large_lookup(large_cache *c, uintptr_t p, size_t *bsize);
/* Free the block at p with the ticket sealed on its freeing stream (taken
 * over on success; a ticket with no record: ready for every stream).
 * MAGPIE_ERR_DOUBLE_FREE (a kept block included) /
 * MAGPIE_ERR_INVALID_POINTER. */
int large_free(large_cache *c, uintptr_t p, const epoch_ticket *t, size_t *bsize);
/* Free the n blocks its caller keeps (LARGE_KEPT), all with the ticket t
 * (taken over on success), under one hold of the lock. On
 * MAGPIE_ERR_OUT_OF_MEMORY (no host memory for the ticket) none is freed
 * and they stay kept. */
int large_free_kept(large_cache *c, lblock *const *b, uint32_t n, const epoch_ticket *t);
/* A freed large block at p of at most max bytes, kept by the calling
 * thread for its stream: marked LARGE_KEPT, *out set. 0 (nothing marked)
 * if p is not a handed-out large block, is kept already or is larger. */
int large_keep_block(large_cache *c, uintptr_t p, size_t max, lblock **out);
/* b's keeping state (lblock.kept's low byte). */
static inline unsigned large_kept_state(const lblock *b) {
  return (unsigned)(atomic_load_acquire(&b->kept) & LARGE_KEPT_STATE);
}

/* Keeping word v with its state replaced by state, the generation kept. */
static inline uint64_t large_kept_word(uint64_t v, unsigned state) { return (v & ~LARGE_KEPT_STATE) | state; }

/* The holder of kept block b sets its state, the generation unchanged;
 * returns the word stored. */
static inline uint64_t large_kept_set(lblock *b, unsigned state) {
  uint64_t v = large_kept_word(atomic_load_relaxed(&b->kept), state);
  atomic_store_release(&b->kept, v);
  return v;
}

/* The holder is about to free its kept block, or hand it out to a user
 * who may free it on any thread. */
static inline void large_unkeep(lblock *b) { large_kept_set(b, 0); }

/* The holder hands its kept block out again to its own thread's user as
 * LARGE_KEPT_OUT; returns the word large_rekeep expects. */
static inline uint64_t large_lend(lblock *b) { return large_kept_set(b, LARGE_KEPT_OUT); }

/* The lender keeps b again at its free, without the lock: 1 if b is still
 * the block it lent (lent: large_lend's word), not freed since, now
 * LARGE_KEPT; 0 if anything happened to it (a free elsewhere, a hand-out
 * anew): the locked path (large_keep_block, large_free) decides. */
static inline int large_rekeep(lblock *b, uint64_t lent) {
  uint64_t want = lent;
  return atomic_cas_strong_acq_rel(&b->kept, &want, large_kept_word(lent, LARGE_KEPT));
}

/* ---- class blocks ----
 * The size classes above SIZECLASS_SLAB_MAX have no slabs: their blocks
 * are carved from segments one by one, best fit, like large blocks, then
 * circulate in magazines like slab blocks (the thread caches and the
 * depot), and go back to the segments, where they coalesce with their
 * neighbours, when the depot gives them back (heap.c). Memory so moves
 * between classes block by block; a slab moves only once all its blocks
 * are free. A class block is a USED block with klass != 0, in the hash
 * (for its give-back), and marked in its segment's ucls table, which
 * frees read without the lock. */
#define LARGE_CLASS_USED 0x80u
#define LARGE_CLASS_LIMIT 0x7fu /* classes that fit the table's byte: cls + 1 below it */
/* The ucls mark of a large block that a graph pool holds (pool/gpool.h):
 * its frees go to the pool, never to the large cache or a thread. */
#define LARGE_GRAPH_MARK LARGE_CLASS_LIMIT

/* Up to n class blocks of class cls (bsize bytes, a multiple of
 * LARGE_QUANTUM) that stream_id may use now, into slots; *got set. flags
 * as large_alloc's, for the first block only (LARGE_NO_MAP: nothing is
 * mapped; the rest come from mapped, ready memory). MAGPIE_OK when at
 * least one was carved. */
int large_class_carve(large_cache *c, unsigned cls, size_t bsize, uint32_t n, uint64_t stream_id, cudaStream_t stream,
                      int flags, void **slots, uint32_t *got);
/* Give n class blocks (free, from a magazine) back to their segments with
 * the magazine's ticket t (t->rec NULL: ready; else the ticket is taken
 * over). MAGPIE_ERR_OUT_OF_MEMORY (host) leaves them to the caller; so
 * does LARGE_BUSY, with LARGE_TRY in flags, where the lock was held. */
#define LARGE_TRY 8
#define LARGE_BUSY 2 /* a return value, as LARGE_WOULD_MAP */
int large_class_put(large_cache *c, void *const *blocks, uint32_t n, const epoch_ticket *t, int flags);

/* The class-table unit of the block starting at p in the large segment of
 * descriptor sl without its LARGE_CLASS_USED bit: cls + 1 at a class
 * block's start, LARGE_GRAPH_MARK at a graph pool's large block, else 0
 * (also where p is not a quantum's start inside the segment). No lock
 * (see lseg.ucls); the descriptor's first line and the table only. */
static inline unsigned large_unit_at(const struct slab *sl, uintptr_t p) {
  uintptr_t off = p - sl->base;
  if (off >= sl->size || off % LARGE_QUANTUM != 0) return 0;
  return atomic_load_relaxed(&sl->ucls[off / LARGE_QUANTUM]) & LARGE_CLASS_LIMIT;
}

/* The size class of the class block starting at p in the large segment
 * of descriptor sl (cls SLAB_LARGE), or -1 if none starts there. */
static inline int large_class_of(const struct slab *sl, uintptr_t p) {
  unsigned v = large_unit_at(sl, p);
  return v == LARGE_GRAPH_MARK ? -1 : (int)v - 1;
}

/* The size class of the block starting at p in sl, a class slab or a
 * large segment, or -1 if no class block starts there (a large block, an
 * interior pointer). The free fast path's test: it computes both kinds'
 * answers and selects with masks, without a branch on the descriptor's
 * kind, which a stream of mixed sizes mispredicts about every other free
 * (bench/DECISIONS.md, "No branch on a block's kind in the fast paths").
 * A class slab's table read is of large_no_class, a zero byte. */
extern const _Atomic uint8_t large_no_class;
static inline int large_or_slab_class(const struct slab *sl, uintptr_t p) {
  uintptr_t off = p - sl->base;
  uint32_t c = sl->cls;
  /* All ones for a segment (masks made by negating a signed 0 or 1: no
   * unsigned arithmetic wraps). */
  uintptr_t seg = (uintptr_t) - (intptr_t)(c >= SIZECLASS_COUNT);
  /* A class slab's block index (for a segment, whose magic is its ucls
   * pointer, unused). */
  uint64_t i = slab_magic_index(off, sl->magic);
  uintptr_t slab_ok = (uintptr_t)((i * sl->bsize == off) & (i < sl->nblocks));
  uintptr_t in = seg & (uintptr_t) - (intptr_t)((off < sl->size) & (off % LARGE_QUANTUM == 0));
  uintptr_t at = (((uintptr_t)sl->ucls + off / LARGE_QUANTUM) & in) | ((uintptr_t)&large_no_class & ~in);
  unsigned v = atomic_load_relaxed((const _Atomic uint8_t *)at) & LARGE_CLASS_LIMIT;
  /* A segment's unit: cls + 1 at a class block's start, 0 elsewhere, the
   * graph mark on a graph pool's large block. */
  int kv = (int)v - 1; /* -1 where no class block starts */
  uintptr_t seg_ok = (uintptr_t)((unsigned)kv < LARGE_GRAPH_MARK - 1u);
  uintptr_t ok = (slab_ok & ~seg) | (seg_ok & seg);
  uint32_t k = c ^ ((c ^ (uint32_t)kv) & (uint32_t)seg);
  return ok ? (int)k : -1;
}

/* Is p the start of a large block a graph pool holds (sl as above)? No
 * lock (as large_class_of: a free is ordered after the allocation that
 * marked it). */
static inline int large_is_graph(const struct slab *sl, uintptr_t p) {
  return large_unit_at(sl, p) == LARGE_GRAPH_MARK;
}

/* Mark (on) or unmark the handed-out large block at p as a graph pool's.
 * 0 if p is not a handed-out large block. */
int large_graph_mark(large_cache *c, uintptr_t p, int on);

/* The size class of the block starting at p in sl: sl's class for a slab,
 * the class block's for a segment, SLAB_LARGE for a large block. */
static inline unsigned large_block_class(const struct slab *sl, uintptr_t p) {
  if (sl->cls != SLAB_LARGE) return sl->cls;
  int k = large_class_of(sl, p);
  return k >= 0 ? (unsigned)k : SLAB_LARGE;
}

/* Checked mode: is the class block at p (large_class_of >= 0) handed out? */
static inline int large_class_is_used(const lseg *sg, uintptr_t p) {
  return (atomic_load_relaxed(&sg->ucls[(p - sg->base) / LARGE_QUANTUM]) & LARGE_CLASS_USED) != 0;
}

/* Checked mode: mark the class block at p (large_class_of >= 0) handed out
 * (used) or free; returns 0 if it already was (a double free, for free). */
static inline int large_class_mark(lseg *sg, uintptr_t p, int used) {
  _Atomic uint8_t *u = &sg->ucls[(p - sg->base) / LARGE_QUANTUM];
  if (used) return (atomic_fetch_or_explicit(u, LARGE_CLASS_USED, memory_order_relaxed) & LARGE_CLASS_USED) == 0;
  return (atomic_fetch_and_explicit(u, (uint8_t)~LARGE_CLASS_USED, memory_order_relaxed) & LARGE_CLASS_USED) != 0;
}

/* ---- memory lent to the span set (heap.c wires them) ----
 * want bytes (a power of two, a multiple of the span's chunk) of free
 * memory ready for every stream (after one round of queries if there is
 * none): a piece aligned to want of a hole (a free block holding no whole
 * granule) in a mapped granule, else a whole mapped granule of a free
 * block. It becomes a USED block with klass LARGE_KLASS_LENT, outside the
 * hash, its pages cleared in the page map: MAGPIE_OK, *base and *size
 * (want or the granule), LARGE_WOULD_MAP if there is none,
 * MAGPIE_ERR_OUT_OF_MEMORY (host). Taken under the span set's grow lock
 * (span.c); this lock stays a leaf. */
#define LARGE_KLASS_LENT UINT32_MAX
int large_lend_span(large_cache *c, size_t want, uintptr_t *base, size_t *size);
/* The memory lent at base comes back, free and ready for every stream
 * (its slabs' blocks all were), its pages the segment's again. */
void large_return_span(large_cache *c, uintptr_t base);

/* Pressure and trimming. */
/* Query the events of free blocks still waiting on a stream; merge those
 * that completed. Returns bytes that became ready. */
size_t large_reclaim(large_cache *c);
/* Block until every free block's epoch completed. Returns bytes waited for. */
size_t large_wait(large_cache *c);
/* Unmap up to want bytes of granules lying wholly in free ready blocks
 * (whole segments without VMM). Returns bytes given back. */
size_t large_release(large_cache *c, size_t want);

/* Where the large bytes are, walked under the lock. */
typedef struct large_account {
  size_t free_ready;   /* mapped bytes in free blocks any stream may use */
  size_t free_pending; /* mapped bytes in free blocks waiting on an epoch */
  size_t overhead;     /* mapped but outside segments' usable range */
} large_account;
void large_account_get(large_cache *c, large_account *out);

/* Append the large segments to a snapshot (JSON array elements). The state
 * of a handed-out block that no thread keeps (where a class block is:
 * "in_use", "thread", ...; "pending" for a block parked by record_stream)
 * comes from state_of, called under the lock (it must take no magpie
 * lock). */
typedef const char *(*large_state_fn)(void *ctx, uintptr_t p, uint64_t *stream);
void large_snapshot(large_cache *c, FILE *out, int *first, large_state_fn state_of, void *ctx);

#endif /* MAGPIE_LARGE_H */
