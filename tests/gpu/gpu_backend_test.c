/* gpu_backend_test: the CUDA backend table (backend_cuda()) on a real GPU.
 *
 * Memory: reserve, map granules (in one call and apart), a kernel writes a
 * pattern and another checks it, unmap part of a mapping, a failing map
 * leaves nothing mapped, the cuMemAlloc fallback, out-of-memory reporting.
 * Events: record/query/synchronize and stream waits, ordered by a delay
 * kernel. Streams: ids unique per stream and never reused, special handles
 * per thread, a thread with no current context, stream_device.
 *
 * Two parts run in child processes of this binary: the probe (--probe,
 * gpu_probe.c), which prints facts about the driver that the allocator
 * relies on and may crash (one step, querying a destroyed stream, is
 * undefined behaviour), and the MAGPIE_CUDA_VMM=0 check (--vmm-off), which
 * needs a fresh init.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "device/backend.h"
#include "tests/gpu/gpu_util.h"

extern char **environ;

static gpu_env env;
static const backend_ops *be;

#define MIB ((size_t)1 << 20)

static int group_setup(void **state) {
  (void)state;
  if (gpu_env_init(&env) != 0) return -1;
  be = backend_cuda();
  int rc = be->init();
  if (rc != MAGPIE_OK) {
    fprintf(stderr, "backend init: %d: %s\n", rc, backend_error_detail());
    return -1;
  }
  printf("device 0: %s, driver %d\n", env.name, env.driver_version);
  return 0;
}

/* A device word counter for the check kernels. */
static CUdeviceptr counter_new(void) {
  CUdeviceptr c = 0;
  GPU_CHECK(cudrv.mem_alloc(&c, sizeof(unsigned int)));
  GPU_CHECK(cudrv.memset_d32(c, 0, 1));
  return c;
}

static unsigned int counter_read(CUdeviceptr c) {
  unsigned int v = 0;
  GPU_CHECK(cudrv.ctx_synchronize());
  GPU_CHECK(cudrv.memcpy_dtoh(&v, c, sizeof v));
  GPU_CHECK(cudrv.memset_d32(c, 0, 1));
  return v;
}

/* Fills [p, p+bytes) with seed's pattern and checks it, and checks that a
 * wrong seed is noticed (so the checker itself works). */
static void pattern_roundtrip(CUdeviceptr p, size_t bytes, unsigned int seed) {
  CUdeviceptr bad = counter_new();
  size_t words = bytes / 4;
  GPU_CHECK(gpu_fill_u32(&env, NULL, p, words, seed));
  GPU_CHECK(gpu_check_u32(&env, NULL, p, words, seed, bad));
  assert_int_equal(counter_read(bad), 0);
  GPU_CHECK(gpu_check_u32(&env, NULL, p, words, seed + 1, bad));
  assert_int_equal(counter_read(bad), (unsigned int)words);
  GPU_CHECK(cudrv.mem_free(bad));
}

static void test_init_and_info(void **state) {
  (void)state;
  assert_string_equal(be->name, "cuda");
  assert_int_equal(be->init(), MAGPIE_OK); /* idempotent */
  int n = 0;
  assert_int_equal(be->device_count(&n), MAGPIE_OK);
  assert_true(n >= 1);
  size_t fr = 0, total = 0;
  assert_int_equal(be->mem_info(0, &fr, &total), MAGPIE_OK);
  assert_true(total > 0 && fr <= total);
  int sup = -1;
  assert_int_equal(be->vmm_supported(0, &sup), MAGPIE_OK);
  size_t g = 0;
  assert_int_equal(be->granularity(0, &g), MAGPIE_OK);
  printf("  devices %d, memory %.1f GiB free of %.1f GiB, vmm %d, granularity %zu\n", n, fr / 1073741824.0,
         total / 1073741824.0, sup, g);
  assert_true(g != 0 && (g & (g - 1)) == 0);
  const char *vmm_env = getenv("MAGPIE_CUDA_VMM");
  if (strstr(env.name, "H200") || strstr(env.name, "H100")) {
    assert_int_equal(g, 2 * MIB);
    assert_int_equal(sup, !(vmm_env && strcmp(vmm_env, "0") == 0));
  }
  assert_int_equal(be->mem_info(n, &fr, &total), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(be->granularity(-1, &g), MAGPIE_ERR_INVALID_ARGUMENT);
}

static void test_vmm_map_kernel(void **state) {
  (void)state;
  int sup = 0;
  size_t g = 0;
  assert_int_equal(be->vmm_supported(0, &sup), MAGPIE_OK);
  if (!sup) skip();
  assert_int_equal(be->granularity(0, &g), MAGPIE_OK);
  uintptr_t base = 0;
  assert_int_equal(be->reserve(0, 16 * g, &base), MAGPIE_OK);
  assert_true(base != 0 && base % g == 0);

  /* Two slabs in one call, a third apart. */
  assert_int_equal(be->map(0, base, 2 * g, 0, 0), MAGPIE_OK);
  assert_int_equal(be->map(0, base + 4 * g, g, 0, 0), MAGPIE_OK);
  pattern_roundtrip(base, 2 * g, 11);
  pattern_roundtrip(base + 4 * g, g, 12);

  /* Unmapping the second half of the first mapping keeps the first half. */
  assert_int_equal(be->unmap(0, base + g, g), MAGPIE_OK);
  CUdeviceptr bad = counter_new();
  GPU_CHECK(gpu_check_u32(&env, NULL, base, g / 4, 11, bad));
  assert_int_equal(counter_read(bad), 0);
  GPU_CHECK(cudrv.mem_free(bad));

  /* A map that fails on its second granule (already mapped) undoes the first. */
  int rc = be->map(0, base + 3 * g, 2 * g, 0, 0);
  printf("  map over a mapped granule: %d: %s\n", rc, backend_error_detail());
  assert_int_not_equal(rc, MAGPIE_OK);
  assert_int_equal(be->map(0, base + 3 * g, g, 0, 0), MAGPIE_OK);
  assert_int_equal(be->unmap(0, base + 3 * g, g), MAGPIE_OK);

  /* Misaligned or empty ranges are the caller's error. */
  assert_int_equal(be->map(0, base + 8 * g + 4096, g, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(be->map(0, base + 8 * g, g + 4096, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(be->map(0, base + 8 * g, 0, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(be->reserve(0, g + 1, &base), MAGPIE_ERR_INVALID_ARGUMENT);

  /* Remapping an unmapped granule gives working memory again. */
  assert_int_equal(be->map(0, base + g, g, 0, 0), MAGPIE_OK);
  pattern_roundtrip(base + g, g, 13);
  assert_int_equal(be->unmap(0, base, 2 * g), MAGPIE_OK);
  assert_int_equal(be->unmap(0, base + 4 * g, g), MAGPIE_OK);
  assert_int_equal(be->unreserve(0, base, 16 * g), MAGPIE_OK);
}

static void test_mem_alloc_fallback(void **state) {
  (void)state;
  uintptr_t p = 0;
  size_t bytes = 3 * MIB + 256;
  assert_int_equal(be->mem_alloc(0, bytes, &p), MAGPIE_OK);
  assert_true(p != 0 && p % 256 == 0);
  pattern_roundtrip(p, bytes, 21);
  assert_int_equal(be->mem_free(0, p, bytes), MAGPIE_OK);

  int rc = be->mem_alloc(0, (size_t)1 << 40, &p);
  printf("  mem_alloc(1 TiB): %d: %s\n", rc, backend_error_detail());
  assert_int_equal(rc, MAGPIE_ERR_OUT_OF_MEMORY);
  assert_non_null(strstr(backend_error_detail(), "CUDA_ERROR_OUT_OF_MEMORY"));
}

static void test_events(void **state) {
  (void)state;
  CUstream a, b;
  GPU_CHECK(cudrv.stream_create(&a, CU_STREAM_NON_BLOCKING));
  GPU_CHECK(cudrv.stream_create(&b, CU_STREAM_NON_BLOCKING));
  void *e1 = NULL, *e2 = NULL;
  assert_int_equal(be->event_create(0, &e1), MAGPIE_OK);
  assert_int_equal(be->event_create(0, &e2), MAGPIE_OK);

  GPU_CHECK(gpu_delay(&env, a, 200u * 1000 * 1000));
  assert_int_equal(be->event_record(e1, a), MAGPIE_OK);
  assert_int_equal(be->event_query(e1), BACKEND_NOT_READY);
  /* b waits for a's delay, so e2 on b is not ready either. */
  assert_int_equal(be->stream_wait_event(b, e1), MAGPIE_OK);
  assert_int_equal(be->event_record(e2, b), MAGPIE_OK);
  assert_int_equal(be->event_query(e2), BACKEND_NOT_READY);
  assert_int_equal(be->event_synchronize(e2), MAGPIE_OK);
  assert_int_equal(be->event_query(e1), MAGPIE_OK);
  assert_int_equal(be->event_query(e2), MAGPIE_OK);

  /* The special handles work for record and wait too. */
  assert_int_equal(be->event_record(e1, NULL), MAGPIE_OK);
  assert_int_equal(be->stream_wait_event(CU_STREAM_PER_THREAD, e1), MAGPIE_OK);
  assert_int_equal(be->event_record(e2, CU_STREAM_PER_THREAD), MAGPIE_OK);
  assert_int_equal(be->event_synchronize(e2), MAGPIE_OK);

  assert_int_equal(be->event_destroy(e1), MAGPIE_OK);
  assert_int_equal(be->event_destroy(e2), MAGPIE_OK);
  GPU_CHECK(cudrv.stream_destroy(a));
  GPU_CHECK(cudrv.stream_destroy(b));
  assert_int_equal(be->device_synchronize(0), MAGPIE_OK);
}

/* --- threads ----------------------------------------------------------- */

typedef struct ids_job {
  int bind; /* make env's context current first */
  int rc_null, rc_legacy, rc_ptds, rc_dev;
  uint64_t id_null, id_legacy, id_ptds;
  int dev;
  int ctx_after; /* env's context current after the calls */
} ids_job;

static void *ids_thread(void *arg) {
  ids_job *j = arg;
  if (j->bind && gpu_env_bind(&env) != CUDA_SUCCESS) return NULL;
  j->rc_null = be->stream_id(NULL, &j->id_null);
  j->rc_legacy = be->stream_id(CU_STREAM_LEGACY, &j->id_legacy);
  j->rc_ptds = be->stream_id(CU_STREAM_PER_THREAD, &j->id_ptds);
  j->rc_dev = be->stream_device(NULL, &j->dev);
  CUcontext cur = NULL;
  j->ctx_after = cudrv.ctx_get_current(&cur) == CUDA_SUCCESS && cur == env.ctx;
  return NULL;
}

static void run_ids_thread(ids_job *j) {
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, ids_thread, j), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void test_stream_ids(void **state) {
  (void)state;
  enum { N = 3, CYCLES = 200 };
  CUstream s[N];
  uint64_t id[N], again;
  for (int i = 0; i < N; i++) {
    GPU_CHECK(cudrv.stream_create(&s[i], CU_STREAM_NON_BLOCKING));
    assert_int_equal(be->stream_id(s[i], &id[i]), MAGPIE_OK);
    assert_int_equal(be->stream_id(s[i], &again), MAGPIE_OK);
    assert_true(again == id[i]);
    for (int k = 0; k < i; k++) assert_true(id[k] != id[i]);
  }

  ids_job main_ids = {.bind = 1}, other = {.bind = 1}, bare = {.bind = 0};
  ids_thread(&main_ids);
  run_ids_thread(&other);
  run_ids_thread(&bare);
  ids_job *all[] = {&main_ids, &other, &bare};
  for (int i = 0; i < 3; i++) {
    assert_int_equal(all[i]->rc_null, MAGPIE_OK);
    assert_int_equal(all[i]->rc_legacy, MAGPIE_OK);
    assert_int_equal(all[i]->rc_ptds, MAGPIE_OK);
    assert_int_equal(all[i]->rc_dev, MAGPIE_OK);
    assert_int_equal(all[i]->dev, 0);
    /* A thread without a context gets device 0's primary one, as with the
     * runtime (bare.ctx_after: see the probe for whether the driver or the
     * backend's retry did it). */
    if (all[i]->bind) assert_true(all[i]->ctx_after);
    /* The legacy stream is one per context, shared by all threads... */
    assert_true(all[i]->id_legacy == main_ids.id_legacy);
    assert_true(all[i]->id_null == main_ids.id_null);
    /* ...the per-thread stream is not. */
    assert_true(all[i]->id_ptds != all[i]->id_legacy);
    for (int k = 0; k < N; k++) assert_true(all[i]->id_ptds != id[k] && all[i]->id_legacy != id[k]);
  }
  assert_true(other.id_ptds != main_ids.id_ptds);
  assert_true(bare.id_ptds != main_ids.id_ptds && bare.id_ptds != other.id_ptds);
  printf("  unbound thread: device 0's primary context current after stream_id(0): %s\n",
         bare.ctx_after ? "yes" : "no");
  printf(
      "  ids: streams %llu %llu %llu; null %llu legacy %llu; per-thread %llu / %llu / %llu"
      " (threads: main, bound, unbound)\n",
      (unsigned long long)id[0], (unsigned long long)id[1], (unsigned long long)id[2],
      (unsigned long long)main_ids.id_null, (unsigned long long)main_ids.id_legacy,
      (unsigned long long)main_ids.id_ptds, (unsigned long long)other.id_ptds, (unsigned long long)bare.id_ptds);

  /* Ids are never reused, even when handle values are. */
  static uint64_t ids[CYCLES + N];
  static uintptr_t handles[CYCLES];
  int reused = 0;
  for (int i = 0; i < CYCLES; i++) {
    CUstream t;
    GPU_CHECK(cudrv.stream_create(&t, CU_STREAM_NON_BLOCKING));
    assert_int_equal(be->stream_id(t, &ids[i]), MAGPIE_OK);
    handles[i] = (uintptr_t)t;
    for (int k = 0; k < i && !reused; k++) reused += handles[k] == handles[i];
    GPU_CHECK(cudrv.stream_destroy(t));
  }
  for (int i = 0; i < N; i++) ids[CYCLES + i] = id[i];
  qsort(ids, CYCLES + N, sizeof ids[0], cmp_u64);
  for (int i = 1; i < CYCLES + N; i++) assert_true(ids[i] != ids[i - 1]);
  printf("  %d create/destroy cycles: handle values reused: %s; ids all distinct\n", CYCLES, reused ? "yes" : "no");

  for (int i = 0; i < N; i++) {
    int dev = -1;
    assert_int_equal(be->stream_device(s[i], &dev), MAGPIE_OK);
    assert_int_equal(dev, 0);
    GPU_CHECK(cudrv.stream_destroy(s[i]));
  }
  int dev = -1;
  assert_int_equal(be->stream_device(CU_STREAM_LEGACY, &dev), MAGPIE_OK);
  assert_int_equal(dev, 0);
  assert_int_equal(be->stream_device(CU_STREAM_PER_THREAD, &dev), MAGPIE_OK);
  assert_int_equal(dev, 0);
}

/* --- child processes --------------------------------------------------- */

/* Runs this binary with arg (and extra_env added), prints its output
 * indented, and returns its wait status (-1 if it could not run). */
static int run_child(const char *arg, const char *extra_env, int timeout_s) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  size_t n = 0;
  while (environ[n]) n++;
  char **envp = calloc(n + 2, sizeof *envp);
  if (envp == NULL) return -1;
  /* extra_env replaces the variable it sets, if the environment has it. */
  size_t m = 0, name_len = extra_env ? strcspn(extra_env, "=") + 1 : 0;
  for (size_t i = 0; i < n; i++)
    if (!extra_env || strncmp(environ[i], extra_env, name_len) != 0) envp[m++] = environ[i];
  if (extra_env) envp[m++] = (char *)extra_env;
  char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return -1;
  self[len] = '\0';
  char *argv[] = {self, (char *)arg, NULL};
  pid_t pid;
  int rc = posix_spawn(&pid, self, &fa, NULL, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  free(envp);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return -1;
  }
  uint64_t deadline = gpu_now_ns() + (uint64_t)timeout_s * 1000000000u;
  char buf[4096];
  int killed = 0;
  for (;;) {
    struct pollfd p = {.fd = fds[0], .events = POLLIN};
    int r = poll(&p, 1, 1000);
    if (r > 0) {
      ssize_t got = read(fds[0], buf, sizeof buf);
      if (got <= 0) break;
      fwrite(buf, 1, (size_t)got, stdout);
    } else if (r < 0 && errno != EINTR) {
      break;
    }
    if (!killed && gpu_now_ns() > deadline) {
      printf("  (child still running after %d s: killed)\n", timeout_s);
      kill(pid, SIGKILL);
      killed = 1;
    }
  }
  close(fds[0]);
  fflush(stdout);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return status;
}

static void test_probe(void **state) {
  (void)state;
  int status = run_child("--probe", NULL, 120);
  assert_true(status != -1);
  if (WIFSIGNALED(status))
    printf("probe: the probe process was killed by signal %d (%s) at the step above\n", WTERMSIG(status),
           strsignal(WTERMSIG(status)));
  else printf("probe: the probe process exited with status %d\n", WEXITSTATUS(status));
}

static void test_vmm_env_off(void **state) {
  (void)state;
  int status = run_child("--vmm-off", "MAGPIE_CUDA_VMM=0", 60);
  assert_true(status != -1 && WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
}

/* Child: MAGPIE_CUDA_VMM=0 reports no VMM; the fallback still allocates. */
static int vmm_off_main(void) {
  const backend_ops *b = backend_cuda();
  int sup = -1;
  uintptr_t p = 0;
  if (b->init() != MAGPIE_OK || b->vmm_supported(0, &sup) != MAGPIE_OK) {
    printf("  vmm-off: backend failed: %s\n", backend_error_detail());
    return 1;
  }
  printf("  MAGPIE_CUDA_VMM=0: vmm_supported reports %d\n", sup);
  if (sup != 0) return 1;
  if (b->mem_alloc(0, 2 * MIB, &p) != MAGPIE_OK || b->mem_free(0, p, 2 * MIB) != MAGPIE_OK) {
    printf("  vmm-off: mem_alloc/mem_free failed: %s\n", backend_error_detail());
    return 1;
  }
  printf("  MAGPIE_CUDA_VMM=0: mem_alloc/mem_free of 2 MiB work\n");
  return 0;
}

int gpu_probe_main(const gpu_env *e); /* gpu_probe.c */

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--vmm-off") == 0) return vmm_off_main();
  if (argc > 1 && strcmp(argv[1], "--probe") == 0) {
    if (gpu_env_init(&env) != 0) return 1;
    return gpu_probe_main(&env);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_init_and_info),
      cmocka_unit_test(test_vmm_map_kernel),
      cmocka_unit_test(test_mem_alloc_fallback),
      cmocka_unit_test(test_events),
      cmocka_unit_test(test_stream_ids),
      cmocka_unit_test(test_vmm_env_off),
      cmocka_unit_test(test_probe),
  };
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
