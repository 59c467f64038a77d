// PyTorch's memory statistics of the blocks magpie's allocator hands to
// PyTorch (torch_native.cpp): allocated, active and requested bytes and
// the allocation and active-block counts, each with PyTorch's four figures
// (current, peak, allocated and freed since the last reset), for all
// blocks and split into PyTorch's small pool (1 MiB and under) and large
// pool. Included by torch_native.cpp only.
//
// Kept per thread, so that the allocation path writes only its own cache
// line: each thread's counters of its small and large blocks are written
// by that thread alone (relaxed loads and stores, no read-modify-write)
// and summed by readers, who add the two pools up for "all"
// (bench/DECISIONS.md, "PyTorch's statistics: a thread's own counters,
// found without a guard"). The way to a thread's counters (Local) lives in
// the thread-local object of the caller's allocation path, which reaches
// it anyway. A thread leaving folds its counters into the retired totals.
// One Stats serves a process: a thread's counters belong to the first
// Stats it counts for.
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
#include <c10/macros/Macros.h>

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

  struct Thread;   // below
  struct Counters; // below
  // A thread's way to its counters, kept by the caller in the thread-local
  // object its allocation path already reaches (torch_native.cpp), so that
  // counting takes no thread-local access of its own. Zero-initialised;
  // written by its thread only.
  struct Local {
    Counters *last;  // the counters of device last_device (null: none yet)
    int last_device; // the device of the thread's last block
    bool gone;       // the thread's Thread was destroyed (it is ending)
    Thread *thread;  // null until the thread's first block, and again once it ended
  };

  // A block of bytes (requested: what was asked) handed out on device, by
  // the thread whose Local l is.
  C10_ALWAYS_INLINE void alloc(Local &l, int device, size_t bytes, size_t requested) {
    change(l, device, bytes, requested, +1);
  }
  C10_ALWAYS_INLINE void free(Local &l, int device, size_t bytes, size_t requested) {
    change(l, device, bytes, requested, -1);
  }

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
  // allocated and freed running totals (the readers' sums, kFields).
  static constexpr int kPools = 3, kKinds = 3;
  static constexpr int kCount = 0, kBytes = 1, kRequested = 2;
  static constexpr int kFields = kPools * kKinds * 2;
  static int field(int pool, int kind, int freed) { return (pool * kKinds + kind) * 2 + freed; }
  // A thread counts its small and large blocks only (kCounted figures),
  // each pool as the kinds' allocated totals, then their current figures
  // (allocated less freed by this thread: below 0 where it frees other
  // threads' blocks): a free writes three figures, an allocation six.
  static constexpr int kCounted = (kPools - 1) * 2 * kKinds;
  static int counted(int pool, int current, int kind) { return ((pool - 1) * 2 + current) * kKinds + kind; }
  static constexpr size_t kSmallSize = (size_t)1 << 20; // PyTorch's small pool: 1 MiB and under
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

  // One thread's counters of one device (small and large pools); written
  // by that thread only. Public, as Thread is, only as Local's pointee.
 public:
  struct alignas(64) Counters {       // a cache line of its own: threads' counters never share one
    std::atomic<int64_t> f[kCounted]; // by counted(): written by the owner, summed by readers
    int64_t mark[kPools][kKinds];     // past these, the owner sums (owner only)
    uint64_t epoch = 0;               // the device's epoch the marks belong to
    Counters() {
      for (auto &x : f) x.store(0, std::memory_order_relaxed);
      for (auto &p : mark)
        for (auto &k : p) k = 0;
    }
    // The owner's current figure of pool (0: all) and kind.
    C10_ALWAYS_INLINE int64_t mine(int pool, int kind) const {
      int64_t small = f[counted(1, 1, kind)].load(std::memory_order_relaxed);
      int64_t large = f[counted(2, 1, kind)].load(std::memory_order_relaxed);
      return pool == 1 ? small : pool == 2 ? large : small + large;
    }
  };

  // A thread's counters by device, as its owner and readers find them
  // (written by the owner under lock_); its destructor (the thread ending)
  // folds them into the retired totals and marks the thread's Local gone:
  // its blocks freed or allocated after that (by later thread-local
  // destructors) count in late_.
  struct Thread {
    Stats *owner;
    Local *slot; // the owner's Local, in its thread-local storage
    std::atomic<Counters *> dev[kDevices];
    Thread(Stats *s, Local *l) : owner(s), slot(l) {
      for (auto &d : dev) d.store(nullptr, std::memory_order_relaxed);
    }
    ~Thread() {
      slot->thread = nullptr;
      slot->last = nullptr;
      slot->gone = true;
      owner->retire(this); // deletes the counters
    }
  };

 private:
  // The calling thread's first block on device.
  Counters *first(Local &l, int device) {
    thread_local std::unique_ptr<Thread> t; // destroyed as the thread ends
    if (t == nullptr) {
      t.reset(new Thread(this, &l));
      std::lock_guard<std::mutex> g(lock_);
      threads_.push_back(t.get());
    }
    Counters *c = new Counters();
    {
      std::lock_guard<std::mutex> g(lock_); // readers walk dev[] under the lock
      t->dev[device].store(c, std::memory_order_release);
    }
    l.thread = t.get();
    return c;
  }

  // The allocation path's part, inlined: the thread's counters, its own
  // figures and the check against its marks; the rest is out of line.
  C10_ALWAYS_INLINE void change(Local &l, int device, size_t bytes, size_t requested, int sign) {
    if (C10_UNLIKELY(device < 0 || device >= kDevices)) return;
    int pool = bytes <= kSmallSize ? 1 : 2;
    const int64_t add[kKinds] = {sign, sign * static_cast<int64_t>(bytes), sign * static_cast<int64_t>(requested)};
    Counters *c = l.last;
    if (C10_UNLIKELY(c == nullptr || l.last_device != device)) {
      c = counters_slow(l, device, pool, add);
      if (c == nullptr) return;
    }
    std::atomic<int64_t> *now = &c->f[counted(pool, 1, 0)];
    // Unrolled, so that the figures stay in registers (-O2 leaves the loops).
    int64_t mine[kKinds];
#pragma GCC unroll 3
    for (int k = 0; k < kKinds; k++) {
      mine[k] = now[k].load(std::memory_order_relaxed) + add[k];
      now[k].store(mine[k], std::memory_order_relaxed);
    }
    if (sign < 0) return;
    // After an allocation: a figure past the thread's mark (or marks of
    // before a reset) makes it sum, raise the peaks and set its marks again.
    std::atomic<int64_t> *got = &c->f[counted(pool, 0, 0)];
    const std::atomic<int64_t> *other = &c->f[counted(kPools - pool, 1, 0)]; // the other pool's current figures
    bool past = c->epoch != devices_[device].epoch.load(std::memory_order_acquire);
#pragma GCC unroll 3
    for (int k = 0; k < kKinds; k++) {
      got[k].store(got[k].load(std::memory_order_relaxed) + add[k], std::memory_order_relaxed);
      past |= (mine[k] > c->mark[pool][k]) | (mine[k] + other[k].load(std::memory_order_relaxed) > c->mark[0][k]);
    }
    if (C10_UNLIKELY(past)) raise(device, c);
  }

  // The calling thread's counters of device, made on its first block there
  // (then l's last); null (the block counted in late_) once the thread's
  // Thread is gone.
  [[gnu::noinline]] Counters *counters_slow(Local &l, int device, int pool, const int64_t *add) {
    if (!l.gone) {
      Counters *c = l.thread != nullptr ? l.thread->dev[device].load(std::memory_order_relaxed) : nullptr;
      if (c == nullptr) c = first(l, device);
      l.last = c;
      l.last_device = device;
      return c;
    }
    for (int k = 0; k < kKinds; k++) {
      late_[device][counted(pool, 1, k)].fetch_add(add[k], std::memory_order_relaxed);
      if (add[k] > 0) late_[device][counted(pool, 0, k)].fetch_add(add[k], std::memory_order_relaxed);
    }
    return nullptr;
  }

  [[gnu::noinline]] void raise(int device, Counters *c) {
    Device &d = devices_[device];
    c->epoch = d.epoch.load(std::memory_order_acquire);
    int64_t sum[kFields];
    total(device, sum);
    for (int p = 0; p < kPools; p++)
      for (int k = 0; k < kKinds; k++) {
        int64_t now = current(sum, p, k), seen = d.peak[p][k].load(std::memory_order_relaxed);
        while (now > seen && !d.peak[p][k].compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
        }
        c->mark[p][k] = c->mine(p, k) + (std::max(now, seen) - now);
      }
  }

  void total(int device, int64_t *sum) {
    std::lock_guard<std::mutex> g(lock_);
    total_locked(device, sum);
  }

  // Every field, "all" as small plus large.
  void total_locked(int device, int64_t *sum) {
    int64_t c[kCounted];
    for (int f = 0; f < kCounted; f++) c[f] = retired_[device][f] + late_[device][f].load(std::memory_order_relaxed);
    for (Thread *t : threads_) {
      Counters *x = t->dev[device].load(std::memory_order_acquire);
      if (x == nullptr) continue;
      for (int f = 0; f < kCounted; f++) c[f] += x->f[f].load(std::memory_order_relaxed);
    }
    for (int k = 0; k < kKinds; k++) {
      sum[field(0, k, 0)] = sum[field(0, k, 1)] = 0;
      for (int p = 1; p < kPools; p++) {
        int64_t got = c[counted(p, 0, k)], now = c[counted(p, 1, k)];
        sum[field(p, k, 0)] = got;
        sum[field(p, k, 1)] = got - now;
        sum[field(0, k, 0)] += got;
        sum[field(0, k, 1)] += got - now;
      }
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
      for (int f = 0; f < kCounted; f++) retired_[d][f] += c->f[f].load(std::memory_order_relaxed);
      delete c;
    }
    threads_.erase(std::remove(threads_.begin(), threads_.end(), t), threads_.end());
  }

  std::mutex lock_; // threads_, retired_, and each thread's dev[] growing
  std::vector<Thread *> threads_;
  int64_t retired_[kDevices][kCounted] = {};
  std::atomic<int64_t> late_[kDevices][kCounted] = {}; // counted by threads past their Thread's end
  Device devices_[kDevices];
};

} // namespace magpie_torch

#endif // MAGPIE_TORCH_STATS_H
