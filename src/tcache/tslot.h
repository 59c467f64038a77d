/* A thread cache's layout: its stream slots (tslot), the magazines it
 * drained and carries while it takes turns on many streams (tsealed, carry;
 * tcache/tdrain.c), and the fields the give-back handshake shares with
 * reclaimers (tcache.h). Types and owner-only counters; the fast paths
 * are in tcache.h, the slow paths in tcache_alloc.c and tcache_free.c.
 *
 * INVARIANT: every block in a slot's loaded/prev/outbox may be used by work
 *            enqueued on the slot's stream after now.
 * INVARIANT: every block in tcache.carry may be used by any stream now; in
 *            an armed slot, the bottom clean[c] - k blocks of loaded[c]
 *            (k: the class's allocations through the slot since
 *            clean_mark[c]) are carried blocks no one touched since. */
#ifndef MAGPIE_TSLOT_H
#define MAGPIE_TSLOT_H

#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/sizeclass.h"
#include "device/backend.h"
#include "heap/heap.h"
#include "pool/magazine.h"

#define TCACHE_SLOTS 32

/* The outbox (tslot.outbox): full magazines leaving loaded/prev wait
 * there, for this stream's next allocations of their class, until
 * TCACHE_OUTBOX of them or TCACHE_OUTBOX_BYTES wait, for a thread that
 * allocates on this stream alone (TCACHE_OUTBOX_CONTENDED_BYTES under
 * contention, below), or TCACHE_OUTBOX_FEW(_BYTES) for one on
 * several, whose slots strand what they hold while it works elsewhere;
 * then one seal sends them all to the depot, as a seal per magazine made
 * event records a large share of a thread's time (bench/DECISIONS.md, "One
 * seal for an outbox of magazines"). It also leaves, with the slot's kept
 * large blocks and class blocks, before an allocation of the slot would
 * map device memory (tcache_own_out), so what a thread caches never makes
 * the device's memory grow; sealing it at every refill instead sent a
 * thread's mixed sizes around through the depot and the segments' lock
 * (bench/DECISIONS.md, "A thread's caches go back before memory grows"). */
/* Empty magazines a thread keeps per class (tcache.spare): a thread whose
 * class blocks come and go through its outbox took an empty magazine from
 * the shared stacks at each free that filled one and gave one back at each
 * refill, and many threads contended on those stacks (bench/DECISIONS.md,
 * "Empty magazines kept per thread"). */
#define TCACHE_SPARES 4
#define TCACHE_OUTBOX 64
#define TCACHE_OUTBOX_BYTES ((size_t)8 << 20)
/* While threads contend on the class blocks' paths (tslot.seg_two) and
 * TCACHE_OUTBOX_CONTENDED_THREADS or more have caches, a thread's outbox
 * holds up to TCACHE_OUTBOX_CONTENDED_BYTES: each seal's magazines go
 * through the depot and the segments' lock to other threads, which is
 * what contending threads wait on; with fewer threads it held more than
 * the memory bound allows (bench/DECISIONS.md, "A larger outbox while
 * threads contend"). */
#define TCACHE_OUTBOX_CONTENDED_BYTES ((size_t)12 << 20)
#define TCACHE_OUTBOX_CONTENDED_THREADS 8
#define TCACHE_OUTBOX_FEW 8
#define TCACHE_OUTBOX_FEW_BYTES ((size_t)1 << 20)
/* A thread that allocates on one stream keeps large blocks freed on it
 * (the first of at most TCACHE_KEEP_MAX, more up to TCACHE_KEEP_BLOCKS
 * while all it keeps stays within TCACHE_KEEP_MORE) for that stream's next
 * large allocations that one fits within an eighth: the same stream reuses
 * it at once, with no event and no lock, as it reuses small blocks. Only
 * such threads: the blocks are stranded, like a slot's magazines, while
 * their thread works on other streams. They all go under one seal before
 * an allocation of the slot would map (above), and at one that none of
 * TCACHE_KEEP_MISS or more fits: their sizes do not match what the thread
 * asks for, and threads keeping such blocks held far more than their
 * peaks; letting them go at every miss sent blocks of varying sizes
 * through the large cache's lock (bench/DECISIONS.md, "A
 * thread's caches go back before memory grows"). A thread keeping one
 * block recorded an event for each large free while it kept one
 * (bench/DECISIONS.md, "A thread keeps up to four large blocks, let go
 * under one seal"). */
#define TCACHE_KEEP_MAX ((size_t)64 << 20)
#define TCACHE_KEEP_BLOCKS 16
#define TCACHE_KEEP_MORE ((size_t)32 << 20)
#define TCACHE_KEEP_MISS 4
/* The large blocks a slot handed out lent that it remembers (tslot.lent):
 * their frees on its stream keep them without the large cache's lock. */
#define TCACHE_LENT 32

typedef struct tclass {
  magazine *loaded;
  _Atomic uint64_t hits;   /* allocations served by the fast path */
  _Atomic uint64_t misses; /* and by the slow path */
  /* The fewest blocks loaded held since a slow path last looked (tcache.c,
   * tcache_note_held). Owner only. */
  uint32_t low;
} tclass;

/* Refills of class blocks without new contention after which a slot keeps
 * one magazine of a class again (tslot.seg_two). */
#define TCACHE_QUIET_REFILLS 64

typedef struct tslot {
  uint64_t id;           /* stream id; meaningful while heap != NULL */
  cudaStream_t handle;   /* handle the slot was created with */
  heap *heap;            /* heap of the cached blocks; NULL = unused slot */
  int sdev;              /* the stream's device (heap's, or another for a cross-device free) */
  stream_rec *rec;       /* the stream's record (one reference held) */
  _Atomic int64_t *live; /* this thread's in-use counter for heap's device */
  /* Bytes this thread took through this slot less those it gave back
   * through it (allocations and frees; owner only), and the level at
   * which a free drains the slot (tcache_slot_drain): INT64_MIN (never)
   * unless the slot was armed when its thread last moved to it from
   * another stream (tdrain.c, tdrain_arm), then the level of that
   * moment. Beside `live`: the fast paths touch both. */
  int64_t held;
  int64_t drain_at;
  int alloc_ok; /* heap is the stream's own device */
  /* Nothing of the slot's needs a seal: every loaded magazine is the
   * sentinel and every prev[c] empty or the sentinel (set when the slot is
   * cleared or drained; cleared by the slow paths that give it blocks,
   * the only way in while every loaded magazine is the sentinel). The
   * outbox and the kept large block are checked on their own. Owner
   * only. */
  int drained;
  /* Per class, what an allocation reads and writes: the loaded magazine
   * and the allocation counts. Side by side, so that a class whose lines
   * went out of the cache (a thread taking turns on several streams) costs
   * one miss here. Counts: owner-written (relaxed load + store); read by
   * statistics under tcache_st.list_lock; folded into the heap when the slot
   * retires. */
  tclass cl[SIZECLASS_COUNT];
  magazine *prev[SIZECLASS_COUNT];
  /* Full magazines that left loaded/prev on a free, not sealed yet: one
   * event seals them all once TCACHE_OUTBOX of them or TCACHE_OUTBOX_BYTES
   * wait, before the slot's allocation would map device memory, and with a
   * large block's free (tcache_slots.c, tcache_outbox_seal); an allocation
   * of their class takes one back first (no seal needed on the slot's own
   * stream). They count as the thread's until sealed. Owner only.
   * INVARIANT: as for loaded/prev, every block in them may be used by work
   * enqueued on the slot's stream after now; out_bytes is the sum of
   * depot_magazine_bytes over outbox[0..nout). */
  magazine *outbox[TCACHE_OUTBOX];
  uint32_t nout;
  size_t out_bytes;
  /* The large blocks kept for this stream, lkeep[0..nkeep) (TCACHE_KEEP_*;
   * LARGE_KEPT in the large layer; tcache.kept names this slot while nkeep
   * > 0), and their bytes. They leave with the slot's magazines, sealed on
   * a caller's handle or to limbo, or for a large allocation none fits.
   * Owner only. INVARIANT: as for the magazines; keep_bytes is the sum of
   * their sizes. */
  lblock *lkeep[TCACHE_KEEP_BLOCKS];
  /* lkeep[i]'s size, beside the pointers: an allocation compares every
   * kept block's size, and the blocks' own lines are the large layer's
   * (tcache_kept_attach keeps them equal; bench/DECISIONS.md, "The
   * large path's searches and a class block's class read fewer lines").
   * Owner only. */
  size_t lkeep_size[TCACHE_KEEP_BLOCKS];
  uint32_t nkeep;
  size_t keep_bytes;
  /* The large blocks this slot last handed out lent (a kept block handed
   * out again, or a new block: large_lend; up to TCACHE_LENT, the oldest
   * replaced first): each one's base in lent_base (0: no entry), apart
   * from the rest so that a free's search reads four lines, not sixteen
   * (bench/DECISIONS.md, as for lkeep_size), and its block, size and the
   * word large_rekeep expects in lent. Its free on
   * this slot's stream keeps it again without the large cache's lock; the
   * word decides whether it still may (pool/large.h, lblock.kept), so a
   * stale entry costs one failed compare-and-swap. Owner only. */
  uintptr_t lent_base[TCACHE_LENT];
  struct tslot_lent {
    lblock *b;
    size_t size;
    uint64_t word;
  } lent[TCACHE_LENT];
  uint32_t lent_next; /* the next entry to fill: the oldest (below TCACHE_LENT) */
  /* Per class, while the slot is armed: how many blocks at the bottom of
   * the loaded magazine were ready for every stream when it was installed
   * (a carried magazine's count: tcache.carry; 0 for any other), and the
   * class's allocation count then. Allocations pop from the top, so after
   * k more of them at least the bottom clean - k blocks are the same
   * untouched ones (tcache_slot_drain). Owner only. */
  uint8_t clean[SIZECLASS_COUNT];
  uint64_t clean_mark[SIZECLASS_COUNT];
  /* Bit c: class c's loaded or prev magazine may be real (set by the slow
   * paths that install one; a drain and a clear recompute it), so that a
   * drain and a recycle look at the classes the slot used only. Owner
   * only. */
  uint64_t used;
  /* Bit c: when a magazine of class blocks of class c last left this slot
   * (tcache.c, a free finding it full), the slot had allocated at least as
   * many blocks of the class as had left it: its blocks come and go here,
   * and what leaves is the thread's surplus, which goes back to the
   * segments (heap_put). Clear: more leave than it took, so blocks flow
   * through it (another thread or stream allocates them), and they go to
   * the depot, where the allocating side takes them with no lock. Owner
   * only. */
  uint64_t round_trip;
  /* Class blocks (the classes without slabs): 1 while the slot keeps a
   * second magazine of a class, as of every other class, and a larger
   * outbox (TCACHE_OUTBOX_CONTENDED_BYTES), if its thread is on its stream
   * alone (tcache_keeps_for). Set when a refill of class
   * blocks finds that threads contended on their paths since the slot last
   * looked (heap_class_contention: contention_seen, UINT64_MAX before its
   * first look), cleared after TCACHE_QUIET_REFILLS such refills without:
   * at one thread a second magazine saves exchanges that cost little, and
   * its blocks pin the granules they sit in (bench/DECISIONS.md, "A second
   * magazine of class blocks while threads contend"). Owner only. */
  uint8_t seg_two;
  uint32_t seg_quiet;
  uint64_t contention_seen;
  /* Per class, the class blocks that left this slot in full magazines;
   * round_trip's bit is set while they are no more than the slot's
   * allocations of the class. Owner only. */
  uint64_t out_blocks[SIZECLASS_COUNT];
  /* Capacity of the empty magazines this slot takes for its frees, per
   * class (mag_cap..mag_max), the class's allocation count at the last
   * exchange with the depot, and the frees in a row (no allocation between)
   * that ended at exchanges since the last growth. Owner only. */
  uint8_t cap[SIZECLASS_COUNT];
  uint64_t mark[SIZECLASS_COUNT];
  uint8_t run[SIZECLASS_COUNT];
  /* Entries into this slot from another since its last decay. Owner
   * only. */
  uint32_t entries;
  /* Per class: the blocks a refill keeps, the rest going back through the
   * outbox (tcache.c, tcache_refill_trim), halved by a decay that sheds
   * blocks and doubled by one after the slot ran out; 0: all of them.
   * INVARIANT: 0 or below the class's starting capacity. Owner only. */
  uint8_t fill[SIZECLASS_COUNT];
  /* Per class: prev's count when a slow path last looked, and the fewest
   * blocks loaded and prev held together since the last decay. Owner
   * only. */
  uint8_t pcount[SIZECLASS_COUNT];
  uint8_t lows[SIZECLASS_COUNT];
  uint64_t emptied; /* bit c: class c refilled since the last decay */
  /* heap, for statistics readers (owner-written, relaxed; a reader may
   * miss a slot being set up or retired). */
  _Atomic(heap *) stats_heap;
} tslot;

/* A magazine a thread drained from one of its slots (tcache.c,
 * tcache_slot_drain), sealed, with the heap it belongs to. */
typedef struct tsealed {
  magazine *m;
  heap *h;
  /* 1: sealed by the previous entry's seal, whose ticket that entry
   * holds (m->ticket is empty). INVARIANT: the oldest entry has 0. */
  int same;
} tsealed;

/* At most this many drained magazines wait in a thread (tcache.sealed)
 * for their seals to complete; the oldest goes to the depot's pending
 * stack when another comes. */
#define TCACHE_SEALED 128

/* tcache.steal's bits (below). */
#define TCACHE_CLAIMED 1u
#define TCACHE_ASKED 2u
#define TCACHE_RECORDED 4u

typedef struct tcache {
  /* Owner: 1 (relaxed store) on entry to any operation, 0 (release store,
   * pairing with the reclaimer's acquire load after its membarrier) on
   * exit. */
  _Atomic uint32_t busy;
  /* Three bits; any bit set sends the owner's fast paths (tcache_enter) to
   * the slow path, so the fast paths read one word.
   * TCACHE_CLAIMED: a reclaimer decides and possibly takes this cache's
   * magazines. Set (fetch_or, acq_rel, under tcache_st.list_lock: it acquires
   * the previous reclaimer's release) only while clear; cleared (fetch_and,
   * release) by that reclaimer when done, pairing with the owner's acquire
   * loads in tcache_enter and tcache_enter_slow, which come after the owner
   * marked itself busy, and with the next reclaimer's fetch_or.
   * TCACHE_ASKED: a reclaimer that found the owner busy asks it to give
   * back its magazines (fetch_or, relaxed, while it holds the claim). The
   * owner gives back at its next operation's slow path and then clears it
   * (fetch_and, release), pairing with a later reclaimer's acquiring
   * fetch_or: a clear bit seen by the reclaimer means the magazines are in
   * limbo. A reclaimer that takes an idle cache clears it too.
   * TCACHE_RECORDED: the owner freed small blocks with recorded streams
   * (record.h) that may still be parked; its allocations look for them on
   * their slow path (tcache_claim_recorded). Set and cleared by the owner
   * only (relaxed fetch_or / fetch_and: the word is shared with the
   * reclaimers' bits); it orders nothing. */
  _Atomic uint32_t steal;
  /* Owner: 1 (relaxed) once it is itself down the heap's ladder of relief
   * past the give-back step (tcache_reclaim_threads, where it gave back
   * its own magazines), 0 at its next slow path or when the allocation
   * returns. Reclaimers read it (relaxed) and do not wait for such a
   * thread: two of them would otherwise wait for each other. */
  _Atomic uint32_t relieving;
  /* The slot and stream of the refill or large allocation in progress
   * (NULL outside one), for the give-back step: the heap's calls leave
   * the cache as it was at the call, so its own magazines can go back
   * there as after the call (tcache_give_back_own). Owner only. */
  tslot *relief_slot;
  cudaStream_t relief_stream;
  tslot *last;     /* the fast paths' slot */
  tslot *kept;     /* the slot keeping large blocks (tslot.lkeep), or NULL */
  uint32_t nalloc; /* alloc-capable slots in use (nonzero alloc_id entries) */
  const backend_ops *ops;
  int check;
  unsigned next_evict;
  uint64_t recorded_poll_ns; /* the last tcache_claim_recorded query; owner only (past the fast paths' line) */
  /* Bytes handed out minus freed by this thread, per device. Written by the
   * owner only (relaxed load + store); read (relaxed) by statistics under
   * tcache_st.list_lock. */
  _Atomic int64_t live[HEAP_MAX_DEVICES];
  /* Bytes of the large blocks this thread keeps (tcache.kept), per device:
   * freed, not in use. Written by whoever owns the cache (the owner, or a
   * reclaimer while the owner is out: tcache_empty_heap), relaxed load +
   * store; read (relaxed) by statistics under tcache_st.list_lock. A counter
   * in the heap took two locked read-modify-writes per pair of a kept
   * block's allocation and free. */
  _Atomic int64_t kept_bytes[HEAP_MAX_DEVICES];
  int64_t published[HEAP_MAX_DEVICES]; /* owner only */
  struct tcache *lnext, *lprev;        /* under tcache_st.list_lock */
  /* Per slot, so that the slow paths find a slot without touching every
   * slot's lines: the id and handle of an alloc-capable slot, 0 and
   * UINTPTR_MAX for any other. Owner only; after the fast paths' fields,
   * which share the first cache line. */
  uint64_t alloc_id[TCACHE_SLOTS];
  cudaStream_t alloc_handle[TCACHE_SLOTS];
  /* Drained magazines, oldest first: a ring of sealed_n entries from
   * sealed_head. They count as the thread's until they leave for the
   * depot: as ready ones once their seal completed (tcache_sealed_promote,
   * before a refill), as pending ones when the ring is full, and all of a
   * heap's when the thread gives back (its exit, a reclaimer, pressure).
   * drains counts tcache_slot_drain calls; head_pending is drains when
   * the oldest entry was last found pending (one query per drain at
   * most). Owner only (or a reclaimer while the owner is out).
   * INVARIANT: every entry's magazine holds blocks and a ticket. */
  tsealed sealed[TCACHE_SEALED];
  uint32_t sealed_head, sealed_n;
  uint64_t drains, head_pending;
  /* Blocks of carry_heap ready for every stream, per class, that the
   * thread carries from stream to stream while it drains its slots: an
   * armed slot takes them as its loaded magazines, and a drain gives back
   * what of them is untouched; completed drained magazines join them.
   * NULL or a magazine with blocks and no ticket. Owner only (or a
   * reclaimer while the owner is out). */
  magazine *carry[SIZECLASS_COUNT];
  heap *carry_heap;
  /* Per class, up to TCACHE_SPARES empty magazines, spare[c][0..nspare[c]),
   * kept for the thread's next frees that need one (a full magazine
   * leaving for the outbox) and drains' splits, and given back there by
   * refills (tcache_spare_take / tcache_spare_give). Owner only. */
  magazine *spare[SIZECLASS_COUNT][TCACHE_SPARES];
  uint8_t nspare[SIZECLASS_COUNT];
  tslot dummy;
  tslot slots[TCACHE_SLOTS];
} tcache;

/* Bytes handed out (delta > 0) or given back through slot ts: the thread's
 * count for the device and the slot's own (both owner-only). */
static inline void tslot_count(tslot *ts, int64_t delta) {
  atomic_owner_add_i64(ts->live, delta);
  ts->held += delta;
}

/* Allocations of class c through slot ts so far. */
static inline uint64_t tslot_allocs(const tslot *ts, unsigned c) {
  return atomic_load_relaxed(&ts->cl[c].hits) + atomic_load_relaxed(&ts->cl[c].misses);
}

/* An empty magazine of class c: one the thread kept (tcache.spare), else
 * a shared one; NULL if host memory ran out. */
static inline magazine *tcache_spare_take(tcache *tc, unsigned c) {
  if (tc->nspare[c] == 0) return magazine_get_empty(c);
  magazine *m = tc->spare[c][--tc->nspare[c]];
  m->cap = sizeclass_table[c].mag_cap; /* as a shared one's */
  return m;
}
/* An empty magazine (or the sentinel) the thread no longer needs: kept
 * while it keeps fewer than TCACHE_SPARES of its class, else shared. */
static inline void tcache_spare_give(tcache *tc, magazine *m) {
  if (!magazine_is_real(m)) return;
  MAGPIE_ASSERT(m->ticket.rec == NULL);
  m->count = 0;
  if (tc->nspare[m->cls] < TCACHE_SPARES) tc->spare[m->cls][tc->nspare[m->cls]++] = m;
  else magazine_put_empty(m);
}
/* Thread exit: the thread's spare empty magazines go back to the shared
 * stacks. */
static inline void tcache_spare_release(tcache *tc) {
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++)
    while (tc->nspare[c] > 0) magazine_put_empty(tc->spare[c][--tc->nspare[c]]);
}

#endif /* MAGPIE_TSLOT_H */
