/* One-time set-up: configuration, backend choice, module tables.
 * Lock order: front_st.init_lock is taken first and alone (the backend's init runs
 * under it; no other magpie lock is held then).
 *
 * The simulated device is a library of its own (sim/): its table comes from
 * magpie_sim_device_table, linked into the program (a weak reference) or
 * else found in libmagpie_sim.so, loaded on demand from the folder of this
 * library (of the program, where magpie is linked statically), then from
 * the dynamic loader's search path. */
#include "front/init.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/error.h"
#include "base/sizeclass.h"
#include "device/backend_timed.h"
#include "front/capture.h"
#include "front/observe.h"
#include "front/stats.h"
#include "heap/heap.h"
#include "pool/epoch.h"
#include "pool/magazine.h"
#include "pool/region.h"
#include "tcache/tcache.h"

front_state front_st = {
    .init_lock = PTHREAD_MUTEX_INITIALIZER,
};

const backend_ops *global_ops(void) { return front_st.backend; }
const magpie_config *global_config(void) { return &front_st.cfg; }

int global_device_check(int device, const char *fn) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  int n = 0;
  if (global_ops()->device_count(&n) != MAGPIE_OK || device < 0 || device >= n)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: no device %d (the backend has %d)", fn, device, n);
  return MAGPIE_OK;
}

MAGPIE_API void magpie_config_default(magpie_config *cfg) {
  if (cfg == NULL) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->backend = MAGPIE_BACKEND_AUTO;
  cfg->magazine_bytes = (size_t)1 << 20;
  cfg->release_threshold = SIZE_MAX;
  cfg->reuse_wait = 1;
  cfg->ipc = 1;
}

/* The simulator's entry point (include/magpie_sim.h): defined where the
 * program links the simulator, or a shared object loaded with global
 * symbols exports it (a program linked with -lmagpie_sim); NULL otherwise. */
MAGPIE_API const void *magpie_sim_device_table(unsigned abi_version) __attribute__((weak));

typedef const void *(*init_sim_entry)(unsigned abi_version);

/* dlopen of libmagpie_sim.so in the folder of path (a file), if it is
 * there; a failure's reason goes to why. */
static void *init_sim_open_beside(const char *path, char *why, size_t len) {
  const char *slash = strrchr(path, '/');
  if (slash == NULL) return NULL;
  char file[PATH_MAX];
  if ((size_t)snprintf(file, sizeof file, "%.*s/libmagpie_sim.so", (int)(slash - path), path) >= sizeof file)
    return NULL;
  if (access(file, F_OK) != 0) return NULL;
  void *h = dlopen(file, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) snprintf(why, len, "%s", dlerror());
  return h;
}

/* The simulated device's table, or NULL with the reason in why. */
static const backend_ops *init_sim_table(char *why, size_t len) {
  init_sim_entry entry = magpie_sim_device_table;
  why[0] = '\0';
  if (entry == NULL) {
    void *h = NULL;
    Dl_info info;
    if (dladdr((void *)init_sim_table, &info) != 0 && info.dli_fname != NULL) {
      h = init_sim_open_beside(info.dli_fname, why, len);
      char real[PATH_MAX];
      if (h == NULL && realpath(info.dli_fname, real) != NULL) h = init_sim_open_beside(real, why, len);
    }
    if (h == NULL) h = dlopen("libmagpie_sim.so", RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
      if (why[0] == '\0') snprintf(why, len, "%s", dlerror());
      return NULL;
    }
    entry = (init_sim_entry)dlsym(h, "magpie_sim_device_table");
    if (entry == NULL) {
      snprintf(why, len, "%s", dlerror());
      return NULL;
    }
  }
  const backend_ops *ops = entry(BACKEND_ABI);
  if (ops == NULL) snprintf(why, len, "the simulator found was built from another version of magpie");
  return ops;
}

/* Picks and starts the simulated device; `instead` says why it is used
 * ("" when it was asked for). */
static int init_pick_sim(const char *instead, const backend_ops **out) {
  char why[256];
  const backend_ops *sim = init_sim_table(why, sizeof why);
  if (sim == NULL)
    return error_set(MAGPIE_ERR_NO_DEVICE,
                     "%sthe simulated device is not available: link the simulator into the program "
                     "(-lmagpie_sim, libmagpie_sim.a, Bazel //sim) or put libmagpie_sim.so beside "
                     "libmagpie.so or on LD_LIBRARY_PATH (%s)",
                     instead, why);
  backend_use_error_detail(sim->error_detail);
  int rc = sim->init();
  if (rc != MAGPIE_OK) return error_set(rc, "cannot start the simulated device: %s", backend_error_detail());
  *out = sim;
  return MAGPIE_OK;
}

static int init_pick_backend(int kind, const backend_ops **out) {
  if (kind == MAGPIE_BACKEND_SIM) return init_pick_sim("", out);
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
  char instead[160];
  snprintf(instead, sizeof instead, "no CUDA device is usable (%s), and ", backend_error_detail());
  return init_pick_sim(instead, out);
}

static void init_verbose_atexit(void) {
  if (front_st.forked) return; /* the parent's heaps are not this process's */
  for (int d = 0; d < HEAP_MAX_DEVICES; d++)
    if (heap_peek(d) != NULL) stats_print(d, stderr);
}

/* The thread caches' calls up into this layer (tcache/tcache_upcalls.h),
 * handed down when the library is loaded: a thread's first slow path can
 * be the process's first call, before any set-up. */
static int init_ensure(void) { return global_ensure(); }

static int init_capture_announced(void) { return (atomic_load_relaxed(&front_st.slow_paths) & SLOW_CAPTURE) != 0; }

__attribute__((constructor)) static void init_upcalls(void) {
  static const tcache_upcalls up = {
      .ensure = init_ensure,
      .graph_free = capture_graph_free,
      .describe = stats_describe,
      .capture_announced = init_capture_announced,
  };
  tcache_set_upcalls(&up);
}

/* fork(): a child of a process in which magpie started cannot use it, as a
 * child cannot use the CUDA context its parent made: the device memory,
 * streams and events it would use are the parent's (the simulated
 * device's streams are the parent's threads). The handler runs in the
 * child's only thread: every later call fails with MAGPIE_ERR_NO_DEVICE
 * and this message, which is also that thread's last error from the start
 * (a child that first meets the refusal elsewhere, in a simulated-device
 * or CUDA call, and asks magpie why reads it there), and the child exits
 * without waiting for threads it does not have. The parent is not
 * touched. */
#define INIT_FORK_MESSAGE                                                                                     \
  "magpie started in the parent process before fork(); a forked child cannot use it (as CUDA cannot be used " \
  "in a child forked after it started): exec a new program (or use spawn) to allocate in another process"

static void init_atfork_child(void) {
  front_st.forked = 1;
  pthread_mutex_init(&front_st.init_lock, NULL);
  /* Not READY: every call takes the slow path, whose forked check answers. */
  atomic_store_release(&front_st.state, GLOBAL_FAILED);
  error_set(MAGPIE_ERR_NO_DEVICE, "%s", INIT_FORK_MESSAGE);
  tcache_after_fork_child();
  heap_after_fork_child();
}

int global_init_slow(const magpie_config *cfg, const backend_ops *ops) {
  pthread_mutex_lock(&front_st.init_lock);
  if (front_st.forked) {
    pthread_mutex_unlock(&front_st.init_lock);
    return error_set(MAGPIE_ERR_NO_DEVICE, "%s", INIT_FORK_MESSAGE);
  }
  if (!front_st.init_atfork) front_st.init_atfork = pthread_atfork(NULL, NULL, init_atfork_child) == 0;
  int state = atomic_load_relaxed(&front_st.state);
  if (state == GLOBAL_READY) {
    pthread_mutex_unlock(&front_st.init_lock);
    if (cfg == NULL && ops == NULL) return MAGPIE_OK;
    return error_set(MAGPIE_ERR_ALREADY_INITIALIZED,
                     "magpie_init: already initialised (call it before the first allocation)");
  }
  if (state == GLOBAL_FAILED && cfg == NULL && ops == NULL) {
    pthread_mutex_unlock(&front_st.init_lock);
    return error_set(front_st.err, "%s", front_st.msg);
  }
  magpie_config c;
  int rc = MAGPIE_OK;
  if (cfg != NULL) {
    c = *cfg;
    if (c.magazine_bytes == 0) c.magazine_bytes = (size_t)1 << 20;
    /* What needs no device is checked before the backend starts. */
    rc = options_check(&c, 0, "magpie_init");
  } else {
    magpie_config_default(&c);
    rc = options_from_env(&c);
  }
  if (rc == MAGPIE_OK) {
    backend_use_error_detail(ops != NULL ? ops->error_detail : NULL);
    if (ops != NULL)
      rc = ops->init() == MAGPIE_OK ? MAGPIE_OK
                                    : error_set(MAGPIE_ERR_NO_DEVICE, "backend failed: %s", backend_error_detail());
    else rc = init_pick_backend(c.backend, &ops);
  }
  size_t gran = (size_t)2 << 20;
  if (rc == MAGPIE_OK && ops->granularity(0, &gran) != MAGPIE_OK) gran = (size_t)2 << 20;
  if (rc == MAGPIE_OK) rc = options_check(&c, region_unit(gran), cfg != NULL ? "magpie_init" : "MAGPIE_CONF");
  if (rc != MAGPIE_OK) {
    front_st.err = rc;
    snprintf(front_st.msg, sizeof front_st.msg, "%s", magpie_last_error_message());
    atomic_store_release(&front_st.state, GLOBAL_FAILED);
    pthread_mutex_unlock(&front_st.init_lock);
    return rc;
  }
  front_st.cfg = c;
  if (c.slow_call_ms) ops = backend_timed(ops, c.slow_call_ms);
  front_st.backend = ops;
  sizeclass_init(c.magazine_bytes, region_unit(gran)); /* the unit every heap's region maps in */
  magazine_module_init();
  tcache_module_init(ops, c.check);
  epoch_module_init();
  heap_module_init(ops, &c);
  if (c.verbose) atexit(init_verbose_atexit);
  /* A device's observer (the simulated device's stream-order checker),
   * switched on by check_streams=1. */
  observe_install(ops, c.check_streams);
  atomic_store_release(&front_st.state, GLOBAL_READY);
  pthread_mutex_unlock(&front_st.init_lock);
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
  return strcmp(front_st.backend->name, "cuda") == 0 ? MAGPIE_BACKEND_CUDA : MAGPIE_BACKEND_SIM;
}

MAGPIE_API const char *magpie_version(void) { return MAGPIE_VERSION_STRING; }
