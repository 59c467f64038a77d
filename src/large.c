/* Large-block path. Lock order: large_cache.lock is a leaf; no driver call
 * under it. */
#include "large.h"

#include "epoch.h"
#include "heap.h"
#include "slab.h"

void large_init(large_cache *c) {
  pthread_mutex_init(&c->lock, NULL);
  c->free = NULL;
  atomic_store_relaxed(&c->cached_bytes, 0);
  atomic_store_relaxed(&c->in_use_bytes, 0);
}

/* Reuse bound: a cached block may be up to a quarter larger than needed. */
static int large_fits(const slab *s, size_t need) {
  return s->size >= need && s->size - need <= need / 4;
}

/* Ready without a driver call? */
static int large_ready_cheap(const slab *s, uint64_t stream_id) {
  const epoch_ticket *t = &s->lticket;
  return t->rec == NULL || t->rec->id == stream_id ||
         atomic_load_acquire(&t->rec->done) >= t->seq;
}

static void large_unlink(slab **pp) { *pp = (*pp)->lnext; }

static slab *large_take_cheap(large_cache *c, size_t need, uint64_t stream_id) {
  slab **best = NULL;
  pthread_mutex_lock(&c->lock);
  for (slab **pp = &c->free; *pp; pp = &(*pp)->lnext) {
    if (large_fits(*pp, need) && large_ready_cheap(*pp, stream_id) &&
        (best == NULL || (*pp)->size < (*best)->size))
      best = pp;
  }
  slab *s = NULL;
  if (best) {
    s = *best;
    large_unlink(best);
    s->lnext = NULL;
  }
  pthread_mutex_unlock(&c->lock);
  return s;
}

static void large_cache_insert(large_cache *c, slab *chain) {
  if (chain == NULL) return;
  slab *last = chain;
  while (last->lnext) last = last->lnext;
  pthread_mutex_lock(&c->lock);
  last->lnext = c->free;
  c->free = chain;
  pthread_mutex_unlock(&c->lock);
}

/* Detach the fitting candidates, query their events outside the lock, keep
 * the best ready one, return the rest. */
static slab *large_take_queried(large_cache *c, size_t need, uint64_t stream_id) {
  slab *cand = NULL;
  pthread_mutex_lock(&c->lock);
  for (slab **pp = &c->free; *pp;) {
    if (large_fits(*pp, need)) {
      slab *s = *pp;
      large_unlink(pp);
      s->lnext = cand;
      cand = s;
    } else {
      pp = &(*pp)->lnext;
    }
  }
  pthread_mutex_unlock(&c->lock);
  slab *best = NULL, *rest = NULL;
  for (slab *s = cand, *next; s; s = next) {
    next = s->lnext;
    if (epoch_ready(&s->lticket, stream_id) != EPOCH_PENDING && (best == NULL || s->size < best->size)) {
      if (best) {
        best->lnext = rest;
        rest = best;
      }
      best = s;
    } else {
      s->lnext = rest;
      rest = s;
    }
  }
  large_cache_insert(c, rest);
  if (best) best->lnext = NULL;
  return best;
}

static void large_hand_out(large_cache *c, slab *s) {
  epoch_ticket_release(&s->lticket);
  atomic_sub_relaxed(&c->cached_bytes, s->size);
  atomic_add_relaxed(&c->in_use_bytes, s->size);
}

int large_alloc(struct heap *h, size_t size, uint64_t stream_id, struct slab **out) {
  large_cache *c = &h->large;
  size_t need = region_round(&h->region, size);
  slab *s = large_take_cheap(c, need, stream_id);
  if (s == NULL) s = large_take_queried(c, need, stream_id);
  if (s != NULL) {
    pthread_mutex_lock(&c->lock);
    s->large_cached = 0;
    pthread_mutex_unlock(&c->lock);
    large_hand_out(c, s);
    *out = s;
    return MAGPIE_OK;
  }
  s = slab_desc_get();
  if (s == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  int rc = heap_map(h, need, &s->base, &s->raw, &s->raw_size);
  if (rc != MAGPIE_OK) {
    slab_desc_put(s);
    return rc;
  }
  s->size = s->bsize = need;
  s->cls = SLAB_LARGE;
  s->nblocks = 1;
  s->heap = h;
  if (pagemap_set(s->base, s->size, s) != MAGPIE_OK) {
    heap_unmap(h, s->base, s->size, s->raw, s->raw_size);
    slab_desc_put(s);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  atomic_add_relaxed(&c->in_use_bytes, s->size);
  *out = s;
  return MAGPIE_OK;
}

int large_free(struct heap *h, struct slab *s, const epoch_ticket *t) {
  large_cache *c = &h->large;
  pthread_mutex_lock(&c->lock);
  if (s->large_cached) {
    pthread_mutex_unlock(&c->lock);
    return MAGPIE_ERR_DOUBLE_FREE;
  }
  s->large_cached = 1;
  s->lticket = *t;
  s->lnext = c->free;
  c->free = s;
  pthread_mutex_unlock(&c->lock);
  atomic_sub_relaxed(&c->in_use_bytes, s->size);
  atomic_add_relaxed(&c->cached_bytes, s->size);
  return MAGPIE_OK;
}

size_t large_release_cached(struct heap *h, int wait) {
  large_cache *c = &h->large;
  pthread_mutex_lock(&c->lock);
  slab *all = c->free;
  c->free = NULL;
  pthread_mutex_unlock(&c->lock);
  size_t released = 0;
  slab *keep = NULL;
  for (slab *s = all, *next; s; s = next) {
    next = s->lnext;
    int ready = epoch_ready(&s->lticket, EPOCH_NO_STREAM) != EPOCH_PENDING;
    if (!ready && wait) ready = epoch_wait(&s->lticket) == MAGPIE_OK;
    if (!ready) {
      s->lnext = keep;
      keep = s;
      continue;
    }
    epoch_ticket_release(&s->lticket);
    pagemap_set(s->base, s->size, NULL); /* leaves exist: cannot fail */
    atomic_sub_relaxed(&c->cached_bytes, s->size);
    released += s->size;
    heap_unmap(h, s->base, s->size, s->raw, s->raw_size);
    slab_desc_put(s);
  }
  large_cache_insert(c, keep);
  return released;
}
