/* Device memory for slabs and large blocks, in granularity units (2 MiB).
 *
 * With VMM, one large virtual range per device is reserved up front and
 * physical memory is mapped into it on demand; freed ranges return to a
 * sorted, coalesced free list and are reused first-fit. Without VMM, each
 * request is a plain device allocation, aligned to the granularity so the
 * page map can describe it.
 *
 * Lock order: region.lock is a leaf, and no driver call is made while it is
 * held (the range is claimed under the lock, mapped after). region.peer_lock
 * is a leaf too, held across the driver's access calls (peer access changes
 * and their corrections). */
#ifndef MAGPIE_REGION_H
#define MAGPIE_REGION_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "device/backend.h"

typedef struct region_range {
  uintptr_t base;
  size_t size;
  struct region_range *next;
} region_range;

typedef struct region {
  int device;
  const backend_ops *ops;
  int vmm;     /* 1: reserved range + map/unmap; 0: mem_alloc/mem_free */
  size_t gran; /* map unit */
  uintptr_t base;
  size_t size;
  pthread_mutex_t lock; /* guards bump and free */
  size_t bump;          /* [base, base+bump) has been handed out at least once */
  region_range *free;   /* free ranges inside [base, base+bump), by address */
  /* Bytes backed by device memory, including mappings in flight: raised
   * (CAS, relaxed) before a map is attempted, so that concurrent mappers
   * cannot together pass the limit, and lowered after an unmap or a failed
   * map. Read for statistics. No other memory is published through it. */
  _Atomic size_t mapped;
  /* Cap on mapped (SIZE_MAX: none). Written at init and by
   * region_set_limit (magpie_set_limit, any thread); read relaxed by
   * region_commit. Publishes nothing: a commit racing a change is held to
   * the old or the new cap. */
  _Atomic size_t limit;
  /* Statistics, relaxed counters that publish nothing: the bytes whose
   * map succeeded and that are not being unmapped (raised after the map,
   * lowered before the unmap is asked; reserved memory as the statistics
   * report it), its highest value, and the mapped bytes no
   * block serves (slab tails, fallback alignment, free span chunks;
   * written by slab.c and span.c as they carve what this region maps).
   * mapped also counts maps in flight, and an unmap's bytes until it
   * returned: a map that fails (the device full) or one made in the room
   * another thread's unmap just left must not raise the peak (reading
   * mapped, a full device reported more reserved than it has: bench/
   * DECISIONS.md, "The peak counts only what the device held"). */
  _Atomic size_t held;
  _Atomic size_t peak_held;
  _Atomic int64_t overhead;
  /* backend map flags for every mapping (BACKEND_MAP_EXPORTABLE with
   * MAGPIE_CONF=ipc=1); set at init. */
  unsigned map_flags;
  /* Devices granted access to every mapping (bit d: device d), besides
   * the region's own: set by region_enable_peer, cleared by
   * region_disable_peer (each under peer_lock); read by every mapper.
   * INVARIANT: once the enable or disable that last changed it has
   * returned, every granule whose bit is set in granmap is accessible from
   * exactly the devices in peers (and the region's own).
   * This and granmap form a store-load pair (seq_cst): a mapper maps with
   * the peers it loaded, sets the granules' bits, then loads peers again
   * and, if they changed meanwhile, sets its granules' rights to the new
   * peers under peer_lock; an enable or disable changes its bit, then
   * walks granmap. Either the mapper's second load sees the change, or the
   * walk sees the mapper's granules. */
  _Atomic uint64_t peers;
  /* Serialises enables, disables and the mappers' corrections: each sets
   * rights from the peers it read, and with two at once an older reading
   * could land last. Held across the driver's access calls; no other lock
   * is taken under it. */
  pthread_mutex_t peer_lock;
  /* Devices ever granted access (only gains bits; under peer_lock): a
   * disable of any other has nothing to take back, and asks the driver
   * nothing (a device that cannot reach the memory may not even be named
   * in an access call). */
  uint64_t granted;
  /* VMM: one bit per granule of [base, base+size), set while mapped
   * (seq_cst, see peers). Set after map returned, cleared before unmap;
   * read by region_enable_peer's walk. NULL without VMM. */
  _Atomic uint64_t *granmap;
  /* Releases whose memory is off every list but still mapped: slab.c and
   * large.c unlink what they give back under their lock, then drop it for
   * the driver calls. Raised (relaxed) under that lock, so a thread that
   * takes the lock later sees it; lowered (acq_rel) after the calls,
   * pairing with the acquire load of region_releases_wait (magpie_trim). */
  _Atomic int releasing;
} region;

/* The map unit for a driver's granularity g: g if it is a power of two no
 * smaller than a page-map page (pagemap.h), else the nearest such unit.
 * Slab sizes (sizeclass.c) and the region's own unit both come from it. */
size_t region_unit(size_t g);
/* reserve_hint: bytes of virtual range to try first (halved on failure);
 * map_flags: backend map flags for every mapping. */
int region_init(region *r, int device, const backend_ops *ops, size_t reserve_hint, unsigned map_flags);
/* Map size bytes (a granularity multiple). *raw/raw_size describe what to
 * give back to region_unmap (differs from *addr only without VMM). */
int region_map(region *r, size_t size, uintptr_t *addr, uintptr_t *raw, size_t *raw_size);
void region_unmap(region *r, uintptr_t addr, size_t size, uintptr_t raw, size_t raw_size);

/* The cap on mapped bytes (SIZE_MAX: none), and its change at run time:
 * lowering it below what is mapped makes later maps fail until enough is
 * given back (the out-of-memory ladder does so before failing); nothing
 * mapped is touched. */
static inline size_t region_limit(const region *r) { return atomic_load_relaxed(&r->limit); }
static inline void region_set_limit(region *r, size_t limit) { atomic_store_relaxed(&r->limit, limit); }
/* Restart peak_held at what is held now. */
static inline void region_reset_peak(region *r) { atomic_store_relaxed(&r->peak_held, atomic_load_relaxed(&r->held)); }

/* Makes every mapping of r, present and future, accessible from device
 * peer (the caller checked that the backend can): with VMM through the
 * backend's set_access over every mapped granule, without it through
 * peer_enable. Idempotent; never takes r->lock. */
int region_enable_peer(region *r, int peer);
/* Undoes region_enable_peer: every mapping of r stops being accessible
 * from peer and later ones are not granted it (revoke_access over every
 * mapped granule; without VMM, peer_disable). The caller makes sure no work
 * of peer still touches the memory. MAGPIE_OK if peer was never granted. */
int region_disable_peer(region *r, int peer);

/* VMM only: claim size bytes of the reserved range without mapping them
 * (large segments map and unmap granules inside it themselves). Returns 0
 * when the range is exhausted. */
uintptr_t region_claim_va(region *r, size_t size);
/* Map / unmap granules inside a claimed range (counted in mapped, held to
 * the limit). */
int region_map_at(region *r, uintptr_t addr, size_t size);
int region_unmap_at(region *r, uintptr_t addr, size_t size);

/* Around a release's driver calls, made with its lock dropped (see
 * region.releasing): begin before dropping the lock, end after the calls. */
static inline void region_release_begin(region *r) { atomic_add_relaxed(&r->releasing, 1); }
static inline void region_release_end(region *r) { atomic_sub_acq_rel(&r->releasing, 1); }
/* Wait out every release begun before (yielding). */
void region_releases_wait(region *r);

static inline void region_overhead_add(region *r, int64_t bytes) { atomic_add_relaxed(&r->overhead, bytes); }

static inline size_t region_round(const region *r, size_t size) { return (size + r->gran - 1) & ~(r->gran - 1); }

#endif /* MAGPIE_REGION_H */
