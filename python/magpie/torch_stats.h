// PyTorch's memory statistics of the blocks magpie's allocator hands to
// PyTorch (torch_native.cpp): allocated, active and requested bytes and
// the allocation and active-block counts, each with PyTorch's four figures
// (current, peak, allocated and freed since the last reset), for all
// blocks and split into PyTorch's small pool (1 MiB and under) and large
// pool. Included by torch_native.cpp only.
//
// Kept per thread, so that the allocation path writes only its own cache
// lines: each thread's counters are written by that thread alone
// (relaxed loads and stores, no read-modify-write) and summed by readers.
// A thread leaving folds its counters into the retired totals.
//
// Peaks: a thread sums every thread's figures (and raises the device's
// peaks to them) when its own figure passes its mark: its own figure at
// its last sum plus the room the peak then left above the sum. While the
// other threads' figures stand still the device's figure passes its peak
// exactly when this thread passes its mark, so in one thread the peaks are
// exact; across threads, growth of several threads each within its room
// may pass the peak unseen. Checking every allocation against the
// device's figure would need one shared counter, which the allocation
// path of 16 threads would contend on. A thread whose blocks other threads
// free sees its own figure only grow, so it sums each time it has
// allocated the room the peak left (near the peak, at most allocations).
//
// Bytes are counted as PyTorch's allocator counts them: a request rounded
// up to 512 bytes, the memory torch.cuda.memory_allocated documents as
// occupied by tensors. The device memory magpie holds for them (its size
// classes and segments) is in magpie's own figures ("magpie.*": in_use,
// reserved) and in reserved_bytes.
//
// Active bytes equal allocated bytes here: magpie's free is at once from
// PyTorch's view (a block recorded on another stream waits inside magpie,
// which its own figures, "magpie.*", count).
#ifndef MAGPIE_TORCH_STATS_H
#define MAGPIE_TORCH_STATS_H

#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace magpie_torch {

class Stats {
 public:
  static constexpr int kDevices = 64;

  // A block of bytes (requested: what was asked) handed out on device.
  void alloc(int device, size_t bytes, size_t requested) { change(device, bytes, requested, +1); }
  void free(int device, size_t bytes, size_t requested) { change(device, bytes, requested, -1); }

  // The figures of device into out's allocation, active, allocated_bytes,
  // active_bytes and requested_bytes.
  void fill(int device, c10::CachingDeviceAllocator::DeviceStats &out) {
    if (device < 0 || device >= kDevices) return;
    int64_t sum[kFields];
    total(device, sum);
    Device &d = devices_[device];
    for (int p = 0; p < kPools; p++) {
      fill_stat(out.allocation[p], d, sum, p, kCount);
      fill_stat(out.active[p], d, sum, p, kCount);
      fill_stat(out.allocated_bytes[p], d, sum, p, kBytes);
      fill_stat(out.active_bytes[p], d, sum, p, kBytes);
      fill_stat(out.requested_bytes[p], d, sum, p, kRequested);
    }
  }

  // torch.cuda.reset_peak_memory_stats: the peaks restart at the current
  // figures; each thread's mark restarts at its next allocation.
  void reset_peaks(int device) {
    if (device < 0 || device >= kDevices) return;
    Device &d = devices_[device];
    int64_t sum[kFields];
    std::lock_guard<std::mutex> g(lock_);
    total_locked(device, sum);
    for (int p = 0; p < kPools; p++)
      for (int k = 0; k < kKinds; k++) d.peak[p][k].store(current(sum, p, k), std::memory_order_relaxed);
    d.epoch.fetch_add(1, std::memory_order_release);
  }

  // torch.cuda.reset_accumulated_memory_stats: allocated and freed restart
  // at 0 (current stays).
  void reset_accumulated(int device) {
    if (device < 0 || device >= kDevices) return;
    Device &d = devices_[device];
    int64_t sum[kFields];
    std::lock_guard<std::mutex> g(lock_);
    total_locked(device, sum);
    for (int f = 0; f < kFields; f++) d.base[f].store(sum[f], std::memory_order_relaxed);
  }

 private:
  // Per pool (all, small, large; PyTorch's StatType order) and kind:
  // allocated and freed running totals.
  static constexpr int kPools = 3, kKinds = 3;
  static constexpr int kCount = 0, kBytes = 1, kRequested = 2;
  static constexpr int kFields = kPools * kKinds * 2;
  static constexpr size_t kSmallSize = (size_t)1 << 20; // PyTorch's small pool: 1 MiB and under
  static int field(int pool, int kind, int freed) { return (pool * kKinds + kind) * 2 + freed; }
  static int64_t current(const int64_t *sum, int pool, int kind) {
    return sum[field(pool, kind, 0)] - sum[field(pool, kind, 1)];
  }

  struct Device {
    std::atomic<int64_t> peak[kPools][kKinds];
    std::atomic<int64_t> base[kFields]; // the totals at the last reset of accumulated figures
    std::atomic<uint64_t> epoch{0};     // reset_peaks calls
    Device() {
      for (auto &p : peak)
        for (auto &k : p) k.store(0, std::memory_order_relaxed);
      for (auto &b : base) b.store(0, std::memory_order_relaxed);
    }
  };

  // One thread's counters of one device; written by that thread only.
  struct Counters {
    std::atomic<int64_t> f[kFields];
    int64_t mark[kPools][kKinds]; // past these, the owner sums (owner only)
    uint64_t epoch = 0;           // the device's epoch the marks belong to
    Counters() {
      for (auto &x : f) x.store(0, std::memory_order_relaxed);
      for (auto &p : mark)
        for (auto &k : p) k = 0;
    }
  };

  struct Thread {
    Stats *owner;
    std::atomic<Counters *> dev[kDevices];
    explicit Thread(Stats *s) : owner(s) {
      for (auto &d : dev) d.store(nullptr, std::memory_order_relaxed);
    }
    ~Thread() { owner->retire(this); }
  };

  Counters *mine(int device) {
    thread_local std::unique_ptr<Thread> t;
    if (t == nullptr) {
      t.reset(new Thread(this));
      std::lock_guard<std::mutex> g(lock_);
      threads_.push_back(t.get());
    }
    Counters *c = t->dev[device].load(std::memory_order_relaxed);
    if (c == nullptr) {
      c = new Counters();
      std::lock_guard<std::mutex> g(lock_); // readers walk dev[] under the lock
      t->dev[device].store(c, std::memory_order_release);
    }
    return c;
  }

  void change(int device, size_t bytes, size_t requested, int sign) {
    if (device < 0 || device >= kDevices) return;
    Counters *c = mine(device);
    int pool = bytes <= kSmallSize ? 1 : 2;
    int freed = sign < 0 ? 1 : 0;
    const int64_t add[kKinds] = {1, static_cast<int64_t>(bytes), static_cast<int64_t>(requested)};
    for (int p : {0, pool})
      for (int k = 0; k < kKinds; k++) {
        std::atomic<int64_t> &x = c->f[field(p, k, freed)];
        x.store(x.load(std::memory_order_relaxed) + add[k], std::memory_order_relaxed);
      }
    if (sign > 0) mark(device, c, pool);
  }

  int64_t own(const Counters *c, int pool, int kind) {
    return c->f[field(pool, kind, 0)].load(std::memory_order_relaxed) -
           c->f[field(pool, kind, 1)].load(std::memory_order_relaxed);
  }

  // After an allocation: a figure past the thread's mark (or marks of
  // before a reset) makes it sum, raise the peaks and set its marks again.
  void mark(int device, Counters *c, int pool) {
    Device &d = devices_[device];
    uint64_t epoch = d.epoch.load(std::memory_order_acquire);
    bool past = c->epoch != epoch;
    for (int p : {0, pool})
      for (int k = 0; k < kKinds && !past; k++) past = own(c, p, k) > c->mark[p][k];
    if (!past) return;
    c->epoch = epoch;
    int64_t sum[kFields];
    total(device, sum);
    for (int p = 0; p < kPools; p++)
      for (int k = 0; k < kKinds; k++) {
        int64_t now = current(sum, p, k), seen = d.peak[p][k].load(std::memory_order_relaxed);
        while (now > seen && !d.peak[p][k].compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
        }
        c->mark[p][k] = own(c, p, k) + (std::max(now, seen) - now);
      }
  }

  void total(int device, int64_t *sum) {
    std::lock_guard<std::mutex> g(lock_);
    total_locked(device, sum);
  }

  void total_locked(int device, int64_t *sum) {
    for (int f = 0; f < kFields; f++) sum[f] = retired_[device][f];
    for (Thread *t : threads_) {
      Counters *c = t->dev[device].load(std::memory_order_acquire);
      if (c == nullptr) continue;
      for (int f = 0; f < kFields; f++) sum[f] += c->f[f].load(std::memory_order_relaxed);
    }
  }

  void fill_stat(c10::CachingAllocator::Stat &s, Device &d, const int64_t *sum, int pool, int kind) {
    s.current = current(sum, pool, kind);
    s.allocated = sum[field(pool, kind, 0)] - d.base[field(pool, kind, 0)].load(std::memory_order_relaxed);
    s.freed = sum[field(pool, kind, 1)] - d.base[field(pool, kind, 1)].load(std::memory_order_relaxed);
    s.peak = std::max(s.current, d.peak[pool][kind].load(std::memory_order_relaxed));
  }

  void retire(Thread *t) {
    std::lock_guard<std::mutex> g(lock_);
    for (int d = 0; d < kDevices; d++) {
      Counters *c = t->dev[d].load(std::memory_order_relaxed);
      if (c == nullptr) continue;
      for (int f = 0; f < kFields; f++) retired_[d][f] += c->f[f].load(std::memory_order_relaxed);
      delete c;
    }
    threads_.erase(std::remove(threads_.begin(), threads_.end(), t), threads_.end());
  }

  std::mutex lock_; // threads_, retired_, and each thread's dev[] growing
  std::vector<Thread *> threads_;
  int64_t retired_[kDevices][kFields] = {};
  Device devices_[kDevices];
};

} // namespace magpie_torch

#endif // MAGPIE_TORCH_STATS_H
