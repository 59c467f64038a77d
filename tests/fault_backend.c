/* Fault injection over any backend table; see fault_backend.h.
 * No locks: counters are atomics (relaxed: only their totals matter, and
 * fetch_add makes "the Nth call" exact across threads). */
#include "fault_backend.h"

#include <stdatomic.h>
#include <string.h>

static const backend_ops *fault_inner;
static _Atomic uint64_t fault_count[FAULT_OP_COUNT];
static _Atomic int fault_op_armed = -1;
static _Atomic uint64_t fault_n;
static _Atomic int fault_did_fire;

static const char *const fault_names[FAULT_OP_COUNT] = {
    "reserve",
    "map",
    "unmap",
    "mem_alloc",
    "mem_free",
    "event_create",
    "event_record",
    "event_query",
    "event_synchronize",
    "stream_wait_event",
    "stream_id",
    "stream_device",
    "device_synchronize",
};

const char *fault_op_name(int op) { return op >= 0 && op < FAULT_OP_COUNT ? fault_names[op] : "?"; }

int fault_op_from_name(const char *name) {
  for (int i = 0; i < FAULT_OP_COUNT; i++)
    if (strcmp(name, fault_names[i]) == 0) return i;
  return -1;
}

void fault_arm(int op, uint64_t n) {
  atomic_store(&fault_n, n);
  atomic_store(&fault_op_armed, op);
}

void fault_disarm(void) { atomic_store(&fault_op_armed, -1); }

uint64_t fault_calls(int op) { return atomic_load(&fault_count[op]); }

int fault_fired(void) { return atomic_load(&fault_did_fire); }

/* Counts the call; nonzero if this is the one to fail. */
static int fault_hit(int op) {
  uint64_t k = atomic_fetch_add_explicit(&fault_count[op], 1, memory_order_relaxed) + 1;
  if (atomic_load_explicit(&fault_op_armed, memory_order_relaxed) != op) return 0;
  if (k != atomic_load_explicit(&fault_n, memory_order_relaxed)) return 0;
  atomic_store(&fault_did_fire, 1);
  backend_set_error_detail("injected fault: call %llu of %s", (unsigned long long)k, fault_names[op]);
  return 1;
}

/* The error each operation reports when it fails: what the driver gives. */
#define FAULT(op, code)             \
  do {                              \
    if (fault_hit(op)) return code; \
  } while (0)

static int f_init(void) { return fault_inner->init(); }
static int f_device_count(int *n) { return fault_inner->device_count(n); }
static int f_mem_info(int d, size_t *f, size_t *t) { return fault_inner->mem_info(d, f, t); }
static int f_vmm_supported(int d, int *s) { return fault_inner->vmm_supported(d, s); }
static int f_granularity(int d, size_t *b) { return fault_inner->granularity(d, b); }

static int f_reserve(int d, size_t size, uintptr_t *base) {
  FAULT(FAULT_RESERVE, MAGPIE_ERR_BACKEND);
  return fault_inner->reserve(d, size, base);
}
static int f_unreserve(int d, uintptr_t base, size_t size) { return fault_inner->unreserve(d, base, size); }
static int f_map(int d, uintptr_t a, size_t size, unsigned flags, uint64_t peers) {
  FAULT(FAULT_MAP, MAGPIE_ERR_OUT_OF_MEMORY);
  return fault_inner->map(d, a, size, flags, peers);
}
static int f_unmap(int d, uintptr_t a, size_t size) {
  FAULT(FAULT_UNMAP, MAGPIE_ERR_BACKEND);
  return fault_inner->unmap(d, a, size);
}
static int f_mem_alloc(int d, size_t size, uintptr_t *out) {
  FAULT(FAULT_MEM_ALLOC, MAGPIE_ERR_OUT_OF_MEMORY);
  return fault_inner->mem_alloc(d, size, out);
}
static int f_mem_free(int d, uintptr_t p, size_t size) {
  FAULT(FAULT_MEM_FREE, MAGPIE_ERR_BACKEND);
  return fault_inner->mem_free(d, p, size);
}
static int f_event_create(int d, void **e) {
  FAULT(FAULT_EVENT_CREATE, MAGPIE_ERR_BACKEND);
  return fault_inner->event_create(d, e);
}
static int f_event_destroy(void *e) { return fault_inner->event_destroy(e); }
static int f_event_record(void *e, cudaStream_t s) {
  FAULT(FAULT_EVENT_RECORD, MAGPIE_ERR_BACKEND);
  return fault_inner->event_record(e, s);
}
static int f_event_query(void *e) {
  FAULT(FAULT_EVENT_QUERY, MAGPIE_ERR_BACKEND);
  return fault_inner->event_query(e);
}
static int f_event_synchronize(void *e) {
  FAULT(FAULT_EVENT_SYNCHRONIZE, MAGPIE_ERR_BACKEND);
  return fault_inner->event_synchronize(e);
}
static int f_stream_wait_event(cudaStream_t s, void *e) {
  FAULT(FAULT_STREAM_WAIT_EVENT, MAGPIE_ERR_BACKEND);
  return fault_inner->stream_wait_event(s, e);
}
static int f_stream_id(cudaStream_t s, uint64_t *id) {
  FAULT(FAULT_STREAM_ID, MAGPIE_ERR_INVALID_STREAM);
  return fault_inner->stream_id(s, id);
}
/* The fast form: the same answer (and, here, the same faults). */
static int f_stream_id_fast(cudaStream_t s, unsigned long long *id) {
  uint64_t v = 0;
  int rc = f_stream_id(s, &v);
  *id = v;
  return rc != MAGPIE_OK;
}
static int f_stream_device(cudaStream_t s, int *d) {
  FAULT(FAULT_STREAM_DEVICE, MAGPIE_ERR_INVALID_STREAM);
  return fault_inner->stream_device(s, d);
}
static int f_device_synchronize(int d) {
  FAULT(FAULT_DEVICE_SYNCHRONIZE, MAGPIE_ERR_BACKEND);
  return fault_inner->device_synchronize(d);
}

static backend_ops fault_ops = {
    .name = "fault",
    .init = f_init,
    .device_count = f_device_count,
    .mem_info = f_mem_info,
    .vmm_supported = f_vmm_supported,
    .granularity = f_granularity,
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
    .event_synchronize = f_event_synchronize,
    .stream_wait_event = f_stream_wait_event,
    .stream_id = f_stream_id,
    .stream_id_fast = f_stream_id_fast,
    .stream_device = f_stream_device,
    .device_synchronize = f_device_synchronize,
};

const backend_ops *fault_backend(const backend_ops *inner) {
  fault_inner = inner;
  /* Peer access and sharing: passed through as they are. */
  backend_copy_sharing(&fault_ops, inner);
  /* Not operations: the inner device's detail buffer and observer (the
   * simulated device's stream-order checker) as they are. */
  fault_ops.error_detail = inner->error_detail;
  fault_ops.observer = inner->observer;
  fault_ops.stream_capture = inner->stream_capture; /* a query: no fault of its own */
  return &fault_ops;
}
