/* A timing wrapper over a backend table (MAGPIE_CONF=slow_call_ms=N): every
 * device operation is timed, and one that takes N ms or more is reported
 * on stderr with its name and duration, so a stall inside an allocation can
 * be traced to the driver call that caused it. It also counts the calls of
 * each kind and their total time, printed with the statistics, to show
 * where an allocator's time goes. Off by default: it costs two clock reads
 * and two shared counter additions per call, the allocation fast path's
 * stream_id included.
 *
 * No locks: the slowest time per operation is a relaxed atomic maximum,
 * the counts and totals relaxed additions (statistics only). */
#include "device/backend_timed.h"

#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "base/atomic.h"

enum {
  TIMED_INIT,
  TIMED_DEVICE_COUNT,
  TIMED_MEM_INFO,
  TIMED_VMM,
  TIMED_GRAN,
  TIMED_RESERVE,
  TIMED_UNRESERVE,
  TIMED_MAP,
  TIMED_UNMAP,
  TIMED_MEM_ALLOC,
  TIMED_MEM_FREE,
  TIMED_EVENT_CREATE,
  TIMED_EVENT_DESTROY,
  TIMED_EVENT_RECORD,
  TIMED_EVENT_QUERY,
  TIMED_EVENT_SYNC,
  TIMED_WAIT_EVENT,
  TIMED_STREAM_ID,
  TIMED_STREAM_DEVICE,
  TIMED_DEVICE_SYNC,
  TIMED_STREAM_CAPTURE,
  TIMED_COUNT
};

/* This file's state: set once by backend_timed before the table is used;
 * counters relaxed (statistics only). */
static struct timed_state {
  const backend_ops *inner;
  uint64_t threshold_ns;
  _Atomic size_t max_ns[TIMED_COUNT];
  _Atomic size_t calls[TIMED_COUNT];
  _Atomic size_t total_ns[TIMED_COUNT];
} timed_st;

static const char *const timed_names[TIMED_COUNT] = {
    "init",
    "device_count",
    "mem_info",
    "vmm_supported",
    "granularity",
    "reserve",
    "unreserve",
    "map",
    "unmap",
    "mem_alloc",
    "mem_free",
    "event_create",
    "event_destroy",
    "event_record",
    "event_query",
    "event_synchronize",
    "stream_wait_event",
    "stream_id",
    "stream_device",
    "device_synchronize",
    "stream_capture",
};

static uint64_t timed_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int timed_done(int op, uint64_t t0, int rc) {
  uint64_t ns = timed_now() - t0;
  atomic_max_size_relaxed(&timed_st.max_ns[op], (size_t)ns);
  atomic_add_relaxed(&timed_st.calls[op], 1);
  atomic_add_relaxed(&timed_st.total_ns[op], (size_t)ns);
  if (ns >= timed_st.threshold_ns)
    fprintf(stderr, "magpie: slow device call: %s took %.3f ms (returned %d)\n", timed_names[op], ns / 1e6, rc);
  return rc;
}

static int timed_init(void) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_INIT, t0, timed_st.inner->init());
}
static int timed_device_count(int *n) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_DEVICE_COUNT, t0, timed_st.inner->device_count(n));
}
static int timed_mem_info(int d, size_t *f, size_t *t) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_MEM_INFO, t0, timed_st.inner->mem_info(d, f, t));
}
static int timed_vmm(int d, int *s) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_VMM, t0, timed_st.inner->vmm_supported(d, s));
}
static int timed_gran(int d, size_t *g) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_GRAN, t0, timed_st.inner->granularity(d, g));
}
static int timed_reserve(int d, size_t size, uintptr_t *base) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_RESERVE, t0, timed_st.inner->reserve(d, size, base));
}
static int timed_unreserve(int d, uintptr_t base, size_t size) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_UNRESERVE, t0, timed_st.inner->unreserve(d, base, size));
}
static int timed_map(int d, uintptr_t a, size_t size, unsigned flags, uint64_t peers) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_MAP, t0, timed_st.inner->map(d, a, size, flags, peers));
}
static int timed_unmap(int d, uintptr_t a, size_t size) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_UNMAP, t0, timed_st.inner->unmap(d, a, size));
}
static int timed_mem_alloc(int d, size_t size, uintptr_t *out) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_MEM_ALLOC, t0, timed_st.inner->mem_alloc(d, size, out));
}
static int timed_mem_free(int d, uintptr_t p, size_t size) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_MEM_FREE, t0, timed_st.inner->mem_free(d, p, size));
}
static int timed_event_create(int d, void **ev) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_EVENT_CREATE, t0, timed_st.inner->event_create(d, ev));
}
static int timed_event_destroy(void *ev) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_EVENT_DESTROY, t0, timed_st.inner->event_destroy(ev));
}
static int timed_event_record(void *ev, cudaStream_t s) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_EVENT_RECORD, t0, timed_st.inner->event_record(ev, s));
}
static int timed_event_query(void *ev) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_EVENT_QUERY, t0, timed_st.inner->event_query(ev));
}
static int timed_event_sync(void *ev) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_EVENT_SYNC, t0, timed_st.inner->event_synchronize(ev));
}
static int timed_wait_event(cudaStream_t s, void *ev) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_WAIT_EVENT, t0, timed_st.inner->stream_wait_event(s, ev));
}
static int timed_stream_id(cudaStream_t s, uint64_t *id) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_STREAM_ID, t0, timed_st.inner->stream_id(s, id));
}
static int timed_stream_id_fast(cudaStream_t s, unsigned long long *id) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_STREAM_ID, t0, timed_st.inner->stream_id_fast(s, id));
}
static int timed_stream_device(cudaStream_t s, int *d) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_STREAM_DEVICE, t0, timed_st.inner->stream_device(s, d));
}
static int timed_device_sync(int d) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_DEVICE_SYNC, t0, timed_st.inner->device_synchronize(d));
}

static int timed_stream_capture(cudaStream_t s, int *status, uint64_t *id) {
  uint64_t t0 = timed_now();
  return timed_done(TIMED_STREAM_CAPTURE, t0, timed_st.inner->stream_capture(s, status, id));
}

static backend_ops timed_ops = {
    .init = timed_init,
    .device_count = timed_device_count,
    .mem_info = timed_mem_info,
    .vmm_supported = timed_vmm,
    .granularity = timed_gran,
    .reserve = timed_reserve,
    .unreserve = timed_unreserve,
    .map = timed_map,
    .unmap = timed_unmap,
    .mem_alloc = timed_mem_alloc,
    .mem_free = timed_mem_free,
    .event_create = timed_event_create,
    .event_destroy = timed_event_destroy,
    .event_record = timed_event_record,
    .event_query = timed_event_query,
    .event_synchronize = timed_event_sync,
    .stream_wait_event = timed_wait_event,
    .stream_id = timed_stream_id,
    .stream_id_fast = timed_stream_id_fast,
    .stream_device = timed_stream_device,
    .device_synchronize = timed_device_sync,
    .stream_capture = timed_stream_capture,
};

const backend_ops *backend_timed(const backend_ops *inner, unsigned threshold_ms) {
  timed_st.inner = inner;
  timed_st.threshold_ns = (uint64_t)threshold_ms * 1000000ull;
  timed_ops.name = inner->name;
  timed_ops.event_prefill = inner->event_prefill;
  timed_ops.error_detail = inner->error_detail; /* not operations: as they are */
  timed_ops.observer = inner->observer;
  if (inner->stream_capture == NULL) timed_ops.stream_capture = NULL; /* optional: as it is */
  /* Peer access and sharing: rare, set up once or one per import; passed
   * through untimed, NULL where the inner table has none. */
  backend_copy_sharing(&timed_ops, inner);
  return &timed_ops;
}

int backend_timed_active(void) { return timed_st.inner != NULL; }

void backend_timed_print(FILE *out) {
  if (timed_st.inner == NULL) return;
  fputs("  slowest device call of each kind (ms):", out);
  for (int i = 0; i < TIMED_COUNT; i++) {
    size_t ns = atomic_load_relaxed(&timed_st.max_ns[i]);
    if (ns) fprintf(out, " %s %.3f", timed_names[i], ns / 1e6);
  }
  fputs("\n  device calls of each kind: count, total ms, mean us:", out);
  for (int i = 0; i < TIMED_COUNT; i++) {
    size_t n = atomic_load_relaxed(&timed_st.calls[i]), ns = atomic_load_relaxed(&timed_st.total_ns[i]);
    if (n) fprintf(out, " %s %zu %.3f %.3f;", timed_names[i], n, ns / 1e6, ns / 1e3 / (double)n);
  }
  fputc('\n', out);
}
