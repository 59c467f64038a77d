/* Fault injection sweep over the simulated device (tests/fault_backend.c).
 *
 * One scenario (small and large blocks on three streams, magazines sealed
 * and reused across streams, a hand-off through a stream wait, a stream
 * destroyed with work pending and its handle reused) is first run without
 * faults, COUNTING_RUNS times, to count the backend calls it makes, per
 * operation: the fewest of those runs is the count. Then, for every
 * operation and every N up to its count, a child process runs the scenario
 * with the Nth call of that operation failing. Each child checks:
 *   - every failed allocator call returned a known error code with a
 *     message (a NULL block, or a free that kept the block allocated) and
 *     nothing crashed;
 *   - once faults stop, the blocks still held are freed, a fresh round of
 *     allocations on every stream succeeds, the stream-order checker found
 *     nothing, and all memory is accounted for: nothing in use, and magpie's
 *     reserved bytes equal the device memory in use.
 * Children run the scenario in a fresh process because magpie is set up
 * once per process. A few faults are never reached: whether a depot magazine
 * is ready (or a new slab is mapped) depends on when simulated work
 * completes, so a run may make fewer calls than the counting runs; the
 * sweep reports them and requires them to be rare (under a tenth; under
 * half in sanitizer builds, whose timing differs more). Event queries, slab
 * maps and stream waits vary most: from one fault-free run to the next,
 * 25-79, 14-26 and 6-19 of them. A single counting run that made many set
 * the sweep on calls that about half the runs never make. Under
 * ThreadSanitizer or AddressSanitizer each child costs about a hundred
 * times more, so those builds sweep every k-th call (about 6 per
 * operation); the plain build sweeps every call. Run by hand:
 * fault_test --child OP N (OP "none" counts). */
#include <setjmp.h>
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

#include "fault_backend.h"
#include "front/init.h"
#include "magpie.h"
#include "magpie_sim.h"
#include "sim/sim_internal.h"

extern char **environ;

#define MAXB 256
static void *held[MAXB];
static cudaStream_t held_s[MAXB];
static int nheld;
static int bad_errors;

static void nop(void *arg) { (void)arg; }

/* A failure must carry a code the caller can act on, and a message. */
static void check_error(const char *what) {
  int e = magpie_last_error();
  const char *m = magpie_last_error_message();
  if ((e != MAGPIE_ERR_BACKEND && e != MAGPIE_ERR_OUT_OF_MEMORY && e != MAGPIE_ERR_INVALID_STREAM) || m == NULL ||
      m[0] == '\0') {
    fprintf(stderr, "%s: unexpected error %d (%s)\n", what, e, m ? m : "(null)");
    bad_errors++;
  }
}

static void *alloc_on(size_t size, cudaStream_t s) {
  void *p = magpie_malloc_async(size, s);
  if (p == NULL) check_error("magpie_malloc_async");
  else if (nheld < MAXB) {
    held[nheld] = p;
    held_s[nheld++] = s;
  }
  return p;
}

/* Frees held[i] on s; a failed free keeps the block held. */
static void free_held(int i, cudaStream_t s) {
  if (magpie_free_async(held[i], s) != MAGPIE_OK) {
    check_error("magpie_free_async");
    held_s[i] = s;
    return;
  }
  held[i] = held[--nheld];
  held_s[i] = held_s[nheld];
}

static const size_t sizes[] = {256, 3000, 20000, ((size_t)1 << 20) + 5, (size_t)3 << 20};

static void scenario(cudaStream_t *st) {
  for (int round = 0; round < 3; round++) {
    cudaStream_t a = st[0], b = st[1];
    int first = nheld;
    for (int i = 0; i < 24; i++) alloc_on(sizes[i % 5], a);
    magpie_sim_launch(a, nop, NULL);
    /* Half freed on a, half handed to b (b waits for a) and freed there. */
    magpie_sim_stream_wait(b, a);
    for (int i = nheld - 1; i >= first; i--) free_held(i, (i & 1) ? b : a);
    for (int i = 0; i < 24; i++) alloc_on(sizes[(i + 2) % 5], b);
    for (int i = nheld - 1; i >= first; i--)
      if (held_s[i] == b) free_held(i, b);
    /* Stream c destroyed with work pending; its handle comes back. */
    for (int i = 0; i < 6; i++) alloc_on(sizes[i % 5], st[2]);
    magpie_sim_launch(st[2], nop, NULL);
    for (int i = nheld - 1; i >= first; i--)
      if (held_s[i] == st[2]) free_held(i, st[2]);
    for (int i = 0; i < nheld; i++)
      if (held_s[i] == st[2]) held_s[i] = NULL; /* freed later, on a */
    magpie_sim_stream_destroy(st[2]);
    st[2] = magpie_sim_stream_create();
    st[0] = b; /* swap roles */
    st[1] = a;
  }
}

static int child(const char *opname, uint64_t n, const char *count_file) {
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.magazine_bytes = 4096; /* small magazines: many seals, events, refills */
  if (global_init_slow(&cfg, fault_backend(backend_sim())) != MAGPIE_OK) {
    fprintf(stderr, "init: %s\n", magpie_last_error_message());
    return 2;
  }
  magpie_sim_check_enable(1);
  cudaStream_t st[3] = {magpie_sim_stream_create(), magpie_sim_stream_create(), magpie_sim_stream_create()};
  if (!st[0] || !st[1] || !st[2]) return 2;
  int op = strcmp(opname, "none") == 0 ? -1 : fault_op_from_name(opname);
  if (op < 0 && strcmp(opname, "none") != 0) return 2;
  fault_arm(op, n);
  scenario(st);
  fault_disarm();
  int fired = fault_fired();
  uint64_t calls[FAULT_OP_COUNT]; /* what the scenario made, for the sweep */
  for (int i = 0; i < FAULT_OP_COUNT; i++) calls[i] = fault_calls(i);
  /* Faults stop: everything still held can be freed (after a device
   * synchronize: some were last used on a stream destroyed since)... */
  magpie_sim_device_synchronize();
  for (int i = nheld - 1; i >= 0; i--) {
    cudaStream_t s = held_s[i] ? held_s[i] : st[0];
    if (magpie_free_async(held[i], s) != MAGPIE_OK) {
      fprintf(stderr, "free after faults: %s\n", magpie_last_error_message());
      return 3;
    }
  }
  nheld = 0;
  /* ... and the allocator works on every stream. */
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 10; i++) {
      void *p = magpie_malloc_async(sizes[i % 5], st[k]);
      if (p == NULL || magpie_free_async(p, st[k]) != MAGPIE_OK) {
        fprintf(stderr, "after faults, stream %d: %s\n", k, magpie_last_error_message());
        return 4;
      }
    }
  magpie_sim_device_synchronize();
  magpie_stats s;
  size_t dev_free = 0, dev_total = 0;
  if (magpie_stats_get(0, &s) != MAGPIE_OK || magpie_sim_mem_info(0, &dev_free, &dev_total) != MAGPIE_OK) return 5;
  int rc = 0;
  if (s.in_use_bytes != 0) {
    fprintf(stderr, "in use after everything was freed: %zu\n", s.in_use_bytes);
    rc = 6;
  }
  if (s.reserved_bytes != dev_total - dev_free) {
    fprintf(stderr, "magpie reserves %zu bytes but the device has %zu in use\n", s.reserved_bytes,
            dev_total - dev_free);
    rc = 7;
  }
  if (magpie_sim_check_violations() != 0) {
    char msg[512];
    magpie_sim_check_message(msg, sizeof msg);
    fprintf(stderr, "%s\n", msg);
    rc = 8;
  }
  if (bad_errors) rc = 9;
  if (count_file != NULL) {
    FILE *f = fopen(count_file, "w");
    if (f == NULL) return 10;
    for (int i = 0; i < FAULT_OP_COUNT; i++) fprintf(f, "%llu\n", (unsigned long long)calls[i]);
    fclose(f);
  }
  if (rc == 0 && op >= 0 && !fired) rc = 11; /* this run made fewer calls (timing decides some paths) */
  return rc;
}

static const char *self;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
static const int sanitized = 1;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
static const int sanitized = 1;
#else
static const int sanitized = 0;
#endif
#else
static const int sanitized = 0;
#endif
#define SANITIZED_RUNS 6 /* calls per operation swept in sanitizer builds */
#define COUNTING_RUNS 8  /* fault-free runs that count the calls to sweep */

static int spawn_child(const char *op, uint64_t n, const char *count_file) {
  char nbuf[32];
  snprintf(nbuf, sizeof nbuf, "%llu", (unsigned long long)n);
  char *argv[] = {(char *)self, "--child", (char *)op, nbuf, (char *)count_file, NULL};
  if (count_file == NULL) argv[4] = NULL;
  pid_t pid;
  if (posix_spawn(&pid, self, NULL, NULL, argv, environ) != 0) return -1;
  int status;
  if (waitpid(pid, &status, 0) != pid) return -1;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

static void test_fault_sweep(void **state) {
  (void)state;
  char count_file[512];
  const char *tmp = getenv("TEST_TMPDIR");
  snprintf(count_file, sizeof count_file, "%s/fault_counts", tmp ? tmp : "/tmp");
  /* Per operation, the fewest calls any counting run made: calls that
   * runs make under most timings of the simulated work. */
  uint64_t counts[FAULT_OP_COUNT];
  for (int i = 0; i < FAULT_OP_COUNT; i++) counts[i] = UINT64_MAX;
  for (int r = 0; r < COUNTING_RUNS; r++) {
    assert_int_equal(spawn_child("none", 0, count_file), 0);
    FILE *f = fopen(count_file, "r");
    assert_non_null(f);
    for (int i = 0; i < FAULT_OP_COUNT; i++) {
      unsigned long long c = 0;
      assert_int_equal(fscanf(f, "%llu", &c), 1);
      if (c < counts[i]) counts[i] = c;
    }
    fclose(f);
  }
  int runs = 0, failures = 0, missed = 0;
  for (int op = 0; op < FAULT_OP_COUNT; op++) {
    /* Under a sanitizer a child costs ~100x more: every stride-th call. */
    uint64_t stride = sanitized && counts[op] > SANITIZED_RUNS ? counts[op] / SANITIZED_RUNS : 1;
    for (uint64_t n = 1; n <= counts[op]; n += stride) {
      int rc = spawn_child(fault_op_name(op), n, NULL);
      runs++;
      if (rc == 11) {
        missed++;
        continue;
      }
      if (rc != 0) {
        failures++;
        print_error("fault in call %llu of %s: child exit %d\n", (unsigned long long)n, fault_op_name(op), rc);
      }
    }
    print_message("%-18s %4llu calls; made to fail once each: call 1, 1 + %llu, ...\n", fault_op_name(op),
                  (unsigned long long)counts[op], (unsigned long long)stride);
  }
  print_message(
      "%d faulty runs, %d failed, %d where the call did not come (a path that depends on when "
      "simulated work completes)\n",
      runs, failures, missed);
  /* Sanitizers stretch the timing, so more calls move. */
  assert_true(sanitized ? missed * 2 < runs : missed * 10 < runs);
  /* The scenario reaches the operations the sweep is about. */
  assert_true(counts[FAULT_MAP] + counts[FAULT_MEM_ALLOC] > 0 && counts[FAULT_EVENT_CREATE] > 0 &&
              counts[FAULT_EVENT_RECORD] > 0 && counts[FAULT_EVENT_QUERY] > 0 && counts[FAULT_STREAM_ID] > 0);
  assert_int_equal(failures, 0);
}

int main(int argc, char **argv) {
  self = argv[0];
  if (argc >= 4 && strcmp(argv[1], "--child") == 0)
    return child(argv[2], strtoull(argv[3], NULL, 10), argc >= 5 ? argv[4] : NULL);
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_fault_sweep)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
