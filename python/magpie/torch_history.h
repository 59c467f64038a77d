// Memory history for torch_native.cpp (torch.cuda.memory._record_memory_history,
// torch.cuda.memory._snapshot): the trace of allocations and frees PyTorch's
// memory_viz draws, with the Python and C++ frames PyTorch's context
// recorder gathers. Included by torch_native.cpp only.
//
// What is recorded, in PyTorch's actions:
//   alloc           each tensor or raw allocation magpie served
//   free_requested  its free, and at once
//   free_completed  the same free: magpie's frees are stream-ordered, so
//                   from then on the block is magpie's to reuse for work
//                   ordered after the free (a recorded stream delays reuse
//                   inside magpie, not the free)
//   oom             an allocation that failed for memory (addr: the device's
//                   free bytes)
// Each entry carries the user metadata set last (_set_memory_metadata) and
// the innermost torch.compile region ("N/A" outside any).
//   segment_alloc   a slab or large segment magpie made for a recorded
//                   allocation (its reserved bytes or segment counts
//                   changed, and the segment was not there), with that
//                   allocation's frames (context "alloc" or "all"), which
//                   the segment carries in the snapshot, as PyTorch's
//                   segments carry theirs
//   segment_free    a segment torch.cuda.empty_cache released, with its
//                   caller's frames (context "all"); one magpie released on
//                   its own is recorded, without frames, when the history
//                   next looks
// The segments are magpie's (magpie_snapshot_json), compared before and
// after; magpie maps and unmaps below the allocator interface, shared by
// all of a device's threads and streams.
//
// Cost while not recording: one relaxed load per allocation and free.
// While recording, one lock per event, plus the context recorder (PyTorch's
// own allocator takes its device lock for the same work).
#ifndef MAGPIE_TORCH_HISTORY_H
#define MAGPIE_TORCH_HISTORY_H

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace magpie_torch {

namespace CCA = c10::cuda::CUDACachingAllocator;
using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;

class History {
 public:
  bool on() const { return on_.load(std::memory_order_relaxed); }

  // Where the segment events look: magpie's segments of a device (base ->
  // size), a figure that changes when they may have (its reserved bytes
  // and segment counts), and the number of devices.
  struct SegmentSource {
    std::map<uintptr_t, size_t> (*segments)(int device);
    uint64_t (*signature)(int device);
    int (*devices)();
  };
  void set_segment_source(SegmentSource s) {
    std::lock_guard<std::mutex> g(lock_);
    source_ = s;
  }

  // torch.cuda.empty_cache while recording: release_begin before magpie
  // gives memory back (the caller's frames, at context "all"), release_end
  // after (a segment_free per segment released).
  std::shared_ptr<c10::GatheredContext> release_begin() { return on() ? gather(CCA::RecordContext::ALL) : nullptr; }
  void release_end(const std::shared_ptr<c10::GatheredContext> &ctx) {
    if (!on()) return;
    std::lock_guard<std::mutex> g(lock_);
    if (!recording_ || source_.segments == nullptr) return;
    for (int d = 0; d < source_.devices() && d < kDevices; d++) {
      seen_[d] = source_.signature(d);
      compare_segments(d, nullptr, ctx);
    }
  }

  // PyTorch's recordHistory: enabled records the trace, with the
  // recorder's frames as when asks (NEVER: none; STATE: the live
  // allocations'; ALLOC: also each alloc entry's; ALL: also each free's).
  // !enabled stops recording and forgets the trace and the live
  // allocations, as PyTorch's allocator does.
  void configure(bool enabled, CCA::CreateContextFn recorder, size_t max_entries, CCA::RecordContext when, bool clear,
                 const std::vector<std::string> &skip_actions) {
    std::lock_guard<std::mutex> g(lock_);
    recorder_ = enabled ? recorder : nullptr;
    when_ = enabled ? when : CCA::RecordContext::NEVER;
    max_ = max_entries > 0 ? max_entries : 1;
    for (bool &s : skip_) s = false;
    for (const std::string &a : skip_actions)
      skip_[static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(a))] = true;
    if (clear || !enabled) {
      for (Ring &r : rings_) r = Ring{};
    }
    if (!enabled) live_.clear();
    segment_ctx_.clear();
    for (int d = 0; d < kDevices; d++) known_[d].clear();
    // The segments mapped before recording began are no event.
    for (int d = 0; enabled && source_.segments != nullptr && d < source_.devices() && d < kDevices; d++) {
      known_[d] = source_.segments(d);
      seen_[d] = source_.signature(d);
    }
    recording_ = enabled;
    on_.store(enabled, std::memory_order_relaxed);
  }

  // torch.cuda.memory._set_memory_metadata: put on every entry from now.
  void set_user_metadata(const std::string &m) {
    std::lock_guard<std::mutex> g(lock_);
    user_metadata_ = m;
  }
  std::string user_metadata() {
    std::lock_guard<std::mutex> g(lock_);
    return user_metadata_;
  }
  // torch.compile's regions (compile_context=True): the innermost names
  // each entry, "N/A" outside any.
  void push_compile_context(const std::string &c) {
    std::lock_guard<std::mutex> g(lock_);
    compile_contexts_.push_back(c);
  }
  void pop_compile_context() {
    std::lock_guard<std::mutex> g(lock_);
    if (!compile_contexts_.empty()) compile_contexts_.pop_back();
  }

  // The allocation paths' entries: one relaxed load while nothing records.
  void alloc(int device, void *p, size_t size, cudaStream_t stream, c10::cuda::MempoolId_t pool) {
    if (C10_UNLIKELY(on())) record_alloc(device, p, size, stream, pool);
  }
  void free(int device, void *p, size_t size, cudaStream_t stream, c10::cuda::MempoolId_t pool) {
    if (C10_UNLIKELY(on())) record_free(device, p, size, stream, pool);
  }

  void oom(int device, size_t size, size_t device_free, cudaStream_t stream) {
    if (!on()) return;
    std::shared_ptr<c10::GatheredContext> ctx = gather(CCA::RecordContext::ALLOC);
    std::lock_guard<std::mutex> g(lock_);
    if (recording_) push(TraceEntry::OOM, device, device_free, size, stream, {0, 0}, ctx);
  }

  // Into out: each device's trace (traces) and, as one segment per live
  // allocation recorded (segment pool id {0, 0}, which no pool has), the
  // live allocations of pool (all: {0, 0}) with their frames; magpie.torch
  // puts those frames on the blocks of magpie's segments.
  void snapshot(CCA::SnapshotInfo &out, int devices, c10::cuda::MempoolId_t pool, bool traces) {
    out.device_traces.assign(devices > 0 ? devices : 0, {});
    std::lock_guard<std::mutex> g(lock_);
    for (int d = 0; traces && d < devices && d < kDevices; d++) {
      Ring &r = rings_[d];
      size_t n = r.entries.size();
      for (size_t i = 0; i < n; i++) out.device_traces[d].push_back(r.entries[(r.next + i) % n]);
    }
    bool all = pool.first == 0 && pool.second == 0;
    for (const auto &kv : live_) {
      const Live &l = kv.second;
      if (!all && l.pool != pool) continue;
      CCA::SegmentInfo seg;
      seg.device = static_cast<c10::DeviceIndex>(l.device);
      seg.address = reinterpret_cast<size_t>(kv.first);
      seg.total_size = seg.requested_size = seg.allocated_size = seg.active_size = l.size;
      seg.stream = l.stream;
      seg.context_when_allocated = l.ctx;
      c10::CachingDeviceAllocator::BlockInfo b;
      b.size = b.requested_size = l.size;
      b.allocated = b.active = true;
      b.context_when_allocated = l.ctx;
      seg.blocks.push_back(std::move(b));
      out.segments.push_back(std::move(seg));
    }
    // The frames of the segments mapped while recording: a segment of pool
    // {0, 0} without blocks at each one's base.
    for (const auto &kv : segment_ctx_) {
      if (!all || kv.first.first >= devices) continue;
      CCA::SegmentInfo seg;
      seg.device = static_cast<c10::DeviceIndex>(kv.first.first);
      seg.address = kv.first.second;
      seg.total_size = seg.requested_size = seg.allocated_size = seg.active_size = 0;
      seg.context_when_allocated = kv.second;
      out.segments.push_back(std::move(seg));
    }
  }

 private:
  [[gnu::noinline]] void record_alloc(int device, void *p, size_t size, cudaStream_t stream,
                                      c10::cuda::MempoolId_t pool) {
    std::shared_ptr<c10::GatheredContext> ctx = gather(CCA::RecordContext::STATE);
    std::lock_guard<std::mutex> g(lock_);
    if (!recording_) return;
    live_[p] = Live{device, size, stream, pool, ctx};
    // Before the alloc entry, as PyTorch orders a segment's and its first
    // block's.
    if (source_.signature != nullptr && device >= 0 && device < kDevices) {
      uint64_t was = seen_[device];
      seen_[device] = source_.signature(device);
      if (seen_[device] != was) compare_segments(device, when_ >= CCA::RecordContext::ALLOC ? ctx : nullptr, nullptr);
    }
    push(TraceEntry::ALLOC, device, reinterpret_cast<size_t>(p), size, stream, pool,
         when_ >= CCA::RecordContext::ALLOC ? ctx : nullptr);
  }

  // magpie's segments of device against those the history knew: each that
  // appeared is a segment_alloc (its frames: mapped, the segment's), each
  // that went a segment_free (freed). Lock held.
  void compare_segments(int device, const std::shared_ptr<c10::GatheredContext> &mapped,
                        const std::shared_ptr<c10::GatheredContext> &freed) {
    std::map<uintptr_t, size_t> now = source_.segments(device);
    std::map<uintptr_t, size_t> &known = known_[device];
    for (const auto &kv : known) {
      if (now.count(kv.first) != 0) continue;
      push(TraceEntry::SEGMENT_FREE, device, kv.first, kv.second, nullptr, {0, 0}, freed);
      segment_ctx_.erase({device, kv.first});
    }
    for (const auto &kv : now) {
      if (known.count(kv.first) != 0) continue;
      push(TraceEntry::SEGMENT_ALLOC, device, kv.first, kv.second, nullptr, {0, 0}, mapped);
      if (mapped != nullptr) segment_ctx_[{device, kv.first}] = mapped;
    }
    known = std::move(now);
  }

  [[gnu::noinline]] void record_free(int device, void *p, size_t size, cudaStream_t stream,
                                     c10::cuda::MempoolId_t pool) {
    std::shared_ptr<c10::GatheredContext> ctx = gather(CCA::RecordContext::ALL);
    std::lock_guard<std::mutex> g(lock_);
    if (!recording_) return;
    live_.erase(p);
    push(TraceEntry::FREE_REQUESTED, device, reinterpret_cast<size_t>(p), size, stream, pool, ctx);
    push(TraceEntry::FREE_COMPLETED, device, reinterpret_cast<size_t>(p), size, stream, pool, ctx);
  }

  static constexpr int kDevices = 64;
  struct Live {
    int device;
    size_t size;
    cudaStream_t stream;
    c10::cuda::MempoolId_t pool;
    std::shared_ptr<c10::GatheredContext> ctx;
  };
  // The last max_ entries of a device, oldest at next once full.
  struct Ring {
    std::vector<TraceEntry> entries;
    size_t next = 0;
  };

  // The caller's frames if recording asks for them at level need; gathered
  // outside the lock (the recorder may take the GIL).
  std::shared_ptr<c10::GatheredContext> gather(CCA::RecordContext need) {
    CCA::CreateContextFn rec;
    CCA::RecordContext when;
    {
      std::lock_guard<std::mutex> g(lock_);
      rec = recorder_;
      when = when_;
    }
    return rec != nullptr && when >= need ? rec() : nullptr;
  }

  // Called with lock_ held.
  void push(TraceEntry::Action action, int device, size_t addr, size_t size, cudaStream_t stream,
            c10::cuda::MempoolId_t pool, std::shared_ptr<c10::GatheredContext> ctx) {
    if (device < 0 || device >= kDevices || skip_[static_cast<int>(action)]) return;
    int64_t us =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    TraceEntry e(action, static_cast<c10::DeviceIndex>(device), addr, size, stream, pool, 0, std::move(ctx),
                 compile_contexts_.empty() ? "N/A" : compile_contexts_.back(), user_metadata_);
    e.time_.t_ = static_cast<time_t>(us);
    Ring &r = rings_[device];
    if (r.entries.size() < max_) {
      r.entries.push_back(std::move(e));
    } else {
      r.entries[r.next] = std::move(e);
      r.next = (r.next + 1) % r.entries.size();
    }
  }

  std::atomic<bool> on_{false}; // recording_, read without the lock
  std::mutex lock_;
  bool recording_ = false;
  std::string user_metadata_;
  std::vector<std::string> compile_contexts_;
  CCA::CreateContextFn recorder_ = nullptr;
  CCA::RecordContext when_ = CCA::RecordContext::NEVER;
  size_t max_ = 1;
  bool skip_[16] = {};
  Ring rings_[kDevices];
  std::unordered_map<void *, Live> live_;
  SegmentSource source_{nullptr, nullptr, nullptr};
  std::map<uintptr_t, size_t> known_[kDevices]; // each device's segments as the history last saw them
  uint64_t seen_[kDevices] = {};                // and its signature then
  std::map<std::pair<int, uintptr_t>, std::shared_ptr<c10::GatheredContext>> segment_ctx_; // mapped while recording
};

} // namespace magpie_torch

#endif // MAGPIE_TORCH_HISTORY_H
