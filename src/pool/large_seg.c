/* Large blocks: segments (made, linked, destroyed; their tiling and their
 * granules' state) and the hash of handed-out blocks by address. Under the
 * lock but large_seg_new, which maps memory without VMM. */
#include "base/meta.h"
#include "base/pagemap.h"
#include "pool/large.h"
#include "pool/large_internal.h"
#include "pool/slab.h"

/* ---- hash (all under the lock) ---- */

MAGPIE_WRAPS static size_t large_hash_of(uintptr_t p, size_t cap) {
  return (size_t)(((uint64_t)p >> 12) * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
}

static int large_hash_grow(large_cache *c) {
  size_t cap = c->hash_cap ? c->hash_cap * 2 : 256;
  lblock **nh = meta_alloc(cap * sizeof *nh);
  if (nh == NULL) return 0;
  for (size_t i = 0; i < c->hash_cap; i++) {
    for (lblock *b = c->hash[i], *next; b; b = next) {
      next = b->hnext;
      size_t k = large_hash_of(b->base, cap);
      b->hnext = nh[k];
      nh[k] = b;
    }
  }
  meta_free(c->hash);
  c->hash = nh;
  c->hash_cap = cap;
  return 1;
}

int large_hash_insert(large_cache *c, lblock *b) {
  if (c->hash_count >= c->hash_cap && !large_hash_grow(c) && c->hash_cap == 0) return 0;
  size_t k = large_hash_of(b->base, c->hash_cap);
  b->hnext = c->hash[k];
  c->hash[k] = b;
  c->hash_count++;
  return 1;
}

lblock *large_hash_find(large_cache *c, uintptr_t p, int unlink) {
  if (c->hash_cap == 0) return NULL;
  for (lblock **pp = &c->hash[large_hash_of(p, c->hash_cap)]; *pp; pp = &(*pp)->hnext) {
    lblock *b = *pp;
    if (b->base != p) continue;
    if (unlink) {
      *pp = b->hnext;
      b->hnext = NULL;
      c->hash_count--;
    }
    return b;
  }
  return NULL;
}

/* ---- granules ---- */

size_t large_gran(large_cache *c) { return c->region->gran; }

/* Is every granule under [a, a+n) of sg mapped? Stops at the first that
 * is not (a segment's never-used tail spans most of its reserved range). */
int large_wholly_mapped(const lseg *sg, size_t g, uintptr_t a, size_t n) {
  if (!sg->vmm) return 1;
  for (size_t i = (a - sg->base) / g, last = (a + n - 1 - sg->base) / g; i <= last; i++)
    if (sg->gran[i] != GRAN_MAPPED) return 0;
  return 1;
}

/* ---- segments ---- */

/* INVARIANT (large.h): the blocks of sg tile it in address order, without
 * gap or overlap, and the links agree both ways. Debug builds only. */
int large_seg_tiles(const lseg *sg) {
  uintptr_t at = sg->base;
  const lblock *prev = NULL;
  for (const lblock *b = sg->first; b; prev = b, b = b->next) {
    if (b->seg != sg || b->prev != prev || b->base != at || b->size == 0) return 0;
    at += b->size;
  }
  return at == sg->base + sg->size;
}

void large_seg_destroy(lseg *sg) {
  meta_free(sg->gran);
  meta_free((void *)sg->ucls);
  meta_free(sg);
}

/* A new segment of at least need bytes with one free block spanning it.
 * Called without the lock (it maps memory without VMM). */
int large_seg_new(large_cache *c, size_t need, lseg **out) {
  size_t g = large_gran(c);
  size_t size = region_round(c->region, need);
  lseg *sg = meta_alloc(sizeof *sg);
  lblock *b = meta_alloc(sizeof *b);
  slab *d = slab_desc_get();
  if (sg == NULL || b == NULL || d == NULL) goto fail_host;
  if (c->region->vmm) {
    /* Virtual space is cheap: claim room to grow into (the device's size,
     * at most an eighth of the reserved range, which slabs share), so later
     * blocks find free space next to earlier ones. */
    size_t roomy = region_round(c->region, c->total_mem < c->region->size / 8 ? c->total_mem : c->region->size / 8);
    uintptr_t a = size < roomy ? region_claim_va(c->region, roomy) : 0;
    if (a != 0) size = roomy;
    else a = region_claim_va(c->region, size);
    if (a == 0) {
      backend_set_error_detail("the reserved virtual range of %zu bytes is exhausted", c->region->size);
      goto fail_oom;
    }
    sg->base = a;
    sg->size = size;
    sg->vmm = 1;
    sg->ngran = size / g;
    sg->gran = meta_alloc(sg->ngran); /* zeroed: GRAN_UNMAPPED */
    /* One byte per quantum: host pages are touched only where class
     * blocks are carved (a large zeroed allocation is fresh mappings). */
    sg->ucls = meta_alloc(size / LARGE_QUANTUM);
    if (sg->gran == NULL || sg->ucls == NULL) goto fail_host; /* the VA claim is lost; harmless */
  } else {
    if ((sg->ucls = meta_alloc(size / LARGE_QUANTUM)) == NULL) goto fail_host;
    int rc = region_map(c->region, size, &sg->base, &sg->raw, &sg->raw_size);
    if (rc != MAGPIE_OK) {
      slab_desc_put(d);
      meta_free(b);
      large_seg_destroy(sg);
      return rc;
    }
    sg->size = size;
    sg->ngran = size / g;
  }
  d->base = sg->base;
  d->size = sg->size;
  d->cls = SLAB_LARGE;
  d->heap = c->owner;
  d->seg = sg;
  d->ucls = sg->ucls;
  sg->desc = d;
  /* The page map learns a VMM segment's granules as they are mapped
   * (large_map_under): its reach is the device's size, and at 32 KiB
   * pages the whole of an 80 GiB device took 20 MiB of host memory. */
  if (!sg->vmm && pagemap_set(sg->base, sg->size, d) != MAGPIE_OK) {
    region_unmap(c->region, sg->base, sg->size, sg->raw, sg->raw_size);
    goto fail_host;
  }
  b->base = sg->base;
  b->size = sg->size;
  b->seg = sg;
  sg->first = b;
  *out = sg;
  return MAGPIE_OK;
fail_host:
  backend_set_error_detail("out of host memory for large-block metadata");
fail_oom:
  if (d) slab_desc_put(d);
  meta_free(b);
  if (sg) large_seg_destroy(sg);
  return MAGPIE_ERR_OUT_OF_MEMORY;
}

void large_seg_link(large_cache *c, lseg *sg) {
  sg->next = c->segs;
  c->segs = sg;
  large_free_link(c, sg->first);
  if (!sg->vmm) atomic_add_relaxed(&c->mapped_bytes, sg->raw_size);
  atomic_add_relaxed(&c->segments, 1);
}
