/* The failure path of MAGPIE_ASSERT (assert.h): debug builds only. */
#include "base/assert.h"

#include <stdio.h>
#include <stdlib.h>

void assert_fail(const char *cond, const char *file, int line, const char *func) {
  fprintf(stderr, "magpie: invariant broken at %s:%d (%s): %s\n", file, line, func, cond);
  fflush(stderr);
  abort();
}
