/* Address -> slab lookup in O(1), lock-free: a two-level radix table over
 * 32 KiB pages of the 48-bit user address space (the chunks small
 * classes' slabs are made of, span.h; granules and large segments cover
 * whole runs of pages). It serves the reserved virtual range and the
 * fallback's scattered slabs alike (one path, two dependent loads), with
 * no hash and no lock on lookup.
 *
 * A leaf covers 4 GiB (2^17 pages, 1 MiB of host memory), so that the top
 * level stays at 512 KiB of the process's data with 32 KiB pages. A VMM
 * segment's pages are set as its granules are mapped (large.c), so the
 * table grows with the memory mapped, 8 bytes a page, not with the
 * segments' virtual reach.
 *
 * Leaves are created on first use with a CAS and never freed. Entries are
 * written (release) when a slab is published and cleared when its memory is
 * unmapped; lookups read them with acquire so the slab descriptor's fields
 * are visible. */
#ifndef MAGPIE_PAGEMAP_H
#define MAGPIE_PAGEMAP_H

#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/types.h"

/* The radix root, this module's state (defined in pagemap.c). Leaves are
 * installed with a CAS (acq_rel) and never freed; lookups load them with
 * acquire. */
extern _Atomic(pagemap_entry *) pagemap_top[1u << PAGEMAP_TOP_BITS];

/* The descriptor set for addr's page (a pool slab descriptor: the caller
 * converts), or NULL. */
static inline void *pagemap_lookup(uintptr_t addr) {
  uintptr_t page = addr >> PAGEMAP_PAGE_SHIFT;
  if (unlikely(page >> (PAGEMAP_TOP_BITS + PAGEMAP_LEAF_BITS))) return NULL;
  pagemap_entry *leaf = atomic_load_acquire(&pagemap_top[page >> PAGEMAP_LEAF_BITS]);
  if (unlikely(leaf == NULL)) return NULL;
  return atomic_load_acquire(&leaf[page & ((1u << PAGEMAP_LEAF_BITS) - 1)]);
}

/* Point every page of [base, base+size) at s (NULL to clear). base and size
 * are multiples of the page (32 KiB). Returns MAGPIE_OK or
 * MAGPIE_ERR_OUT_OF_MEMORY (host metadata), in which case nothing was
 * set. */
int pagemap_set(uintptr_t base, size_t size, void *s);

#endif /* MAGPIE_PAGEMAP_H */
