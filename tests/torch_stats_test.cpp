// python/magpie/torch_stats.h, PyTorch's statistics of the blocks magpie's
// allocator hands to PyTorch, built against stand-ins of PyTorch's headers
// (tests/torch_stub): each figure's current value, peak and running totals
// per pool (all, small, large) on one thread, exact peaks on one thread
// (counts and bytes each, and each pool's), resets, devices apart, threads whose counters
// are summed and folded in when they end, blocks freed by another thread,
// and blocks freed after the thread's counters were destroyed.
#include <cstdio>
#include <thread>
#include <vector>

#include "magpie_test_check.h"
#include "torch_stats.h"

namespace {

using magpie_torch::Stats;
using DeviceStats = c10::CachingDeviceAllocator::DeviceStats;
constexpr int kAll = 0, kSmall = 1, kLarge = 2;
constexpr size_t kMiB = (size_t)1 << 20;

// Each thread's Local, as torch_native.cpp keeps it (zero-initialised).
Stats::Local &local() {
  static thread_local Stats::Local l;
  return l;
}

DeviceStats figures(Stats &s, int device) {
  DeviceStats out;
  s.fill(device, out);
  return out;
}

void test_one_thread() {
  Stats &s = *new Stats;
  s.alloc(local(), 0, 512, 100);
  s.alloc(local(), 0, 2 * kMiB, 2 * kMiB - 10);
  DeviceStats d = figures(s, 0);
  CHECK(d.allocation[kAll].current == 2 && d.allocation[kSmall].current == 1 && d.allocation[kLarge].current == 1);
  CHECK(d.allocated_bytes[kAll].current == (int64_t)(512 + 2 * kMiB));
  CHECK(d.allocated_bytes[kSmall].current == 512 && d.allocated_bytes[kLarge].current == (int64_t)(2 * kMiB));
  CHECK(d.requested_bytes[kAll].current == (int64_t)(100 + 2 * kMiB - 10));
  CHECK(d.active_bytes[kAll].current == d.allocated_bytes[kAll].current && d.active[kAll].current == 2);
  s.free(local(), 0, 2 * kMiB, 2 * kMiB - 10);
  d = figures(s, 0);
  CHECK(d.allocation[kAll].current == 1 && d.allocation[kAll].peak == 2);
  CHECK(d.allocation[kAll].allocated == 2 && d.allocation[kAll].freed == 1);
  CHECK(d.allocated_bytes[kLarge].current == 0 && d.allocated_bytes[kLarge].peak == (int64_t)(2 * kMiB));
  CHECK(d.allocated_bytes[kAll].peak == (int64_t)(512 + 2 * kMiB));
  CHECK(d.allocated_bytes[kLarge].freed == (int64_t)(2 * kMiB));

  // The count's peak passes while the bytes' does not: one block of 1 MiB
  // freed, two of 512 KiB allocated.
  s.alloc(local(), 0, kMiB, kMiB);
  s.free(local(), 0, kMiB, kMiB);
  s.alloc(local(), 0, kMiB / 2, kMiB / 2);
  s.alloc(local(), 0, kMiB / 2, kMiB / 2);
  d = figures(s, 0);
  CHECK(d.allocation[kAll].current == 3 && d.allocation[kAll].peak == 3);
  CHECK(d.allocation[kSmall].peak == 3);
  CHECK(d.allocated_bytes[kSmall].peak == (int64_t)(512 + kMiB) &&
        d.allocated_bytes[kSmall].current == d.allocated_bytes[kSmall].peak);
  CHECK(d.allocated_bytes[kAll].peak == (int64_t)(512 + 2 * kMiB)); // the large block's time

  // reset_peak_memory_stats: the peaks restart at the current figures.
  s.reset_peaks(0);
  d = figures(s, 0);
  CHECK(d.allocated_bytes[kAll].peak == d.allocated_bytes[kAll].current && d.allocation[kAll].peak == 3);
  s.alloc(local(), 0, 1024, 1000);
  d = figures(s, 0);
  CHECK(d.allocation[kAll].peak == 4 && d.allocated_bytes[kAll].peak == (int64_t)(512 + kMiB + 1024));
  s.free(local(), 0, 1024, 1000);

  // reset_accumulated_memory_stats: allocated and freed restart at 0.
  s.reset_accumulated(0);
  d = figures(s, 0);
  CHECK(d.allocation[kAll].allocated == 0 && d.allocation[kAll].freed == 0 && d.allocation[kAll].current == 3);
  s.free(local(), 0, kMiB / 2, kMiB / 2);
  d = figures(s, 0);
  CHECK(d.allocation[kAll].freed == 1 && d.allocated_bytes[kSmall].freed == (int64_t)(kMiB / 2));

  // Another device keeps its own figures; the thread goes back and forth.
  s.alloc(local(), 1, 4096, 4000);
  s.alloc(local(), 0, 4096, 4000);
  s.free(local(), 1, 4096, 4000);
  DeviceStats d0 = figures(s, 0), d1 = figures(s, 1);
  CHECK(d0.allocation[kAll].current == 3 && d1.allocation[kAll].current == 0);
  CHECK(d1.allocation[kAll].allocated == 1 && d1.allocation[kAll].freed == 1 && d1.allocated_bytes[kAll].peak == 4096);
  CHECK(d0.requested_bytes[kAll].current == (int64_t)(100 + kMiB / 2 + 4000));
  // A device outside the table is not counted, nor refused.
  // The devices are volatile: with them known, gcc warns of an access past
  // the table on the path the range check closes.
  volatile int outside[] = {64, -1};
  for (int device : outside) {
    s.alloc(local(), device, 4096, 4096);
    DeviceStats o = figures(s, device);
    CHECK(o.allocation[kAll].current == 0);
  }
  CHECK(figures(s, 0).allocation[kAll].current == 3);
}

// A pool's peak passes while the sum's does not: the small pool grows
// after a large block went.
void test_pool_peak() {
  Stats &s = *new Stats;
  s.alloc(local(), 0, 2 * kMiB, 2 * kMiB);
  s.free(local(), 0, 2 * kMiB, 2 * kMiB);
  s.alloc(local(), 0, 512, 512);
  s.free(local(), 0, 512, 512);
  DeviceStats d = figures(s, 0);
  CHECK(d.allocated_bytes[kSmall].peak == 512 && d.allocation[kSmall].peak == 1);
  CHECK(d.allocated_bytes[kAll].peak == (int64_t)(2 * kMiB) && d.allocated_bytes[kSmall].current == 0);
}

// Threads with blocks of their own, summed while they run and folded into
// the retired totals when they end; peaks while the others stand still.
void test_threads() {
  Stats &s = *new Stats;
  constexpr int kThreads = 4, kBlocks = 100;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; t++)
    ts.emplace_back([&s] {
      for (int i = 0; i < kBlocks; i++) s.alloc(local(), 0, 4096, 4000);
      for (int i = 0; i < kBlocks / 2; i++) s.free(local(), 0, 4096, 4000);
    });
  for (auto &t : ts) t.join();
  DeviceStats d = figures(s, 0);
  CHECK(d.allocation[kAll].current == kThreads * kBlocks / 2);
  CHECK(d.allocation[kAll].allocated == kThreads * kBlocks && d.allocation[kAll].freed == kThreads * kBlocks / 2);
  CHECK(d.allocated_bytes[kSmall].current == (int64_t)kThreads * kBlocks / 2 * 4096);
  CHECK(d.allocation[kAll].peak >= kBlocks && d.allocation[kAll].peak <= kThreads * kBlocks);
  // The others' blocks stand still: this thread's allocations pass the
  // device's peak exactly.
  s.reset_peaks(0);
  for (int i = 0; i < 3; i++) s.alloc(local(), 0, 4096, 4000);
  d = figures(s, 0);
  CHECK(d.allocation[kAll].peak == kThreads * kBlocks / 2 + 3);
}

// Blocks one thread allocates and another frees: the freeing thread's
// figures go below zero, the sums stay right.
void test_cross_thread_free() {
  Stats &s = *new Stats;
  std::thread a([&s] {
    for (int i = 0; i < 10; i++) s.alloc(local(), 0, 2 * kMiB, 2 * kMiB);
  });
  a.join();
  std::thread b([&s] {
    for (int i = 0; i < 10; i++) s.free(local(), 0, 2 * kMiB, 2 * kMiB);
  });
  b.join();
  DeviceStats d = figures(s, 0);
  CHECK(d.allocation[kLarge].current == 0 && d.allocation[kLarge].allocated == 10 && d.allocation[kLarge].freed == 10);
  CHECK(d.allocated_bytes[kAll].peak == (int64_t)(20 * kMiB));
}

// A block freed by a thread-local destructor that runs after the thread's
// counters were folded in (it was made before them, so it is destroyed
// after them) still counts.
struct LateFree {
  Stats *s = nullptr;
  ~LateFree() {
    if (s != nullptr) s->free(local(), 0, 4096, 4096);
  }
};

void test_late_free() {
  Stats &s = *new Stats;
  std::thread t([&s] {
    static thread_local LateFree late;
    late.s = &s;
    s.alloc(local(), 0, 4096, 4096);
    s.alloc(local(), 0, 4096, 4096);
    s.free(local(), 0, 4096, 4096);
  });
  t.join();
  DeviceStats d = figures(s, 0);
  CHECK(d.allocation[kAll].current == 0 && d.allocation[kAll].freed == 2 && d.allocation[kAll].allocated == 2);
  CHECK(d.allocated_bytes[kAll].current == 0 && d.requested_bytes[kAll].current == 0);
}

// Each test on a thread of its own: a thread's Local and its counters
// serve one Stats, as torch_native.cpp has one.
void run(void (*test)()) {
  std::thread t(test);
  t.join();
}

} // namespace

int main() {
  run(test_one_thread);
  run(test_pool_peak);
  run(test_threads);
  run(test_cross_thread_free);
  run(test_late_free);
  return magpie_test::check_report("torch_stats_test");
}
