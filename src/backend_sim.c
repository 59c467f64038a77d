/* The backend table over the simulated device (sim_*.c). Every operation is
 * a thin wrapper: the simulator already returns magpie_error codes and puts
 * the reason in backend_error_detail(). */
#include "backend.h"
#include "sim_internal.h"

static int sim_backend_init(void) { return sim_init(); }

static int sim_backend_device_count(int *count) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  *count = sim_device_count();
  return MAGPIE_OK;
}

static int sim_backend_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
  return sim_memory_info(device, free_bytes, total_bytes);
}

static int sim_backend_check_device(int device) {
  int rc = sim_init();
  if (rc != MAGPIE_OK) return rc;
  if (device < 0 || device >= sim_device_count())
    return sim_fail(MAGPIE_ERR_INVALID_ARGUMENT, "device %d does not exist (%d simulated)",
                    device, sim_device_count());
  return MAGPIE_OK;
}

static int sim_backend_vmm_supported(int device, int *supported) {
  int rc = sim_backend_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  *supported = sim_memory_vmm_supported();
  return MAGPIE_OK;
}

static int sim_backend_granularity(int device, size_t *bytes) {
  int rc = sim_backend_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  *bytes = SIM_GRANULARITY;
  return MAGPIE_OK;
}

/* With MAGPIE_SIM_VMM=0 the virtual memory operations fail, as a driver
 * without VMM support would: the caller should have asked vmm_supported. */
static int sim_backend_need_vmm(void) {
  if (!sim_memory_vmm_supported())
    return sim_fail(MAGPIE_ERR_BACKEND, "virtual memory management is disabled (MAGPIE_SIM_VMM=0)");
  return MAGPIE_OK;
}

static int sim_backend_reserve(int device, size_t size, uintptr_t *base) {
  int rc = sim_backend_need_vmm();
  return rc != MAGPIE_OK ? rc : sim_memory_reserve(device, size, base);
}

static int sim_backend_unreserve(int device, uintptr_t base, size_t size) {
  int rc = sim_backend_need_vmm();
  return rc != MAGPIE_OK ? rc : sim_memory_unreserve(device, base, size);
}

static int sim_backend_map(int device, uintptr_t addr, size_t size) {
  int rc = sim_backend_need_vmm();
  return rc != MAGPIE_OK ? rc : sim_memory_map(device, addr, size);
}

static int sim_backend_unmap(int device, uintptr_t addr, size_t size) {
  int rc = sim_backend_need_vmm();
  return rc != MAGPIE_OK ? rc : sim_memory_unmap(device, addr, size);
}

static int sim_backend_mem_alloc(int device, size_t size, uintptr_t *out) {
  return sim_memory_alloc(device, size, out);
}

static int sim_backend_mem_free(int device, uintptr_t ptr, size_t size) {
  return sim_memory_free(device, ptr, size);
}

static int sim_backend_event_create(int device, void **event) {
  magpie_sim_event e;
  int rc = sim_event_create(device, &e);
  if (rc == MAGPIE_OK) *event = e;
  return rc;
}

static int sim_backend_event_destroy(void *event) { return sim_event_destroy(event); }

static int sim_backend_event_record(void *event, cudaStream_t stream) {
  return sim_event_record(event, stream);
}

static int sim_backend_event_query(void *event) {
  int rc = sim_event_query(event);
  return rc == MAGPIE_SIM_NOT_READY ? BACKEND_NOT_READY : rc;
}

static int sim_backend_event_synchronize(void *event) { return sim_event_synchronize(event); }

static int sim_backend_stream_wait_event(cudaStream_t stream, void *event) {
  return sim_event_stream_wait(stream, event);
}

static int sim_backend_stream_id(cudaStream_t stream, uint64_t *id) {
  uint64_t v = sim_stream_id(stream);
  if (v == 0)
    return sim_fail(MAGPIE_ERR_INVALID_STREAM, "stream %p is not a live simulated stream",
                    (void *)stream);
  *id = v;
  return MAGPIE_OK;
}

static int sim_backend_stream_device(cudaStream_t stream, int *device) {
  int d = sim_stream_device_of_handle(stream);
  if (d < 0)
    return sim_fail(MAGPIE_ERR_INVALID_STREAM, "stream %p is not a live simulated stream",
                    (void *)stream);
  *device = d;
  return MAGPIE_OK;
}

static int sim_backend_device_synchronize(int device) {
  return sim_stream_device_synchronize(device);
}

static const backend_ops sim_backend_ops = {
    .name = "sim",
    .init = sim_backend_init,
    .device_count = sim_backend_device_count,
    .mem_info = sim_backend_mem_info,
    .vmm_supported = sim_backend_vmm_supported,
    .granularity = sim_backend_granularity,
    .reserve = sim_backend_reserve,
    .unreserve = sim_backend_unreserve,
    .map = sim_backend_map,
    .unmap = sim_backend_unmap,
    .mem_alloc = sim_backend_mem_alloc,
    .mem_free = sim_backend_mem_free,
    .event_create = sim_backend_event_create,
    .event_destroy = sim_backend_event_destroy,
    .event_record = sim_backend_event_record,
    .event_query = sim_backend_event_query,
    .event_synchronize = sim_backend_event_synchronize,
    .stream_wait_event = sim_backend_stream_wait_event,
    .stream_id = sim_backend_stream_id,
    .stream_device = sim_backend_stream_device,
    .device_synchronize = sim_backend_device_synchronize,
};

const backend_ops *backend_sim(void) { return &sim_backend_ops; }
