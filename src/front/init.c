/* One-time set-up: configuration, backend choice, module tables.
 * Lock order: init_lock is taken first and alone (the backend's init runs
 * under it; no other magpie lock is held then). */
#include "front/init.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/backend_timed.h"
#include "pool/epoch.h"
#include "base/error.h"
#include "heap/heap.h"
#include "pool/magazine.h"
#include "pool/region.h"
#include "sim/sim_check.h"
#include "front/tcache.h"
#include "base/sizeclass.h"
#include "front/stats.h"

_Atomic int global_state_v;

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
/* Written under init_lock before global_state_v becomes READY (release);
 * read after an acquire load of READY. */
static magpie_config global_cfg;
static const backend_ops *global_backend;
static int global_err;
static char global_msg[512];

const backend_ops *global_ops(void) { return global_backend; }
const magpie_config *global_config(void) { return &global_cfg; }

MAGPIE_API void magpie_config_default(magpie_config *cfg) {
  if (cfg == NULL) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->backend = MAGPIE_BACKEND_AUTO;
  cfg->magazine_bytes = (size_t)1 << 20;
  cfg->release_threshold = SIZE_MAX;
  cfg->reuse_wait = 1;
}

static int init_pick_backend(int kind, const backend_ops **out) {
  if (kind == MAGPIE_BACKEND_SIM) {
    *out = backend_sim();
    int rc = (*out)->init();
    if (rc != MAGPIE_OK) return error_set(rc, "cannot start the simulated device: %s", backend_error_detail());
    return MAGPIE_OK;
  }
  const backend_ops *cuda = backend_cuda();
  int rc = cuda->init();
  int n = 0;
  if (rc == MAGPIE_OK && cuda->device_count(&n) == MAGPIE_OK && n > 0) {
    *out = cuda;
    return MAGPIE_OK;
  }
  if (kind == MAGPIE_BACKEND_CUDA)
    return error_set(MAGPIE_ERR_NO_DEVICE, "MAGPIE_BACKEND=cuda but no CUDA device is usable: %s",
                     backend_error_detail());
  return init_pick_backend(MAGPIE_BACKEND_SIM, out);
}

static void init_verbose_atexit(void) {
  for (int d = 0; d < HEAP_MAX_DEVICES; d++)
    if (heap_peek(d) != NULL) stats_print(d, stderr);
}

int global_init_slow(const magpie_config *cfg, const backend_ops *ops) {
  pthread_mutex_lock(&init_lock);
  int state = atomic_load_relaxed(&global_state_v);
  if (state == GLOBAL_READY) {
    pthread_mutex_unlock(&init_lock);
    if (cfg == NULL && ops == NULL) return MAGPIE_OK;
    return error_set(MAGPIE_ERR_ALREADY_INITIALIZED,
                     "magpie_init: already initialised (call it before the first allocation)");
  }
  if (state == GLOBAL_FAILED && cfg == NULL && ops == NULL) {
    pthread_mutex_unlock(&init_lock);
    return error_set(global_err, "%s", global_msg);
  }
  magpie_config c;
  int rc = MAGPIE_OK;
  if (cfg != NULL) {
    c = *cfg;
    if (c.magazine_bytes == 0) c.magazine_bytes = (size_t)1 << 20;
    if (c.backend < MAGPIE_BACKEND_AUTO || c.backend > MAGPIE_BACKEND_SIM)
      rc = error_set(MAGPIE_ERR_CONFIG, "magpie_init: backend %d is not one of AUTO (0), CUDA (1), SIM (2)",
                     c.backend);
  } else {
    magpie_config_default(&c);
    rc = options_from_env(&c);
  }
  if (rc == MAGPIE_OK) {
    if (ops != NULL) rc = ops->init() == MAGPIE_OK ? MAGPIE_OK
                           : error_set(MAGPIE_ERR_NO_DEVICE, "backend failed: %s", backend_error_detail());
    else rc = init_pick_backend(c.backend, &ops);
  }
  size_t gran = (size_t)2 << 20;
  if (rc == MAGPIE_OK && ops->granularity(0, &gran) != MAGPIE_OK) gran = (size_t)2 << 20;
  if (rc != MAGPIE_OK) {
    global_err = rc;
    snprintf(global_msg, sizeof global_msg, "%s", magpie_last_error_message());
    atomic_store_release(&global_state_v, GLOBAL_FAILED);
    pthread_mutex_unlock(&init_lock);
    return rc;
  }
  global_cfg = c;
  if (c.slow_call_ms) ops = backend_timed(ops, c.slow_call_ms);
  global_backend = ops;
  sizeclass_init(c.magazine_bytes, region_unit(gran)); /* the unit every heap's region maps in */
  magazine_module_init();
  tcache_module_init();
  epoch_module_init();
  heap_module_init(ops, &c);
  if (c.verbose) atexit(init_verbose_atexit);
  /* The stream-order checker exists only on the simulated device. */
  if (c.check_streams && strcmp(ops->name, "sim") == 0) atomic_store_relaxed(&sim_check_on, 1);
  atomic_store_release(&global_state_v, GLOBAL_READY);
  pthread_mutex_unlock(&init_lock);
  return MAGPIE_OK;
}

/* cfg NULL: the defaults with the environment applied, as on first use. */
MAGPIE_API int magpie_init(const magpie_config *cfg) {
  magpie_config d;
  if (cfg == NULL) {
    magpie_config_default(&d);
    int rc = options_from_env(&d);
    if (rc != MAGPIE_OK) return rc;
    cfg = &d;
  }
  return global_init_slow(cfg, NULL);
}

MAGPIE_API int magpie_active_backend(void) {
  if (global_ensure() != MAGPIE_OK) return -1;
  return strcmp(global_backend->name, "cuda") == 0 ? MAGPIE_BACKEND_CUDA : MAGPIE_BACKEND_SIM;
}

MAGPIE_API const char *magpie_version(void) { return MAGPIE_VERSION_STRING; }
