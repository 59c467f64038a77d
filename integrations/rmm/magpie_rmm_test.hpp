/* What RMM's tests built against magpie (integrations/rmm/build.sh) share:
 * the switch to RMM's own resources for a baseline, and the upstream
 * resource of RMM's adaptor fixtures (cpp/tests/mr/mr_ref_<adaptor>_tests.cpp),
 * which build.sh points here instead of at a cuda_memory_resource of their
 * own. */
#ifndef MAGPIE_RMM_TEST_HPP
#define MAGPIE_RMM_TEST_HPP

#include <magpie_rmm.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/resource_ref.hpp>

#include <cstdlib>
#include <cstring>

namespace magpie_rmm_test {

/* MAGPIE_RMM_BASELINE=1: the tests run on RMM's own resources, as upstream. */
inline bool baseline() {
  static bool const on = [] {
    char const *v = std::getenv("MAGPIE_RMM_BASELINE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

/* The adaptor fixtures' upstream: magpie's resource, or under the baseline
 * the cuda_memory_resource the fixtures have upstream. Both live as long as
 * the program, so that no fixture refers to a resource a test replaced
 * (as one referring to the current device resource would). */
inline rmm::device_async_resource_ref upstream() {
  static magpie::rmm_memory_resource magpie_mr;
  static rmm::mr::cuda_memory_resource cuda_mr;
  if (baseline()) return rmm::device_async_resource_ref{cuda_mr};
  return rmm::device_async_resource_ref{magpie_mr};
}

} // namespace magpie_rmm_test

#endif /* MAGPIE_RMM_TEST_HPP */
