/* fork() while magpie runs on the simulated device: worker threads churn
 * streams whose cached blocks go to limbo (so the maintenance thread is
 * often inside a device synchronisation) and allocate small and large
 * blocks (so their locks are often held), while the main thread forks
 * children. Each child must get a clear error from every magpie and
 * simulator call (as a child cannot use its parent's CUDA context) and
 * exit promptly; the parent must go on unaffected. Before the fork
 * handlers, children hung in exit (the maintenance thread's busy flag,
 * inherited without the thread) or in a lock held by a parent thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "magpie.h"
#include "magpie_sim.h"

#define CHILDREN 24

static atomic_int stop;

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void slow_work(void *arg) {
  (void)arg;
  sleep_ms(3);
}

/* A short-lived thread: blocks cached on a stream with slow work, the
 * stream destroyed, the thread gone: its magazines go to limbo, which the
 * maintenance thread drains with a device synchronisation. */
static void *churn_once(void *arg) {
  (void)arg;
  cudaStream_t s = magpie_sim_stream_create();
  if (s == NULL) return NULL;
  void *p[16];
  for (int i = 0; i < 16; i++) p[i] = magpie_malloc_async((size_t)256 << (i % 8), s);
  magpie_sim_launch(s, slow_work, NULL);
  for (int i = 0; i < 16; i++)
    if (p[i]) magpie_free_async(p[i], s);
  magpie_sim_stream_destroy(s);
  return NULL;
}

static void *churner(void *arg) {
  (void)arg;
  while (!atomic_load(&stop)) {
    pthread_t t;
    if (pthread_create(&t, NULL, churn_once, NULL) == 0) pthread_join(t, NULL);
  }
  return NULL;
}

static void *large_user(void *arg) {
  (void)arg;
  cudaStream_t s = magpie_sim_stream_create();
  while (!atomic_load(&stop)) {
    void *p = magpie_malloc_async((size_t)3 << 20, s);
    if (p) magpie_free_async(p, s);
  }
  magpie_sim_stream_synchronize(s);
  magpie_sim_stream_destroy(s);
  return NULL;
}

/* The child: every call fails with a message that says why; then exit. */
static int child_main(cudaStream_t parent_stream, void *parent_block) {
  int bad = 0;
  /* A refusal met first in a simulator call: magpie's last error already
   * says why (the child's state is that refusal from the fork on). */
  bad |= magpie_sim_stream_create() != NULL;
  bad |= magpie_last_error() != MAGPIE_ERR_NO_DEVICE || strstr(magpie_last_error_message(), "fork") == NULL;
  void *p = magpie_malloc_async(100, parent_stream);
  bad |=
      p != NULL || magpie_last_error() != MAGPIE_ERR_NO_DEVICE || strstr(magpie_last_error_message(), "fork") == NULL;
  bad |= magpie_malloc(1000) != NULL;
  bad |= magpie_free_async(parent_block, parent_stream) != MAGPIE_ERR_NO_DEVICE;
  bad |= magpie_trim(0, 0) != MAGPIE_ERR_NO_DEVICE;
  magpie_stats st;
  bad |= magpie_stats_get(0, &st) != MAGPIE_ERR_NO_DEVICE;
  magpie_config c;
  magpie_config_default(&c);
  bad |= magpie_init(&c) != MAGPIE_ERR_NO_DEVICE;
  /* The simulator's streams are the parent's threads: an error, not a
   * hang. */
  bad |= magpie_sim_launch(parent_stream, slow_work, NULL) != MAGPIE_ERR_NO_DEVICE;
  bad |= magpie_sim_stream_synchronize(parent_stream) != MAGPIE_ERR_NO_DEVICE;
  bad |= magpie_sim_stream_create() != NULL;
  bad |= magpie_sim_device_synchronize() != MAGPIE_ERR_NO_DEVICE;
  if (bad) fprintf(stderr, "child: %s / %s\n", magpie_last_error_message(), magpie_sim_last_error_message());
  return bad ? 3 : 0;
}

static void test_fork_while_running(void **state) {
  (void)state;
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  void *mine = magpie_malloc_async(4096, s);
  assert_non_null(mine);
  pthread_t w[3];
  assert_int_equal(pthread_create(&w[0], NULL, churner, NULL), 0);
  assert_int_equal(pthread_create(&w[1], NULL, churner, NULL), 0);
  assert_int_equal(pthread_create(&w[2], NULL, large_user, NULL), 0);
  int hung = 0, failed = 0;
  for (int i = 0; i < CHILDREN; i++) {
    sleep_ms(7);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) _exit(child_main(s, mine));
    /* A child has 5 s to finish; one that hangs is killed and counted. */
    int status = 0, done = 0;
    for (int t = 0; t < 500 && !done; t++) {
      if (waitpid(pid, &status, WNOHANG) == pid) done = 1;
      else sleep_ms(10);
    }
    if (!done) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      hung++;
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed++;
    }
    /* The parent is unaffected: it allocates and frees as before. */
    void *p = magpie_malloc_async(1000, s);
    assert_non_null(p);
    assert_int_equal(magpie_free_async(p, s), MAGPIE_OK);
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < 3; i++) pthread_join(w[i], NULL);
  assert_int_equal(magpie_free_async(mine, s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_destroy(s), MAGPIE_OK);
  printf("  %d children: %d hung, %d failed\n", CHILDREN, hung, failed);
  assert_int_equal(hung, 0);
  assert_int_equal(failed, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fork_while_running),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
