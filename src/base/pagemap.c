/* Radix page map; see pagemap.h. */
#include "base/pagemap.h"

#include "base/meta.h"
#include "magpie.h"

_Atomic(pagemap_entry *) pagemap_top[1u << PAGEMAP_TOP_BITS];

static pagemap_entry *pagemap_leaf(uintptr_t page) {
  _Atomic(pagemap_entry *) *slot = &pagemap_top[page >> PAGEMAP_LEAF_BITS];
  pagemap_entry *leaf = atomic_load_acquire(slot);
  if (leaf != NULL) return leaf;
  pagemap_entry *fresh = meta_alloc(sizeof(pagemap_entry) << PAGEMAP_LEAF_BITS);
  if (fresh == NULL) return NULL;
  pagemap_entry *expected = NULL;
  if (atomic_cas_strong_acq_rel(slot, &expected, fresh)) return fresh;
  meta_free(fresh); /* another thread installed one first */
  return expected;
}

int pagemap_set(uintptr_t base, size_t size, void *s) {
  uintptr_t first = base >> PAGEMAP_PAGE_SHIFT;
  uintptr_t end = (base + size) >> PAGEMAP_PAGE_SHIFT;
  if (end > ((uintptr_t)1 << (PAGEMAP_TOP_BITS + PAGEMAP_LEAF_BITS))) return MAGPIE_ERR_INVALID_ARGUMENT;
  /* Create every leaf first so a failure leaves no page half-set. */
  for (uintptr_t p = first; p < end; p++)
    if (pagemap_leaf(p) == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  for (uintptr_t p = first; p < end; p++) {
    pagemap_entry *leaf = atomic_load_acquire(&pagemap_top[p >> PAGEMAP_LEAF_BITS]);
    atomic_store_release(&leaf[p & ((1u << PAGEMAP_LEAF_BITS) - 1)], s);
  }
  return MAGPIE_OK;
}
