/* Tests that run magpie on the simulated device with its stream-order
 * checker on: set-up, and the verdict on the violations since a point.
 * Include after <cmocka.h>. */
#ifndef MAGPIE_TESTS_CHECKER_UTIL_H
#define MAGPIE_TESTS_CHECKER_UTIL_H

#include <stdint.h>
#include <stdio.h>

#include "magpie.h"
#include "magpie_sim.h"

/* magpie on the simulated device with the checker on; 0, or 1 with the
 * reason printed (the test's main returns it). */
static inline int checker_init(void) {
  magpie_config cfg;
  magpie_config_default(&cfg);
  cfg.backend = MAGPIE_BACKEND_SIM;
  cfg.check_streams = 1;
  if (magpie_init(&cfg) != MAGPIE_OK || !magpie_sim_check_enabled()) {
    fprintf(stderr, "magpie_init: %s\n", magpie_last_error_message());
    return 1;
  }
  return 0;
}

/* No violation since the count was `before`; else the first one's
 * message, and the test fails. */
static inline void checker_expect_none(uint64_t before) {
  uint64_t v = magpie_sim_check_violations() - before;
  if (v != 0) {
    char msg[512];
    magpie_sim_check_message(msg, sizeof msg);
    print_error("%llu stream-order violations; first: %s\n", (unsigned long long)v, msg);
  }
  assert_int_equal(v, 0);
}

#endif /* MAGPIE_TESTS_CHECKER_UTIL_H */
