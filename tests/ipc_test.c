/* Sharing blocks between processes (magpie_ipc_*) on the simulated device,
 * whose exportable memory is memfd-backed, so another process maps the
 * same pages as a GPU's importer maps the same physical memory.
 *
 * Two processes: the test binary runs itself again (posix_spawn of
 * /proc/self/exe with --ipc-child; the simulated device's threads do not
 * survive fork, as CUDA does not) to import, export, or die holding an
 * import. Most refusals are also checked in one process: a process may
 * import its own handles (the server thread answers it as any other).
 *
 * The rule checked throughout: a block stays out of reuse in the exporting
 * process while any process has it imported, or while an export made with
 * MAGPIE_IPC_HOLD waits for its first import; it is parked at its free as a
 * recorded block is (record_pending_bytes), and comes back once the last
 * hold is gone, whether by magpie_ipc_close or the importer's exit.
 *
 * The compact handle (magpie_ipc_export_compact, the 64 bytes of a
 * cudaIpcMemHandle_t) is the same export: the same checks run through it,
 * and bytes that are not one (a CUDA handle's) are told apart. Peer access
 * is granted and taken back on three simulated devices, while other threads
 * map. */
#include "tests/sim_test_util.h"

#include "tests/ipc_hex.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/random.h>

#include "heap/heap.h"
#include "ipc/ipc.h"
#include "pool/record.h"

#define SMALL 4096
#define LARGE (8 * MiB + 4096) /* a large block over several granules */

/* ------------------------------------------------------------ helpers */

static void stamp(void *p, size_t n, unsigned seed) {
  unsigned char *b = p;
  for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i * 31u + seed);
}

/* Index of the first byte differing from stamp's, or n. */
static size_t stamped(const void *p, size_t n, unsigned seed) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != (unsigned char)(i * 31u + seed)) return i;
  return n;
}

/* Bytes parked in device 0's record table: blocks freed and held. */
static size_t parked(void) { return record_pending_bytes(&heap_peek(0)->records); }

/* Waits (trimming, which hands back what is ready) until nothing is parked;
 * the exporter's server releases a hold when it sees the importer's
 * socket close, asynchronously. */
static void wait_unparked(void) {
  for (int i = 0; i < WAIT_MS / 10; i++) {
    assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
    if (parked() == 0) return;
    struct timespec t = {0, 10 * 1000000L};
    nanosleep(&t, NULL);
  }
  fail_msg("%zu bytes still parked after %d ms", parked(), WAIT_MS);
}

/* A child running this binary with args; its stdin and stdout as pipes
 * (to_child / from_child, NULL: inherited). */
typedef struct child {
  pid_t pid;
  FILE *in, *out;
} child;

static child spawn_child(const char *const args[], int want_in, int want_out) {
  char *argv[16];
  int n = 0;
  argv[n++] = "/proc/self/exe";
  argv[n++] = "--ipc-child";
  for (int i = 0; args[i] != NULL; i++) argv[n++] = (char *)args[i];
  argv[n] = NULL;
  int pin[2] = {-1, -1}, pout[2] = {-1, -1};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (want_in) {
    assert_int_equal(pipe2(pin, O_CLOEXEC), 0);
    posix_spawn_file_actions_adddup2(&fa, pin[0], 0);
  }
  if (want_out) {
    assert_int_equal(pipe2(pout, O_CLOEXEC), 0);
    posix_spawn_file_actions_adddup2(&fa, pout[1], 1);
  }
  child c = {0};
  extern char **environ;
  assert_int_equal(posix_spawn(&c.pid, "/proc/self/exe", &fa, NULL, argv, environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  if (want_in) {
    close(pin[0]);
    c.in = fdopen(pin[1], "w");
  }
  if (want_out) {
    close(pout[1]);
    c.out = fdopen(pout[0], "r");
  }
  return c;
}

static int child_wait(child *c) {
  if (c->in != NULL) fclose(c->in);
  if (c->out != NULL) fclose(c->out);
  int st = 0;
  assert_int_equal(waitpid(c->pid, &st, 0), c->pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ------------------------------------------------------------ the child */

/* --ipc-child check HEX SIZE SEED REPLY: import, check SEED's stamp, stamp
 *   REPLY, close; exit 0, or the step that failed.
 * --ipc-child hold HEX: import, say "imported", exit without closing when
 *   stdin closes.
 * --ipc-child export SIZE SEED: allocate, stamp, export, print the handle,
 *   exit when stdin closes (the block never freed). */
static int child_main(int argc, char **argv) {
  if (argc < 3) return 90;
  magpie_ipc_handle h;
  void *p = NULL;
  size_t got = 0;
  if (strcmp(argv[2], "check") == 0 && argc == 7) {
    size_t size = strtoull(argv[4], NULL, 0);
    unsigned seed = (unsigned)atoi(argv[5]), reply = (unsigned)atoi(argv[6]);
    if (from_hex(argv[3], &h) != 0) return 91;
    if (magpie_ipc_import(&h, &p, &got) != MAGPIE_OK) {
      fprintf(stderr, "child import: %s\n", magpie_last_error_message());
      return 92;
    }
    if (got != size) return 93;
    if (stamped(p, size, seed) != size) return 94;
    stamp(p, size, reply);
    if (magpie_ipc_close(p, 0) != MAGPIE_OK) return 95;
    if (magpie_ipc_close(p, 0) != MAGPIE_ERR_INVALID_POINTER) return 96; /* closed already */
    return 0;
  }
  if (strcmp(argv[2], "check-compact") == 0 && argc == 7) {
    magpie_ipc_compact c;
    void *q = NULL;
    size_t size = strtoull(argv[4], NULL, 0);
    unsigned seed = (unsigned)atoi(argv[5]), reply = (unsigned)atoi(argv[6]);
    if (compact_from_hex(argv[3], &c) != 0) return 91;
    if (!magpie_ipc_is_compact(&c)) return 97;
    if (magpie_ipc_import_compact(&c, -1, &p, &got) != MAGPIE_OK) {
      fprintf(stderr, "child import: %s\n", magpie_last_error_message());
      return 92;
    }
    if (got != size) return 93;
    if (stamped(p, size, seed) != size) return 94;
    /* Imported again: mapped again, the same memory. */
    if (magpie_ipc_import_compact(&c, -1, &q, NULL) != MAGPIE_OK || q == p) return 98;
    stamp(q, size, reply);
    if (stamped(p, size, reply) != size) return 99;
    if (magpie_ipc_close(q, 0) != MAGPIE_OK || magpie_ipc_close(p, 0) != MAGPIE_OK) return 95;
    if (magpie_ipc_close(p, 0) != MAGPIE_ERR_INVALID_POINTER) return 96; /* closed already */
    return 0;
  }
  if (strcmp(argv[2], "hold-compact") == 0 && argc == 4) {
    magpie_ipc_compact c;
    if (compact_from_hex(argv[3], &c) != 0) return 91;
    if (magpie_ipc_import_compact(&c, -1, &p, &got) != MAGPIE_OK) return 92;
    printf("imported\n");
    fflush(stdout);
    char line[8];
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
    _exit(0); /* dies holding the import */
  }
  if (strcmp(argv[2], "hold") == 0 && argc == 4) {
    if (from_hex(argv[3], &h) != 0) return 91;
    if (magpie_ipc_import(&h, &p, &got) != MAGPIE_OK) return 92;
    printf("imported\n");
    fflush(stdout);
    char line[8];
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
    _exit(0); /* dies holding the import */
  }
  if (strcmp(argv[2], "export") == 0 && argc == 5) {
    size_t size = strtoull(argv[3], NULL, 0);
    p = magpie_malloc(size);
    if (p == NULL) return 92;
    stamp(p, size, (unsigned)atoi(argv[4]));
    if (magpie_ipc_export(p, 0, &h) != MAGPIE_OK) return 93;
    char hex[IPC_HEX_LEN];
    to_hex(&h, hex);
    printf("%s\n", hex);
    fflush(stdout);
    char line[8];
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
    return 0;
  }
  return 90;
}

/* ------------------------------------------------------------ tests */

/* Another process imports a small and a large block, sees the stamps and
 * writes its own, which the exporter sees. */
static void test_two_processes(void **state) {
  (void)state;
  size_t sizes[] = {SMALL, LARGE};
  for (int i = 0; i < 2; i++) {
    void *p = magpie_malloc(sizes[i]);
    assert_non_null(p);
    stamp(p, sizes[i], 7 + i);
    magpie_ipc_handle h;
    assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
    char hex[IPC_HEX_LEN], size[32], seed[8], reply[8];
    to_hex(&h, hex);
    snprintf(size, sizeof size, "%zu", sizes[i]);
    snprintf(seed, sizeof seed, "%d", 7 + i);
    snprintf(reply, sizeof reply, "%d", 100 + i);
    const char *args[] = {"check", hex, size, seed, reply, NULL};
    child c = spawn_child(args, 0, 0);
    assert_int_equal(child_wait(&c), 0);
    assert_int_equal(stamped(p, sizes[i], 100 + i), sizes[i]);
    assert_int_equal(magpie_free(p), MAGPIE_OK);
    wait_unparked(); /* the child closed: nothing holds the block */
  }
}

/* In one process: the import is the same memory at another address; its
 * size is the block's; closing twice fails. */
static void test_self_import(void **state) {
  (void)state;
  void *p = magpie_malloc(SMALL);
  stamp(p, SMALL, 3);
  magpie_ipc_handle h, h2;
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  assert_int_equal(magpie_ipc_export(p, 0, &h2), MAGPIE_OK);
  assert_memory_equal(&h, &h2, sizeof h); /* exporting again: the same handle */
  void *q = NULL;
  size_t n = 0;
  assert_int_equal(magpie_ipc_import(&h, &q, &n), MAGPIE_OK);
  assert_ptr_not_equal(p, q);
  assert_int_equal(n, SMALL);
  assert_int_equal(stamped(q, SMALL, 3), SMALL);
  stamp(q, SMALL, 4);
  assert_int_equal(stamped(p, SMALL, 4), SMALL);
  assert_int_equal(magpie_usable_size(q), 0); /* not a block of this process's heap */
  assert_int_equal(magpie_free(q), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  wait_unparked();
}

/* While imported, a freed block is parked, not reused; it comes back when
 * the import closes. */
static void test_free_while_imported(void **state) {
  (void)state;
  void *p = magpie_malloc(LARGE);
  magpie_ipc_handle h;
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  void *q = NULL;
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_OK);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_true(parked() >= LARGE);
  void *v[8];
  for (int i = 0; i < 8; i++) {
    v[i] = magpie_malloc(LARGE);
    assert_non_null(v[i]);
    assert_ptr_not_equal(v[i], p);
  }
  for (int i = 0; i < 8; i++) assert_int_equal(magpie_free(v[i]), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_true(parked() >= LARGE); /* still imported */
  stamp(q, LARGE, 9);             /* the importer's memory is still the block's */
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  wait_unparked();
  /* Freed and gone back: the export is over. */
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_ERR_IPC);
}

/* Without MAGPIE_IPC_HOLD, an import after the free is refused; with it,
 * the block waits for its first import; revoke drops that hold. */
static void test_hold_and_revoke(void **state) {
  (void)state;
  void *q = NULL;
  void *p = magpie_malloc(SMALL);
  magpie_ipc_handle h;
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "freed the block before this import"));
  wait_unparked();

  p = magpie_malloc(SMALL);
  stamp(p, SMALL, 11);
  assert_int_equal(magpie_ipc_export(p, MAGPIE_IPC_HOLD, &h), MAGPIE_OK);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_true(parked() >= SMALL); /* held for its import */
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_OK);
  assert_int_equal(stamped(q, SMALL, 11), SMALL);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  wait_unparked();

  p = magpie_malloc(SMALL);
  assert_int_equal(magpie_ipc_export(p, MAGPIE_IPC_HOLD, &h), MAGPIE_OK);
  assert_int_equal(magpie_ipc_revoke(&h), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "revoked"));
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  wait_unparked(); /* the revoked hold holds nothing */
  assert_int_equal(magpie_ipc_revoke(&h), MAGPIE_ERR_INVALID_ARGUMENT);
}

/* An importer that dies holding an import gives its hold back. */
static void test_importer_dies(void **state) {
  (void)state;
  void *p = magpie_malloc(LARGE);
  magpie_ipc_handle h;
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  char hex[IPC_HEX_LEN], line[32];
  to_hex(&h, hex);
  const char *args[] = {"hold", hex, NULL};
  child c = spawn_child(args, 1, 1);
  assert_non_null(fgets(line, sizeof line, c.out));
  assert_string_equal(line, "imported\n");
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_true(parked() >= LARGE);      /* the child holds it */
  assert_int_equal(child_wait(&c), 0); /* closes its stdin: it exits */
  wait_unparked();
}

/* The exporter dies: an import made before stays valid (the memory lives
 * while mapped); a later import says the exporter is gone. */
static void test_exporter_dies(void **state) {
  (void)state;
  char line[2 * MAGPIE_IPC_HANDLE_SIZE + 8];
  const char *args[] = {"export", "8392704", "21", NULL}; /* LARGE */
  child c = spawn_child(args, 1, 1);
  assert_non_null(fgets(line, sizeof line, c.out));
  magpie_ipc_handle h;
  assert_int_equal(from_hex(line, &h), 0);
  void *q = NULL;
  size_t n = 0;
  assert_int_equal(magpie_ipc_import(&h, &q, &n), MAGPIE_OK);
  assert_int_equal(n, LARGE);
  assert_int_equal(child_wait(&c), 0);
  assert_int_equal(stamped(q, LARGE, 21), LARGE);
  stamp(q, LARGE, 22);
  assert_int_equal(stamped(q, LARGE, 22), LARGE);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import(&h, &q, &n), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "is gone"));
}

/* Bad handles and pointers get clear errors and change nothing. */
static void test_bad_input(void **state) {
  (void)state;
  magpie_ipc_handle h;
  void *q = (void *)1;
  memset(&h, 0xab, sizeof h);
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_null(q);
  assert_non_null(strstr(magpie_last_error_message(), "not a magpie IPC handle"));
  assert_int_equal(magpie_ipc_import(NULL, &q, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_export(NULL, 0, &h), MAGPIE_ERR_INVALID_ARGUMENT);
  int local = 0;
  assert_int_equal(magpie_ipc_export(&local, 0, &h), MAGPIE_ERR_INVALID_POINTER);
  void *p = magpie_malloc(SMALL);
  assert_int_equal(magpie_ipc_export((char *)p + 256, 0, &h), MAGPIE_ERR_INVALID_POINTER);
  assert_int_equal(magpie_ipc_export(p, 0x80, &h), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_export(p, 0, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_close(p, 0), MAGPIE_ERR_INVALID_POINTER);
  /* A handle with a wrong secret names no export. */
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  magpie_ipc_handle bad = h;
  bad.bytes[offsetof(ipc_wire_handle, secret)] ^= 1;
  assert_int_equal(magpie_ipc_import(&bad, &q, NULL), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "no such export"));
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_OK); /* the real one still works */
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  wait_unparked();
}

/* Peer access on two simulated devices: a block of device 0 mapped before
 * and one mapped after enabling, small and large, are accessible from
 * device 1 only once enabled; a pair with no path is refused. */
static void test_peer_access(void **state) {
  (void)state;
  int can = -1;
  assert_int_equal(magpie_device_can_access_peer(0, 1, &can), MAGPIE_OK);
  assert_int_equal(can, 1);
  assert_int_equal(magpie_device_can_access_peer(0, 0, &can), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_device_enable_peer_access(0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_device_enable_peer_access(0, 99), MAGPIE_ERR_INVALID_ARGUMENT);
  void *small = magpie_malloc(SMALL), *large = magpie_malloc(LARGE);
  assert_int_equal(magpie_sim_access_check(0, small, SMALL), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, small, SMALL), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, large, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, small, SMALL), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, large, LARGE), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(2, large, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  void *later = magpie_malloc(3 * LARGE); /* maps anew */
  assert_int_equal(magpie_sim_access_check(1, later, 3 * LARGE), MAGPIE_OK);
  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK); /* again: nothing changes */
  /* Device 2 has no path to device 0's memory. */
  assert_int_equal(magpie_sim_set_peer_capable(0, 2, 0), MAGPIE_OK);
  assert_int_equal(magpie_device_can_access_peer(0, 2, &can), MAGPIE_OK);
  assert_int_equal(can, 0);
  assert_int_equal(magpie_device_enable_peer_access(0, 2), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_non_null(strstr(magpie_last_error_message(), "device 0 owns the memory and device 2 wants"));
  assert_int_equal(magpie_sim_set_peer_capable(0, 2, 1), MAGPIE_OK);
  /* Device 1's own blocks are not device 0's peers' business. */
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t s1 = magpie_sim_stream_create();
  void *one = magpie_malloc_async(SMALL, s1);
  assert_non_null(one);
  assert_int_equal(magpie_sim_access_check(0, one, SMALL), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_free_async(one, s1), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s1), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  assert_int_equal(magpie_free(small), MAGPIE_OK);
  assert_int_equal(magpie_free(large), MAGPIE_OK);
  assert_int_equal(magpie_free(later), MAGPIE_OK);
}

/* ------------------------------------------------------------ compact handles */

/* Another process imports a small and a large block through the compact
 * handle (twice: two mappings of one memory), sees the stamps and writes
 * its own, which the exporter sees. */
static void test_compact_two_processes(void **state) {
  (void)state;
  size_t sizes[] = {SMALL, LARGE};
  for (int i = 0; i < 2; i++) {
    void *p = magpie_malloc(sizes[i]);
    assert_non_null(p);
    stamp(p, sizes[i], 31 + i);
    magpie_ipc_compact c, c2;
    assert_int_equal(magpie_ipc_export_compact(p, 0, &c), MAGPIE_OK);
    assert_int_equal(magpie_ipc_export_compact(p, 0, &c2), MAGPIE_OK);
    assert_memory_equal(&c, &c2, sizeof c); /* exporting again: the same handle, as cudaIpcGetMemHandle */
    assert_int_equal(magpie_ipc_is_compact(&c), 1);
    char hex[IPC_COMPACT_HEX_LEN], size[32], seed[8], reply[8];
    compact_to_hex(&c, hex);
    snprintf(size, sizeof size, "%zu", sizes[i]);
    snprintf(seed, sizeof seed, "%d", 31 + i);
    snprintf(reply, sizeof reply, "%d", 130 + i);
    const char *args[] = {"check-compact", hex, size, seed, reply, NULL};
    child ch = spawn_child(args, 0, 0);
    assert_int_equal(child_wait(&ch), 0);
    assert_int_equal(stamped(p, sizes[i], 130 + i), sizes[i]);
    assert_int_equal(magpie_free(p), MAGPIE_OK);
    wait_unparked();
  }
}

/* The compact and the long handle of a block name one export: an import
 * of either holds the block, a held export is revoked through the long
 * form, and a freed block refuses both. */
static void test_compact_is_the_same_export(void **state) {
  (void)state;
  void *p = magpie_malloc(LARGE), *q = NULL;
  stamp(p, LARGE, 41);
  magpie_ipc_compact c;
  magpie_ipc_handle h;
  assert_int_equal(magpie_ipc_export_compact(p, 0, &c), MAGPIE_OK);
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  size_t n = 0;
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &q, &n), MAGPIE_OK);
  assert_int_equal(n, LARGE);
  assert_int_equal(stamped(q, LARGE, 41), LARGE);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_true(parked() >= LARGE); /* the compact import holds it */
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  wait_unparked();
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &q, NULL), MAGPIE_ERR_IPC);
  assert_int_equal(magpie_ipc_import(&h, &q, NULL), MAGPIE_ERR_IPC);

  p = magpie_malloc(SMALL);
  assert_int_equal(magpie_ipc_export_compact(p, MAGPIE_IPC_HOLD, &c), MAGPIE_OK);
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK); /* the long form of the held export */
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_true(parked() >= SMALL); /* held for its first import */
  assert_int_equal(magpie_ipc_revoke(&h), MAGPIE_OK);
  wait_unparked(); /* the compact export's hold was the long one's */
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &q, NULL), MAGPIE_ERR_IPC);

  p = magpie_malloc(SMALL);
  assert_int_equal(magpie_ipc_export_compact(p, 0, &c), MAGPIE_OK);
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  assert_int_equal(magpie_ipc_revoke(&h), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &q, NULL), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "revoked"));
  assert_int_equal(magpie_ipc_export_compact(NULL, 0, &c), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_export_compact(p, 0x80, &c), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_export_compact(p, 0, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  wait_unparked();
}

/* Bytes that are not a compact handle (a CUDA handle's, a long handle's
 * first 64, noise) are told apart without any side effect; a compact
 * handle of another version, or with a wrong secret, is magpie's and is
 * refused as such. */
static void test_compact_told_apart(void **state) {
  (void)state;
  magpie_ipc_compact c, bad;
  magpie_ipc_handle h;
  void *q = (void *)1;
  assert_int_equal(magpie_ipc_is_compact(NULL), 0);
  memset(&bad, 0, sizeof bad);
  assert_int_equal(magpie_ipc_is_compact(&bad), 0);
  memset(&bad, 0xab, sizeof bad);
  assert_int_equal(magpie_ipc_is_compact(&bad), 0);
  assert_int_equal(magpie_ipc_import_compact(&bad, -1, &q, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_null(q);
  assert_non_null(strstr(magpie_last_error_message(), "not a magpie compact IPC handle"));
  assert_int_equal(magpie_ipc_import_compact(NULL, -1, &q, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  /* Noise, and noise behind magpie's tag (a CUDA handle that happened to
   * start with it): the check tells them apart. */
  for (int i = 0; i < 1000; i++) {
    assert_int_equal(getrandom(&bad, sizeof bad, 0), (ssize_t)sizeof bad);
    assert_int_equal(magpie_ipc_is_compact(&bad), 0);
    memcpy(bad.bytes, IPC_COMPACT_TAG, IPC_COMPACT_TAG_LEN);
    bad.bytes[IPC_COMPACT_TAG_LEN] = IPC_VERSION;
    assert_int_equal(magpie_ipc_is_compact(&bad), 0);
  }
  void *p = magpie_malloc(SMALL);
  stamp(p, SMALL, 43);
  assert_int_equal(magpie_ipc_export(p, 0, &h), MAGPIE_OK);
  memcpy(&bad, h.bytes, sizeof bad); /* the long handle's first 64 bytes */
  assert_int_equal(magpie_ipc_is_compact(&bad), 0);
  assert_int_equal(magpie_ipc_export_compact(p, 0, &c), MAGPIE_OK);
  assert_int_equal(magpie_ipc_is_compact(&c), 1);
  /* One bit changed anywhere: no longer a compact handle. */
  for (size_t i = 0; i < sizeof c.bytes; i++) {
    bad = c;
    bad.bytes[i] ^= 0x10;
    if (magpie_ipc_is_compact(&bad)) fail_msg("byte %zu changed, still a compact handle", i);
  }
  /* Another version, properly checked: magpie's, and refused as such. */
  ipc_compact_wire w;
  memcpy(&w, c.bytes, sizeof w);
  w.version = IPC_VERSION + 1;
  w.check = ipc_compact_check(&w);
  memcpy(bad.bytes, &w, sizeof w);
  assert_int_equal(magpie_ipc_is_compact(&bad), 1);
  assert_int_equal(magpie_ipc_import_compact(&bad, -1, &q, NULL), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "version"));
  /* A wrong secret, properly checked: no such export. */
  memcpy(&w, c.bytes, sizeof w);
  w.secret[0] ^= 1;
  w.check = ipc_compact_check(&w);
  memcpy(bad.bytes, &w, sizeof w);
  assert_int_equal(magpie_ipc_import_compact(&bad, -1, &q, NULL), MAGPIE_ERR_IPC);
  assert_non_null(strstr(magpie_last_error_message(), "no such export"));
  assert_int_equal(magpie_ipc_import_compact(&c, -5, &q, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_import_compact(&c, -1, NULL, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  /* The real one still works. */
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &q, NULL), MAGPIE_OK);
  assert_int_equal(stamped(q, SMALL, 43), SMALL);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  wait_unparked();
}

/* An importer that dies holding a compact import gives its hold back. */
static void test_compact_importer_dies(void **state) {
  (void)state;
  void *p = magpie_malloc(LARGE);
  magpie_ipc_compact c;
  assert_int_equal(magpie_ipc_export_compact(p, 0, &c), MAGPIE_OK);
  char hex[IPC_COMPACT_HEX_LEN], line[32];
  compact_to_hex(&c, hex);
  const char *args[] = {"hold-compact", hex, NULL};
  child ch = spawn_child(args, 1, 1);
  assert_non_null(fgets(line, sizeof line, ch.out));
  assert_string_equal(line, "imported\n");
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  assert_int_equal(magpie_trim(0, 0), MAGPIE_OK);
  assert_true(parked() >= LARGE); /* the child holds it */
  assert_int_equal(child_wait(&ch), 0);
  wait_unparked();
}

/* The importer's extra device (cudaIpcMemLazyEnablePeerAccess): the
 * import of device 0's block is accessible from it, and from no other
 * device; a device that cannot be connected, or does not exist, is
 * refused. */
static void test_compact_peer(void **state) {
  (void)state;
  void *p = magpie_malloc(LARGE), *q = NULL, *r = NULL;
  magpie_ipc_compact c;
  assert_int_equal(magpie_ipc_export_compact(p, 0, &c), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import_compact(&c, 1, &q, NULL), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(0, q, LARGE), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, q, LARGE), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(2, q, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &r, NULL), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, r, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_ipc_close(r, 0), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import_compact(&c, 0, &r, NULL), MAGPIE_OK); /* its own device: nothing more */
  assert_int_equal(magpie_sim_access_check(1, r, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_ipc_close(r, 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_peer_capable(0, 2, 0), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import_compact(&c, 2, &r, NULL), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_null(r);
  assert_int_equal(magpie_sim_set_peer_capable(0, 2, 1), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import_compact(&c, 99, &r, NULL), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  assert_int_equal(magpie_free(p), MAGPIE_OK);
  wait_unparked(); /* the refused imports hold nothing */
}

/* ------------------------------------------------------------ peer revocation */

/* Taken back: device 0's mappings, present (small and large) and future,
 * stop being accessible from device 1, and a device-1 kernel on them is
 * refused, as a GPU faults; granted again, they are accessible again.
 * An import made while granted keeps its rights. */
static void test_peer_revoke(void **state) {
  (void)state;
  assert_int_equal(magpie_device_disable_peer_access(0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_device_disable_peer_access(0, 99), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_device_disable_peer_access(0, 2), MAGPIE_OK); /* never granted: nothing to do */
  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
  void *small = magpie_malloc(SMALL), *large = magpie_malloc(LARGE), *q = NULL;
  assert_int_equal(magpie_sim_access_check(1, small, SMALL), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, large, LARGE), MAGPIE_OK);
  magpie_ipc_compact c;
  assert_int_equal(magpie_ipc_export_compact(large, 0, &c), MAGPIE_OK);
  assert_int_equal(magpie_ipc_import_compact(&c, -1, &q, NULL), MAGPIE_OK); /* mapped for device 0's peers */
  assert_int_equal(magpie_sim_access_check(1, q, LARGE), MAGPIE_OK);

  assert_int_equal(magpie_device_disable_peer_access(0, 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, small, SMALL), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, large, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(0, large, LARGE), MAGPIE_OK); /* its own device always */
  void *later = magpie_malloc(5 * LARGE);                                /* maps anew */
  assert_non_null(later);
  assert_int_equal(magpie_sim_access_check(1, later, 5 * LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, q, LARGE), MAGPIE_OK); /* the import keeps its rights */
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t s1 = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  int ran = 0;
  assert_int_equal(magpie_sim_launch_access(s1, set_flag, &ran, large, LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_device_disable_peer_access(0, 1), MAGPIE_OK); /* again: nothing changes */

  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, small, SMALL), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, later, 5 * LARGE), MAGPIE_OK);
  assert_int_equal(magpie_sim_launch_access(s1, set_flag, &ran, large, LARGE), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(ran, 1);
  assert_int_equal(magpie_sim_stream_destroy(s1), MAGPIE_OK);
  assert_int_equal(magpie_device_disable_peer_access(0, 1), MAGPIE_OK);
  assert_int_equal(magpie_ipc_close(q, 0), MAGPIE_OK);
  assert_int_equal(magpie_free(small), MAGPIE_OK);
  assert_int_equal(magpie_free(large), MAGPIE_OK);
  assert_int_equal(magpie_free(later), MAGPIE_OK);
  wait_unparked();
}

/* Threads that keep mapping and unmapping device 0's memory while access
 * is granted and taken back: once the last change returned, every
 * mapping has the rights it says, whichever the mappers saw (a mapping
 * made during a change is corrected under the region's peer lock). */
typedef struct mapper {
  atomic_int *stop;
  void *kept[4];
  int failed;
} mapper;

static void *mapper_main(void *arg) {
  mapper *m = arg;
  for (unsigned i = 0; !atomic_load(m->stop); i++) {
    size_t n = LARGE + (size_t)(i % 7) * 2 * MiB;
    void *p = magpie_malloc(n);
    if (p == NULL) {
      m->failed = 1;
      break;
    }
    if (m->kept[i % 4] != NULL && magpie_free(m->kept[i % 4]) != MAGPIE_OK) m->failed = 1;
    m->kept[i % 4] = p;
    if (i % 8 == 0) magpie_trim(0, 0); /* unmapped: the next allocations map */
  }
  return NULL;
}

static void test_peer_toggle_while_mapping(void **state) {
  (void)state;
  atomic_int stop = 0;
  mapper m[2] = {{.stop = &stop}, {.stop = &stop}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&t[i], NULL, mapper_main, &m[i]), 0);
  for (int round = 0; round < 200; round++) {
    assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
    assert_int_equal(magpie_device_disable_peer_access(0, 1), MAGPIE_OK);
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_join(t[i], NULL), 0);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(m[i].failed, 0);
    for (int k = 0; k < 4; k++)
      if (m[i].kept[k] != NULL)
        assert_int_equal(magpie_sim_access_check(1, m[i].kept[k], LARGE), MAGPIE_ERR_NO_PEER_ACCESS);
  }
  assert_int_equal(magpie_device_enable_peer_access(0, 1), MAGPIE_OK);
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 4; k++)
      if (m[i].kept[k] != NULL) assert_int_equal(magpie_sim_access_check(1, m[i].kept[k], LARGE), MAGPIE_OK);
  assert_int_equal(magpie_device_disable_peer_access(0, 1), MAGPIE_OK);
  for (int i = 0; i < 2; i++)
    for (int k = 0; k < 4; k++)
      if (m[i].kept[k] != NULL) assert_int_equal(magpie_free(m[i].kept[k]), MAGPIE_OK);
}

/* Without virtual memory management (MAGPIE_SIM_VMM=0, in a child): the
 * plain allocations are opened to the peer and closed again. */
static void test_peer_revoke_fallback(void **state) {
  (void)state;
  const char *args[] = {"peer-novmm", NULL};
  child c = spawn_child(args, 0, 0);
  assert_int_equal(child_wait(&c), 0);
}

static int peer_novmm_main(void) {
  void *p = magpie_malloc(LARGE);
  if (p == NULL) return 92;
  if (magpie_sim_access_check(1, p, LARGE) != MAGPIE_ERR_NO_PEER_ACCESS) return 93;
  if (magpie_device_enable_peer_access(0, 1) != MAGPIE_OK) return 94;
  if (magpie_sim_access_check(1, p, LARGE) != MAGPIE_OK) return 95;
  if (magpie_device_disable_peer_access(0, 1) != MAGPIE_OK) return 96;
  if (magpie_sim_access_check(1, p, LARGE) != MAGPIE_ERR_NO_PEER_ACCESS) return 97;
  void *later = magpie_malloc(3 * LARGE);
  if (later == NULL || magpie_sim_access_check(1, later, 3 * LARGE) != MAGPIE_ERR_NO_PEER_ACCESS) return 98;
  return magpie_free(p) == MAGPIE_OK && magpie_free(later) == MAGPIE_OK ? 0 : 99;
}

/* MAGPIE_CONF=ipc=0: memory is not exportable, and export says why. */
static void test_ipc_off(void **state) {
  (void)state;
  const char *args[] = {"ipc-off", NULL};
  child c = spawn_child(args, 0, 0);
  assert_int_equal(child_wait(&c), 0);
}

static int ipc_off_main(void) {
  void *p = magpie_malloc(SMALL);
  magpie_ipc_handle h;
  if (p == NULL) return 92;
  if (magpie_ipc_export(p, 0, &h) != MAGPIE_ERR_IPC) return 93;
  if (strstr(magpie_last_error_message(), "ipc=0") == NULL) return 94;
  return magpie_free(p) == MAGPIE_OK ? 0 : 95;
}

int main(int argc, char **argv) {
  setenv("MAGPIE_BACKEND", "sim", 1);
  setenv("MAGPIE_SIM_DEVICES", "3", 1);
  if (argc > 2 && strcmp(argv[1], "--ipc-child") == 0 && strcmp(argv[2], "ipc-off") == 0) {
    setenv("MAGPIE_CONF", "ipc=0", 1);
    return ipc_off_main();
  }
  if (argc > 2 && strcmp(argv[1], "--ipc-child") == 0 && strcmp(argv[2], "peer-novmm") == 0) {
    setenv("MAGPIE_SIM_VMM", "0", 1);
    return peer_novmm_main();
  }
  if (argc > 1 && strcmp(argv[1], "--ipc-child") == 0) return child_main(argc, argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_self_import),
      cmocka_unit_test(test_two_processes),
      cmocka_unit_test(test_free_while_imported),
      cmocka_unit_test(test_hold_and_revoke),
      cmocka_unit_test(test_importer_dies),
      cmocka_unit_test(test_exporter_dies),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_peer_access),
      cmocka_unit_test(test_peer_revoke),
      cmocka_unit_test(test_peer_toggle_while_mapping),
      cmocka_unit_test(test_peer_revoke_fallback),
      cmocka_unit_test(test_compact_two_processes),
      cmocka_unit_test(test_compact_is_the_same_export),
      cmocka_unit_test(test_compact_told_apart),
      cmocka_unit_test(test_compact_importer_dies),
      cmocka_unit_test(test_compact_peer),
      cmocka_unit_test(test_ipc_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
