/* The simulated device's memory (reserve, map, unmap, capacity), its
 * configuration from the environment, and the backend table over it. */
#include "tests/sim_test_util.h"

/* ---------------------------------------------------------------- memory */

static void test_memory_reserve_map_unmap(void **state) {
  (void)state;
  size_t free0, total0, f, t;
  assert_int_equal(sim_memory_info(0, &free0, &total0), MAGPIE_OK);
  uintptr_t base;
  assert_int_equal(sim_memory_reserve(0, 8 * MiB, &base), MAGPIE_OK);
  assert_int_equal(base % SIM_GRANULARITY, 0);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0); /* a reservation costs no capacity */
  assert_int_equal(sim_memory_map(0, base + 2 * MiB, 4 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0 - 4 * MiB && t == total0);
  memset((void *)(base + 2 * MiB), 0xab, 4 * MiB);
  assert_int_equal(((unsigned char *)base)[6 * MiB - 1], 0xab);
  /* Honest errors: mapping twice, unmapping what is not mapped, ranges
   * outside reservations or not on the granularity, unreserving a mapped
   * reservation. Each leaves the figures unchanged. */
  assert_int_equal(sim_memory_map(0, base + 4 * MiB, 2 * MiB, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_unmap(0, base, 2 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_map(0, base + 1, 2 * MiB, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_map(0, base + 6 * MiB, 4 * MiB, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_map(1, base, 2 * MiB, 0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_unreserve(0, base, 8 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_true(strlen(backend_error_detail()) > 0);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0 - 4 * MiB);
  /* Partial unmap, then the rest. */
  assert_int_equal(sim_memory_unmap(0, base + 2 * MiB, 2 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0 - 2 * MiB);
  assert_int_equal(sim_memory_unmap(0, base + 4 * MiB, 2 * MiB), MAGPIE_OK);
  /* Mapped again after an unmap: usable. */
  assert_int_equal(sim_memory_map(0, base, 8 * MiB, 0, 0), MAGPIE_OK);
  ((volatile char *)base)[8 * MiB - 1] = 1;
  assert_int_equal(sim_memory_unmap(0, base, 8 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(0, &f, &t), MAGPIE_OK);
  assert_true(f == free0);
  assert_int_equal(sim_memory_unreserve(0, base, 8 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unreserve(0, base, 8 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_reserve(0, 3 * MiB, &base), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_reserve(0, 0, &base), MAGPIE_ERR_INVALID_ARGUMENT);
}

static void test_memory_over_capacity(void **state) {
  (void)state;
  assert_int_equal(sim_memory_set_capacity(1, 6 * MiB), MAGPIE_OK);
  size_t f, t;
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 6 * MiB && t == 6 * MiB);
  uintptr_t base;
  assert_int_equal(sim_memory_reserve(1, 16 * MiB, &base), MAGPIE_OK);
  assert_int_equal(sim_memory_map(1, base, 4 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(sim_memory_map(1, base + 4 * MiB, 4 * MiB, 0, 0), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 2 * MiB && t == 6 * MiB);
  /* The failed map left its range unmapped: mapping part of it works. */
  assert_int_equal(sim_memory_map(1, base + 4 * MiB, 2 * MiB, 0, 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 0);
  uintptr_t p;
  assert_int_equal(sim_memory_alloc(1, 1, &p), MAGPIE_ERR_OUT_OF_MEMORY);
  /* A capacity below what is in use: nothing free, nothing lost. */
  assert_int_equal(sim_memory_set_capacity(1, 2 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 0 && t == 2 * MiB);
  assert_int_equal(sim_memory_set_capacity(1, 6 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_unmap(1, base, 6 * MiB), MAGPIE_OK);
  assert_int_equal(magpie_sim_mem_info(1, &f, &t), MAGPIE_OK);
  assert_true(f == 6 * MiB);
  assert_int_equal(sim_memory_unreserve(1, base, 16 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_set_capacity(1, SIM_DEFAULT_CAPACITY), MAGPIE_OK);
}

static void test_memory_alloc_free(void **state) {
  (void)state;
  assert_int_equal(sim_memory_set_capacity(2, 8 * MiB), MAGPIE_OK);
  uintptr_t p, q;
  size_t f, t;
  assert_int_equal(sim_memory_alloc(2, 3 * MiB, &p), MAGPIE_OK);
  assert_int_equal(p % SIM_GRANULARITY, 0);
  memset((void *)p, 1, 3 * MiB);
  assert_int_equal(sim_memory_info(2, &f, &t), MAGPIE_OK);
  assert_true(f == 4 * MiB); /* counted in whole granules */
  assert_int_equal(sim_memory_alloc(2, 4 * MiB + 1, &q), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(sim_memory_alloc(2, 4 * MiB, &q), MAGPIE_OK);
  assert_int_equal(sim_memory_free(2, p + 4096, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_free(1, p, 3 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_free(2, p, 3 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_free(2, p, 3 * MiB), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_free(2, q, 4 * MiB), MAGPIE_OK);
  assert_int_equal(sim_memory_info(2, &f, &t), MAGPIE_OK);
  assert_true(f == 8 * MiB);
  assert_int_equal(sim_memory_alloc(2, 0, &p), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(sim_memory_alloc(2, SIZE_MAX, &p), MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(sim_memory_set_capacity(2, SIM_DEFAULT_CAPACITY), MAGPIE_OK);
}

static void test_config_parsing(void **state) {
  (void)state;
  uint64_t v;
  assert_int_equal(sim_parse_size("4g", 1, &v), 0);
  assert_true(v == (uint64_t)4 << 30);
  assert_int_equal(sim_parse_size("12M", 1, &v), 0);
  assert_true(v == (uint64_t)12 << 20);
  assert_int_equal(sim_parse_size("512k", 1, &v), 0);
  assert_true(v == 512 * 1024);
  assert_int_equal(sim_parse_size("123", 0, &v), 0);
  assert_true(v == 123);
  assert_int_equal(sim_parse_size("", 1, &v), -1);
  assert_int_equal(sim_parse_size("4x", 1, &v), -1);
  assert_int_equal(sim_parse_size("4g", 0, &v), -1);
  assert_int_equal(sim_parse_size("-1", 1, &v), -1);
  assert_int_equal(sim_parse_size("4gb", 1, &v), -1);
  assert_int_equal(sim_parse_size("99999999999999999999", 1, &v), -1);
  assert_int_equal(sim_parse_size("17179869184g", 1, &v), -1);
  assert_int_equal(sim_parse_size(NULL, 1, &v), -1);
}

/* A malformed variable is reported, not fatal. The environment is read once
 * per process, so each case runs in a fresh copy of this program (see
 * config_child in main). */
extern char **environ;

static int run_config_child(const char *assignment, const char *variable) {
  char *argv[] = {"sim_memory_test", "--config-child", (char *)variable, NULL};
  size_t n = 0;
  while (environ[n] != NULL) n++;
  char **envp = calloc(n + 2, sizeof *envp);
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "MAGPIE_SIM_", 11) != 0) envp[k++] = environ[i];
  envp[k++] = (char *)assignment;
  envp[k] = NULL;
  pid_t pid;
  int rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, envp);
  free(envp);
  if (rc != 0) return -1;
  int status;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* In the child: every entry point fails with MAGPIE_ERR_CONFIG naming the
 * variable; exit 0 if so. */
static int config_child(const char *variable) {
  int ok = 1;
  ok &= magpie_sim_stream_create() == NULL;
  ok &= magpie_sim_last_error() == MAGPIE_ERR_CONFIG;
  ok &= strstr(magpie_sim_last_error_message(), variable) != NULL;
  static int flag;
  ok &= magpie_sim_launch(NULL, set_flag, &flag) == MAGPIE_ERR_CONFIG;
  ok &= magpie_sim_device_count() == 0;
  ok &= backend_sim()->init() == MAGPIE_ERR_CONFIG;
  ok &= strstr(backend_error_detail(), variable) != NULL;
  size_t f, t;
  ok &= magpie_sim_mem_info(0, &f, &t) == MAGPIE_ERR_CONFIG;
  return ok ? 0 : 1;
}

static void test_bad_environment_is_reported(void **state) {
  (void)state;
  assert_int_equal(run_config_child("MAGPIE_SIM_MEMORY=12x", "MAGPIE_SIM_MEMORY"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_MEMORY=0", "MAGPIE_SIM_MEMORY"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_DEVICES=17", "MAGPIE_SIM_DEVICES"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_DEVICES=two", "MAGPIE_SIM_DEVICES"), 0);
  assert_int_equal(run_config_child("MAGPIE_SIM_VMM=yes", "MAGPIE_SIM_VMM"), 0);
  /* The check can fail: a good value is not reported. */
  assert_int_equal(run_config_child("MAGPIE_SIM_MEMORY=64m", "MAGPIE_SIM_MEMORY"), 1);
}

/* ---------------------------------------------------------------- backend */

static void test_backend_table(void **state) {
  (void)state;
  const backend_ops *ops = backend_sim();
  assert_string_equal(ops->name, "sim");
  assert_int_equal(ops->init(), MAGPIE_OK);
  assert_int_equal(ops->init(), MAGPIE_OK); /* idempotent */
  int n = 0, vmm = -1;
  assert_int_equal(ops->device_count(&n), MAGPIE_OK);
  assert_int_equal(n, TEST_DEVICES);
  size_t gran = 0, f, t;
  assert_int_equal(ops->granularity(0, &gran), MAGPIE_OK);
  assert_true(gran == 2 * MiB);
  assert_int_equal(ops->vmm_supported(0, &vmm), MAGPIE_OK);
  assert_int_equal(vmm, 1);
  assert_int_equal(ops->mem_info(0, &f, &t), MAGPIE_OK);
  assert_true(t == SIM_DEFAULT_CAPACITY);
  assert_int_equal(ops->granularity(TEST_DEVICES, &gran), MAGPIE_ERR_INVALID_ARGUMENT);

  /* Virtual memory. */
  uintptr_t base, p;
  assert_int_equal(ops->reserve(0, 4 * gran, &base), MAGPIE_OK);
  assert_int_equal(ops->map(0, base, 2 * gran, 0, 0), MAGPIE_OK);
  *(volatile int *)base = 7;
  size_t f2;
  assert_int_equal(ops->mem_info(0, &f2, &t), MAGPIE_OK);
  assert_true(f2 == f - 2 * gran);
  assert_int_equal(ops->unmap(0, base, 2 * gran), MAGPIE_OK);
  assert_int_equal(ops->unreserve(0, base, 4 * gran), MAGPIE_OK);
  assert_int_equal(ops->mem_alloc(0, gran, &p), MAGPIE_OK);
  assert_int_equal(ops->mem_free(0, p, gran), MAGPIE_OK);

  /* Without VMM: reported, and the VMM operations refuse. */
  sim_memory_set_vmm(0);
  assert_int_equal(ops->vmm_supported(0, &vmm), MAGPIE_OK);
  assert_int_equal(vmm, 0);
  assert_int_equal(ops->reserve(0, gran, &base), MAGPIE_ERR_BACKEND);
  assert_non_null(strstr(backend_error_detail(), "MAGPIE_SIM_VMM"));
  assert_int_equal(ops->mem_alloc(0, gran, &p), MAGPIE_OK);
  assert_int_equal(ops->mem_free(0, p, gran), MAGPIE_OK);
  sim_memory_set_vmm(1);

  /* Streams and events. */
  cudaStream_t a = magpie_sim_stream_create(), b = magpie_sim_stream_create();
  uint64_t id;
  int dev = -1;
  assert_int_equal(ops->stream_id(a, &id), MAGPIE_OK);
  assert_true(id == magpie_sim_stream_id(a));
  assert_int_equal(ops->stream_id(NULL, &id), MAGPIE_OK);
  assert_true(id == magpie_sim_stream_id(NULL));
  assert_int_equal(ops->stream_device(b, &dev), MAGPIE_OK);
  assert_int_equal(dev, 0);
  void *ev = NULL;
  assert_int_equal(ops->event_create(0, &ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  struct ordered o;
  memset(&o, 0, sizeof o);
  gated_init(&o.g);
  assert_int_equal(magpie_sim_launch(a, ordered_writer, &o), MAGPIE_OK);
  assert_int_equal(ops->event_record(ev, a), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), BACKEND_NOT_READY);
  assert_int_equal(ops->stream_wait_event(b, ev), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch(b, ordered_reader, &o), MAGPIE_OK);
  sem_post(&o.g.gate);
  assert_int_equal(ops->event_synchronize(ev), MAGPIE_OK);
  assert_int_equal(ops->event_query(ev), MAGPIE_OK);
  assert_int_equal(ops->device_synchronize(0), MAGPIE_OK);
  assert_int_equal(o.seen, 1);
  assert_int_equal(atomic_load(&o.b_ran), 1);
  assert_int_equal(ops->event_destroy(ev), MAGPIE_OK);
  assert_int_equal(ops->event_create(TEST_DEVICES, &ev), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->device_synchronize(TEST_DEVICES), MAGPIE_ERR_INVALID_ARGUMENT);

  /* Destroyed stream: INVALID_STREAM with a reason. */
  magpie_sim_stream_destroy(a);
  backend_set_error_detail("%s", "");
  assert_int_equal(ops->stream_id(a, &id), MAGPIE_ERR_INVALID_STREAM);
  assert_true(strlen(backend_error_detail()) > 0);
  assert_int_equal(ops->stream_device(a, &dev), MAGPIE_ERR_INVALID_STREAM);
  magpie_sim_stream_destroy(b);
  gated_fini(&o.g);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--config-child") == 0) return config_child(argv[2]);
  /* Before the simulator's first use: it reads the environment once. */
  setenv("MAGPIE_SIM_DEVICES", "3", 1);
  unsetenv("MAGPIE_SIM_MEMORY");
  unsetenv("MAGPIE_SIM_VMM");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_memory_reserve_map_unmap),    cmocka_unit_test(test_memory_over_capacity),
      cmocka_unit_test(test_memory_alloc_free),           cmocka_unit_test(test_config_parsing),
      cmocka_unit_test(test_bad_environment_is_reported), cmocka_unit_test(test_backend_table),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
