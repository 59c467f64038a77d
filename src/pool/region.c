/* Virtual range and physical mapping per device.
 * Lock order: region.lock is a leaf; never held across a driver call.
 * region.peer_lock is a leaf, held across the driver's access calls. */
#include "pool/region.h"

#include <sched.h>
#include <string.h>

#include "base/meta.h"
#include "base/pagemap.h"

size_t region_unit(size_t g) {
  if (g == 0 || (g & (g - 1)) != 0) g = (size_t)2 << 20;
  /* The page map tells slabs apart by its pages: map no less. */
  if (g < ((size_t)1 << PAGEMAP_PAGE_SHIFT)) g = (size_t)1 << PAGEMAP_PAGE_SHIFT;
  return g;
}

int region_init(region *r, int device, const backend_ops *ops, size_t reserve_hint, unsigned map_flags) {
  memset(r, 0, sizeof *r);
  r->device = device;
  r->ops = ops;
  r->map_flags = map_flags;
  pthread_mutex_init(&r->lock, NULL);
  pthread_mutex_init(&r->peer_lock, NULL);
  atomic_store_relaxed(&r->limit, SIZE_MAX);
  int rc = ops->granularity(device, &r->gran);
  if (rc != MAGPIE_OK) return rc;
  r->gran = region_unit(r->gran);
  int vmm = 0;
  if (ops->vmm_supported(device, &vmm) != MAGPIE_OK) vmm = 0;
  if (vmm) {
    size_t want = region_round(r, reserve_hint);
    while (want >= r->gran) {
      if (ops->reserve(device, want, &r->base) == MAGPIE_OK) {
        r->size = want;
        r->vmm = 1;
        break;
      }
      want /= 2;
      want = region_round(r, want);
    }
  }
  if (r->vmm) {
    size_t words = (r->size / r->gran + 63) / 64;
    r->granmap = meta_alloc(words * sizeof *r->granmap);
    if (r->granmap == NULL) {
      ops->unreserve(device, r->base, r->size);
      backend_set_error_detail("out of host memory for the map of %zu granules", r->size / r->gran);
      return MAGPIE_ERR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < words; i++) atomic_store_relaxed(&r->granmap[i], 0);
  }
  return MAGPIE_OK;
}

/* Claim a virtual range under the lock: first fit in the free list, else the
 * bump pointer. Returns 0 if the range is exhausted. */
static uintptr_t region_claim(region *r, size_t size) {
  uintptr_t addr = 0;
  pthread_mutex_lock(&r->lock);
  for (region_range **pp = &r->free; *pp; pp = &(*pp)->next) {
    region_range *f = *pp;
    if (f->size < size) continue;
    addr = f->base;
    f->base += size;
    f->size -= size;
    if (f->size == 0) {
      *pp = f->next;
      meta_free(f);
    }
    break;
  }
  if (addr == 0 && r->size - r->bump >= size) {
    addr = r->base + r->bump;
    r->bump += size;
  }
  pthread_mutex_unlock(&r->lock);
  return addr;
}

/* Return a virtual range, coalescing with its neighbours. */
static void region_release(region *r, uintptr_t addr, size_t size) {
  pthread_mutex_lock(&r->lock);
  region_range **pp = &r->free;
  while (*pp && (*pp)->base < addr) pp = &(*pp)->next;
  region_range *next = *pp;
  /* Predecessor: the node whose next pointer is pp (found by rescanning). */
  region_range *prev = NULL;
  for (region_range *q = r->free; q && q != next; q = q->next) prev = q;
  if (prev && prev->base + prev->size == addr) {
    prev->size += size;
    if (next && prev->base + prev->size == next->base) {
      prev->size += next->size;
      prev->next = next->next;
      meta_free(next);
    }
  } else if (next && addr + size == next->base) {
    next->base = addr;
    next->size += size;
  } else {
    region_range *n = meta_alloc(sizeof *n);
    if (n != NULL) {
      n->base = addr;
      n->size = size;
      n->next = next;
      *pp = n;
    }
    /* Out of host memory: the range is leaked from the reservation only
     * (no device memory stays mapped), which is safe. */
  }
  pthread_mutex_unlock(&r->lock);
}

/* Count size bytes as mapped before mapping them, unless that passes the
 * limit. */
static int region_commit(region *r, size_t size) {
  size_t cur = atomic_load_relaxed(&r->mapped), limit = region_limit(r);
  do {
    if (cur > limit || limit - cur < size) {
      backend_set_error_detail("the limit of %zu bytes reserved would be passed (%zu reserved, %zu more asked)", limit,
                               cur, size);
      return MAGPIE_ERR_OUT_OF_MEMORY;
    }
  } while (!atomic_cas_weak_relaxed(&r->mapped, &cur, cur + size));
  return MAGPIE_OK;
}

static void region_uncommit(region *r, size_t size) { atomic_sub_relaxed(&r->mapped, size); }

/* held: after a map succeeded, and before an unmap is asked (again if it
 * failed), so that it never counts bytes the device does not hold. */
static void region_held_add(region *r, size_t size) {
  atomic_max_size_relaxed(&r->peak_held, atomic_add_relaxed(&r->held, size) + size);
}
static void region_held_sub(region *r, size_t size) { atomic_sub_relaxed(&r->held, size); }

void region_releases_wait(region *r) {
  while (atomic_load_acquire(&r->releasing) > 0) sched_yield();
}

uintptr_t region_claim_va(region *r, size_t size) { return r->vmm ? region_claim(r, size) : 0; }

/* Sets (on) or clears the granmap bits of [addr, addr+size). */
static void region_mark(region *r, uintptr_t addr, size_t size, int on) {
  size_t g0 = (addr - r->base) / r->gran, n = size / r->gran;
  for (size_t g = g0; g < g0 + n; g++) {
    uint64_t bit = (uint64_t)1 << (g % 64);
    if (on) atomic_or_seq_cst(&r->granmap[g / 64], bit);
    else atomic_and_seq_cst(&r->granmap[g / 64], ~bit);
  }
}

static int region_granule_mapped(region *r, size_t g) {
  return (atomic_load_seq_cst(&r->granmap[g / 64]) >> (g % 64)) & 1;
}

/* A new mapping, made for was (the peers it loaded), set to the peers of
 * now, under peer_lock: the current peers granted, and those of was that
 * are gone revoked. The enables and disables that ran meanwhile may or may
 * not have seen it; any that did ran whole under the lock, so a device
 * they granted it and later took back has no access left, and only was
 * can be stale. */
static int region_correct(region *r, uintptr_t addr, size_t size, uint64_t was) {
  pthread_mutex_lock(&r->peer_lock);
  uint64_t now = atomic_load_seq_cst(&r->peers), gone = was & ~now;
  int rc = now != 0 ? r->ops->set_access(r->device, addr, size, now) : MAGPIE_OK;
  if (rc == MAGPIE_OK && gone != 0) rc = r->ops->revoke_access(r->device, addr, size, gone);
  pthread_mutex_unlock(&r->peer_lock);
  return rc;
}

int region_map_at(region *r, uintptr_t addr, size_t size) {
  int rc = region_commit(r, size);
  if (rc != MAGPIE_OK) return rc;
  uint64_t peers = atomic_load_seq_cst(&r->peers);
  rc = r->ops->map(r->device, addr, size, r->map_flags, peers);
  if (rc != MAGPIE_OK) {
    region_uncommit(r, size);
    return rc;
  }
  region_mark(r, addr, size, 1);
  /* A peer enabled or disabled while this mapping was made (region.peers). */
  if (atomic_load_seq_cst(&r->peers) != peers && region_correct(r, addr, size, peers) != MAGPIE_OK) {
    region_mark(r, addr, size, 0);
    r->ops->unmap(r->device, addr, size);
    region_uncommit(r, size);
    return MAGPIE_ERR_BACKEND;
  }
  region_held_add(r, size);
  return MAGPIE_OK;
}

int region_unmap_at(region *r, uintptr_t addr, size_t size) {
  region_mark(r, addr, size, 0);
  region_held_sub(r, size); /* before: a map the unmap makes room for may follow at once */
  int rc = r->ops->unmap(r->device, addr, size);
  if (rc == MAGPIE_OK) {
    region_uncommit(r, size);
  } else {
    region_held_add(r, size);
    region_mark(r, addr, size, 1); /* still mapped */
  }
  return rc;
}

/* op (set_access or revoke_access) with mask over every mapped granule, in
 * runs; a run that fails is retried granule by granule, and only a
 * granule still mapped counts (one being unmapped concurrently is refused
 * by the driver, harmlessly). Under peer_lock. */
static int region_walk(region *r, int (*op)(int, uintptr_t, size_t, uint64_t), uint64_t mask) {
  size_t ng = r->size / r->gran;
  for (size_t g = 0; g < ng;) {
    if (!region_granule_mapped(r, g)) {
      g++;
      continue;
    }
    size_t end = g + 1;
    while (end < ng && region_granule_mapped(r, end)) end++;
    uintptr_t a = r->base + g * r->gran;
    if (op(r->device, a, (end - g) * r->gran, mask) != MAGPIE_OK)
      for (size_t k = g; k < end; k++) {
        int rc = op(r->device, r->base + k * r->gran, r->gran, mask);
        if (rc != MAGPIE_OK && region_granule_mapped(r, k)) return rc;
      }
    g = end;
  }
  return MAGPIE_OK;
}

int region_enable_peer(region *r, int peer) {
  uint64_t bit = (uint64_t)1 << peer;
  pthread_mutex_lock(&r->peer_lock);
  r->granted |= bit;
  uint64_t peers = atomic_or_seq_cst(&r->peers, bit) | bit;
  int rc = r->vmm ? region_walk(r, r->ops->set_access, peers) : r->ops->peer_enable(r->device, peer);
  pthread_mutex_unlock(&r->peer_lock);
  return rc;
}

int region_disable_peer(region *r, int peer) {
  uint64_t bit = (uint64_t)1 << peer;
  pthread_mutex_lock(&r->peer_lock);
  atomic_and_seq_cst(&r->peers, ~bit);
  int rc = MAGPIE_OK;
  if (r->granted & bit)
    rc = r->vmm ? region_walk(r, r->ops->revoke_access, bit) : r->ops->peer_disable(r->device, peer);
  pthread_mutex_unlock(&r->peer_lock);
  return rc;
}

int region_map(region *r, size_t size, uintptr_t *addr, uintptr_t *raw, size_t *raw_size) {
  if (r->vmm) {
    uintptr_t a = region_claim(r, size);
    if (a == 0) {
      backend_set_error_detail("the reserved virtual range of %zu bytes is exhausted", r->size);
      return MAGPIE_ERR_OUT_OF_MEMORY;
    }
    int rc = region_map_at(r, a, size);
    if (rc != MAGPIE_OK) {
      region_release(r, a, size);
      return rc;
    }
    *addr = *raw = a;
    *raw_size = size;
    return MAGPIE_OK;
  }
  int rc = region_commit(r, size);
  if (rc != MAGPIE_OK) return rc;
  uintptr_t p = 0;
  rc = r->ops->mem_alloc(r->device, size, &p);
  if (rc != MAGPIE_OK) {
    region_uncommit(r, size);
    return rc;
  }
  size_t got = size;
  if (p & (r->gran - 1)) {
    /* The page map needs granularity alignment: over-allocate once. */
    r->ops->mem_free(r->device, p, size);
    region_uncommit(r, size);
    got = size + r->gran;
    if ((rc = region_commit(r, got)) != MAGPIE_OK) return rc;
    rc = r->ops->mem_alloc(r->device, got, &p);
    if (rc != MAGPIE_OK) {
      region_uncommit(r, got);
      return rc;
    }
  }
  region_held_add(r, got);
  *raw = p;
  *raw_size = got;
  *addr = (p + r->gran - 1) & ~(uintptr_t)(r->gran - 1);
  return MAGPIE_OK;
}

void region_unmap(region *r, uintptr_t addr, size_t size, uintptr_t raw, size_t raw_size) {
  if (r->vmm) {
    if (region_unmap_at(r, addr, size) != MAGPIE_OK) return; /* still mapped: keep it out of reuse */
    region_release(r, addr, size);
  } else {
    region_held_sub(r, raw_size);
    if (r->ops->mem_free(r->device, raw, raw_size) != MAGPIE_OK) {
      region_held_add(r, raw_size);
      return;
    }
    region_uncommit(r, raw_size);
  }
}
