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
//     them): every block comes from that allocator (raw_alloc_with_stream)
//     and goes back to it (raw_delete) only at the pool's empty_cache,
//     torch.cuda.empty_cache once the pool is no longer used, or as freed
//     once the pool is gone, as under PyTorch's allocator. A freed block
//     serves the pool's later requests of its size: at once on its own
//     stream, on another once an event recorded at the free completed;
//     a larger one serves when the memory fraction leaves no room for a
//     new block (PyTorch's allocator would split it). Its blocks count
//     against the memory fraction, as under PyTorch's allocator.
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

#include <atomic>
#include <functional>
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

  // A block for stream from the pool an announcement routes it to; nullptr
  // with *routed false when none does. *pool: the pool; *custom: whether
  // it is a custom allocator's (free it with free_custom).
  void *alloc(size_t size, cudaStream_t stream, bool *routed, PoolId *pool, bool *custom) {
    *routed = false;
    if (active_count_.load(std::memory_order_acquire) == 0) return nullptr;
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
        void *q = take_cached(p, size, stream, false);
        if (q != nullptr) return q;
        custom = p.custom;
        device = p.device;
      }
    }
    if (magpie != 0) return fns_->malloc(magpie, size, stream);
    if (!fns_->admit(device, size)) {
      std::lock_guard<std::mutex> g(lock_);
      auto it = pools_.find(id);
      void *q = it == pools_.end() ? nullptr : take_cached(it->second, size, stream, true);
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
    it->second.custom_blocks[q] = CustomBlock{size, stream, true, nullptr};
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
      PoolId id = o->second; /* collect may erase p's entry */
      Pool &pool = pools_.at(id);
      CustomBlock &b = pool.custom_blocks.at(p);
      b.used = false;
      b.event = event_after(b.stream);
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
        for (auto &b : p.custom_blocks)
          out.push_back(PoolBlock{kv.first, p.device, b.first, b.second.size, b.second.used, b.second.stream});
        continue;
      }
      size_t n = 0;
      if (fns_->blocks(p.magpie, nullptr, 0, &n) != 0 || n == 0) continue;
      std::vector<magpie_pool_block> mb(n + 16);
      if (fns_->blocks(p.magpie, mb.data(), mb.size(), &n) != 0) continue;
      for (size_t i = 0; i < n && i < mb.size(); i++)
        out.push_back(PoolBlock{kv.first, p.device, mb[i].ptr, mb[i].size, mb[i].in_use != 0, nullptr});
    }
    return out;
  }

 private:
  struct CustomBlock {
    size_t size;
    cudaStream_t stream; // of its allocation, where PyTorch frees it
    bool used;
    cudaEvent_t event; // recorded at its free (nullptr: none needed)
  };
  struct Pool {
    c10::DeviceIndex device = 0;
    uint64_t magpie = 0; // magpie's graph pool, when custom is null
    bool magpie_released = false;
    CustomAllocator custom;
    int uses = 0;
    bool use_on_oom = false;
    std::unordered_map<void *, CustomBlock> custom_blocks;
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
      if (!p.custom_blocks.empty()) return;
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

  // Whether free block b's stream work completed (its event; none: only
  // when wait, after a device synchronisation). Lock held.
  static bool settled(CustomBlock &b, bool wait) {
    if (b.event == nullptr) return wait && cudaDeviceSynchronize() == cudaSuccess;
    cudaError_t rc = wait ? cudaEventSynchronize(b.event) : cudaEventQuery(b.event);
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    cudaEventDestroy(b.event);
    b.event = nullptr;
    return true;
  }

  // A free block of custom pool p for size bytes on stream, at most a
  // quarter larger unless any_size. Lock held.
  void *take_cached(Pool &p, size_t size, cudaStream_t stream, bool any_size) {
    void *best = nullptr;
    size_t best_size = 0;
    for (auto &kv : p.custom_blocks) {
      CustomBlock &b = kv.second;
      if (b.used || b.size < size || (!any_size && b.size > size + size / 4)) continue;
      if (best != nullptr && b.size >= best_size) continue;
      if (b.stream != stream && !settled(b, false)) continue;
      best = kv.first;
      best_size = b.size;
    }
    if (best == nullptr) return nullptr;
    CustomBlock &b = p.custom_blocks.at(best);
    if (b.event != nullptr) {
      cudaEventDestroy(b.event);
      b.event = nullptr;
    }
    b.used = true;
    b.stream = stream;
    return best;
  }

  // p's free blocks whose streams' work completed (all, waiting, when
  // wait) leave it onto *give. Lock held.
  void collect(Pool &p, bool wait, std::vector<Given> *give) {
    for (auto it = p.custom_blocks.begin(); it != p.custom_blocks.end();) {
      if (it->second.used || !settled(it->second, wait)) {
        ++it;
        continue;
      }
      give->push_back(Given{p.custom, it->first, it->second.size, p.device});
      owner_.erase(it->first);
      it = p.custom_blocks.erase(it);
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
  std::atomic<size_t> custom_count_{0}; // custom pools alive
};

} // namespace magpie_torch

#endif // MAGPIE_TORCH_POOLS_H
