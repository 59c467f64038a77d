/* Simulated device memory: host address space handed out the way the CUDA
 * driver's virtual memory management hands out device memory.
 *
 *   reserve   mmap(PROT_NONE, MAP_NORESERVE): address space only, aligned
 *             to the granularity; costs no capacity.
 *   map       mprotect(read/write) of whole granules of a reservation,
 *             after taking their size from the device's capacity.
 *   unmap     madvise(MADV_DONTNEED) + mprotect(PROT_NONE); gives the
 *             capacity back. Touching unmapped memory faults, as on a GPU.
 *   alloc     the fallback without VMM: aligned read/write memory counted
 *             against the same capacity.
 * Every region is remembered, so mapping a mapped granule, unmapping an
 * unmapped one, freeing an unknown pointer or unreserving a range that is
 * still mapped is reported as an error instead of corrupting the count.
 * All six are the calls CUDA deems potentially unsafe during a stream
 * capture: each first asks sim_capture_unsafe_call whether the calling thread's
 * capture mode allows it (sim_graph.c), so a device table that does not
 * switch to the relaxed mode around them fails as it would on CUDA.
 *
 * Lock order: one lock per device (sim_memory_devices[d].lock), never two at
 * once, nothing else taken under it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "device/backend.h"
#include "sim/sim_internal.h"

enum sim_region_kind { SIM_REGION_RESERVED, SIM_REGION_ALLOCATED };

/* INVARIANT: base and size are multiples of SIM_GRANULARITY. For a
 * reservation, bit g of mapped is set iff granule g is mapped read/write,
 * and mapped_bytes counts those granules; an allocation is wholly mapped
 * and has no bitmap. */
struct sim_region {
  uintptr_t base;
  size_t size;
  enum sim_region_kind kind;
  uint64_t *mapped;
  size_t mapped_bytes;
  struct sim_region *next;
};

/* INVARIANT: used equals the sum over regions of mapped_bytes (for
 * reservations) and size (for allocations), except transiently: map and
 * alloc take capacity before adding to a region, free gives it back after
 * the region is gone, so used never undercounts. */
struct sim_memory_device {
  pthread_mutex_t lock; /* guards regions and every region's fields */
  struct sim_region *regions;
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
  uint64_t *bits = calloc((granules + 63) / 64, sizeof *bits);
  if (r == NULL || bits == NULL) {
    free(r);
    free(bits);
    return sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory for a reservation's map");
  }
  rc = sim_memory_mmap_aligned(size, PROT_NONE, &r->base);
  if (rc != MAGPIE_OK) {
    free(r);
    free(bits);
    return rc;
  }
  r->size = size;
  r->kind = SIM_REGION_RESERVED;
  r->mapped = bits;
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
  munmap((void *)r->base, r->size);
  free(r->mapped);
  free(r);
  return MAGPIE_OK;
}

/* Whether granules [first, first+count) of r are all mapped (want 1) or all
 * unmapped (want 0). */
static int sim_memory_bits_all(const struct sim_region *r, size_t first, size_t count, int want) {
  for (size_t g = first; g < first + count; g++)
    if ((int)((r->mapped[g / 64] >> (g % 64)) & 1) != want) return 0;
  return 1;
}

static void sim_memory_bits_set(struct sim_region *r, size_t first, size_t count, int on) {
  for (size_t g = first; g < first + count; g++) {
    if (on) r->mapped[g / 64] |= (uint64_t)1 << (g % 64);
    else r->mapped[g / 64] &= ~((uint64_t)1 << (g % 64));
  }
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

int sim_memory_map(int device, uintptr_t addr, size_t size) {
  struct sim_memory_device *d;
  struct sim_region *r;
  size_t first, count;
  int rc = sim_memory_lock_reserved(device, "mapping device memory", addr, size, &d, &r, &first, &count);
  if (rc != MAGPIE_OK) return rc;
  if (!sim_memory_bits_all(r, first, count, 0)) {
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is already (partly) mapped", (unsigned long)addr, size);
  } else {
    rc = sim_memory_take(d, device, size);
  }
  if (rc == MAGPIE_OK && mprotect((void *)addr, size, PROT_READ | PROT_WRITE) != 0) {
    rc = sim_fail(MAGPIE_ERR_OUT_OF_MEMORY, "mprotect(read/write) of %zu bytes: %s", size, strerror(errno));
    sim_memory_give(d, size);
  }
  if (rc == MAGPIE_OK) {
    sim_memory_bits_set(r, first, count, 1);
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
  if (!sim_memory_bits_all(r, first, count, 1)) {
    rc = sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "%#lx+%zu is not (wholly) mapped", (unsigned long)addr, size);
  } else if (madvise((void *)addr, size, MADV_DONTNEED) != 0 || mprotect((void *)addr, size, PROT_NONE) != 0) {
    rc = sim_fail(MAGPIE_ERR_BACKEND, "unmapping %zu bytes: %s", size, strerror(errno));
  } else {
    sim_memory_bits_set(r, first, count, 0);
    r->mapped_bytes -= size;
    sim_memory_give(d, size);
  }
  pthread_mutex_unlock(&d->lock);
  return rc;
}

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

MAGPIE_API int magpie_sim_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  return sim_public_result("magpie_sim_mem_info", sim_memory_info(device, free_bytes, total_bytes));
}
