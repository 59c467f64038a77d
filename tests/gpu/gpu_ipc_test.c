/* Two processes on one GPU share magpie blocks both ways (magpie_ipc_*),
 * small and large, with kernels in both checking what the other wrote;
 * and an import outlives its exporter.
 *
 * The parent runs this binary again (--ipc-child: a fresh process with its
 * own CUDA context, as CUDA requires) and talks to it over pipes: handles
 * as hex lines one way, the child's handles and its kernels' counts of bad
 * words the other. Stamps are gpu_fill_u32's (a hash of seed and index),
 * checked by gpu_check_u32 into a host-mapped counter. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "magpie.h"
#include "tests/gpu/gpu_util.h"
#include "tests/ipc_hex.h"

#define SMALL ((size_t)4096)
#define LARGE (((size_t)64 << 20) + 4096)
static const size_t sizes[2] = {SMALL, LARGE};

static gpu_env env;
static gpu_host_words words;
static CUstream stream;

static int setup(void) {
  if (gpu_magpie_setup(&env, &words) != 0) return -1;
  return cudrv.stream_create(&stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS ? 0 : -1;
}

static volatile unsigned *bad_word(void) { return (volatile unsigned *)((char *)words.flag + 512); }

/* Words of p (bytes long) that differ from seed's stamp, by a kernel. */
static unsigned check(void *p, size_t bytes, unsigned seed) {
  *bad_word() = 0;
  if (gpu_check_u32(&env, stream, (CUdeviceptr)(uintptr_t)p, bytes / 4, seed, words.dev_bad) != CUDA_SUCCESS ||
      cudrv.stream_synchronize(stream) != CUDA_SUCCESS)
    return ~0u;
  return *bad_word();
}

static int fill(void *p, size_t bytes, unsigned seed) {
  if (gpu_fill_u32(&env, stream, (CUdeviceptr)(uintptr_t)p, bytes / 4, seed) != CUDA_SUCCESS) return -1;
  return cudrv.stream_synchronize(stream) == CUDA_SUCCESS ? 0 : -1;
}

/* ---- the child ---- */

/* exchange: reads two handles (seeds 1, 2), checks them, stamps 101, 102,
 * closes; allocates two blocks stamped 11, 12 and prints "bad N" and their
 * handles; after the line "done" checks they hold 12, 13 (the parent's
 * stamps) and prints "bad2 N".
 * export: one LARGE block stamped 31, its handle printed; exits when stdin
 * closes, the block never freed. */
static int child_main(const char *mode) {
  if (setup() != 0) return 90;
  char line[IPC_HEX_LEN + 8];
  magpie_ipc_handle h;
  if (strcmp(mode, "export") == 0) {
    void *p = magpie_malloc_async(LARGE, stream);
    if (p == NULL || fill(p, LARGE, 31) != 0 || magpie_ipc_export(p, 0, &h) != MAGPIE_OK) return 91;
    to_hex(&h, line);
    printf("%s\n", line);
    fflush(stdout);
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
    return 0;
  }
  unsigned bad = 0;
  for (int i = 0; i < 2; i++) {
    void *q = NULL;
    size_t n = 0;
    if (fgets(line, sizeof line, stdin) == NULL || from_hex(line, &h) != 0) return 92;
    if (magpie_ipc_import(&h, &q, &n) != MAGPIE_OK) {
      fprintf(stderr, "child: import: %s\n", magpie_last_error_message());
      return 93;
    }
    if (n != sizes[i]) return 94;
    bad += check(q, n, 1 + i);
    if (fill(q, n, 101 + i) != 0) return 95;
    if (magpie_ipc_close(q, stream) != MAGPIE_OK) return 96;
  }
  void *mine[2];
  for (int i = 0; i < 2; i++) {
    mine[i] = magpie_malloc_async(sizes[i], stream);
    if (mine[i] == NULL || fill(mine[i], sizes[i], 11 + i) != 0) return 97;
  }
  printf("bad %u\n", bad);
  for (int i = 0; i < 2; i++) {
    if (magpie_ipc_export(mine[i], 0, &h) != MAGPIE_OK) return 98;
    to_hex(&h, line);
    printf("%s\n", line);
  }
  fflush(stdout);
  if (fgets(line, sizeof line, stdin) == NULL || strcmp(line, "done\n") != 0) return 99;
  unsigned bad2 = 0;
  for (int i = 0; i < 2; i++) bad2 += check(mine[i], sizes[i], 12 + i);
  printf("bad2 %u\n", bad2);
  fflush(stdout);
  for (int i = 0; i < 2; i++)
    if (magpie_free_async(mine[i], stream) != MAGPIE_OK) return 100;
  return 0;
}

/* ---- the parent ---- */

typedef struct child {
  pid_t pid;
  FILE *in, *out;
} child;

static child spawn_child(const char *mode) {
  char *argv[] = {"/proc/self/exe", "--ipc-child", (char *)mode, NULL};
  int pin[2], pout[2];
  assert_int_equal(pipe2(pin, O_CLOEXEC), 0);
  assert_int_equal(pipe2(pout, O_CLOEXEC), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pin[0], 0);
  posix_spawn_file_actions_adddup2(&fa, pout[1], 1);
  child c;
  extern char **environ;
  assert_int_equal(posix_spawn(&c.pid, "/proc/self/exe", &fa, NULL, argv, environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  close(pin[0]);
  close(pout[1]);
  c.in = fdopen(pin[1], "w");
  c.out = fdopen(pout[0], "r");
  return c;
}

static int child_exit(child *c) {
  if (c->in != NULL) fclose(c->in);
  c->in = NULL;
  int st = 0;
  assert_int_equal(waitpid(c->pid, &st, 0), c->pid);
  fclose(c->out);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void test_exchange_both_ways(void **state) {
  (void)state;
  void *p[2];
  char line[IPC_HEX_LEN + 8];
  magpie_ipc_handle h;
  child c = spawn_child("exchange");
  for (int i = 0; i < 2; i++) {
    assert_non_null(p[i] = magpie_malloc_async(sizes[i], stream));
    assert_int_equal(fill(p[i], sizes[i], 1 + i), 0);
    assert_int_equal(magpie_ipc_export(p[i], 0, &h), MAGPIE_OK);
    to_hex(&h, line);
    fprintf(c.in, "%s\n", line);
  }
  fflush(c.in);
  unsigned bad = ~0u;
  assert_non_null(fgets(line, sizeof line, c.out));
  assert_int_equal(sscanf(line, "bad %u", &bad), 1);
  printf("child's kernels: %u bad words in the parent's blocks (%zu and %zu bytes)\n", bad, sizes[0], sizes[1]);
  assert_int_equal(bad, 0);
  for (int i = 0; i < 2; i++) {
    void *q = NULL;
    size_t n = 0;
    assert_non_null(fgets(line, sizeof line, c.out));
    assert_int_equal(from_hex(line, &h), 0);
    assert_int_equal(magpie_ipc_import(&h, &q, &n), MAGPIE_OK);
    assert_int_equal(n, sizes[i]);
    unsigned b = check(q, n, 11 + i);
    printf("parent's kernel: %u bad words in the child's block of %zu bytes\n", b, n);
    assert_int_equal(b, 0);
    assert_int_equal(fill(q, n, 12 + i), 0);
    assert_int_equal(magpie_ipc_close(q, stream), MAGPIE_OK);
  }
  fprintf(c.in, "done\n");
  fflush(c.in);
  unsigned bad2 = ~0u;
  assert_non_null(fgets(line, sizeof line, c.out));
  assert_int_equal(sscanf(line, "bad2 %u", &bad2), 1);
  printf("child's kernel: %u bad words of the parent's stamps in its blocks\n", bad2);
  assert_int_equal(bad2, 0);
  assert_int_equal(child_exit(&c), 0);
  for (int i = 0; i < 2; i++) {
    unsigned b = check(p[i], sizes[i], 101 + i);
    printf("parent's kernel: %u bad words of the child's stamps in its block of %zu bytes\n", b, sizes[i]);
    assert_int_equal(b, 0);
    assert_int_equal(magpie_free_async(p[i], stream), MAGPIE_OK);
  }
}

static void test_import_outlives_exporter(void **state) {
  (void)state;
  char line[IPC_HEX_LEN + 8];
  magpie_ipc_handle h;
  child c = spawn_child("export");
  assert_non_null(fgets(line, sizeof line, c.out));
  assert_int_equal(from_hex(line, &h), 0);
  void *q = NULL;
  size_t n = 0;
  assert_int_equal(magpie_ipc_import(&h, &q, &n), MAGPIE_OK);
  assert_int_equal(child_exit(&c), 0);
  unsigned b = check(q, n, 31);
  printf("after the exporter exited: %u bad words in its block of %zu bytes\n", b, n);
  assert_int_equal(b, 0);
  assert_int_equal(fill(q, n, 32), 0);
  assert_int_equal(check(q, n, 32), 0);
  assert_int_equal(magpie_ipc_close(q, stream), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import(&h, &q, &n), MAGPIE_ERR_IPC);
  printf("import after the exporter exited: %s\n", magpie_last_error_message());
}

static int group_setup(void **state) {
  (void)state;
  return setup();
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--ipc-child") == 0) return child_main(argv[2]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_exchange_both_ways),
      cmocka_unit_test(test_import_outlives_exporter),
  };
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
