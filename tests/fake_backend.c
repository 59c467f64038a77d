/* Deterministic fake device layer; see fake_backend.h.
 * Lock order: fake_gate_mu and fake_lock are leaves, never nested. */
#include "fake_backend.h"

#include "front/init.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FAKE_MAX_STREAMS 4096
#define FAKE_DEVICES 4
#define FAKE_GRAN ((size_t)2 << 20)

typedef struct fake_event {
  int recorded;
  cudaStream_t stream;
  uint64_t stream_id;
  uint64_t ticket; /* position in the stream's work */
} fake_event;

typedef struct fake_stream {
  uint64_t id;
  int alive; /* 0 once destroyed (its work may still be pending) */
  int device;
  uint64_t enqueued;  /* work items so far (events recorded) */
  uint64_t completed; /* work completed up to */
} fake_stream;

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static fake_stream fake_streams[FAKE_MAX_STREAMS]; /* never reused */
static int fake_nstreams;
static int fake_handles[FAKE_MAX_STREAMS]; /* handle - 16 -> stream index, -1 free */
static int fake_nhandles;
static int fake_free_handles[FAKE_MAX_STREAMS];
static int fake_nfree;
static uint64_t fake_next_id = 100;
static int fake_ndev = 1;
static size_t fake_capacity[FAKE_DEVICES] = {(size_t)1 << 30, (size_t)1 << 30, (size_t)1 << 30, (size_t)1 << 30};
static size_t fake_mapped[FAKE_DEVICES];
static fake_counters fake_cnt;
static __thread int fake_cur_dev;
/* Legacy stream of each device: index FAKE_DEVICES.. in the table. */
static int fake_legacy_index[FAKE_DEVICES] = {-1, -1, -1, -1};

static fake_stream *fake_lookup(cudaStream_t s) {
  uintptr_t h = (uintptr_t)s;
  if (h <= 2) {
    int d = fake_cur_dev;
    if (fake_legacy_index[d] < 0) {
      int i = fake_nstreams++;
      fake_streams[i].id = fake_next_id++;
      fake_streams[i].alive = 1;
      fake_streams[i].device = d;
      fake_legacy_index[d] = i;
    }
    return &fake_streams[fake_legacy_index[d]];
  }
  if (h < 16 || h - 16 >= (uintptr_t)fake_nhandles || fake_handles[h - 16] < 0) return NULL;
  return &fake_streams[fake_handles[h - 16]];
}

cudaStream_t fake_stream_create(int device) {
  pthread_mutex_lock(&fake_lock);
  int h = fake_nfree > 0 ? fake_free_handles[--fake_nfree] : fake_nhandles++;
  int i = fake_nstreams++;
  fake_streams[i] = (fake_stream){.id = fake_next_id++, .alive = 1, .device = device};
  fake_handles[h] = i;
  pthread_mutex_unlock(&fake_lock);
  return (cudaStream_t)(uintptr_t)(h + 16);
}

void fake_stream_destroy(cudaStream_t s) {
  pthread_mutex_lock(&fake_lock);
  fake_stream *st = fake_lookup(s);
  if (st && (uintptr_t)s > 2) {
    /* Pending work of a destroyed stream still completes, but only when the
     * test says so through a device synchronisation. */
    st->alive = 0;
    fake_handles[(uintptr_t)s - 16] = -1;
    fake_free_handles[fake_nfree++] = (int)((uintptr_t)s - 16);
  }
  pthread_mutex_unlock(&fake_lock);
}

void fake_stream_complete(cudaStream_t s) {
  pthread_mutex_lock(&fake_lock);
  fake_stream *st = fake_lookup(s);
  if (st) st->completed = st->enqueued;
  pthread_mutex_unlock(&fake_lock);
}

void fake_set_devices(int n) { fake_ndev = n; }
void fake_set_capacity(int device, size_t bytes) { fake_capacity[device] = bytes; }
void fake_set_current_device(int device) { fake_cur_dev = device; }

void fake_get_counters(fake_counters *out) {
  pthread_mutex_lock(&fake_lock);
  *out = fake_cnt;
  for (int d = 0; d < FAKE_DEVICES; d++) out->mapped_bytes[d] = fake_mapped[d];
  pthread_mutex_unlock(&fake_lock);
}

static int f_init(void) { return MAGPIE_OK; }
static int f_device_count(int *n) {
  *n = fake_ndev;
  return MAGPIE_OK;
}
static int f_mem_info(int d, size_t *fr, size_t *tot) {
  pthread_mutex_lock(&fake_lock);
  *tot = fake_capacity[d];
  *fr = fake_capacity[d] - fake_mapped[d];
  pthread_mutex_unlock(&fake_lock);
  return MAGPIE_OK;
}
static int f_vmm(int d, int *s) {
  (void)d;
  *s = 1;
  return MAGPIE_OK;
}
static int f_gran(int d, size_t *g) {
  (void)d;
  *g = FAKE_GRAN;
  return MAGPIE_OK;
}
static int f_reserve(int d, size_t size, uintptr_t *base) {
  (void)d;
  void *p = mmap(NULL, size + FAKE_GRAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return MAGPIE_ERR_OUT_OF_MEMORY;
  *base = ((uintptr_t)p + FAKE_GRAN - 1) & ~(uintptr_t)(FAKE_GRAN - 1);
  return MAGPIE_OK;
}
static int f_unreserve(int d, uintptr_t base, size_t size) {
  (void)d;
  (void)base;
  (void)size;
  return MAGPIE_OK;
}
static _Atomic unsigned fake_map_delay_us;
void fake_set_map_delay_us(unsigned us) { fake_map_delay_us = us; }

static int f_map(int d, uintptr_t a, size_t size, unsigned flags, uint64_t peers) {
  (void)flags; /* the fake device neither exports nor has peers */
  (void)peers;
  if (fake_map_delay_us) usleep(fake_map_delay_us);
  pthread_mutex_lock(&fake_lock);
  if (fake_mapped[d] + size > fake_capacity[d]) {
    pthread_mutex_unlock(&fake_lock);
    backend_set_error_detail("fake device %d full", d);
    return MAGPIE_ERR_OUT_OF_MEMORY;
  }
  fake_mapped[d] += size;
  fake_cnt.maps++;
  pthread_mutex_unlock(&fake_lock);
  mprotect((void *)a, size, PROT_READ | PROT_WRITE);
  return MAGPIE_OK;
}
/* Gates: device_synchronize and unmap wait while theirs is closed. */
static pthread_mutex_t fake_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fake_gate_cv = PTHREAD_COND_INITIALIZER;
static int fake_gate_closed, fake_unmap_gate_closed, fake_unmap_waiters;

void fake_gate_unmap(int closed) {
  pthread_mutex_lock(&fake_gate_mu);
  fake_unmap_gate_closed = closed;
  pthread_cond_broadcast(&fake_gate_cv);
  pthread_mutex_unlock(&fake_gate_mu);
}

int fake_unmaps_held(void) {
  pthread_mutex_lock(&fake_gate_mu);
  int n = fake_unmap_waiters;
  pthread_mutex_unlock(&fake_gate_mu);
  return n;
}

static int f_unmap(int d, uintptr_t a, size_t size) {
  pthread_mutex_lock(&fake_gate_mu);
  fake_unmap_waiters++;
  while (fake_unmap_gate_closed) pthread_cond_wait(&fake_gate_cv, &fake_gate_mu);
  fake_unmap_waiters--;
  pthread_mutex_unlock(&fake_gate_mu);
  mprotect((void *)a, size, PROT_NONE);
  madvise((void *)a, size, MADV_DONTNEED);
  pthread_mutex_lock(&fake_lock);
  fake_mapped[d] -= size;
  fake_cnt.unmaps++;
  pthread_mutex_unlock(&fake_lock);
  return MAGPIE_OK;
}
static int f_mem_alloc(int d, size_t size, uintptr_t *out) {
  (void)d;
  (void)size;
  (void)out;
  return MAGPIE_ERR_BACKEND;
}
static int f_mem_free(int d, uintptr_t p, size_t size) {
  (void)d;
  (void)p;
  (void)size;
  return MAGPIE_OK;
}
static int f_event_create(int d, void **ev) {
  (void)d;
  *ev = calloc(1, sizeof(fake_event));
  return *ev ? MAGPIE_OK : MAGPIE_ERR_OUT_OF_MEMORY;
}
static int f_event_destroy(void *ev) {
  free(ev);
  return MAGPIE_OK;
}
static int f_event_record(void *ev, cudaStream_t s) {
  fake_event *e = ev;
  pthread_mutex_lock(&fake_lock);
  fake_stream *st = fake_lookup(s);
  if (st == NULL) {
    pthread_mutex_unlock(&fake_lock);
    return MAGPIE_ERR_INVALID_STREAM;
  }
  e->recorded = 1;
  e->stream = s;
  e->stream_id = st->id;
  e->ticket = ++st->enqueued;
  fake_cnt.event_records++;
  pthread_mutex_unlock(&fake_lock);
  return MAGPIE_OK;
}
/* Completed when the stream (by id: it may be destroyed) completed past it. */
static int fake_event_done_locked(fake_event *e) {
  if (!e->recorded) return 1;
  for (int i = 0; i < fake_nstreams; i++) {
    fake_stream *st = &fake_streams[i];
    if (st->id == e->stream_id) return st->completed >= e->ticket;
  }
  return 1;
}
static int f_event_query(void *ev) {
  pthread_mutex_lock(&fake_lock);
  fake_cnt.event_queries++;
  int done = fake_event_done_locked(ev);
  pthread_mutex_unlock(&fake_lock);
  return done ? MAGPIE_OK : BACKEND_NOT_READY;
}
static int f_event_sync(void *ev) {
  fake_event *e = ev;
  pthread_mutex_lock(&fake_lock);
  fake_cnt.event_syncs++;
  for (int i = 0; i < fake_nstreams; i++)
    if (fake_streams[i].id == e->stream_id && fake_streams[i].completed < e->ticket)
      fake_streams[i].completed = e->ticket;
  pthread_mutex_unlock(&fake_lock);
  return MAGPIE_OK;
}
static _Atomic unsigned fake_wait_failures;
void fake_fail_stream_waits(unsigned n) { fake_wait_failures = n; }

static int f_wait_event(cudaStream_t s, void *ev) {
  (void)s;
  (void)ev;
  unsigned left = fake_wait_failures;
  if (left > 0) {
    fake_wait_failures = left - 1;
    backend_set_error_detail("fake stream wait refused");
    return MAGPIE_ERR_BACKEND;
  }
  pthread_mutex_lock(&fake_lock);
  fake_cnt.stream_waits++;
  pthread_mutex_unlock(&fake_lock);
  return MAGPIE_OK;
}
static int f_stream_id(cudaStream_t s, uint64_t *id) {
  pthread_mutex_lock(&fake_lock);
  fake_stream *st = fake_lookup(s);
  uint64_t v = st ? st->id : 0;
  pthread_mutex_unlock(&fake_lock);
  if (!v) {
    backend_set_error_detail("fake stream %p destroyed", (void *)s);
    return MAGPIE_ERR_INVALID_STREAM;
  }
  *id = v;
  return MAGPIE_OK;
}
/* The fast form: the same answer (under the same lock). */
static int f_stream_id_fast(cudaStream_t s, unsigned long long *id) {
  uint64_t v = 0;
  int rc = f_stream_id(s, &v);
  *id = v;
  return rc != MAGPIE_OK;
}
static int f_stream_device(cudaStream_t s, int *dev) {
  pthread_mutex_lock(&fake_lock);
  fake_stream *st = fake_lookup(s);
  int d = st ? st->device : -1;
  pthread_mutex_unlock(&fake_lock);
  if (d < 0) return MAGPIE_ERR_INVALID_STREAM;
  *dev = d;
  return MAGPIE_OK;
}
void fake_gate_device_sync(int closed) {
  pthread_mutex_lock(&fake_gate_mu);
  fake_gate_closed = closed;
  pthread_cond_broadcast(&fake_gate_cv);
  pthread_mutex_unlock(&fake_gate_mu);
}

static int f_device_sync(int d) {
  pthread_mutex_lock(&fake_gate_mu);
  while (fake_gate_closed) pthread_cond_wait(&fake_gate_cv, &fake_gate_mu);
  pthread_mutex_unlock(&fake_gate_mu);
  pthread_mutex_lock(&fake_lock);
  fake_cnt.device_syncs++;
  /* Destroyed streams' pending work drains too. */
  for (int i = 0; i < fake_nstreams; i++)
    if (fake_streams[i].device == d) fake_streams[i].completed = fake_streams[i].enqueued;
  pthread_mutex_unlock(&fake_lock);
  return MAGPIE_OK;
}

static const backend_ops fake_ops = {
    .name = "fake",
    .init = f_init,
    .device_count = f_device_count,
    .mem_info = f_mem_info,
    .vmm_supported = f_vmm,
    .granularity = f_gran,
    .reserve = f_reserve,
    .unreserve = f_unreserve,
    .map = f_map,
    .unmap = f_unmap,
    .mem_alloc = f_mem_alloc,
    .mem_free = f_mem_free,
    .event_create = f_event_create,
    .event_destroy = f_event_destroy,
    .event_record = f_event_record,
    .event_query = f_event_query,
    .event_synchronize = f_event_sync,
    .stream_wait_event = f_wait_event,
    .stream_id = f_stream_id,
    .stream_id_fast = f_stream_id_fast,
    .stream_device = f_stream_device,
    .device_synchronize = f_device_sync,
};

const backend_ops *fake_backend(void) { return &fake_ops; }

int fake_magpie_init(int check) {
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.check = check;
  return global_init_slow(&cfg, fake_backend());
}
