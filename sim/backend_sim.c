/* The backend table over the simulated device (sim_*.c). Every operation is
 * a thin wrapper: the simulator already returns magpie_error codes and puts
 * the reason in backend_error_detail(). The memory operations switch the
 * calling thread to the relaxed capture mode around the simulator's call,
 * as the CUDA table does (device/backend.h). The allocator reaches the table
 * through magpie_sim_device_table (below), the simulator's one entry point
 * for it, whether the simulator is linked into the program or loaded as
 * libmagpie_sim.so. */
#include <string.h>

#include "device/backend.h"
#include "sim/sim_check.h"
#include "sim/sim_internal.h"

static int backend_sim_init(void) { return sim_init(); }

static int backend_sim_device_count(int *count) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  *count = sim_device_count();
  return MAGPIE_OK;
}

static int backend_sim_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  return sim_memory_info(device, free_bytes, total_bytes);
}

static int backend_sim_vmm_supported(int device, int *supported) {
  int rc = sim_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  *supported = sim_memory_vmm_supported();
  return MAGPIE_OK;
}

static int backend_sim_granularity(int device, size_t *bytes) {
  int rc = sim_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  *bytes = SIM_GRANULARITY;
  return MAGPIE_OK;
}

/* With MAGPIE_SIM_VMM=0 the virtual memory operations fail, as a driver
 * without VMM support would: the caller should have asked vmm_supported. */
static int backend_sim_need_vmm(void) {
  if (!sim_memory_vmm_supported())
    return sim_fail(MAGPIE_ERR_BACKEND, "virtual memory management is disabled (MAGPIE_SIM_VMM=0)");
  return MAGPIE_OK;
}

/* The memory operations run in the relaxed capture mode (device/backend.h):
 * the allocator maps and frees on behalf of whatever thread allocates, and
 * its memory is not part of any graph, so a capture in progress, on this
 * thread or another, neither refuses them nor is invalidated by them. The
 * thread's own mode is restored afterwards, so its other calls keep the
 * rules it chose (the CUDA table does the same with
 * cuThreadExchangeStreamCaptureMode). The simulator checks the mode inside
 * sim_memory_*, so this switch is what makes them pass. */
static int backend_sim_relaxed_begin(void) { return sim_capture_exchange_mode(MAGPIE_SIM_CAPTURE_RELAXED); }

static void backend_sim_relaxed_end(int mode) { sim_capture_exchange_mode(mode); }

static int backend_sim_reserve(int device, size_t size, uintptr_t *base) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_reserve(device, size, base);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_unreserve(int device, uintptr_t base, size_t size) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_unreserve(device, base, size);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_map(int device, uintptr_t addr, size_t size, unsigned flags, uint64_t peers) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_map(device, addr, size, flags, peers);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_unmap(int device, uintptr_t addr, size_t size) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_unmap(device, addr, size);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_mem_alloc(int device, size_t size, uintptr_t *out) {
  int mode = backend_sim_relaxed_begin();
  int rc = sim_memory_alloc(device, size, out);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_mem_free(int device, uintptr_t ptr, size_t size) {
  int mode = backend_sim_relaxed_begin();
  int rc = sim_memory_free(device, ptr, size);
  backend_sim_relaxed_end(mode);
  return rc;
}

/* Peer access. can_access_peer is a query of the machine, not a memory
 * call: no capture rule. The grants and revocations change device memory's
 * mappings, as cuMemSetAccess and cuCtxEnablePeerAccess do: relaxed, like
 * map. */
static int backend_sim_can_access_peer(int device, int peer, int *can) {
  return sim_memory_can_access_peer(device, peer, can);
}

static int backend_sim_set_access(int device, uintptr_t addr, size_t size, uint64_t peers) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_set_access(device, addr, size, peers);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_revoke_access(int device, uintptr_t addr, size_t size, uint64_t peers) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_revoke_access(device, addr, size, peers);
  backend_sim_relaxed_end(mode);
  return rc;
}

/* Not tied to VMM: without it, this is how a peer reaches the plain
 * allocations. */
static int backend_sim_peer_enable(int device, int peer) {
  int mode = backend_sim_relaxed_begin();
  int rc = sim_memory_peer_enable(device, peer);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_peer_disable(int device, int peer) {
  int mode = backend_sim_relaxed_begin();
  int rc = sim_memory_peer_disable(device, peer);
  backend_sim_relaxed_end(mode);
  return rc;
}

/* "magpie-sim-dev" and the device's index, big-endian, in the last two
 * bytes: the same in every process that simulates the device, so that
 * processes can tell they share it, as GPUs' UUIDs let them. */
static int backend_sim_device_uuid(int device, unsigned char uuid[16]) {
  int rc = sim_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  static const char prefix[14] = "magpie-sim-dev"; /* no terminating zero */
  memcpy(uuid, prefix, sizeof prefix);
  uuid[14] = (unsigned char)((unsigned)device >> 8);
  uuid[15] = (unsigned char)device;
  return MAGPIE_OK;
}

static int backend_sim_export_fds(int device, uintptr_t addr, size_t size, int *fds) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_export_fds(device, addr, size, fds);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_import_map(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers) {
  int rc = backend_sim_need_vmm();
  if (rc != MAGPIE_OK) return rc;
  int mode = backend_sim_relaxed_begin();
  rc = sim_memory_import_map(device, addr, size, fds, peers);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_event_create(int device, void **event) {
  magpie_sim_event e;
  int rc = sim_event_create(device, &e);
  if (rc == MAGPIE_OK) *event = e;
  return rc;
}

static int backend_sim_event_destroy(void *event) { return sim_event_destroy(event); }

static int backend_sim_event_record(void *event, cudaStream_t stream) { return sim_event_record(event, stream); }

/* Event queries and synchronisations run relaxed too (device/backend.h):
 * the allocator's events are recorded outside any capture, and in the
 * global mode a query while another thread captures would invalidate that
 * capture (sim_capture_unsafe_call). */
static int backend_sim_event_query(void *event) {
  int mode = backend_sim_relaxed_begin();
  int rc = sim_event_query(event);
  backend_sim_relaxed_end(mode);
  return rc == MAGPIE_SIM_NOT_READY ? BACKEND_NOT_READY : rc;
}

static int backend_sim_event_synchronize(void *event) {
  int mode = backend_sim_relaxed_begin();
  int rc = sim_event_synchronize(event);
  backend_sim_relaxed_end(mode);
  return rc;
}

static int backend_sim_stream_wait_event(cudaStream_t stream, void *event) {
  return sim_event_stream_wait(stream, event);
}

/* A stream whose identity was refused (it captures: the detail says so)
 * gives MAGPIE_ERR_CAPTURE, as CUDA's table does. */
static int backend_sim_identity_error(cudaStream_t stream) {
  int st = MAGPIE_SIM_CAPTURE_NONE;
  uint64_t cid;
  if (sim_capture_any() && sim_capture_info(stream, &st, &cid) == MAGPIE_OK && st != MAGPIE_SIM_CAPTURE_NONE)
    return MAGPIE_ERR_CAPTURE;
  return sim_fail(MAGPIE_ERR_INVALID_STREAM, "stream %p is not a live simulated stream", (void *)stream);
}

static int backend_sim_stream_id(cudaStream_t stream, uint64_t *id) {
  uint64_t v = sim_stream_id(stream);
  if (v == 0) return backend_sim_identity_error(stream);
  *id = v;
  return MAGPIE_OK;
}

static int backend_sim_stream_id_fast(cudaStream_t stream, unsigned long long *id) {
  uint64_t v = sim_stream_id(stream);
  *id = v;
  return v == 0;
}

static int backend_sim_stream_device(cudaStream_t stream, int *device) {
  int d = sim_stream_device_of_handle(stream);
  if (d < 0) return backend_sim_identity_error(stream);
  *device = d;
  return MAGPIE_OK;
}

static int backend_sim_device_synchronize(int device) { return sim_stream_device_synchronize(device); }

/* The simulator's capture states are CUDA's, as are the table's. */
static int backend_sim_stream_capture(cudaStream_t stream, int *status, uint64_t *capture_id) {
  int state;
  uint64_t id;
  int rc = sim_capture_info(stream, &state, &id);
  if (rc != MAGPIE_OK) return rc;
  *status = state == MAGPIE_SIM_CAPTURE_ACTIVE        ? BACKEND_CAPTURE_ACTIVE
            : state == MAGPIE_SIM_CAPTURE_INVALIDATED ? BACKEND_CAPTURE_INVALIDATED
                                                      : BACKEND_CAPTURE_NONE;
  *capture_id = id;
  return MAGPIE_OK;
}

static const backend_ops backend_sim_ops = {
    .name = "sim",
    .init = backend_sim_init,
    .device_count = backend_sim_device_count,
    .mem_info = backend_sim_mem_info,
    .vmm_supported = backend_sim_vmm_supported,
    .granularity = backend_sim_granularity,
    .reserve = backend_sim_reserve,
    .unreserve = backend_sim_unreserve,
    .map = backend_sim_map,
    .unmap = backend_sim_unmap,
    .mem_alloc = backend_sim_mem_alloc,
    .mem_free = backend_sim_mem_free,
    .can_access_peer = backend_sim_can_access_peer,
    .set_access = backend_sim_set_access,
    .revoke_access = backend_sim_revoke_access,
    .peer_enable = backend_sim_peer_enable,
    .peer_disable = backend_sim_peer_disable,
    .device_uuid = backend_sim_device_uuid,
    .export_fds = backend_sim_export_fds,
    .import_map = backend_sim_import_map,
    .event_create = backend_sim_event_create,
    .event_destroy = backend_sim_event_destroy,
    .event_record = backend_sim_event_record,
    .event_query = backend_sim_event_query,
    .event_synchronize = backend_sim_event_synchronize,
    .stream_wait_event = backend_sim_stream_wait_event,
    .stream_id = backend_sim_stream_id,
    .stream_id_fast = backend_sim_stream_id_fast,
    .stream_device = backend_sim_stream_device,
    .device_synchronize = backend_sim_device_synchronize,
    .stream_capture = backend_sim_stream_capture,
    /* This copy of the device interface's detail: the allocator may be
     * another shared object with a copy of its own. */
    .error_detail = backend_local_error_detail,
    .observer = &sim_check_observer,
};

const backend_ops *backend_sim(void) { return &backend_sim_ops; }

MAGPIE_API const void *magpie_sim_device_table(unsigned abi_version) {
  return abi_version == BACKEND_ABI ? &backend_sim_ops : NULL;
}
