/* See devshim.h. On CUDA the driver comes from magpie's one loader
 * (src/device/cuda_driver.h): the table magpie's backend calls, loaded once. */
#include "tools/devshim.h"

#include <stdio.h>
#include <stdlib.h>

#include "device/cuda_driver.h"
#include "magpie_sim.h"

static struct {
  int cuda;
  cudrv_context ctx;
  cudrv_device device;
} dev;

int devshim_init(void) {
  int kind = magpie_active_backend();
  if (kind < 0) {
    fprintf(stderr, "magpie failed to start: %s\n", magpie_last_error_message());
    return -1;
  }
  dev.cuda = kind == MAGPIE_BACKEND_CUDA;
  if (!dev.cuda) return 0;
  const char *why = NULL;
  if (cudrv_load(CUDRV_LOAD_ALL, &why) != 0) {
    fprintf(stderr, "devshim: %s\n", why);
    return -1;
  }
  if (cudrv.init(0) || cudrv.device_get(&dev.device, 0) || cudrv.primary_ctx_retain(&dev.ctx, dev.device)) return -1;
  cudrv.ctx_set_current(dev.ctx);
  return 0;
}

int devshim_is_cuda(void) { return dev.cuda; }

void devshim_thread_init(void) {
  if (dev.cuda) cudrv.ctx_set_current(dev.ctx);
}

cudaStream_t devshim_stream_create(void) {
  if (!dev.cuda) return magpie_sim_stream_create();
  cudaStream_t s = NULL;
  return cudrv.stream_create(&s, CUDRV_STREAM_NON_BLOCKING) == 0 ? s : NULL;
}

void devshim_stream_destroy(cudaStream_t s) {
  if (dev.cuda) cudrv.stream_destroy(s);
  else magpie_sim_stream_destroy(s);
}

typedef struct fill_arg {
  uint32_t *p;
  size_t words;
  uint32_t value;
} fill_arg;

static void devshim_sim_fill(void *a) {
  fill_arg *f = a;
  for (size_t i = 0; i < f->words; i += 64) f->p[i] = f->value; /* one word per 256 B */
  free(f);
}

int devshim_fill(void *p, size_t bytes, uint32_t value, cudaStream_t s) {
  if (dev.cuda) return cudrv.memset_d32_async((cudrv_deviceptr)(uintptr_t)p, value, bytes / 4, s);
  fill_arg *f = malloc(sizeof *f);
  if (f == NULL) return -1;
  *f = (fill_arg){p, bytes / 4, value};
  int rc = magpie_sim_launch(s, devshim_sim_fill, f);
  if (rc != 0) free(f);
  return rc;
}

int devshim_order(cudaStream_t to, cudaStream_t from) {
  if (!dev.cuda) return magpie_sim_stream_wait(to, from);
  cudrv_event ev = NULL;
  int rc = cudrv.event_create(&ev, CUDRV_EVENT_DISABLE_TIMING);
  if (rc == 0) rc = cudrv.event_record(ev, from);
  if (rc == 0) rc = cudrv.stream_wait_event(to, ev, 0);
  if (ev) cudrv.event_destroy(ev);
  return rc;
}

void devshim_stream_synchronize(cudaStream_t s) {
  if (dev.cuda) cudrv.stream_synchronize(s);
  else magpie_sim_stream_synchronize(s);
}

void devshim_synchronize(void) {
  if (dev.cuda) cudrv.ctx_synchronize();
  else magpie_sim_device_synchronize();
}

int devshim_pool_prepare(void) {
  if (!dev.cuda) return -1;
  cudrv_mem_pool pool = NULL;
  if (cudrv.device_get_default_mem_pool(&pool, dev.device) != 0) return -1;
  cudrv_uint64 max = UINT64_MAX;
  return cudrv.mem_pool_set_attribute(pool, CUDRV_MEMPOOL_ATTR_RELEASE_THRESHOLD, &max);
}

void *devshim_pool_alloc(size_t size, cudaStream_t s) {
  cudrv_deviceptr p = 0;
  return cudrv.mem_alloc_async(&p, size, s) == 0 ? (void *)(uintptr_t)p : NULL;
}

int devshim_pool_free(void *p, cudaStream_t s) { return cudrv.mem_free_async((cudrv_deviceptr)(uintptr_t)p, s); }
