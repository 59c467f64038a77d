// PyTorch's private pools for torch_native.cpp: CUDA graph pools
// (torch.cuda.graph, graph_pool_handle) and torch.cuda.MemPool, used under
// torch.cuda.use_mem_pool or as a graph's pool. Included by
// torch_native.cpp only.
//
// A pool id is one of two kinds:
//   magpie's blocks (MemPool() and every graph pool): one magpie graph pool
//     (magpie.h, "CUDA graphs"). Its blocks serve only its own requests
//     until it is released; a block a capture was handed stays in it until
//     then (the graph replays into it).
//   a custom allocator's (MemPool(allocator=...), as vLLM's sleep mode makes
//     them): every segment comes from that allocator (raw_alloc_with_stream)
//     and goes back to it (raw_delete), whole, only at the pool's
//     empty_cache, torch.cuda.empty_cache once the pool is no longer used,
//     or as freed once the pool is gone, as under PyTorch's allocator. A
//     request takes the smallest free block of the pool that fits it
//     before the allocator is asked, split as PyTorch's allocator splits
//     (the rest stays free when it is 512 bytes or more, past 1 MiB when
//     the request is over 1 MiB); free neighbours of one segment merge. A
//     free block serves its own stream at once, another once an event
//     recorded at the free completed. Its segments count against the
//     memory fraction, as under PyTorch's allocator.
//
// Uses are counted as PyTorch counts them: one by createOrIncrefPool (a
// MemPool's creation) and one by each beginAllocateToPool (a capture, or a
// use_mem_pool), dropped by releasePool. At 0 a magpie pool is released
// (its free blocks, and each block when freed, return to magpie after a
// device synchronisation) and a custom pool hands its free blocks back.
//
// Routing: while beginAllocateToPool's announcements are in force,
// allocations on a stream one of their filters accepts (the capturing
// streams, or the calling thread for use_mem_pool) come from its pool; the
// check costs one load while none is.
#ifndef MAGPIE_TORCH_POOLS_H
#define MAGPIE_TORCH_POOLS_H

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace magpie_torch {

using PoolId = c10::cuda::MempoolId_t;
using CustomAllocator = std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>;

// What the pools need of magpie (the functions torch_native.cpp loaded).
struct PoolFns {
  int (*create)(int, uint64_t *);
  int (*capture_begin)(uint64_t, cudaStream_t);
  int (*capture_end)(uint64_t, cudaStream_t);
  void *(*malloc)(uint64_t, size_t, cudaStream_t);
  int (*release)(uint64_t);
  int (*trim)(uint64_t);
  int (*blocks)(uint64_t, magpie_pool_block *, size_t, size_t *);
  const char *(*last_message)();
  // PyTorch's memory fraction covers custom pools' blocks too: whether
  // bytes more of them fit on device, and the bytes they hold changing.
  bool (*admit)(int, size_t);
  void (*held)(int, int64_t);
};

// A block of a pool as snapshot() lists it.
struct PoolBlock {
  PoolId pool;
  int device;
  void *ptr;
  size_t size;
  bool used;
  cudaStream_t stream;
  void *segment; // the segment it is part of (a custom pool's), else ptr
  size_t segment_size;
};

class Pools {
 public:
  explicit Pools(const PoolFns *fns) : fns_(fns) {}

  void create_or_incref(c10::DeviceIndex device, PoolId id, CustomAllocator custom) {
    std::lock_guard<std::mutex> g(lock_);
    find_or_make(device, id, std::move(custom)).uses++;
  }

  int use_count(PoolId id) {
    std::lock_guard<std::mutex> g(lock_);
    auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.uses;
  }

  // The magpie graph pool of id; 0 for a custom allocator's or an unknown.
  uint64_t magpie_pool(PoolId id) {
    std::lock_guard<std::mutex> g(lock_);
    auto it = pools_.find(id);
    return it == pools_.end() || it->second.magpie_released ? 0 : it->second.magpie;
  }

  void set_use_on_oom(PoolId id, bool on) {
    std::lock_guard<std::mutex> g(lock_);
    auto it = pools_.find(id);
    TORCH_CHECK(it != pools_.end(), "magpie: no pool (", id.first, ", ", id.second, ") to use on out of memory");
    it->second.use_on_oom = on;
  }

  // Whether an announcement (beginAllocateToPool) may route allocations to
  // a pool; while none does, every allocation is magpie's.
  bool announced() const { return active_count_.load(std::memory_order_acquire) != 0; }

  // A block for stream from the pool an announcement routes it to; nullptr
  // with *routed false when none does. *pool: the pool; *custom: whether
  // it is a custom allocator's (free it with free_custom).
  void *alloc(size_t size, cudaStream_t stream, bool *routed, PoolId *pool, bool *custom) {
    *routed = false;
    if (!announced()) return nullptr;
    std::vector<Active> active;
    {
      std::lock_guard<std::mutex> g(lock_);
      active = active_;
    }
    // The latest announcement first: a use_mem_pool nested in another
    // routes to the inner pool.
    for (auto a = active.rbegin(); a != active.rend(); ++a) {
      if (!a->filter(stream)) continue;
      *routed = true;
      *pool = a->id;
      return alloc_in(a->id, size, stream, custom);
    }
    return nullptr;
  }

  // A block of pool id (nullptr when it has none: magpie's error, or the
  // custom allocator's).
  void *alloc_in(PoolId id, size_t size, cudaStream_t stream, bool *is_custom) {
    refused() = false;
    CustomAllocator custom;
    uint64_t magpie = 0;
    int device = 0;
    *is_custom = false;
    {
      std::lock_guard<std::mutex> g(lock_);
      auto it = pools_.find(id);
      TORCH_CHECK(it != pools_.end(), "magpie: allocation into pool (", id.first, ", ", id.second,
                  ") that does not exist");
      Pool &p = it->second;
      if (p.custom == nullptr) {
        magpie = p.magpie;
      } else {
        *is_custom = true;
        void *q = take_cached(id, p, size, stream);
        if (q != nullptr) return q;
        custom = p.custom;
        device = p.device;
      }
    }
    if (magpie != 0) return fns_->malloc(magpie, size, stream);
    if (!fns_->admit(device, size)) {
      std::lock_guard<std::mutex> g(lock_);
      auto it = pools_.find(id);
      void *q = it == pools_.end() ? nullptr : take_cached(id, it->second, size, stream);
      refused() = q == nullptr;
      return q;
    }
    // The custom allocator is called without the lock: it may allocate
    // through PyTorch itself.
    void *q = custom->raw_alloc_with_stream(size, stream);
    if (q == nullptr) return nullptr;
    fns_->held(device, static_cast<int64_t>(size));
    std::lock_guard<std::mutex> g(lock_);
    auto it = pools_.find(id);
    if (it == pools_.end()) {
      custom->raw_delete(q);
      fns_->held(device, -static_cast<int64_t>(size));
      TORCH_CHECK(false, "magpie: pool (", id.first, ", ", id.second, ") ended during an allocation");
    }
    Pool &p = it->second;
    p.segments[q] = size;
    p.pieces[q] = Piece{size, q, stream, true, false, nullptr, 0};
    owner_[q] = id;
    return q;
  }

  // Whether the calling thread's last custom-pool allocation that came
  // back empty was refused for the memory fraction (not by the allocator).
  static bool &refused() {
    static thread_local bool r;
    return r;
  }

  // An allocation the device could not serve: from a pool made with
  // use_on_oom on device, if one has room.
  void *alloc_on_oom(int device, size_t size, cudaStream_t stream, PoolId *pool, bool *custom) {
    std::vector<PoolId> candidates;
    {
      std::lock_guard<std::mutex> g(lock_);
      for (auto &kv : pools_)
        if (kv.second.use_on_oom && kv.second.device == device && kv.second.uses > 0) candidates.push_back(kv.first);
    }
    for (const PoolId &id : candidates) {
      void *p = alloc_in(id, size, stream, custom);
      if (p != nullptr) {
        *pool = id;
        return p;
      }
    }
    return nullptr;
  }

  // Whether p is a custom pool's block; if so it is freed here (true).
  bool free_custom(void *p) {
    if (custom_count_.load(std::memory_order_acquire) == 0) return false;
    std::vector<Given> give;
    {
      std::lock_guard<std::mutex> g(lock_);
      auto o = owner_.find(p);
      if (o == owner_.end()) return false;
      PoolId id = o->second;
      owner_.erase(o);
      Pool &pool = pools_.at(id);
      auto b = pool.pieces.find(p);
      if (b == pool.pieces.end() || !b->second.used) return false; /* cannot be: owner_ lists used pieces */
      b->second.used = false;
      b->second.ready = false;
      b->second.event = event_after(b->second.stream);
      b->second.freed = ++frees_;
      coalesce(pool);
      if (pool.uses == 0) collect(pool, false, &give);
      maybe_drop(id);
    }
    hand_back(give);
    return true;
  }

  void begin(c10::DeviceIndex device, PoolId id, std::function<bool(cudaStream_t)> filter) {
    std::lock_guard<std::mutex> g(lock_);
    Pool &p = find_or_make(device, id, nullptr);
    if (p.custom == nullptr) TORCH_CHECK(fns_->capture_begin(p.magpie, nullptr) == 0, "magpie: ", fns_->last_message());
    p.uses++;
    active_.push_back(Active{id, std::move(filter)});
    active_count_.store(active_.size(), std::memory_order_release);
  }

  void end(PoolId id) {
    std::lock_guard<std::mutex> g(lock_);
    for (auto a = active_.end(); a != active_.begin();) {
      --a;
      if (a->id != id) continue;
      auto it = pools_.find(id);
      if (it != pools_.end() && it->second.custom == nullptr) fns_->capture_end(it->second.magpie, nullptr);
      active_.erase(a);
      break;
    }
    active_count_.store(active_.size(), std::memory_order_release);
  }

  // A custom pool's free blocks stay until its empty_cache (PyTorch's
  // MemPool calls it as it ends) or torch.cuda.empty_cache.
  void release(PoolId id) {
    std::lock_guard<std::mutex> g(lock_);
    auto it = pools_.find(id);
    if (it == pools_.end() || it->second.uses == 0 || --it->second.uses > 0) return;
    Pool &p = it->second;
    if (p.custom == nullptr) {
      fns_->release(p.magpie);
      p.magpie_released = true;
    }
    maybe_drop(id);
  }

  // PyTorch's emptyCache(id): the pool's free blocks go back (a magpie
  // pool's through magpie_graph_pool_trim, a custom pool's to its
  // allocator once their streams' work completed). {0, 0}: every pool no
  // longer used (PyTorch's torch.cuda.empty_cache()).
  void empty_cache(PoolId id) {
    std::vector<Given> give;
    {
      std::lock_guard<std::mutex> g(lock_);
      bool all = id.first == 0 && id.second == 0;
      std::vector<PoolId> ids;
      for (auto &kv : pools_)
        if (all ? kv.second.uses == 0 : kv.first == id) ids.push_back(kv.first);
      for (const PoolId &i : ids) {
        Pool &p = pools_.at(i);
        if (p.custom != nullptr) collect(p, true, &give);
        else if (!p.magpie_released) fns_->trim(p.magpie);
        maybe_drop(i);
      }
    }
    hand_back(give);
  }

  // Every block of pool id ({0, 0}: of every pool), for snapshot().
  std::vector<PoolBlock> blocks(PoolId id) {
    std::vector<PoolBlock> out;
    std::lock_guard<std::mutex> g(lock_);
    bool all = id.first == 0 && id.second == 0;
    for (auto &kv : pools_) {
      if (!all && kv.first != id) continue;
      Pool &p = kv.second;
      if (p.custom != nullptr) {
        for (auto &b : p.pieces)
          out.push_back(PoolBlock{kv.first, p.device, b.first, b.second.size, b.second.used, b.second.stream,
                                  b.second.segment, p.segments.at(b.second.segment)});
        continue;
      }
      size_t n = 0;
      if (fns_->blocks(p.magpie, nullptr, 0, &n) != 0 || n == 0) continue;
      std::vector<magpie_pool_block> mb(n + 16);
      if (fns_->blocks(p.magpie, mb.data(), mb.size(), &n) != 0) continue;
      for (size_t i = 0; i < n && i < mb.size(); i++)
        out.push_back(
            PoolBlock{kv.first, p.device, mb[i].ptr, mb[i].size, mb[i].in_use != 0, nullptr, mb[i].ptr, mb[i].size});
    }
    return out;
  }

 private:
  // A block of a custom pool: a segment (the allocator's block) or part
  // of one.
  struct Piece {
    size_t size;
    void *segment;       // the segment it is part of
    cudaStream_t stream; // of its allocation, where PyTorch frees it
    bool used;
    bool ready;        // free, and the work its stream had before the free completed: any stream may take it
    cudaEvent_t event; // recorded at its free (nullptr: ready, or freed while its stream captured)
    uint64_t freed;    // its free's order among the pools' frees
  };
  struct Pool {
    c10::DeviceIndex device = 0;
    uint64_t magpie = 0; // magpie's graph pool, when custom is null
    bool magpie_released = false;
    CustomAllocator custom;
    int uses = 0;
    bool use_on_oom = false;
    std::map<void *, Piece> pieces;              // by address, so that neighbours are next to each other
    std::unordered_map<void *, size_t> segments; // the allocator's blocks: base -> size
  };
  struct Active {
    PoolId id;
    std::function<bool(cudaStream_t)> filter;
  };
  // A custom pool's block going back to its allocator.
  struct Given {
    CustomAllocator allocator;
    void *ptr;
    size_t size;
    int device;
  };

  // Lock held.
  Pool &find_or_make(c10::DeviceIndex device, PoolId id, CustomAllocator custom) {
    auto it = pools_.find(id);
    if (it != pools_.end()) return it->second;
    Pool p;
    p.device = device;
    if (custom != nullptr) {
      p.custom = std::move(custom);
      custom_count_.fetch_add(1, std::memory_order_release);
    } else {
      TORCH_CHECK(fns_->create(device, &p.magpie) == 0, "magpie: cannot create a pool: ", fns_->last_message());
    }
    return pools_.emplace(id, std::move(p)).first->second;
  }

  // A pool no longer used and holding nothing is forgotten. Lock held.
  void maybe_drop(PoolId id) {
    auto it = pools_.find(id);
    if (it == pools_.end() || it->second.uses > 0) return;
    Pool &p = it->second;
    if (p.custom != nullptr) {
      if (!p.segments.empty()) return;
      custom_count_.fetch_sub(1, std::memory_order_release);
    } else if (!p.magpie_released) {
      return;
    }
    pools_.erase(it);
  }

  // An event the free's stream completes after the work enqueued before
  // it; nullptr (a block reusable on its own stream only, handed back at a
  // device synchronisation) while the stream captures. Lock held.
  static cudaEvent_t event_after(cudaStream_t stream) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &st) != cudaSuccess || st != cudaStreamCaptureStatusNone) {
      (void)cudaGetLastError();
      return nullptr;
    }
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    if (cudaEventRecord(e, stream) != cudaSuccess) {
      (void)cudaGetLastError();
      cudaEventDestroy(e);
      return nullptr;
    }
    return e;
  }

  // Free piece b is made ready once its free's event completed (waiting
  // for it, or for the device when it has none, when wait). Lock held.
  static void settle(Piece &b, bool wait) {
    if (b.used || b.ready) return;
    if (b.event == nullptr) {
      b.ready = wait && cudaDeviceSynchronize() == cudaSuccess;
      if (!b.ready) (void)cudaGetLastError();
      return;
    }
    cudaError_t rc = wait ? cudaEventSynchronize(b.event) : cudaEventQuery(b.event);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    cudaEventDestroy(b.event);
    b.event = nullptr;
    b.ready = true;
  }

  // Whether free pieces a and b may become one: both ready, or freed on
  // one stream (the later free's event then covers both).
  static bool mergeable(const Piece &a, const Piece &b) {
    return a.segment == b.segment && !a.used && !b.used && ((a.ready && b.ready) || a.stream == b.stream);
  }

  // Adjacent free pieces of p that may become one do. Lock held.
  void coalesce(Pool &p) {
    for (auto it = p.pieces.begin(); it != p.pieces.end();) {
      auto next = std::next(it);
      if (next == p.pieces.end()) break;
      Piece &a = it->second, &b = next->second;
      if (static_cast<char *>(it->first) + a.size != next->first || !mergeable(a, b)) {
        it = next;
        continue;
      }
      if (!(a.ready && b.ready)) {
        // One stream: the piece waits as its pieces that were not ready
        // did: behind the later free's event, or, when one was freed during
        // a capture (no event), until a device synchronisation.
        Piece *wait[2] = {a.ready ? &b : &a, a.ready || b.ready ? nullptr : &b};
        bool capture = wait[0]->event == nullptr || (wait[1] != nullptr && wait[1]->event == nullptr);
        Piece *later = wait[1] != nullptr && wait[1]->freed > wait[0]->freed ? wait[1] : wait[0];
        cudaEvent_t keep = capture ? nullptr : later->event;
        for (Piece *w : wait)
          if (w != nullptr && w->event != nullptr && w->event != keep) cudaEventDestroy(w->event);
        a.ready = false;
        a.event = keep;
        a.freed = std::max(a.freed, b.freed);
      }
      a.size += b.size;
      p.pieces.erase(next);
    }
  }

  // The smallest free piece of custom pool p that serves size bytes on
  // stream, split as PyTorch's allocator splits; nullptr if none. Lock
  // held.
  void *take_cached(PoolId id, Pool &p, size_t size, cudaStream_t stream) {
    if (size == 0) return nullptr;
    for (auto &kv : p.pieces) settle(kv.second, false);
    coalesce(p);
    void *best = nullptr;
    size_t best_size = 0;
    for (auto &kv : p.pieces) {
      Piece &b = kv.second;
      if (b.used || b.size < size || (best != nullptr && b.size >= best_size)) continue;
      if (!b.ready && b.stream != stream) continue;
      best = kv.first;
      best_size = b.size;
    }
    if (best == nullptr) return nullptr;
    Piece &b = p.pieces.at(best);
    size_t cut = std::min(b.size, (size + 511) / 512 * 512);
    size_t rest = b.size - cut;
    if (rest >= 512 && (size <= kSmallSize || rest > kSmallSize)) {
      // The rest stays free as it was: ready, or behind the free's event.
      p.pieces[static_cast<char *>(best) + cut] = Piece{rest, b.segment, b.stream, false, b.ready, b.event, b.freed};
      b.event = nullptr;
      b.size = cut;
    } else if (b.event != nullptr) {
      cudaEventDestroy(b.event);
      b.event = nullptr;
    }
    b.used = true;
    b.ready = false;
    b.stream = stream;
    owner_[best] = id;
    return best;
  }

  // p's segments that are one free piece whose stream's work completed
  // (all free ones, waiting, when wait) leave it onto *give. Lock held.
  void collect(Pool &p, bool wait, std::vector<Given> *give) {
    for (auto &kv : p.pieces) settle(kv.second, wait);
    coalesce(p);
    for (auto it = p.pieces.begin(); it != p.pieces.end();) {
      Piece &b = it->second;
      if (b.used || !b.ready || it->first != b.segment || b.size != p.segments.at(b.segment)) {
        ++it;
        continue;
      }
      give->push_back(Given{p.custom, it->first, b.size, p.device});
      p.segments.erase(b.segment);
      it = p.pieces.erase(it);
    }
  }

  // Without the lock: the allocator may call back into PyTorch.
  void hand_back(const std::vector<Given> &give) {
    for (const Given &g : give) {
      g.allocator->raw_delete(g.ptr);
      fns_->held(g.device, -static_cast<int64_t>(g.size));
    }
  }

  const PoolFns *fns_;
  std::mutex lock_;
  std::map<PoolId, Pool> pools_;
  std::unordered_map<void *, PoolId> owner_; // custom pools' blocks
  std::vector<Active> active_;
  std::atomic<size_t> active_count_{0};
  std::atomic<size_t> custom_count_{0};                 // custom pools alive
  uint64_t frees_ = 0;                                  // custom pools' frees so far (Piece::freed)
  static constexpr size_t kSmallSize = (size_t)1 << 20; // PyTorch's small blocks: 1 MiB and under
};

} // namespace magpie_torch

#endif // MAGPIE_TORCH_POOLS_H
