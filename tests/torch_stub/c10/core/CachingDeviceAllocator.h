// The part of PyTorch's c10 that python/magpie/torch_stats.h uses, for
// torch_stats_test.cpp: the test builds where PyTorch is not installed.
// Names, types and order as PyTorch 2.11 declares them (the statistics a
// device allocator reports); the fields torch_stats.h leaves alone are
// left out.
#ifndef MAGPIE_TEST_TORCH_STUB_CACHING_DEVICE_ALLOCATOR_H
#define MAGPIE_TEST_TORCH_STUB_CACHING_DEVICE_ALLOCATOR_H

#include <array>
#include <cstddef>
#include <cstdint>

namespace c10 {
namespace CachingAllocator {
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
};
enum struct StatType : uint64_t { AGGREGATE = 0, SMALL_POOL = 1, LARGE_POOL = 2, NUM_TYPES = 3 };
using StatArray = std::array<Stat, static_cast<size_t>(StatType::NUM_TYPES)>;
} // namespace CachingAllocator

namespace CachingDeviceAllocator {
using c10::CachingAllocator::StatArray;
struct DeviceStats {
  StatArray allocation;
  StatArray segment;
  StatArray active;
  StatArray inactive_split;
  StatArray allocated_bytes;
  StatArray reserved_bytes;
  StatArray active_bytes;
  StatArray inactive_split_bytes;
  StatArray requested_bytes;
};
} // namespace CachingDeviceAllocator
} // namespace c10

#endif
