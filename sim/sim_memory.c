/* Simulated device memory: host address space handed out the way the CUDA
 * driver's virtual memory management hands out device memory.
 *
 *   reserve   mmap(PROT_NONE, MAP_NORESERVE): address space only, aligned
 *             to the granularity; costs no capacity.
 *   map       mprotect(read/write) of whole granules of a reservation,
 *             after taking their size from the device's capacity. Mapped
 *             exportable (BACKEND_MAP_EXPORTABLE), each granule is instead
 *             its own memfd, mapped shared over the granule, whose
 *             descriptor the region keeps: the physical allocation another
 *             process can map (export_fds, import_map).
 *   unmap     madvise(MADV_DONTNEED) + mprotect(PROT_NONE); gives the
 *             capacity back. A memfd-backed or imported granule gets an
 *             anonymous PROT_NONE mapping put over it instead, and its
 *             descriptor closed: that drops this process's mapping only,
 *             and the memory lives on in every other mapping of it, as
 *             CUDA's physical memory lives until its last mapping is gone.
 *             Touching unmapped memory faults, as on a GPU.
 *   alloc     the fallback without VMM: aligned read/write memory counted
 *             against the same capacity.
 *   import    mmap(MAP_SHARED) of another mapping's descriptors over
 *             unmapped granules of a reservation; takes no capacity: the
 *             device of the process that mapped the memory first counts it.
 * Every region is remembered, so mapping a mapped granule, unmapping an
 * unmapped one, freeing an unknown pointer or unreserving a range that is
 * still mapped is reported as an error instead of corrupting the count.
 *
 * Access rights, as CUDA's: each mapped granule has a mask of the devices
 * whose kernels may touch it (its own device always; peers added by map,
 * import_map and set_access, taken away by revoke_access), and each device
 * a mask of the peers its plain allocations are open to (peer_enable,
 * peer_disable). Whether a
 * device's memory can be opened to a peer at all is a setting of the
 * simulated machine (magpie_sim_set_peer_capable; by default every pair
 * can, as on an NVLink system). magpie_sim_access_check and
 * magpie_sim_launch_access are where the rights are enforced: the host
 * checks the range a simulated kernel will touch, at enqueue.
 *
 * Every call that changes device memory (reserve, unreserve, map, unmap,
 * alloc, free, set_access, revoke_access, peer_enable, peer_disable,
 * export, import) is one CUDA deems
 * potentially unsafe during a stream capture: each first asks
 * sim_capture_unsafe_call whether the calling thread's capture mode allows
 * it (sim_graph.c), so a device table that does not switch to the relaxed
 * mode around them fails as it would on CUDA.
 *
 * Lock order: one lock per device (sim_memory_devices[d].lock), never two at
 * once, nothing else taken under it. The access check visits the devices
 * one after another, one lock at a time.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "device/backend.h"
#include "sim/sim_internal.h"

enum sim_region_kind { SIM_REGION_RESERVED, SIM_REGION_ALLOCATED };

/* A reservation granule's backing (sim_region.fds): anonymous memory of
 * this process (map without BACKEND_MAP_EXPORTABLE, or never mapped), or
 * another mapping's memory (import_map; no descriptor is kept: the mapping
 * itself keeps the memory alive). Any other value is the memfd of a
 * granule mapped exportable here. */
#define SIM_FD_NONE (-1)
#define SIM_FD_IMPORTED (-2)

/* INVARIANT: base and size are multiples of SIM_GRANULARITY.
 * A reservation: access[g] != 0 iff granule g is mapped (by map or
 * import_map), and then bit d of it is set iff device d may access the
 * granule (the reservation's own device always may); mapped_bytes counts
 * the mapped granules. fds is NULL until a granule of the reservation is
 * first mapped exportable or imported; from then on fds[g] is granule g's
 * backing (SIM_FD_*, or its memfd), SIM_FD_NONE whenever g is unmapped.
 * Capacity is taken for every mapped granule except imported ones.
 * An allocation: wholly mapped; no per-granule arrays; accessible from its
 * device and from the device's alloc_peers. */
struct sim_region {
  uintptr_t base;
  size_t size;
  enum sim_region_kind kind;
  uint64_t *access;
  int *fds;
  size_t mapped_bytes;
  struct sim_region *next;
};

/* INVARIANT: used equals the sum over regions of mapped_bytes less the
 * imported granules (for reservations) and size (for allocations), except
 * transiently: map and alloc take capacity before adding to a region, free
 * gives it back after the region is gone, so used never undercounts. */
struct sim_memory_device {
  pthread_mutex_t lock; /* guards regions, every region's fields, alloc_peers */
  struct sim_region *regions;
  /* Bit p: device p may access every allocation (alloc) of this device,
   * present and future (peer_enable; peer_disable clears it). */
  uint64_t alloc_peers;
  /* Bytes mapped or allocated. Increased only under lock (a CAS bounded
   * by capacity), decreased by the thread that gave memory back; read
   * relaxed by mem_info without the lock: a figure, not a
   * synchronisation. */
  _Atomic size_t used;
  /* Written by configuration and sim_memory_set_capacity; read relaxed:
   * a figure. */
  _Atomic size_t capacity;
};

static struct sim_memory_device sim_memory_devices[SIM_MAX_DEVICES];
/* MAGPIE_SIM_VMM: written by configuration (inside sim_init's once) and by
 * sim_memory_set_vmm (tests); read relaxed. */
static _Atomic int sim_memory_vmm = 1;
/* Bit p of sim_memory_no_peer[d]: device d's memory cannot be made
 * accessible from device p (magpie_sim_set_peer_capable; all clear: every
 * pair can, as on an NVLink machine). Written by whoever sets up the
 * simulated machine, read by can_access_peer and every grant of rights;
 * relaxed: a setting of the machine, ordering nothing else. */
static _Atomic uint64_t sim_memory_no_peer[SIM_MAX_DEVICES];

/* Every granule mapped exportable keeps a descriptor open (a 4 GiB device
 * has 2048 granules, twice the usual soft limit of 1024): the soft limit
 * goes up to the hard one, as a program that needs many descriptors
 * does. A failure leaves the limit as it was; an exportable map that then
 * runs out of descriptors says so. */
static void sim_memory_raise_fd_limit(void) {
  struct rlimit l;
  if (getrlimit(RLIMIT_NOFILE, &l) != 0 || l.rlim_cur >= l.rlim_max) return;
  l.rlim_cur = l.rlim_max;
  (void)setrlimit(RLIMIT_NOFILE, &l);
}

int sim_memory_configure(char *detail, size_t detail_len) {
  size_t capacity = SIM_DEFAULT_CAPACITY;
  const char *v = getenv("MAGPIE_SIM_MEMORY");
  if (v != NULL) {
    uint64_t bytes;
    if (sim_parse_size(v, 1, &bytes) != 0 || bytes == 0 || bytes > SIZE_MAX / 2) {
      snprintf(detail, detail_len,
               "MAGPIE_SIM_MEMORY=\"%s\" is not a size in bytes (a positive number, "
               "optionally followed by k, m or g)",
               v);
      return MAGPIE_ERR_CONFIG;
    }
    if (bytes < SIM_GRANULARITY) {
      snprintf(detail, detail_len,
               "MAGPIE_SIM_MEMORY=\"%s\" is below the simulated device's mapping granularity of %zu bytes "
               "(%zu MiB): give at least that much",
               v, (size_t)SIM_GRANULARITY, (size_t)SIM_GRANULARITY >> 20);
      return MAGPIE_ERR_CONFIG;
    }
    capacity = (size_t)bytes;
  }
  v = getenv("MAGPIE_SIM_VMM");
  if (v != NULL) {
    if (strcmp(v, "0") != 0 && strcmp(v, "1") != 0) {
      snprintf(detail, detail_len, "MAGPIE_SIM_VMM=\"%s\" is not 0 or 1", v);
      return MAGPIE_ERR_CONFIG;
    }
    atomic_store_explicit(&sim_memory_vmm, v[0] == '1', memory_order_relaxed);
  }
  for (int d = 0; d < SIM_MAX_DEVICES; d++) {
    pthread_mutex_init(&sim_memory_devices[d].lock, NULL);
    atomic_store_explicit(&sim_memory_devices[d].capacity, capacity, memory_order_relaxed);
  }
  sim_memory_raise_fd_limit();
  return MAGPIE_OK;
}

int sim_memory_vmm_supported(void) { return atomic_load_explicit(&sim_memory_vmm, memory_order_relaxed); }

void sim_memory_set_vmm(int supported) { atomic_store_explicit(&sim_memory_vmm, supported != 0, memory_order_relaxed); }

/* Checks the device and that sim_init succeeded (it initialises the locks). */
static int sim_memory_device(int device, struct sim_memory_device **out) {
  int rc = sim_check_device(device);
  if (rc == MAGPIE_OK) *out = &sim_memory_devices[device];
  return rc;
}

/* sim_memory_device, then the capture rules for a call that changes device
 * memory (what names it in the refusal). */
static int sim_memory_device_for(int device, const char *what, struct sim_memory_device **out) {
  int rc = sim_memory_device(device, out);
  if (rc == MAGPIE_OK) rc = sim_capture_unsafe_call(what);
  return rc;
}

int sim_memory_set_capacity(int device, size_t bytes) {
  struct sim_memory_device *d;
  int rc = sim_memory_device(device, &d);
  if (rc != MAGPIE_OK) return rc;
  atomic_store_explicit(&d->capacity, bytes, memory_order_relaxed);
  return MAGPIE_OK;
}

int sim_memory_info(int device, size_t *free_bytes, size_t *total_bytes) {
  struct sim_memory_device *d;
  int rc = sim_memory_device(device, &d);
  if (rc != MAGPIE_OK) return rc;
  size_t cap = atomic_load_explicit(&d->capacity, memory_order_relaxed);
  size_t used = atomic_load_explicit(&d->used, memory_order_relaxed);
  if (free_bytes != NULL) *free_bytes = used < cap ? cap - used : 0;
  if (total_bytes != NULL) *total_bytes = cap;
  return MAGPIE_OK;
}

/* Takes bytes of capacity, or fails leaving everything as it was. */
static int sim_memory_take(struct sim_memory_device *d, int device, size_t bytes) {
  size_t used = atomic_load_explicit(&d->used, memory_order_relaxed);
  do {
    size_t cap = atomic_load_explicit(&d->capacity, memory_order_relaxed);
    if (used > cap || bytes > cap - used)
      return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "device %d: %zu bytes requested, %zu of %zu free", device, bytes,
                      used < cap ? cap - used : 0, cap);
  } while (!atomic_compare_exchange_weak_explicit(&d->used, &used, used + bytes, memory_order_relaxed,
                                                  memory_order_relaxed));
  return MAGPIE_OK;
}

static void sim_memory_give(struct sim_memory_device *d, size_t bytes) {
  atomic_fetch_sub_explicit(&d->used, bytes, memory_order_relaxed);
}

static int sim_memory_check_range(uintptr_t addr, size_t size) {
  if (size == 0 || size % SIM_GRANULARITY != 0 || addr % SIM_GRANULARITY != 0)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "range %#lx+%zu is not a nonzero multiple of the %zu-byte granularity",
                    (unsigned long)addr, size, SIM_GRANULARITY);
  if (size > UINTPTR_MAX - addr)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "range %#lx+%zu wraps around", (unsigned long)addr, size);
  return MAGPIE_OK;
}

/* size bytes of fresh address space aligned to the granularity. */
static int sim_memory_mmap_aligned(size_t size, int prot, uintptr_t *out) {
  if (size > SIZE_MAX - SIM_GRANULARITY)
    return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "%zu bytes of address space is too much", size);
  size_t span = size + SIM_GRANULARITY;
  void *p = mmap(NULL, span, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "mmap of %zu bytes of address space: %s", span, strerror(errno));
  uintptr_t raw = (uintptr_t)p;
  uintptr_t base = (raw + SIM_GRANULARITY - 1) & ~(uintptr_t)(SIM_GRANULARITY - 1);
  if (base > raw) munmap(p, base - raw);
  uintptr_t end = base + size, raw_end = raw + span;
  if (raw_end > end) munmap((void *)end, raw_end - end);
  *out = base;
  return MAGPIE_OK;
}

/* The region of d holding [addr, addr+size) entirely, under d->lock. */
static struct sim_region *sim_memory_find(struct sim_memory_device *d, uintptr_t addr, size_t size) {
  for (struct sim_region *r = d->regions; r != NULL; r = r->next)
    if (addr >= r->base && addr - r->base <= r->size && size <= r->size - (addr - r->base)) return r;
  return NULL;
}

static void sim_memory_unlink(struct sim_memory_device *d, struct sim_region *r) {
  for (struct sim_region **p = &d->regions; *p != NULL; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      return;
    }
}

int sim_memory_reserve(int device, size_t size, uintptr_t *base) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, "reserving device address space", &d);
  if (rc != MAGPIE_OK) return rc;
  if (size == 0 || size % SIM_GRANULARITY != 0)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "reservation of %zu bytes is not a nonzero multiple of %zu", size,
                    SIM_GRANULARITY);
  size_t granules = size / SIM_GRANULARITY;
  struct sim_region *r = calloc(1, sizeof *r);
  /* calloc: the pages of a large reservation's array stay untouched until
   * their granules are mapped. */
  uint64_t *access = calloc(granules, sizeof *access);
  if (r == NULL || access == NULL) {
    free(r);
    free(access);
    return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a reservation's map");
  }
  rc = sim_memory_mmap_aligned(size, PROT_NONE, &r->base);
  if (rc != MAGPIE_OK) {
    free(r);
    free(access);
    return rc;
  }
  r->size = size;
  r->kind = SIM_REGION_RESERVED;
  r->access = access;
  pthread_mutex_lock(&d->lock);
  r->next = d->regions;
  d->regions = r;
  pthread_mutex_unlock(&d->lock);
  *base = r->base;
  return MAGPIE_OK;
}

int sim_memory_unreserve(int device, uintptr_t base, size_t size) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, "releasing device address space", &d);
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&d->lock);
  struct sim_region *r = sim_memory_find(d, base, size);
  if (r == NULL || r->kind != SIM_REGION_RESERVED || r->base != base || r->size != size) {
    pthread_mutex_unlock(&d->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is not a reservation of device %d", (unsigned long)base,
                    size, device);
  }
  if (r->mapped_bytes != 0) {
    size_t mapped = r->mapped_bytes;
    pthread_mutex_unlock(&d->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "reservation %#lx still has %zu bytes mapped: unmap them first",
                    (unsigned long)base, mapped);
  }
  sim_memory_unlink(d, r);
  pthread_mutex_unlock(&d->lock);
  /* Nothing is mapped: no descriptor is left to close. */
  munmap((void *)r->base, r->size);
  free(r->access);
  free(r->fds);
  free(r);
  return MAGPIE_OK;
}

/* Whether granules [first, first+count) of r are all mapped (want 1) or all
 * unmapped (want 0). */
static int sim_memory_all_mapped(const struct sim_region *r, size_t first, size_t count, int want) {
  for (size_t g = first; g < first + count; g++)
    if ((r->access[g] != 0) != want) return 0;
  return 1;
}

/* Locks the device's memory and finds the reservation holding the range
 * (or fails, unlocked); *first and *count name its granules there. */
static int sim_memory_lock_reserved(int device, const char *what, uintptr_t addr, size_t size,
                                    struct sim_memory_device **dout, struct sim_region **out, size_t *first,
                                    size_t *count) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, what, &d);
  if (rc == MAGPIE_OK) rc = sim_memory_check_range(addr, size);
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&d->lock);
  struct sim_region *r = sim_memory_find(d, addr, size);
  if (r == NULL || r->kind != SIM_REGION_RESERVED) {
    pthread_mutex_unlock(&d->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is not inside a reservation of device %d",
                    (unsigned long)addr, size, device);
  }
  *dout = d;
  *out = r;
  *first = (addr - r->base) / SIM_GRANULARITY;
  *count = size / SIM_GRANULARITY;
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- peers */

/* Whether peer is a simulated device other than device (which the caller
 * checked). */
static int sim_memory_check_pair(int device, int peer) {
  if (peer < 0 || peer >= sim_device_count())
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "peer device %d does not exist (%d simulated)", peer,
                    sim_device_count());
  if (peer == device)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d is not a peer of itself: it always accesses its memory",
                    device);
  return MAGPIE_OK;
}

/* Whether device's memory may be opened to every device of peers (device's
 * own bit is allowed: it always has access): MAGPIE_ERR_INVALID_ARGUMENT
 * for a device that does not exist, MAGPIE_ERR_NO_PEER_ACCESS for one that
 * cannot be connected to device. */
static int sim_memory_check_peers(int device, uint64_t peers) {
  uint64_t no = atomic_load_explicit(&sim_memory_no_peer[device], memory_order_relaxed);
  for (int p = 0; p < 64; p++) {
    if (((peers >> p) & 1) == 0 || p == device) continue;
    if (p >= sim_device_count())
      return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT,
                      "peer mask %#llx names device %d, which does not exist (%d simulated)", (unsigned long long)peers,
                      p, sim_device_count());
    if ((no >> p) & 1)
      return sim_fail(MAGPIE_ERR_NO_PEER_ACCESS,
                      "device %d's memory cannot be made accessible from device %d: the two devices have no "
                      "peer-to-peer path (magpie_sim_set_peer_capable)",
                      device, p);
  }
  return MAGPIE_OK;
}

int sim_memory_can_access_peer(int device, int peer, int *can) {
  int rc = sim_check_device(device);
  if (rc == MAGPIE_OK) rc = sim_memory_check_pair(device, peer);
  if (rc != MAGPIE_OK) return rc;
  *can = ((atomic_load_explicit(&sim_memory_no_peer[device], memory_order_relaxed) >> peer) & 1) == 0;
  return MAGPIE_OK;
}

int sim_memory_set_peer_capable(int device, int peer, int capable) {
  int rc = sim_check_device(device);
  if (rc == MAGPIE_OK) rc = sim_memory_check_pair(device, peer);
  if (rc != MAGPIE_OK) return rc;
  uint64_t bit = (uint64_t)1 << peer;
  if (capable) atomic_fetch_and_explicit(&sim_memory_no_peer[device], ~bit, memory_order_relaxed);
  else atomic_fetch_or_explicit(&sim_memory_no_peer[device], bit, memory_order_relaxed);
  return MAGPIE_OK;
}

int sim_memory_peer_enable(int device, int peer) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, "enabling peer access", &d);
  if (rc == MAGPIE_OK) rc = sim_memory_check_pair(device, peer);
  if (rc == MAGPIE_OK) rc = sim_memory_check_peers(device, (uint64_t)1 << peer);
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&d->lock);
  d->alloc_peers |= (uint64_t)1 << peer;
  pthread_mutex_unlock(&d->lock);
  return MAGPIE_OK;
}

/* Device's plain allocations stop being accessible from peer (rights
 * granted before by peer_enable are taken back, as cuCtxDisablePeerAccess
 * does); MAGPIE_OK if they were not. */
int sim_memory_peer_disable(int device, int peer) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, "disabling peer access", &d);
  if (rc == MAGPIE_OK) rc = sim_memory_check_pair(device, peer);
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&d->lock);
  d->alloc_peers &= ~((uint64_t)1 << peer);
  pthread_mutex_unlock(&d->lock);
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- shared granules */

/* The failure (err, an errno) of a system call (what) making a descriptor
 * for device's exportable memory. */
static int sim_memory_fd_fail(int device, const char *what, int err) {
  if (err == EMFILE || err == ENFILE) {
    struct rlimit l;
    unsigned long long limit = getrlimit(RLIMIT_NOFILE, &l) == 0 ? (unsigned long long)l.rlim_cur : 0;
    return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY,
                    "device %d: the process ran out of file descriptors for exportable simulated memory (%s: %s; "
                    "RLIMIT_NOFILE %llu, one per 2 MiB granule): raise the limit or set MAGPIE_CONF=ipc=0",
                    device, what, strerror(err), limit);
  }
  return sim_fail(err == ENOMEM || err == ENOSPC ? MAGPIE_ERR_OUT_OF_MEMORY : MAGPIE_ERR_BACKEND,
                  "device %d: %s for exportable memory: %s", device, what, strerror(err));
}

/* Puts an anonymous inaccessible mapping over [a, a+n), as the reservation
 * left it: this process's mapping of shared memory there is dropped (the
 * memory lives on in its other mappings). 0, or the errno. */
static int sim_memory_cover(uintptr_t a, size_t n) {
  void *p = mmap((void *)a, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return p == MAP_FAILED ? errno : 0;
}

/* Maps fd's first granule shared, read/write, at a. 0, or the errno (the
 * range then covered again: a failed MAP_FIXED may have removed what was
 * there). */
static int sim_memory_map_shared(uintptr_t a, int fd) {
  void *p = mmap((void *)a, SIM_GRANULARITY, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p != MAP_FAILED) return 0;
  int err = errno;
  (void)sim_memory_cover(a, SIM_GRANULARITY);
  return err;
}

/* Backs the granule at a with a new memfd mapped over it; *out: its
 * descriptor. */
static int sim_memory_memfd_granule(int device, uintptr_t a, int *out) {
  int fd = memfd_create("magpie-sim-granule", MFD_CLOEXEC);
  if (fd < 0) return sim_memory_fd_fail(device, "memfd_create", errno);
  int err = ftruncate(fd, (off_t)SIM_GRANULARITY) == 0 ? 0 : errno;
  const char *what = "ftruncate";
  if (err == 0) {
    err = sim_memory_map_shared(a, fd);
    what = "mmap";
  }
  if (err != 0) {
    close(fd);
    return sim_memory_fd_fail(device, what, err);
  }
  *out = fd;
  return MAGPIE_OK;
}

/* r's backing array, made (every granule SIM_FD_NONE) on first need. Under
 * the device's lock. */
static int sim_memory_fds(struct sim_region *r) {
  if (r->fds != NULL) return MAGPIE_OK;
  size_t n = r->size / SIM_GRANULARITY;
  int *fds = malloc(n * sizeof *fds);
  if (fds == NULL) return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a reservation's descriptors");
  for (size_t g = 0; g < n; g++) fds[g] = SIM_FD_NONE;
  r->fds = fds;
  return MAGPIE_OK;
}

/* Granule g of r, mapped shared (exportable or imported), goes back to an
 * inaccessible part of the reservation and its descriptor is closed. 0, or
 * the errno (nothing changed). Under the device's lock. */
static int sim_memory_drop_shared(struct sim_region *r, size_t g) {
  int err = sim_memory_cover(r->base + g * SIM_GRANULARITY, SIM_GRANULARITY);
  if (err != 0) return err;
  if (r->fds[g] >= 0) close(r->fds[g]);
  r->fds[g] = SIM_FD_NONE;
  return 0;
}

/* ---------------------------------------------------------------- map, unmap */

int sim_memory_map(int device, uintptr_t addr, size_t size, unsigned flags, uint64_t peers) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "mapping device memory", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  if ((flags & ~BACKEND_MAP_EXPORTABLE) != 0)
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "unknown map flags %#x", flags & ~BACKEND_MAP_EXPORTABLE);
  if (rc == MAGPIE_OK) rc = sim_memory_check_peers(device, peers);
  if (rc == MAGPIE_OK && !sim_memory_all_mapped(r, first, count, 0))
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is already (partly) mapped", (unsigned long)addr, size);
  if (rc == MAGPIE_OK) rc = sim_memory_take(d, device, size);
  if (rc == MAGPIE_OK && (flags & BACKEND_MAP_EXPORTABLE)) {
    /* Granule by granule, each its own physical allocation; a failure
     * undoes the granules already backed. */
    rc = sim_memory_fds(r);
    size_t done = 0;
    while (rc == MAGPIE_OK && done < count) {
      rc = sim_memory_memfd_granule(device, addr + done * SIM_GRANULARITY, &r->fds[first + done]);
      if (rc == MAGPIE_OK) done++;
    }
    if (rc != MAGPIE_OK) {
      for (size_t j = 0; j < done; j++) (void)sim_memory_drop_shared(r, first + j);
      sim_memory_give(d, size);
    }
  } else if (rc == MAGPIE_OK && mprotect((void *)addr, size, PROT_READ | PROT_WRITE) != 0) {
    rc = sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "mprotect(read/write) of %zu bytes: %s", size, strerror(errno));
    sim_memory_give(d, size);
  }
  if (rc == MAGPIE_OK) {
    for (size_t g = first; g < first + count; g++) r->access[g] = ((uint64_t)1 << device) | peers;
    r->mapped_bytes += size;
  }
  pthread_mutex_unlock(&d->lock);
  return rc;
}

int sim_memory_unmap(int device, uintptr_t addr, size_t size) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "unmapping device memory", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  if (!sim_memory_all_mapped(r, first, count, 1)) {
    pthread_mutex_unlock(&d->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is not (wholly) mapped", (unsigned long)addr, size);
  }
  /* Runs of anonymous granules in two calls each; shared granules one by
   * one (each has its own mapping and descriptor). Should the kernel refuse
   * a change part way, the granules before it stay unmapped and counted so. */
  size_t g = first, end = first + count, own = 0;
  while (g < end && rc == MAGPIE_OK) {
    if (r->fds != NULL && r->fds[g] != SIM_FD_NONE) {
      int imported = r->fds[g] == SIM_FD_IMPORTED;
      int err = sim_memory_drop_shared(r, g);
      if (err != 0) {
        rc = sim_fail(MAGPIE_ERR_BACKEND, "unmapping the shared granule at %#lx: %s",
                      (unsigned long)(r->base + g * SIM_GRANULARITY), strerror(err));
        break;
      }
      if (!imported) own += SIM_GRANULARITY; /* an import took no capacity */
      r->access[g++] = 0;
      r->mapped_bytes -= SIM_GRANULARITY;
      continue;
    }
    size_t run = 1;
    while (g + run < end && (r->fds == NULL || r->fds[g + run] == SIM_FD_NONE)) run++;
    void *p = (void *)(r->base + g * SIM_GRANULARITY);
    size_t n = run * SIM_GRANULARITY;
    if (madvise(p, n, MADV_DONTNEED) != 0 || mprotect(p, n, PROT_NONE) != 0) {
      rc = sim_fail(MAGPIE_ERR_BACKEND, "unmapping %zu bytes: %s", n, strerror(errno));
      break;
    }
    for (size_t k = 0; k < run; k++) r->access[g++] = 0;
    r->mapped_bytes -= n;
    own += n;
  }
  sim_memory_give(d, own);
  pthread_mutex_unlock(&d->lock);
  return rc;
}

int sim_memory_set_access(int device, uintptr_t addr, size_t size, uint64_t peers) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "changing access to device memory", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  rc = sim_memory_check_peers(device, peers);
  if (rc == MAGPIE_OK && !sim_memory_all_mapped(r, first, count, 1))
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is not (wholly) mapped on device %d: no access to set",
                  (unsigned long)addr, size, device);
  if (rc == MAGPIE_OK)
    for (size_t g = first; g < first + count; g++) r->access[g] |= peers;
  pthread_mutex_unlock(&d->lock);
  return rc;
}

/* The devices in peers lose access to the granules (cuMemSetAccess with
 * PROT_NONE for them): a later access check from one of them is refused,
 * as a GPU faults. The granules' own device cannot be in peers. */
int sim_memory_revoke_access(int device, uintptr_t addr, size_t size, uint64_t peers) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "taking access to device memory back", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  if ((peers >> device) & 1)
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d's access to its own memory cannot be revoked", device);
  else if (sim_device_count() < 64 && (peers >> sim_device_count()) != 0)
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "peer mask %#llx names a device that does not exist (%d simulated)",
                  (unsigned long long)peers, sim_device_count());
  if (rc == MAGPIE_OK && !sim_memory_all_mapped(r, first, count, 1))
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is not (wholly) mapped on device %d: no access to revoke",
                  (unsigned long)addr, size, device);
  if (rc == MAGPIE_OK)
    for (size_t g = first; g < first + count; g++) r->access[g] &= ~peers;
  pthread_mutex_unlock(&d->lock);
  return rc;
}

/* ---------------------------------------------------------------- export, import */

int sim_memory_export_fds(int device, uintptr_t addr, size_t size, int *fds) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "exporting device memory", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  for (size_t g = first; rc == MAGPIE_OK && g < first + count; g++) {
    unsigned long a = (unsigned long)(r->base + g * SIM_GRANULARITY);
    if (r->access[g] == 0)
      rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "the granule at %#lx of device %d is not mapped: nothing to export", a,
                    device);
    else if (r->fds == NULL || r->fds[g] == SIM_FD_NONE)
      rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT,
                    "the granule at %#lx of device %d was not mapped exportable (BACKEND_MAP_EXPORTABLE): its memory "
                    "cannot be shared",
                    a, device);
    else if (r->fds[g] == SIM_FD_IMPORTED)
      rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT,
                    "the granule at %#lx of device %d maps memory imported from another mapping: only the "
                    "memory's exporter exports it",
                    a, device);
  }
  size_t done = 0;
  while (rc == MAGPIE_OK && done < count) {
    int fd = fcntl(r->fds[first + done], F_DUPFD_CLOEXEC, 0);
    if (fd >= 0) fds[done++] = fd;
    else rc = sim_memory_fd_fail(device, "dup of a granule's descriptor", errno);
  }
  if (rc != MAGPIE_OK) /* no descriptor stays open */
    for (size_t j = 0; j < done; j++) {
      close(fds[j]);
      fds[j] = -1;
    }
  pthread_mutex_unlock(&d->lock);
  return rc;
}

/* Whether fd can be granule k of an import: a regular file of exactly one
 * granule, as export_fds gives. */
static int sim_memory_check_import_fd(int fd, size_t k) {
  struct stat st;
  if (fstat(fd, &st) != 0)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "descriptor %d (granule %zu of the import) cannot be used: %s", fd, k,
                    strerror(errno));
  if (!S_ISREG(st.st_mode) || st.st_size != (off_t)SIM_GRANULARITY)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT,
                    "descriptor %d (granule %zu of the import) is not exported simulated device memory: a file of "
                    "%zu bytes expected, found %s of %lld bytes",
                    fd, k, SIM_GRANULARITY, S_ISREG(st.st_mode) ? "a file" : "something else", (long long)st.st_size);
  return MAGPIE_OK;
}

int sim_memory_import_map(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "importing device memory", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  if (fds == NULL) rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no descriptors to import");
  if (rc == MAGPIE_OK) rc = sim_memory_check_peers(device, peers);
  if (rc == MAGPIE_OK && !sim_memory_all_mapped(r, first, count, 0))
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is already (partly) mapped: nothing can be imported there",
                  (unsigned long)addr, size);
  /* Every descriptor checked before anything is mapped. */
  for (size_t k = 0; rc == MAGPIE_OK && k < count; k++) rc = sim_memory_check_import_fd(fds[k], k);
  if (rc == MAGPIE_OK) rc = sim_memory_fds(r);
  size_t done = 0;
  while (rc == MAGPIE_OK && done < count) {
    int err = sim_memory_map_shared(addr + done * SIM_GRANULARITY, fds[done]);
    if (err == 0) {
      r->fds[first + done++] = SIM_FD_IMPORTED;
    } else {
      rc = sim_fail(err == EACCES   ? MAGPIE_ERR_INVALID_ARGUMENT
                    : err == ENOMEM ? MAGPIE_ERR_OUT_OF_MEMORY
                                    : MAGPIE_ERR_BACKEND,
                    "mapping descriptor %d (granule %zu of the import)%s: %s", fds[done], done,
                    err == EACCES ? ", which must be open for reading and writing" : "", strerror(err));
    }
  }
  if (rc != MAGPIE_OK) {
    for (size_t j = 0; j < done; j++) (void)sim_memory_drop_shared(r, first + j);
  } else {
    for (size_t g = first; g < first + count; g++) r->access[g] = ((uint64_t)1 << device) | peers;
    r->mapped_bytes += size; /* and no capacity: the exporter's device counts it */
  }
  pthread_mutex_unlock(&d->lock);
  return rc;
}

/* ---------------------------------------------------------------- plain allocations */

int sim_memory_alloc(int device, size_t size, uintptr_t *out) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, "allocating device memory", &d);
  if (rc != MAGPIE_OK) return rc;
  if (size == 0) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "allocation of 0 bytes");
  if (size > SIZE_MAX - (SIM_GRANULARITY - 1))
    return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "allocation of %zu bytes is too large", size);
  size_t rounded = (size + SIM_GRANULARITY - 1) & ~(SIM_GRANULARITY - 1);
  struct sim_region *r = calloc(1, sizeof *r);
  if (r == NULL) return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a region");
  pthread_mutex_lock(&d->lock);
  rc = sim_memory_take(d, device, rounded);
  if (rc == MAGPIE_OK) {
    rc = sim_memory_mmap_aligned(rounded, PROT_READ | PROT_WRITE, &r->base);
    if (rc != MAGPIE_OK) sim_memory_give(d, rounded);
  }
  if (rc == MAGPIE_OK) {
    r->size = rounded;
    r->kind = SIM_REGION_ALLOCATED;
    r->next = d->regions;
    d->regions = r;
    *out = r->base;
  }
  pthread_mutex_unlock(&d->lock);
  if (rc != MAGPIE_OK) free(r);
  return rc;
}

int sim_memory_free(int device, uintptr_t ptr, size_t size) {
  struct sim_memory_device *d;
  int rc = sim_memory_device_for(device, "freeing device memory", &d);
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&d->lock);
  struct sim_region *r = sim_memory_find(d, ptr, 0);
  if (r == NULL || r->kind != SIM_REGION_ALLOCATED || r->base != ptr) {
    pthread_mutex_unlock(&d->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx is not an allocation of device %d", (unsigned long)ptr, device);
  }
  if (size > r->size) {
    size_t have = r->size;
    pthread_mutex_unlock(&d->lock);
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "freeing %zu bytes at %#lx, but the allocation has %zu", size,
                    (unsigned long)ptr, have);
  }
  sim_memory_unlink(d, r);
  pthread_mutex_unlock(&d->lock);
  munmap((void *)r->base, r->size);
  sim_memory_give(d, r->size); /* after the memory is really gone */
  free(r);
  return MAGPIE_OK;
}

/* ---------------------------------------------------------------- access checks */

/* Whether work of device may touch address a (MAGPIE_OK, or the error
 * with the detail set); *last: the last address of the run from a on that
 * has the same verdict (its granule, or its whole allocation). Takes the
 * devices' locks one after another. */
static int sim_memory_access_at(int device, uintptr_t a, uintptr_t *last) {
  for (int o = 0; o < sim_device_count(); o++) {
    struct sim_memory_device *d = &sim_memory_devices[o];
    pthread_mutex_lock(&d->lock);
    struct sim_region *r = sim_memory_find(d, a, 1);
    if (r == NULL) {
      pthread_mutex_unlock(&d->lock);
      continue;
    }
    uint64_t mask;
    if (r->kind == SIM_REGION_ALLOCATED) {
      mask = ((uint64_t)1 << o) | d->alloc_peers;
      *last = r->base + (r->size - 1);
    } else {
      size_t g = (a - r->base) / SIM_GRANULARITY;
      mask = r->access[g];
      *last = r->base + g * SIM_GRANULARITY + (SIM_GRANULARITY - 1);
    }
    pthread_mutex_unlock(&d->lock);
    if (mask == 0)
      return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx is reserved on device %d but not mapped", (unsigned long)a, o);
    if (((mask >> device) & 1) == 0)
      return sim_fail(MAGPIE_ERR_NO_PEER_ACCESS,
                      "device %d's memory at %#lx is not accessible from device %d: enable peer access first "
                      "(magpie_device_enable_peer_access(%d, %d))",
                      o, (unsigned long)a, device, o, device);
    return MAGPIE_OK;
  }
  return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx is not simulated device memory (no device has it mapped)",
                  (unsigned long)a);
}

int sim_memory_access_check(int device, uintptr_t p, size_t n) {
  int rc = sim_check_device(device);
  if (rc != MAGPIE_OK || n == 0) return rc;
  if (n - 1 > UINTPTR_MAX - p)
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "range %#lx+%zu wraps around", (unsigned long)p, n);
  uintptr_t a = p, end = p + (n - 1);
  for (;;) {
    uintptr_t last = end;
    rc = sim_memory_access_at(device, a, &last);
    if (rc != MAGPIE_OK || last >= end) return rc;
    a = last + 1;
  }
}

int sim_memory_launch_access(cudaStream_t h, void (*fn)(void *), void *arg, const void *p, size_t n) {
  if (fn == NULL) return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "no function to launch");
  struct sim_stream *s;
  /* The stream's own device, resolved as a launch resolves it: not a query
   * of its identity, which CUDA refuses on a capturing stream. */
  int rc = sim_stream_resolve(h, &s);
  if (rc == MAGPIE_OK) rc = sim_memory_access_check(sim_stream_device(s), (uintptr_t)p, n);
  if (rc != MAGPIE_OK) return rc;
  return sim_stream_launch(h, fn, arg);
}

MAGPIE_API int magpie_sim_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  return sim_public_result("magpie_sim_mem_info", sim_memory_info(device, free_bytes, total_bytes));
}

MAGPIE_API int magpie_sim_set_peer_capable(int device, int peer, int capable) {
  return sim_public_result("magpie_sim_set_peer_capable", sim_memory_set_peer_capable(device, peer, capable));
}

MAGPIE_API int magpie_sim_access_check(int device, const void *p, size_t n) {
  return sim_public_result("magpie_sim_access_check", sim_memory_access_check(device, (uintptr_t)p, n));
}

MAGPIE_API int magpie_sim_launch_access(cudaStream_t s, void (*fn)(void *), void *arg, const void *p, size_t n) {
  return sim_public_result("magpie_sim_launch_access", sim_memory_launch_access(s, fn, arg, p, n));
}
