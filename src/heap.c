/* Per-device heaps, the refill ladder and the limbo reaper.
 *
 * Lock order: heap_create_lock -> (region/epoch init, no other magpie
 * lock). reaper_lock is a leaf. Neither is held across a device
 * synchronisation. */
#include "heap.h"

#include <pthread.h>
#include <string.h>

#include "error.h"
#include "meta.h"
#include "record.h"

static const backend_ops *heap_ops;
static pthread_mutex_t heap_create_lock = PTHREAD_MUTEX_INITIALIZER;
/* Heaps by device. Written once (release) under heap_create_lock after the
 * heap is fully built; read with acquire. */
static _Atomic(heap *) heaps[HEAP_MAX_DEVICES];

void heap_module_init(const backend_ops *ops) { heap_ops = ops; }

heap *heap_peek(int device) {
  if (device < 0 || device >= HEAP_MAX_DEVICES) return NULL;
  return atomic_load_acquire(&heaps[device]);
}

static heap *heap_create(int device) {
  const backend_ops *ops = heap_ops;
  size_t free_b = 0, total = 0;
  int rc = ops->mem_info(device, &free_b, &total);
  if (rc != MAGPIE_OK) {
    error_set(rc, "cannot query memory of device %d: %s", device, backend_error_detail());
    return NULL;
  }
  heap *h = meta_alloc(sizeof *h);
  if (h == NULL) {
    error_set(MAGPIE_ERR_OUT_OF_MEMORY, "out of host memory creating the heap of device %d", device);
    return NULL;
  }
  h->device = device;
  h->ops = ops;
  h->total_mem = total;
  /* Virtual range: four times the device (room for fragmentation of the
   * range itself), at least 4 GiB, at most 1 TiB. Reserving costs no
   * memory. */
  size_t hint = total * 4;
  if (hint < ((size_t)4 << 30)) hint = (size_t)4 << 30;
  if (hint > ((size_t)1 << 40)) hint = (size_t)1 << 40;
  rc = region_init(&h->region, device, ops, hint);
  if (rc != MAGPIE_OK) {
    error_set(rc, "cannot set up device memory of device %d: %s", device, backend_error_detail());
    meta_free(h);
    return NULL;
  }
  epoch_table_init(&h->epochs, device, ops);
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) depot_init(&h->depots[c]);
  stack_init(&h->limbo);
  large_init(&h->large);
  return h;
}

heap *heap_get(int device) {
  if (device < 0 || device >= HEAP_MAX_DEVICES) {
    error_set(MAGPIE_ERR_INVALID_ARGUMENT, "device %d out of range (0..%d)", device, HEAP_MAX_DEVICES - 1);
    return NULL;
  }
  heap *h = atomic_load_acquire(&heaps[device]);
  if (likely(h != NULL)) return h;
  pthread_mutex_lock(&heap_create_lock);
  h = atomic_load_relaxed(&heaps[device]);
  if (h == NULL) {
    h = heap_create(device);
    if (h != NULL) atomic_store_release(&heaps[device], h);
  }
  pthread_mutex_unlock(&heap_create_lock);
  return h;
}

int heap_map(heap *h, size_t size, uintptr_t *addr, uintptr_t *raw, size_t *raw_size) {
  int rc = region_map(&h->region, size, addr, raw, raw_size);
  if (rc == MAGPIE_OK) atomic_max_size_relaxed(&h->stat_peak_reserved, atomic_load_relaxed(&h->region.mapped));
  return rc;
}

void heap_unmap(heap *h, uintptr_t addr, size_t size, uintptr_t raw, size_t raw_size) {
  region_unmap(&h->region, addr, size, raw, raw_size);
}

void heap_slab_added(heap *h, slab *s) {
  (void)s;
  atomic_add_relaxed(&h->stat_slabs, 1);
}

void heap_publish_in_use(heap *h, int64_t delta) {
  int64_t now = atomic_add_relaxed(&h->stat_in_use_published, delta) + delta;
  if (now > 0) atomic_max_size_relaxed(&h->stat_peak_in_use, (size_t)now);
}

int heap_refill(heap *h, unsigned cls, uint64_t stream_id, magazine **out) {
  record_poll(h); /* recorded blocks whose streams completed (record.c) */
  magazine *m = depot_take(h, cls, stream_id);
  if (m != NULL) {
    *out = m;
    return MAGPIE_OK;
  }
  int rc = slab_carve(h, cls, out);
  if (rc != MAGPIE_ERR_OUT_OF_MEMORY) return rc;
  /* Pressure, cheapest step first; nothing here runs on the fast path. */
  if (large_release_cached(h, 0) > 0 && slab_carve(h, cls, out) == MAGPIE_OK) return MAGPIE_OK;
  if (depot_wait_pending(h, cls) > 0 && (m = depot_take(h, cls, stream_id)) != NULL) {
    *out = m;
    return MAGPIE_OK;
  }
  if (large_release_cached(h, 1) > 0 && slab_carve(h, cls, out) == MAGPIE_OK) return MAGPIE_OK;
  return MAGPIE_ERR_OUT_OF_MEMORY;
}

int heap_large_alloc(heap *h, size_t size, uint64_t stream_id, slab **out) {
  record_poll(h); /* recorded blocks whose streams completed (record.c) */
  int rc = large_alloc(h, size, stream_id, out);
  for (int wait = 0; rc == MAGPIE_ERR_OUT_OF_MEMORY && wait < 2; wait++)
    if (large_release_cached(h, wait) > 0) rc = large_alloc(h, size, stream_id, out);
  return rc;
}

/* ---- limbo and its reaper ---- */

static pthread_mutex_t reaper_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reaper_cv = PTHREAD_COND_INITIALIZER;
static int reaper_started; /* under reaper_lock */
static int reaper_work;    /* under reaper_lock */

/* Move everything in h's limbo to the depot once the device has drained.
 * The chain is taken before the synchronisation, so every magazine in it
 * was put there (and its stream's work enqueued) before the wait began. */
static void heap_reap(heap *h) {
  registry_link *chain = stack_take_all(&h->limbo, &magazine_registry);
  if (chain == NULL) return;
  int ok = h->ops->device_synchronize(h->device) == MAGPIE_OK;
  for (registry_link *n = chain, *next; n; n = next) {
    next = stack_next(&magazine_registry, n);
    magazine *m = (magazine *)n;
    if (ok) depot_put(h, m);
    else stack_push(&h->limbo, &magazine_registry, &m->link);
  }
}

static void *heap_reaper_main(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&reaper_lock);
    while (!reaper_work) pthread_cond_wait(&reaper_cv, &reaper_lock);
    reaper_work = 0;
    pthread_mutex_unlock(&reaper_lock);
    for (int d = 0; d < HEAP_MAX_DEVICES; d++) {
      heap *h = heap_peek(d);
      if (h != NULL) heap_reap(h);
    }
  }
  return NULL;
}

void heap_limbo_put(heap *h, magazine *m) {
  m->ticket = (epoch_ticket){0};
  stack_push(&h->limbo, &magazine_registry, &m->link);
  atomic_add_relaxed(&h->stat_limbo, 1);
  pthread_mutex_lock(&reaper_lock);
  reaper_work = 1;
  int inline_reap = 0;
  if (!reaper_started) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, heap_reaper_main, NULL) == 0) reaper_started = 1;
    else inline_reap = 1;
    pthread_attr_destroy(&attr);
  }
  pthread_cond_signal(&reaper_cv);
  pthread_mutex_unlock(&reaper_lock);
  /* No thread could be started: drain here (this is a slow path: a slot
   * being retired), rather than strand the memory. */
  if (inline_reap) heap_reap(h);
}
