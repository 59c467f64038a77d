/* Graph pools (gpool.h): a set per device, under one lock. Allocations
 * during captures are few (a decode step's temporaries, once per capture)
 * and replays allocate nothing, so a lock and lists serve; the large layer
 * provides the memory.
 *
 * Lock order: gpool_set.lock is a leaf (see gpool.h). */
#include "pool/gpool.h"

#include "base/assert.h"
#include "base/meta.h"
#include "magpie.h"

#define GPOOL_HASH_MIN 64

void gpool_set_init(gpool_set *s) {
  pthread_mutex_init(&s->lock, NULL);
  s->pools = NULL;
  s->hash = NULL;
  s->hash_cap = 0;
  s->hash_count = 0;
  atomic_store_relaxed(&s->bytes, 0);
  atomic_store_relaxed(&s->used_bytes, 0);
  atomic_store_relaxed(&s->npools, 0);
}

MAGPIE_WRAPS static size_t gpool_slot(const gpool_set *s, uintptr_t p) {
  return (size_t)((p >> 12) * 0x9E3779B97F4A7C15ull >> 7) & (s->hash_cap - 1);
}

static gblock **gpool_find_ref(gpool_set *s, uintptr_t p) {
  if (s->hash_cap == 0) return NULL;
  for (gblock **r = &s->hash[gpool_slot(s, p)]; *r != NULL; r = &(*r)->hnext)
    if ((*r)->base == p) return r;
  return NULL;
}

/* Room for one more entry (doubling); MAGPIE_ERR_OUT_OF_MEMORY (host). */
static int gpool_hash_grow(gpool_set *s) {
  if (s->hash_count < s->hash_cap / 2) return MAGPIE_OK;
  size_t ncap = s->hash_cap ? 2 * s->hash_cap : GPOOL_HASH_MIN;
  gblock **nh = meta_alloc(ncap * sizeof *nh);
  if (nh == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  gblock **old = s->hash;
  size_t ocap = s->hash_cap;
  s->hash = nh;
  s->hash_cap = ncap;
  for (size_t i = 0; i < ocap; i++) {
    for (gblock *b = old[i], *next; b != NULL; b = next) {
      next = b->hnext;
      size_t k = gpool_slot(s, b->base);
      b->hnext = nh[k];
      nh[k] = b;
    }
  }
  meta_free(old);
  return MAGPIE_OK;
}

/* The INVARIANTs of gpool.h, walked whole (MAGPIE_ASSERT evaluates it in
 * debug builds only; lock held): every
 * block of every pool is in the hash and on its pool's list once, used
 * blocks carry no ticket, and the byte counts add up. */
__attribute__((unused)) static int gpool_consistent(gpool_set *s) {
  size_t bytes = 0, used = 0, blocks = 0;
  for (gpool *g = s->pools; g != NULL; g = g->next) {
    size_t gb = 0, gu = 0;
    for (gblock *b = g->blocks; b != NULL; b = b->pnext) {
      if (b->pool != g || (b->pnext != NULL && b->pnext->pprev != b)) return 0;
      if (b->used && b->ticket.rec != NULL) return 0;
      if (gpool_find_ref(s, b->base) == NULL) return 0;
      gb += b->size;
      if (b->used) gu += b->size;
      blocks++;
    }
    if (gb != g->bytes || gu != g->used_bytes) return 0;
    bytes += gb;
    used += gu;
  }
  return blocks == s->hash_count && bytes == atomic_load_relaxed(&s->bytes) &&
         used == atomic_load_relaxed(&s->used_bytes);
}

static gpool *gpool_find(gpool_set *s, uint64_t id) {
  for (gpool *g = s->pools; g != NULL; g = g->next)
    if (g->id == id) return g;
  return NULL;
}

int gpool_create(gpool_set *s, uint64_t id) {
  gpool *g = meta_alloc(sizeof *g);
  if (g == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  g->id = id;
  pthread_mutex_lock(&s->lock);
  g->next = s->pools;
  s->pools = g;
  atomic_add_relaxed(&s->npools, 1);
  pthread_mutex_unlock(&s->lock);
  return MAGPIE_OK;
}

/* A block leaves the set: off its pool's list and the hash; its ticket is
 * let go (limbo's synchronisation of the freeing stream's device, named in
 * its gpool_retired, covers its free). Lock held. */
static void gpool_unlink(gpool_set *s, gblock *b) {
  gpool *g = b->pool;
  if (b->pprev != NULL) b->pprev->pnext = b->pnext;
  else g->blocks = b->pnext;
  if (b->pnext != NULL) b->pnext->pprev = b->pprev;
  gblock **r = gpool_find_ref(s, b->base);
  if (r != NULL) {
    *r = b->hnext;
    s->hash_count--;
  }
  g->bytes -= b->size;
  atomic_sub_relaxed(&s->bytes, b->size);
  if (b->ticket.rec != NULL) epoch_ticket_release(&b->ticket);
}

/* Frees pool g if nothing keeps it: released, no capture, no block. */
static void gpool_maybe_drop(gpool_set *s, gpool *g) {
  if (!g->released || g->captures != 0 || g->blocks != NULL) return;
  for (gpool **r = &s->pools; *r != NULL; r = &(*r)->next) {
    if (*r == g) {
      *r = g->next;
      break;
    }
  }
  atomic_sub_relaxed(&s->npools, 1);
  meta_free(g);
}

/* Moves b out of the set onto *retired; MAGPIE_ERR_OUT_OF_MEMORY (host)
 * leaves it in the pool. Lock held. */
static int gpool_retire(gpool_set *s, gblock *b, gpool_retired **retired) {
  gpool_retired *r = meta_alloc(sizeof *r);
  if (r == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  r->base = b->base;
  r->size = b->size;
  r->dev = b->free_dev;
  r->next = *retired;
  *retired = r;
  gpool_unlink(s, b);
  meta_free(b);
  return MAGPIE_OK;
}

int gpool_capture(gpool_set *s, uint64_t id, int delta) {
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  int rc = MAGPIE_OK;
  if (g == NULL || (delta > 0 && g->released)) {
    rc = MAGPIE_ERR_INVALID_ARGUMENT;
  } else if (delta > 0) {
    g->captures++;
  } else if (g->captures > 0) {
    if (--g->captures == 0) g->quiet++;
    gpool_maybe_drop(s, g);
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  return rc;
}

/* May free block b serve a request of capture c on stream id st? Lock held. */
static int gpool_may_serve(const gpool *g, gblock *b, uint64_t c, uint64_t st) {
  if (b->free_capture != 0) return (b->free_capture == c && b->free_stream == st) || b->free_quiet < g->quiet;
  if (b->ticket.rec == NULL) return 1;
  if (c == 0 && b->free_stream == st) return 1;
  return epoch_ready(&b->ticket, EPOCH_NO_STREAM) != EPOCH_PENDING;
}

/* Free block b of pool g handed out (to capture; 0: none): its ticket let
 * go, the pool's and the set's used bytes counted. Lock held. */
static void gpool_hand_out(gpool_set *s, gpool *g, gblock *b, uint64_t capture) {
  b->used = 1;
  b->captured |= capture != 0;
  if (b->ticket.rec != NULL) epoch_ticket_release(&b->ticket);
  b->ticket = (epoch_ticket){0};
  g->used_bytes += b->size;
  atomic_add_relaxed(&s->used_bytes, b->size);
}

int gpool_take(gpool_set *s, uint64_t id, size_t need, uint64_t capture, uint64_t stream, uintptr_t *out,
               size_t *bsize) {
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  if (g == NULL || g->released) {
    pthread_mutex_unlock(&s->lock);
    return MAGPIE_ERR_INVALID_ARGUMENT;
  }
  gblock *best = NULL;
  size_t most = need + need / 4;
  for (gblock *b = g->blocks; b != NULL; b = b->pnext) {
    if (b->used || b->size < need || b->size > most) continue;
    if (best != NULL && b->size >= best->size) continue;
    if (gpool_may_serve(g, b, capture, stream)) best = b;
  }
  int rc = GPOOL_NONE;
  if (best != NULL) {
    gpool_hand_out(s, g, best, capture);
    *out = best->base;
    *bsize = best->size;
    rc = MAGPIE_OK;
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int gpool_add(gpool_set *s, uint64_t id, uintptr_t p, size_t size, uint64_t capture) {
  gblock *b = meta_alloc(sizeof *b);
  if (b == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  b->base = p;
  b->size = size;
  b->used = 1;
  b->captured = capture != 0;
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  int rc = g == NULL || g->released ? MAGPIE_ERR_INVALID_ARGUMENT : gpool_hash_grow(s);
  if (rc == MAGPIE_OK) {
    b->pool = g;
    b->pnext = g->blocks;
    if (g->blocks != NULL) g->blocks->pprev = b;
    g->blocks = b;
    size_t k = gpool_slot(s, p);
    b->hnext = s->hash[k];
    s->hash[k] = b;
    s->hash_count++;
    g->bytes += size;
    g->used_bytes += size;
    atomic_add_relaxed(&s->bytes, size);
    atomic_add_relaxed(&s->used_bytes, size);
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  if (rc != MAGPIE_OK) meta_free(b);
  return rc;
}

int gpool_free(gpool_set *s, uintptr_t p, uint64_t capture, uint64_t stream, int dev, epoch_ticket *t, size_t *bsize,
               gpool_retired **retired) {
  *retired = NULL;
  pthread_mutex_lock(&s->lock);
  gblock **r = gpool_find_ref(s, p);
  int rc = MAGPIE_OK;
  if (r == NULL) {
    rc = MAGPIE_ERR_INVALID_POINTER;
  } else if (!(*r)->used) {
    rc = MAGPIE_ERR_DOUBLE_FREE;
  } else {
    gblock *b = *r;
    gpool *g = b->pool;
    *bsize = b->size;
    b->used = 0;
    g->used_bytes -= b->size;
    atomic_sub_relaxed(&s->used_bytes, b->size);
    b->free_capture = capture;
    b->free_stream = stream;
    b->free_dev = dev;
    b->free_quiet = g->quiet;
    b->ticket = t != NULL ? *t : (epoch_ticket){0};
    if (t != NULL) *t = (epoch_ticket){0}; /* taken over */
    if (g->released && gpool_retire(s, b, retired) == MAGPIE_OK) gpool_maybe_drop(s, g);
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int gpool_release(gpool_set *s, uint64_t id, gpool_retired **retired) {
  *retired = NULL;
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  int rc = MAGPIE_OK;
  if (g == NULL || g->released) {
    rc = MAGPIE_ERR_INVALID_ARGUMENT;
  } else {
    g->released = 1;
    for (gblock *b = g->blocks, *next; b != NULL; b = next) {
      next = b->pnext;
      if (!b->used && gpool_retire(s, b, retired) != MAGPIE_OK) break; /* host OOM: the rest at their frees */
    }
    gpool_maybe_drop(s, g);
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  return rc;
}

void gpool_retired_free(gpool_retired *r) {
  for (gpool_retired *next; r != NULL; r = next) {
    next = r->next;
    meta_free(r);
  }
}

size_t gpool_pool_bytes(gpool_set *s, uint64_t id) {
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  size_t n = g != NULL ? g->bytes : 0;
  pthread_mutex_unlock(&s->lock);
  return n;
}

int gpool_take_at(gpool_set *s, uint64_t id, uintptr_t p, size_t *bsize) {
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  gblock **r = gpool_find_ref(s, p);
  int rc = MAGPIE_OK;
  if (g == NULL || g->released) {
    rc = MAGPIE_ERR_INVALID_ARGUMENT;
  } else if (r == NULL || (*r)->pool != g) {
    rc = MAGPIE_ERR_INVALID_POINTER;
  } else if ((*r)->used) {
    rc = MAGPIE_ERR_DOUBLE_FREE;
  } else {
    gpool_hand_out(s, g, *r, 0);
    *bsize = (*r)->size;
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int gpool_trim(gpool_set *s, uint64_t id, gpool_retired **retired) {
  *retired = NULL;
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  int rc = g == NULL || g->released ? MAGPIE_ERR_INVALID_ARGUMENT : MAGPIE_OK;
  for (gblock *b = rc == MAGPIE_OK ? g->blocks : NULL, *next; b != NULL; b = next) {
    next = b->pnext;
    if (!b->used && !b->captured && gpool_retire(s, b, retired) != MAGPIE_OK) break; /* host OOM: kept */
  }
  MAGPIE_ASSERT(gpool_consistent(s));
  pthread_mutex_unlock(&s->lock);
  return rc;
}

int gpool_blocks(gpool_set *s, uint64_t id, gpool_info *out, size_t cap, size_t *count) {
  pthread_mutex_lock(&s->lock);
  gpool *g = gpool_find(s, id);
  size_t n = 0;
  for (gblock *b = g != NULL ? g->blocks : NULL; b != NULL; b = b->pnext, n++)
    if (n < cap) out[n] = (gpool_info){b->base, b->size, b->used};
  pthread_mutex_unlock(&s->lock);
  *count = n;
  return g != NULL ? MAGPIE_OK : MAGPIE_ERR_INVALID_ARGUMENT;
}
