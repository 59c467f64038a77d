/* RMM's parameterized memory-resource suites (cpp/tests/mr/mr_ref_test*.hpp)
 * on magpie's resource, instantiated as RMM's mr_ref_cuda_async_tests.cpp
 * does for "CUDA_Async". The "Magpie" name is added to RMM's
 * mr_factory_dispatch by integrations/rmm/build.sh, in its build copy of the
 * RMM sources. */
#include "mr_ref_test_allocation.hpp"
#include "mr_ref_test_basic.hpp"
#include "mr_ref_test_mt.hpp"

namespace rmm::test {
namespace {

INSTANTIATE_TEST_SUITE_P(MagpieResourceTests, mr_ref_test, ::testing::Values("Magpie"),
                         [](auto const &info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(MagpieResourceAllocationTests, mr_ref_allocation_test, ::testing::Values("Magpie"),
                         [](auto const &info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(MagpieMultiThreadResourceTests, mr_ref_test_mt, ::testing::Values("Magpie"),
                         [](auto const &info) { return info.param; });

} // namespace
} // namespace rmm::test
