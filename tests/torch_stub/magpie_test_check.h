// The checks of the tests built against these stand-ins (torch_pools_test,
// torch_stats_test): a failed check is printed and counted and the test
// goes on; check_report prints the outcome and gives main's exit status.
#ifndef MAGPIE_TEST_TORCH_STUB_CHECK_H
#define MAGPIE_TEST_TORCH_STUB_CHECK_H

#include <cstdio>

namespace magpie_test {
inline int &failures() {
  static int n;
  return n;
}
inline int check_report(const char *test) {
  std::printf("%s: %s (%d failed checks)\n", test, failures() == 0 ? "OK" : "FAILED", failures());
  return failures() == 0 ? 0 : 1;
}
} // namespace magpie_test

// CHECK(condition): a condition with commas needs no extra parentheses.
#define CHECK(...)                                                                \
  do {                                                                            \
    if (!(__VA_ARGS__)) {                                                         \
      magpie_test::failures()++;                                                  \
      std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #__VA_ARGS__); \
    }                                                                             \
  } while (0)

#endif
