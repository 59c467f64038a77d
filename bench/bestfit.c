/* The best-fit reference for memory (allocators.h, "bestfit"): what an
 * ideal stream-blind allocator would hold on the same sequence.
 *
 * One address range, blocks of the request rounded to 256 bytes carved
 * best fit (the fewest 2 MiB granules not yet holding a live block, then
 * the smallest free block; from whichever end of it needs fewer), split and
 * merged with free neighbours at once. A granule counts as reserved exactly
 * while a live block lies in it: a free granule is given back the moment
 * it empties, and a freed block serves any stream at once. No size
 * classes, no caches, no waiting for a stream's work: what a best fit
 * holds with none of an allocator's costs for speed or stream safety, the
 * reference magpie's reserved / live figure is read against. It is not a
 * proven lower bound: another placement could hold a little more or less
 * on a given sequence (on one thread of workload 2's sequence, variants
 * of its placement rule held 1.22 to 1.28 times the peak live bytes).
 *
 * It hands out addresses that name no memory: only workloads that never
 * touch their blocks (2 and 5) run it. One mutex; its speed is not a
 * reference. Free blocks sit in bins by size (four per power of two), as
 * magpie's large blocks do, so that a fit is found without walking every
 * block. */
#include "bench/bestfit.h"

#include "bench/bench_util.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define BF_ALIGN ((uintptr_t)256)
#define BF_GRANULE ((uintptr_t)2 << 20)
#define BF_BASE ((uintptr_t)1 << 44) /* the range's start: an address nothing maps */
#define BF_SPAN ((uintptr_t)1 << 42) /* its length */
#define BF_BINS 256
#define BF_HASH 65536

/* INVARIANT: the blocks tile [BF_BASE, BF_BASE + BF_SPAN) in address order;
 *            no two free blocks are neighbours; a free block is in the bin
 *            of its size, a used one in the hash. */
typedef struct bf_block {
  uintptr_t base;
  size_t size;
  int used;
  struct bf_block *prev, *next;   /* address order */
  struct bf_block *fprev, *fnext; /* bin list */
  struct bf_block *hnext;         /* hash chain */
} bf_block;

static struct {
  pthread_mutex_t lock;
  bf_block *bins[BF_BINS];
  bf_block *hash[BF_HASH];
  uint32_t *live; /* per granule: live bytes in it (granules up to `ngran`) */
  size_t ngran;
  uint64_t reserved, peak; /* granules */
  int ready;
} bf = {.lock = PTHREAD_MUTEX_INITIALIZER};

static unsigned bf_bin_of(size_t size) {
  size_t u = size / BF_ALIGN;
  if (u < 8) return (unsigned)u;
  unsigned fl = 63u - (unsigned)__builtin_clzll((unsigned long long)u);
  return 8u + (fl - 3u) * 4u + ((unsigned)(u >> (fl - 2u)) & 3u);
}

static void bf_link(bf_block *b) {
  bf_block **head = &bf.bins[bf_bin_of(b->size)];
  b->fprev = NULL;
  b->fnext = *head;
  if (*head) (*head)->fprev = b;
  *head = b;
}

static void bf_unlink(bf_block *b) {
  if (b->fprev) b->fprev->fnext = b->fnext;
  else bf.bins[bf_bin_of(b->size)] = b->fnext;
  if (b->fnext) b->fnext->fprev = b->fprev;
}

BENCH_WRAPS static bf_block **bf_slot(uintptr_t base) {
  return &bf.hash[(base / BF_ALIGN * 0x9E3779B97F4A7C15ull) >> 48];
}

/* Granules [first, last] of [a, a + n). */
static void bf_granules(uintptr_t a, size_t n, size_t *first, size_t *last) {
  *first = (a - BF_BASE) / BF_GRANULE;
  *last = (a + n - 1 - BF_BASE) / BF_GRANULE;
}

/* Room in the per-granule table for granule g. */
static int bf_grow_table(size_t g) {
  if (g < bf.ngran) return 0;
  size_t n = bf.ngran ? bf.ngran : 1024;
  while (n <= g) n *= 2;
  uint32_t *t = realloc(bf.live, n * sizeof *t);
  if (t == NULL) return -1;
  memset(t + bf.ngran, 0, (n - bf.ngran) * sizeof *t);
  bf.live = t;
  bf.ngran = n;
  return 0;
}

/* Granules of [a, a + n) holding no live block. */
static size_t bf_cost(uintptr_t a, size_t n) {
  size_t first, last, cost = 0;
  bf_granules(a, n, &first, &last);
  for (size_t g = first; g <= last; g++) cost += g >= bf.ngran || bf.live[g] == 0;
  return cost;
}

/* Count [a, a + n) as live (sign 1) or no longer (-1). Its granules are
 * in the table: bestfit_alloc made room before it carved the block. */
static void bf_account(uintptr_t a, size_t n, int sign) {
  size_t first, last;
  bf_granules(a, n, &first, &last);
  for (size_t g = first; g <= last; g++) {
    uintptr_t gs = BF_BASE + g * BF_GRANULE, ge = gs + BF_GRANULE;
    uintptr_t s = gs > a ? gs : a, e = ge < a + n ? ge : a + n;
    uint32_t was = bf.live[g];
    bf.live[g] = sign > 0 ? was + (uint32_t)(e - s) : was - (uint32_t)(e - s);
    if (was == 0 && bf.live[g] != 0 && ++bf.reserved > bf.peak) bf.peak = bf.reserved;
    if (was != 0 && bf.live[g] == 0) bf.reserved--;
  }
}

static int bf_setup(void) {
  bf_block *b = calloc(1, sizeof *b);
  if (b == NULL) return -1;
  b->base = BF_BASE;
  b->size = BF_SPAN;
  bf_link(b);
  bf.ready = 1;
  return 0;
}

void *bestfit_alloc(size_t size) {
  size_t need = (size + BF_ALIGN - 1) & ~(BF_ALIGN - 1);
  if (need == 0) need = BF_ALIGN;
  void *out = NULL;
  pthread_mutex_lock(&bf.lock);
  if (!bf.ready && bf_setup() != 0) goto done;
  bf_block *best = NULL;
  size_t best_cost = 0;
  int at_end = 0;
  for (unsigned k = bf_bin_of(need); k < BF_BINS; k++) {
    for (bf_block *b = bf.bins[k]; b; b = b->fnext) {
      if (b->size < need) continue;
      size_t c0 = bf_cost(b->base, need), c1 = bf_cost(b->base + b->size - need, need);
      size_t c = c1 < c0 ? c1 : c0;
      if (best == NULL || c < best_cost || (c == best_cost && b->size < best->size)) {
        best = b;
        best_cost = c;
        at_end = c1 < c0;
      }
    }
    if (best != NULL && best_cost == 0) break; /* a fit in memory held already: the rest of the bins are larger */
  }
  if (best == NULL) goto done;
  uintptr_t ubase = at_end ? best->base + best->size - need : best->base;
  size_t gfirst, glast;
  bf_granules(ubase, need, &gfirst, &glast);
  if (bf_grow_table(glast) != 0) goto done; /* out of host memory: a failed allocation */
  bf_block *u = best;
  if (best->size > need) {
    if ((u = calloc(1, sizeof *u)) == NULL) goto done;
    bf_unlink(best);
    u->size = need;
    best->size -= need;
    if (at_end) {
      u->base = best->base + best->size;
      u->prev = best;
      u->next = best->next;
      if (u->next) u->next->prev = u;
      best->next = u;
    } else {
      u->base = best->base;
      best->base += need;
      u->prev = best->prev;
      u->next = best;
      if (u->prev) u->prev->next = u;
      best->prev = u;
    }
    bf_link(best);
  } else {
    bf_unlink(best);
  }
  bf_account(u->base, u->size, 1);
  u->used = 1;
  bf_block **slot = bf_slot(u->base);
  u->hnext = *slot;
  *slot = u;
  out = (void *)u->base;
done:
  pthread_mutex_unlock(&bf.lock);
  return out;
}

/* Fold free block b into a, its free lower neighbour. */
static void bf_absorb(bf_block *a, bf_block *b) {
  bf_unlink(a);
  bf_unlink(b);
  a->size += b->size;
  a->next = b->next;
  if (b->next) b->next->prev = a;
  bf_link(a);
  free(b);
}

void bestfit_free(void *p) {
  pthread_mutex_lock(&bf.lock);
  bf_block **pp = bf_slot((uintptr_t)p);
  while (*pp && (*pp)->base != (uintptr_t)p) pp = &(*pp)->hnext;
  bf_block *b = *pp;
  if (b != NULL) {
    *pp = b->hnext;
    bf_account(b->base, b->size, -1);
    b->used = 0;
    bf_link(b);
    if (b->next && !b->next->used) bf_absorb(b, b->next);
    if (b->prev && !b->prev->used) bf_absorb(b->prev, b);
  }
  pthread_mutex_unlock(&bf.lock);
}

void bestfit_reset_peak(void) {
  pthread_mutex_lock(&bf.lock);
  bf.peak = bf.reserved;
  pthread_mutex_unlock(&bf.lock);
}

uint64_t bestfit_peak_reserved(void) {
  pthread_mutex_lock(&bf.lock);
  uint64_t peak = bf.peak * BF_GRANULE;
  pthread_mutex_unlock(&bf.lock);
  return peak;
}
