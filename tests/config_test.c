/* One check for every configuration, from MAGPIE_CONF or magpie_init: each
 * case runs in a child process of its own (set-up happens once per
 * process), reports the result code and message through a pipe, and the
 * parent, which never sets magpie up, checks them. Every rejected case was
 * accepted (or failed later with an unhelpful message) before. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "magpie.h"

typedef struct outcome {
  int rc;
  char msg[512];
} outcome;

/* In a child: MAGPIE_CONF = conf (NULL: unset), MAGPIE_SIM_MEMORY = mem
 * (NULL: unset); then magpie_init(cfg) if edit is given (the defaults,
 * edited), else set-up on first use through one allocation. */
static outcome run_case(const char *conf, const char *mem, void (*edit)(magpie_config *)) {
  int fd[2];
  assert_int_equal(pipe(fd), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fd[0]);
    if (conf) setenv("MAGPIE_CONF", conf, 1);
    else unsetenv("MAGPIE_CONF");
    if (mem) setenv("MAGPIE_SIM_MEMORY", mem, 1);
    outcome o = {0};
    if (edit != NULL) {
      magpie_config c;
      magpie_config_default(&c);
      edit(&c);
      o.rc = magpie_init(&c);
    }
    if (o.rc == MAGPIE_OK) {
      void *p = magpie_malloc(100);
      o.rc = p != NULL ? magpie_free(p) : magpie_last_error();
    }
    snprintf(o.msg, sizeof o.msg, "%s", o.rc == MAGPIE_OK ? "" : magpie_last_error_message());
    ssize_t w = write(fd[1], &o, sizeof o);
    _exit(w == (ssize_t)sizeof o ? 0 : 1);
  }
  close(fd[1]);
  outcome o = {.rc = -1};
  ssize_t r = read(fd[0], &o, sizeof o);
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  assert_true(r == (ssize_t)sizeof o);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return o;
}

static void expect_config_error(outcome o, const char *a, const char *b) {
  if (o.rc != MAGPIE_ERR_CONFIG || strstr(o.msg, a) == NULL || (b && strstr(o.msg, b) == NULL))
    fail_msg("expected a configuration error naming '%s'%s%s, got %d: %s", a, b ? " and " : "", b ? b : "", o.rc,
             o.msg);
}

static void test_negative_sizes_rejected(void **state) {
  (void)state;
  expect_config_error(run_case("limit=-1", NULL, NULL), "limit", "-1");
  expect_config_error(run_case("magazine_bytes=-1", NULL, NULL), "magazine_bytes", NULL);
  expect_config_error(run_case("release_threshold=-1", NULL, NULL), "release_threshold", NULL);
  expect_config_error(run_case("slow_call_ms=+5", NULL, NULL), "slow_call_ms", NULL);
}

static void test_spaces_alike_before_and_after(void **state) {
  (void)state;
  assert_int_equal(run_case("limit= 64m", NULL, NULL).rc, MAGPIE_OK);
  assert_int_equal(run_case("limit=64m ", NULL, NULL).rc, MAGPIE_OK);
  assert_int_equal(run_case(" limit = 64m , check = 1 ", NULL, NULL).rc, MAGPIE_OK);
}

static void test_limit_below_the_mapping_unit(void **state) {
  (void)state;
  expect_config_error(run_case("limit=1", NULL, NULL), "limit=1 ", "2097152");
  expect_config_error(run_case("limit=1m", NULL, NULL), "limit=1048576", "2 MiB");
  assert_int_equal(run_case("limit=2m", NULL, NULL).rc, MAGPIE_OK);
}

static void test_magazine_bytes_range(void **state) {
  (void)state;
  expect_config_error(run_case("magazine_bytes=1", NULL, NULL), "magazine_bytes=1", "256");
  expect_config_error(run_case("magazine_bytes=1g", NULL, NULL), "magazine_bytes", "64 MiB");
  assert_int_equal(run_case("magazine_bytes=256", NULL, NULL).rc, MAGPIE_OK);
}

static void test_sim_memory_below_granularity(void **state) {
  (void)state;
  outcome o = run_case(NULL, "1m", NULL);
  if (strstr(o.msg, "MAGPIE_SIM_MEMORY") == NULL || strstr(o.msg, "granularity") == NULL)
    fail_msg("expected an error naming MAGPIE_SIM_MEMORY and the granularity, got %d: %s", o.rc, o.msg);
  assert_int_equal(run_case(NULL, "2m", NULL).rc, MAGPIE_OK);
}

static void percent_500(magpie_config *c) { c->limit_percent = 500; }
static void percent_50(magpie_config *c) { c->limit_percent = 50; }
static void magazine_1(magpie_config *c) { c->magazine_bytes = 1; }
static void check_2(magpie_config *c) { c->check = 2; }
static void limit_1(magpie_config *c) { c->limit = 1; }
static void both_limits(magpie_config *c) {
  c->limit = (size_t)64 << 20;
  c->limit_percent = 50;
}

/* magpie_init goes through the same check as MAGPIE_CONF. */
static void test_magpie_init_checked_alike(void **state) {
  (void)state;
  expect_config_error(run_case(NULL, NULL, percent_500), "magpie_init", "limit_percent=500");
  expect_config_error(run_case(NULL, NULL, magazine_1), "magpie_init", "magazine_bytes=1");
  expect_config_error(run_case(NULL, NULL, check_2), "magpie_init", "check=2");
  expect_config_error(run_case(NULL, NULL, limit_1), "magpie_init", "2 MiB");
  expect_config_error(run_case(NULL, NULL, both_limits), "magpie_init", "set one of them");
  assert_int_equal(run_case(NULL, NULL, percent_50).rc, MAGPIE_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_negative_sizes_rejected),      cmocka_unit_test(test_spaces_alike_before_and_after),
      cmocka_unit_test(test_limit_below_the_mapping_unit), cmocka_unit_test(test_magazine_bytes_range),
      cmocka_unit_test(test_sim_memory_below_granularity), cmocka_unit_test(test_magpie_init_checked_alike),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
