/* The gtest main of RMM's memory-resource tests built against magpie
 * (integrations/rmm/build.sh). In place of RMM's gtest_main/gmock_main, it
 * makes magpie's resource (include/magpie_rmm.hpp) RMM's current device
 * resource for the current device before the tests run, so that every test
 * taking rmm::mr::get_current_device_resource_ref() as its upstream runs on
 * magpie.
 *
 * Some of RMM's tests set or reset the current device resource and leave
 * RMM's initial one (cuda_memory_resource) behind; a listener sets magpie's
 * again before each test, so that no test's upstream depends on the order
 * the tests run in.
 *
 *   MAGPIE_RMM_BASELINE=1   leave RMM's default (cuda_memory_resource) as the
 *                           current device resource, and give the adaptor
 *                           fixtures their cuda_memory_resource back
 *                           (magpie_rmm_test.hpp): the same binary gives the
 *                           baseline to compare with. (The "Magpie" suites
 *                           of rmm_mr_tests stay on magpie.)
 *
 * Listing the tests (--gtest_list_tests) needs no GPU. Otherwise, without a
 * CUDA device, or where magpie would serve allocations from its simulated
 * device, the program says so and exits with status 1 instead of running
 * tests that cannot pass. */
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <magpie_rmm.hpp>
#include <rmm/mr/per_device_resource.hpp>

#include <cstdio>
#include <exception>

#include "magpie_rmm_test.hpp"

namespace {

void set_magpie_current() { rmm::mr::set_current_device_resource(magpie::rmm_memory_resource{}); }

class magpie_current_listener : public ::testing::EmptyTestEventListener {
  void OnTestStart(::testing::TestInfo const &) override { set_magpie_current(); }
};

} // namespace

int main(int argc, char **argv) {
  /* InitGoogleMock also takes gtest's flags; some of RMM's tests use gmock. */
  ::testing::InitGoogleMock(&argc, argv);
  if (GTEST_FLAG_GET(list_tests)) return RUN_ALL_TESTS();

  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "magpie-rmm: no CUDA device (%s); RMM's tests need one\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 1;
  }
  int device = 0;
  e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "magpie-rmm: cudaGetDevice: %s\n", cudaGetErrorString(e));
    return 1;
  }

  if (magpie_rmm_test::baseline()) {
    std::printf("magpie-rmm: MAGPIE_RMM_BASELINE=1: current device resource of device %d is RMM's default\n", device);
    return RUN_ALL_TESTS();
  }

  /* magpie picks its backend itself (MAGPIE_BACKEND, else CUDA when a device
   * is present); tests of RMM on its simulated device would compare CUDA's
   * view of memory with addresses CUDA never handed out. */
  int backend = magpie_active_backend();
  if (backend != MAGPIE_BACKEND_CUDA) {
    std::fprintf(stderr, "magpie-rmm: magpie is not on its CUDA backend (backend %d%s%s)\n", backend,
                 backend < 0 ? ": " : "", backend < 0 ? magpie_last_error_message() : "");
    return 1;
  }
  try {
    set_magpie_current();
  } catch (std::exception const &ex) {
    std::fprintf(stderr, "magpie-rmm: setting magpie as the current device resource: %s\n", ex.what());
    return 1;
  }
  ::testing::UnitTest::GetInstance()->listeners().Append(new magpie_current_listener);
  std::printf("magpie-rmm: current device resource of device %d is magpie::rmm_memory_resource\n", device);
  return RUN_ALL_TESTS();
}
