// magpie as PyTorch's CUDA allocator without the pluggable wrapper's lock,
// built against the installed PyTorch by magpie.torch on first use
// (python/magpie/_shim.py), like torch_shim.cpp.
//
// Why: torch::cuda::CUDAPluggableAllocator takes one std::mutex and updates
// an unordered_map on every allocation and free, which set the pace of
// magpie behind it (bench/DECISIONS.md, "PyTorch's allocator without the
// pluggable wrapper's lock").
//
// MagpieAllocator is a CUDAPluggableAllocator (so every other method, the
// record-stream, reset and memory-fraction hooks included, is PyTorch's own)
// whose allocation paths call magpie without a lock:
//   allocate: magpie on the current stream; the DataPtr's context holds the
//     block and its stream (PyTorch frees on the allocation stream), so the
//     free needs no table;
//   raw_alloc / raw_alloc_with_stream / raw_delete (the raw interface, a
//     pointer only at the free): a table of 64 shards, each with its own
//     lock;
//   an allocation magpie cannot serve throws c10::OutOfMemoryError with
//     magpie's message (torch.cuda.OutOfMemoryError in Python);
//   CUDA graphs (torch.cuda.graph, shared pools, make_graphed_callables)
//     and torch.cuda.MemPool: torch_pools.h;
//   memory history (torch.cuda.memory._record_memory_history) and the
//     snapshot's traces, pools and frames: torch_history.h and snapshot().
// magpie's functions arrive as pointers (magpie_torch_native_install), from
// the libmagpie.so Python loaded.
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "magpie.h" /* magpie_stats; the functions come from fn[] below */
#include "torch_history.h"
#include "torch_pools.h"
#include "torch_stats.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include <array>
#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

struct MagpieFns {
  void *(*malloc_async)(size_t, cudaStream_t);
  int (*free_async)(void *, cudaStream_t);
  int (*last_error)();
  const char *(*last_message)();
  void (*record_stream)(void *, cudaStream_t);
  void (*empty_cache)();
  void (*memory_fraction)(double, int);
  int (*graph_pool_create)(int, uint64_t *);
  int (*capture_begin)(uint64_t, cudaStream_t);
  int (*capture_end)(uint64_t, cudaStream_t);
  void *(*graph_pool_malloc)(uint64_t, size_t, cudaStream_t);
  int (*graph_pool_release)(uint64_t);
  int (*stats_get)(int, magpie_stats *);
  int (*stats_reset_peaks)(int);
  int (*graph_pool_trim)(uint64_t);
  int (*graph_pool_blocks)(uint64_t, magpie_pool_block *, size_t, size_t *);
  int (*graph_pool_take)(uint64_t, void *, cudaStream_t, size_t *);
  int (*snapshot_json)(int, FILE *);
};

// The allocator's state is never destroyed (nor is the allocator: install
// keeps a reference): blocks are freed through it after static destructors
// ran (libraries' exit handlers freeing their workspaces, threads ending),
// and a destroyed pool table or history written then corrupts the host
// heap.
MagpieFns fns;
magpie_torch::PoolFns pool_fns;
magpie_torch::Pools &pools = *new magpie_torch::Pools(&pool_fns);
magpie_torch::History &history = *new magpie_torch::History;
magpie_torch::Stats &stats = *new magpie_torch::Stats;
using magpie_torch::PoolId;

// The current device. PyTorch asks the runtime (cudaGetDevice), which takes
// a lock of its own that threads contend on; the driver's cuCtxGetDevice
// does not (bench/DECISIONS.md, same entry). The current context's device
// is the runtime's current device once the runtime has made its context
// current (cudaSetDevice, PyTorch's device guards); with no context
// current, the runtime's answer.
using ctx_get_device_fn = int (*)(int *);
ctx_get_device_fn ctx_get_device;

c10::DeviceIndex current_device() {
  int d = -1;
  if (ctx_get_device != nullptr && ctx_get_device(&d) == 0) return static_cast<c10::DeviceIndex>(d);
  return c10::cuda::current_device();
}

// MAGPIE_ERR_OUT_OF_MEMORY and MAGPIE_ERR_TOO_LARGE (include/magpie.h).
constexpr int kOutOfMemory = 4;
constexpr int kTooLarge = 5;

// PyTorch's way of printing a size in its out-of-memory message (its own
// tests match it: "Tried to allocate 8.00 GiB").
void format_size(char *buf, size_t n, size_t bytes) {
  if (bytes < 1024) snprintf(buf, n, "%zu bytes", bytes);
  else if (bytes < ((size_t)1 << 20)) snprintf(buf, n, "%.2f KiB", bytes / 1024.0);
  else if (bytes < ((size_t)1 << 30)) snprintf(buf, n, "%.2f MiB", bytes / 1048576.0);
  else snprintf(buf, n, "%.2f GiB", bytes / 1073741824.0);
}

// torch._C._cuda_attach_out_of_memory_observer: called, as by PyTorch's
// allocator, before an out-of-memory error is thrown.
class OomObservers {
 public:
  void add(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver o) {
    std::lock_guard<std::mutex> g(lock_);
    list_.push_back(std::move(o));
  }
  void notify(int64_t device, size_t allocated, size_t total, size_t free) {
    std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> copy;
    {
      std::lock_guard<std::mutex> g(lock_);
      copy = list_;
    }
    for (auto &o : copy) o(device, allocated, total, free);
  }

 private:
  std::mutex lock_;
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> list_;
};

OomObservers &oom_observers = *new OomObservers;

// Throws for a null block from magpie (its error: out of memory, or
// another reason). The message is formatted here, into one string: a
// size_t streamed into TORCH_CHECK's message crashed the process when the
// error was thrown from inside a CUDA graph capture (PyTorch 2.11, H100).
// Out of memory reads as PyTorch's ("CUDA out of memory. Tried to allocate
// ... GPU d has a total capacity of ... of which ... is free."), magpie's
// account of where the device's bytes are following.
void *magpie_checked(void *p, size_t size, cudaStream_t stream, bool custom) {
  if (p != nullptr) return p;
  bool refused = custom && magpie_torch::Pools::refused();
  int code = refused ? kOutOfMemory : custom ? 0 : fns.last_error();
  const char *message = refused  ? "the memory fraction (set_per_process_memory_fraction) leaves no room for another "
                                   "block of the pool's allocator"
                        : custom ? "the pool's allocator returned no memory"
                                 : fns.last_message();
  if (message == nullptr) message = "(no message)";
  char what[1536];
  if ((code == kOutOfMemory || code == kTooLarge) && size >= (size_t)1 << 60) {
    /* PyTorch's own words for such a request, which its tests match. */
    snprintf(what, sizeof what, "Tried to allocate more than 1EB memory. magpie: %s", message);
  } else if (code == kOutOfMemory || code == kTooLarge) {
    int device = current_device();
    size_t free_bytes = 0, total_bytes = 0, in_use = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError(); /* not sticky: nothing to report beyond the sizes */
      free_bytes = total_bytes = 0;
    }
    magpie_stats st;
    if (fns.stats_get(device, &st) == 0) in_use = st.in_use_bytes;
    oom_observers.notify(device, in_use, total_bytes, free_bytes);
    history.oom(device, size, free_bytes, stream);
    char want[32], total[32], avail[32];
    format_size(want, sizeof want, size);
    format_size(total, sizeof total, total_bytes);
    format_size(avail, sizeof avail, free_bytes);
    snprintf(what, sizeof what,
             "Tried to allocate %s. GPU %d has a total capacity of %s of which %s is free. magpie: %s", want, device,
             total, avail, message);
  } else {
    snprintf(what, sizeof what, "magpie could not allocate %zu bytes: %s", size, message);
  }
  if (getenv("MAGPIE_TORCH_DEBUG") != nullptr) fprintf(stderr, "%s (code %d)\n", what, code);
  TORCH_CHECK_WITH(OutOfMemoryError, code != kOutOfMemory && code != kTooLarge, "CUDA out of memory. ",
                   static_cast<const char *>(what));
  TORCH_CHECK(false, static_cast<const char *>(what));
  return nullptr;
}

// torch.profiler(profile_memory=True) hears of each allocation and free, as
// from PyTorch's allocator, with magpie's device totals. The reporter is
// looked up once (c10::memoryProfilingEnabled and
// c10::reportMemoryUsageToProfiler would each look it up again), inline:
// while no profiler listens that lookup is all the tensor path pays.
[[gnu::noinline]] void report_memory(c10::MemoryReportingInfoBase *r, void *ptr, int64_t size, int device) {
  if (!r->memoryProfilingEnabled()) return;
  magpie_stats st;
  size_t in_use = 0, reserved = 0;
  if (fns.stats_get(device, &st) == 0) {
    in_use = st.in_use_bytes;
    reserved = st.reserved_bytes;
  }
  r->reportMemoryUsage(ptr, size, in_use, reserved,
                       c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}
inline void report_to_profiler(void *ptr, int64_t size, int device) {
  auto *r =
      static_cast<c10::MemoryReportingInfoBase *>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE));
  if (C10_UNLIKELY(r != nullptr)) report_memory(r, ptr, size, device);
}

// PyTorch's memory fraction (set_per_process_memory_fraction) covers every
// block PyTorch holds: magpie's mappings and the blocks custom pools hold
// (torch_pools.h). magpie's limit is the fraction of the device less the
// custom pools' bytes, set again as those change; a custom pool's new
// block is admitted while magpie's reserved bytes, the custom pools' and
// it fit in the fraction. At 1 (the default) neither is limited.
class Fraction {
 public:
  Fraction() {
    for (auto &f : fraction_) f.store(1.0, std::memory_order_relaxed);
    for (auto &c : custom_) c.store(0, std::memory_order_relaxed);
  }
  double get(int d) const { return ok(d) ? fraction_[d].load(std::memory_order_relaxed) : 1.0; }
  void set(int d, double f) {
    if (!ok(d)) return;
    fraction_[d].store(f, std::memory_order_relaxed);
    apply(d, true);
  }
  bool admit(int d, size_t bytes) {
    double f = get(d);
    if (f >= 1.0) return true;
    magpie_stats st;
    size_t reserved = fns.stats_get(d, &st) == 0 ? st.reserved_bytes : 0;
    return (double)(reserved + (size_t)custom_[d].load(std::memory_order_relaxed) + bytes) <= f * (double)total(d);
  }
  // Bytes custom pools hold on device (part of PyTorch's reserved bytes).
  size_t custom(int d) const { return ok(d) ? (size_t)custom_[d].load(std::memory_order_relaxed) : 0; }
  void held(int d, int64_t bytes) {
    if (!ok(d)) return;
    custom_[d].fetch_add(bytes, std::memory_order_relaxed);
    apply(d, false);
  }

 private:
  static bool ok(int d) { return d >= 0 && d < kDevices; }
  void apply(int d, bool always) {
    double f = fraction_[d].load(std::memory_order_relaxed);
    if (f >= 1.0 && !always) return;
    double allowed = f * (double)total(d) - (double)custom_[d].load(std::memory_order_relaxed);
    fns.memory_fraction(f >= 1.0 ? 1.0 : (allowed > 0 ? allowed / (double)total(d) : 0.0), d);
  }
  size_t total(int d) {
    size_t t = total_[d].load(std::memory_order_relaxed);
    if (t == 0) {
      cudaDeviceProp prop;
      if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) t = prop.totalGlobalMem;
      else (void)cudaGetLastError();
      total_[d].store(t, std::memory_order_relaxed);
    }
    return t > 0 ? t : 1;
  }
  static constexpr int kDevices = 64;
  std::array<std::atomic<double>, kDevices> fraction_;
  std::array<std::atomic<int64_t>, kDevices> custom_;
  std::array<std::atomic<size_t>, kDevices> total_{};
};

Fraction &fraction = *new Fraction;
bool fraction_admit(int d, size_t bytes) { return fraction.admit(d, bytes); }
void fraction_held(int d, int64_t bytes) { fraction.held(d, bytes); }

// magpie's segments of device (base -> size), from magpie_snapshot_json
// ({"kind":..., "base":N, "size":N, ...} per slab or large segment), and
// a figure of its reserved bytes and segment counts that changes when
// they may have: what the history's segment events compare. Empty, or 0,
// when magpie cannot say.
std::map<uintptr_t, size_t> magpie_segments(int device) {
  std::map<uintptr_t, size_t> out;
  char *text = nullptr;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == nullptr) return out;
  int rc = fns.snapshot_json(device, f);
  fclose(f);
  for (const char *p = rc == 0 ? text : nullptr; p != nullptr && (p = strstr(p, "{\"kind\":\"")) != nullptr; p++) {
    const char *base = strstr(p, "\"base\":"), *size = base != nullptr ? strstr(base, "\"size\":") : nullptr;
    if (size == nullptr) break;
    out[strtoull(base + 7, nullptr, 10)] = strtoull(size + 7, nullptr, 10);
  }
  free(text);
  return out;
}
uint64_t magpie_segment_signature(int device) {
  magpie_stats st;
  if (fns.stats_get(device, &st) != 0) return 0;
  return st.reserved_bytes ^ (st.slab_count << 40) ^ (st.large_segment_count << 52);
}

// A block handed to PyTorch and what its free needs: the stream it was
// allocated on (PyTorch frees on it), its size as asked and as held (the
// statistics: bytes as PyTorch counts them), its device and pool (the
// history), and whether a custom allocator's pool holds it
// (torch_pools.h).
struct Block {
  Block *next; // in a thread's spare records (BlockRecords)
  void *ptr;
  cudaStream_t stream;
  size_t size;
  size_t bytes;
  int device;
  PoolId pool;
  bool custom;
};

// PyTorch's roundup_power2_divisions setting (PYTORCH_ALLOC_CONF or
// torch.cuda.memory._set_allocator_settings): a request above 512 bytes
// times its divisions is rounded up to the next of that many equal steps
// between the powers of two around it, so that requests of nearby sizes
// fit one another's blocks. magpie is asked for the rounded size, as
// PyTorch's allocator carves it; without the setting the request goes to
// magpie as it is, and magpie rounds it to its own classes.
//
// The divisions are PyTorch's table of 16 intervals (1 MiB and under, then
// each power of two to 64 GiB), which its settings rewrite in place. Where
// PyTorch hands out the table itself (a reference), it is read in place as
// PyTorch's own allocator reads it, without the call into libc10 and the
// guards of its instance() on every allocation (bench/DECISIONS.md,
// "PyTorch's tensor path: one thread-local object, the rounding table read
// in place"); otherwise libc10 is asked each time.
using AllocatorConfig = c10::CachingAllocator::AcceleratorAllocatorConfig;
constexpr size_t kRoundupIntervals = 16;
const std::vector<size_t> *roundup_table; // set once by magpie_torch_native_install

void find_roundup_table() {
  if constexpr (std::is_lvalue_reference<decltype(AllocatorConfig::roundup_power2_divisions())>::value) {
    const std::vector<size_t> &t = AllocatorConfig::roundup_power2_divisions();
    if (t.size() == kRoundupIntervals) roundup_table = &t;
  }
}

size_t roundup_divisions(size_t size) {
  const std::vector<size_t> *t = roundup_table;
  if (C10_UNLIKELY(t == nullptr)) return AllocatorConfig::roundup_power2_divisions(size);
  size_t log = 63 - __builtin_clzll(size), first = 20; /* 1 MiB: interval 0 */
  size_t i = log > first ? log - first : 0;
  return (*t)[i < kRoundupIntervals ? i : kRoundupIntervals - 1];
}

size_t rounded_request(size_t size) {
  if (size <= 512) return size; /* a division is at least 1: no setting rounds these */
  size_t div = roundup_divisions(size);
  if (div <= 1 || size <= 512 * div || (size & (size - 1)) == 0) return size;
  size_t floor = size_t(1) << (63 - __builtin_clzll(size));
  size_t step = floor >> (63 - __builtin_clzll(div)); /* divisions taken as a power of two */
  if (step == 0) return floor << 1;
  size_t up = (size + step - 1) / step * step;
  return up >= size ? up : size; /* no wrap at the top of size_t */
}

// The tensor path's thread-local state, one object so that an allocation
// or a free reaches it with one thread-local access: the statistics' way
// to the thread's counters and the thread's spare Block records
// (BlockRecords). Plain data: no initialisation check on its access.
struct PathLocal {
  magpie_torch::Stats::Local stats;
  Block *spare_head; // spare records, linked by Block::next
  int spare_count;   // spares held, plus one once the thread's Drain exists (0: not yet; -1: ending, keep none)
};
PathLocal &path_local() {
  static thread_local PathLocal l;
  return l;
}

// PyTorch's count of a block's bytes (torch_stats.h): the request as
// carved, in 512-byte steps.
inline size_t pytorch_bytes(size_t want) { return want < 512 ? 512 : (want + 511) / 512 * 512; }

// The statistics and the history hear of block b handed out (or restored
// by a checkpoint, which the profiler does not hear of).
C10_ALWAYS_INLINE void count_alloc(const Block &b, PathLocal &l) {
  stats.alloc(l.stats, b.device, b.bytes, b.size);
  history.alloc(b.device, b.ptr, b.size, b.stream, b.pool);
}

// ... and the profiler too, for a block handed out.
C10_ALWAYS_INLINE void note_alloc(const Block &b, PathLocal &l) {
  count_alloc(b, l);
  report_to_profiler(b.ptr, static_cast<int64_t>(b.size), b.device);
}

// b as served (b.ptr null: refused; magpie: whether magpie was asked),
// counted; an allocation magpie refused for memory may come from a pool
// made with use_on_oom. Throws when there is none.
Block served(Block b, size_t want, PathLocal &l, bool magpie) {
  if (C10_UNLIKELY(b.ptr == nullptr)) {
    if (magpie && fns.last_error() == kOutOfMemory) {
      b.ptr = pools.alloc_on_oom(b.device, want, b.stream, &b.pool, &b.custom);
      if (b.ptr == nullptr) b.custom = false; /* magpie's error stands */
    }
    if (b.ptr == nullptr) {
      if (b.size == 0 && b.custom) return b; /* no memory asked: none given, as PyTorch's */
      magpie_checked(nullptr, want, b.stream, b.custom);
    }
  }
  b.bytes = pytorch_bytes(want);
  note_alloc(b, l);
  return b;
}

// The record of a block at ptr of size bytes as asked (bytes: as PyTorch's
// statistics count it) on stream, magpie's own (no pool).
inline Block block_at(void *ptr, cudaStream_t stream, size_t size, size_t bytes, int device) {
  return Block{nullptr, ptr, stream, size, bytes, device, {0, 0}, false};
}

// A block for stream: from the pool an announcement routes it to, else
// magpie's (served).
Block magpie_alloc(size_t size, cudaStream_t stream, int device, PathLocal &l) {
  Block b = block_at(nullptr, stream, size, size, device);
  size_t want = rounded_request(size);
  bool routed = false;
  b.ptr = pools.alloc(want, stream, &routed, &b.pool, &b.custom);
  if (!routed) b.ptr = fns.malloc_async(want, stream);
  return served(b, want, l, !routed);
}

C10_ALWAYS_INLINE void magpie_release(const Block &b, PathLocal &l) {
  if (b.ptr == nullptr) return;
  stats.free(l.stats, b.device, b.bytes, b.size);
  history.free(b.device, b.ptr, b.size, b.stream, b.pool);
  report_to_profiler(b.ptr, -static_cast<int64_t>(b.size), b.device);
  if (!b.custom || !pools.free_custom(b.ptr)) fns.free_async(b.ptr, b.stream);
}

// A tensor's Block record (its DataPtr's context) comes from the
// allocating thread's spare records and goes back to the freeing thread's:
// new and delete were a large share of the tensor path's own work
// (bench/DECISIONS.md, "PyTorch's tensor path: records reused per thread,
// one profiler lookup"). A thread keeps up to kMax spares in its PathLocal;
// its last thread-local destructor deletes them, and records freed after
// that are deleted at once.
class BlockRecords {
 public:
  static Block *take(PathLocal &l, const Block &b) {
    Block *r = l.spare_head;
    if (C10_LIKELY(r != nullptr)) {
      l.spare_head = r->next;
      l.spare_count--;
      *r = b;
      return r;
    }
    return new Block(b);
  }
  static void give(PathLocal &l, Block *r) {
    if (C10_LIKELY(l.spare_count > 0 && l.spare_count < kMax)) {
      r->next = l.spare_head;
      l.spare_head = r;
      l.spare_count++;
      return;
    }
    give_slow(l, r);
  }

 private:
  static constexpr int kMax = 64;
  struct Drain {
    ~Drain() {
      PathLocal &l = path_local();
      for (Block *r = l.spare_head, *next; r != nullptr; r = next) {
        next = r->next;
        delete r;
      }
      l.spare_head = nullptr;
      l.spare_count = -1;
    }
  };
  [[gnu::noinline]] static void give_slow(PathLocal &l, Block *r) {
    if (l.spare_count == 0) { // the thread's first: its Drain deletes its spares when it ends
      static thread_local Drain drain;
      (void)drain;
      l.spare_count = 1;
      give(l, r);
      return;
    }
    delete r; // full, or the thread is ending
  }
};

void delete_block(void *ctx) {
  Block *b = static_cast<Block *>(ctx);
  PathLocal &l = path_local();
  magpie_release(*b, l);
  BlockRecords::give(l, b);
}

class MagpieAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  MagpieAllocator()
      // The base class's own allocation paths, which this class overrides
      // all of: magpie's blocks, outside the statistics and the history
      // alike.
      : CUDAPluggableAllocator(
            [](size_t size, int, cudaStream_t stream) {
              return magpie_checked(fns.malloc_async(size, stream), size, stream, false);
            },
            [](void *ptr, size_t, int, cudaStream_t stream) { fns.free_async(ptr, stream); }) {
    set_record_stream_fn(fns.record_stream);
    set_reset_fn(fns.empty_cache);
    set_memory_fraction_fn(fns.memory_fraction);
  }

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    PathLocal &l = path_local();
    Block b;
    if (C10_LIKELY(!pools.announced())) {
      // The tensor path: magpie's block, its record written in place.
      size_t want = rounded_request(size);
      void *p = fns.malloc_async(want, stream);
      if (C10_LIKELY(p != nullptr)) {
        Block *r = BlockRecords::take(l, block_at(p, stream, size, pytorch_bytes(want), device));
        note_alloc(*r, l);
        return {p, r, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
      }
      b = served(block_at(nullptr, stream, size, size, device), want, l, true);
    } else {
      b = magpie_alloc(size, stream, device, l);
    }
    if (b.pool.first == 0 && b.pool.second == 0)
      return {b.ptr, BlockRecords::take(l, b), &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
    // A pool's block is PyTorch's kind of DataPtr (context the pointer,
    // deleter raw_deleter()): cudagraph trees swap such deleters and free
    // through raw_delete.
    if (b.ptr != nullptr) remember(b);
    return {b.ptr, b.ptr, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device)};
  }

  void *raw_alloc(size_t nbytes) override {
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(current_device()).stream());
  }

  void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    int device = current_device();
    if (!enabled_.load(std::memory_order_relaxed)) return direct_alloc(nbytes, device);
    Block b = magpie_alloc(nbytes, stream, device, path_local());
    if (b.ptr != nullptr) remember(b);
    return b.ptr;
  }

  void raw_delete(void *ptr) override {
    if (ptr == nullptr) return;
    Block b;
    {
      Shard &s = shard(ptr);
      std::lock_guard<std::mutex> g(s.lock);
      auto it = s.blocks.find(ptr);
      if (it == s.blocks.end()) {
        if (direct_free(ptr)) return;
        // Called from DataPtr deleters, where a throw ends the process:
        // warn and leave the pointer alone.
        TORCH_WARN("magpie: raw_delete of ", ptr, ", which magpie's allocator did not hand out (or freed already)");
        return;
      }
      b = it->second;
      s.blocks.erase(it);
    }
    magpie_release(b, path_local());
  }

  // Pools: torch_pools.h.
  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    pools.begin(device, mempool_id, std::move(filter));
  }

  void endAllocateToPool(c10::DeviceIndex, c10::cuda::MempoolId_t mempool_id) override { pools.end(mempool_id); }

  void releasePool(c10::DeviceIndex, c10::cuda::MempoolId_t mempool_id) override { pools.release(mempool_id); }

  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                          std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    pools.create_or_incref(device, mempool_id, std::move(allocator));
  }

  int getPoolUseCount(c10::DeviceIndex, c10::cuda::MempoolId_t mempool_id) override {
    return pools.use_count(mempool_id);
  }

  void setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t mempool_id, bool use_on_oom) override {
    pools.set_use_on_oom(mempool_id, use_on_oom);
  }

  // Allocator checkpoints (cudagraph trees, torch.compile's
  // mode="reduce-overhead"): the state of a pool is its live blocks;
  // restoring it frees the pool's blocks that were not live then and hands
  // out again those that were (magpie_graph_pool_take: a pool's blocks
  // stay its own until it is released, so each is still there, at its
  // address). PyTorch is told every live block was freed and every
  // checkpointed block allocated, with DataPtrs it gives to the storages
  // it keeps.
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, c10::cuda::MempoolId_t id) override {
    auto st = std::make_shared<PoolState>();
    st->device = device;
    st->pool = id;
    st->live = live_in(id);
    return st;
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override {
    auto st = std::dynamic_pointer_cast<PoolState>(pps);
    TORCH_CHECK(st != nullptr, "magpie: setCheckpointPoolState of a state magpie did not make");
    uint64_t magpie_pool = pools.magpie_pool(st->pool);
    TORCH_CHECK(magpie_pool != 0, "magpie: checkpoints of pool (", st->pool.first, ", ", st->pool.second,
                "), which is not one of magpie's graph pools");
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    std::unordered_map<void *, Block> then;
    for (const Block &b : st->live) then[b.ptr] = b;
    for (const Block &b : live_in(st->pool)) {
      delta.ptrs_freed.push_back(b.ptr);
      if (then.count(b.ptr) != 0) continue; /* live then and now: stays allocated */
      forget(b.ptr);
      magpie_release(b, path_local());
    }
    for (auto &kv : then) {
      const Block &b = kv.second;
      if (!known(b.ptr)) {
        size_t size = 0;
        TORCH_CHECK(fns.graph_pool_take(magpie_pool, b.ptr, b.stream, &size) == 0,
                    "magpie: cannot restore the checkpoint: ", fns.last_message());
        remember(b);
        count_alloc(b, path_local());
      }
      delta.dataptrs_allocd.emplace_back(b.ptr, b.ptr, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // Whether the pool's live blocks are exactly expected.
  bool checkPoolLiveAllocations(c10::DeviceIndex, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void *> &expected) override {
    std::vector<Block> live = live_in(id);
    if (live.size() != expected.size()) return false;
    for (const Block &b : live)
      if (expected.count(b.ptr) == 0) return false;
    return true;
  }

  // torch.cuda.caching_allocator_enable(False): the raw interface then
  // takes and gives back device memory with cudaMalloc and cudaFree, as
  // PyTorch's allocator does, outside magpie and its statistics; tensors
  // still come from magpie.
  void enable(bool value) override { enabled_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return enabled_.load(std::memory_order_relaxed); }

  // magpie never splits a pool's block (each is one large block).
  void setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) override {}

  // torch.cuda.empty_cache() ({0, 0}: every device's cached memory and the
  // pools no longer used) or a MemPool's ({0, 0} is no pool's id).
  void emptyCache(c10::cuda::MempoolId_t mempool_id) override {
    std::shared_ptr<c10::GatheredContext> ctx = history.release_begin();
    if (mempool_id.first == 0 && mempool_id.second == 0) fns.empty_cache();
    pools.empty_cache(mempool_id);
    history.release_end(ctx);
  }

  // Memory history: torch_history.h.
  bool isHistoryEnabled() override { return history.on(); }
  void setUserMetadata(const std::string &metadata) override { history.set_user_metadata(metadata); }
  std::string getUserMetadata() override { return history.user_metadata(); }
  void pushCompileContext(std::string &md) override { history.push_compile_context(md); }
  void popCompileContext() override { history.pop_compile_context(); }

  void recordHistory(bool enabled, c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, c10::cuda::CUDACachingAllocator::RecordContext when,
                     bool clearHistory, const std::vector<std::string> &skip_actions) override {
    history.configure(enabled, context_recorder, alloc_trace_max_entries, when, clearHistory, skip_actions);
  }

  // torch.cuda.memory._snapshot's C++ half (magpie.torch adds magpie's
  // segments): the traces, each pool's blocks as segments of that pool
  // (mempool_id's only, unless {0, 0}), and the frames of live allocations
  // recorded with their context as segments of pool {0, 0}.
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool_id,
                                                         bool include_traces) override {
    c10::cuda::CUDACachingAllocator::SnapshotInfo out;
    history.snapshot(out, c10::cuda::device_count(), mempool_id, include_traces);
    // One segment per magpie block or custom pool segment, its blocks in
    // address order (blocks() lists them so).
    std::unordered_map<void *, size_t> seg_of;
    for (const magpie_torch::PoolBlock &b : pools.blocks(mempool_id)) {
      auto at = seg_of.find(b.segment);
      if (at == seg_of.end()) {
        c10::cuda::CUDACachingAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(b.device);
        seg.address = reinterpret_cast<size_t>(b.segment);
        seg.total_size = b.segment_size;
        seg.requested_size = seg.allocated_size = seg.active_size = 0;
        seg.stream = b.stream;
        seg.is_large = true;
        seg.owner_private_pool_id = b.pool;
        at = seg_of.emplace(b.segment, out.segments.size()).first;
        out.segments.push_back(std::move(seg));
      }
      c10::cuda::CUDACachingAllocator::SegmentInfo &seg = out.segments[at->second];
      if (b.used) {
        seg.requested_size += b.size;
        seg.allocated_size += b.size;
        seg.active_size += b.size;
      }
      c10::CachingDeviceAllocator::BlockInfo blk;
      blk.size = b.size;
      blk.requested_size = b.used ? b.size : 0;
      blk.allocated = blk.active = b.used;
      seg.blocks.push_back(std::move(blk));
    }
    return out;
  }

  // torch.cuda.get_per_process_memory_fraction: the fraction last set on
  // the device (1 before any), which magpie holds as its limit.
  double getMemoryFraction(c10::DeviceIndex device) override { return fraction.get(device); }

  void setMemoryFraction(double f, c10::DeviceIndex device) override {
    if (!(f >= 0.0 && f <= 1.0)) { /* refused, with the reason in magpie_last_error */
      CUDAPluggableAllocator::setMemoryFraction(f, device);
      return;
    }
    fraction.set(device, f);
  }

  // torch.cuda.memory_stats(), torch.accelerator.memory_stats() and every
  // other caller: PyTorch's figures of the blocks this allocator handed out
  // (torch_stats.h: allocation, active, allocated, active and requested
  // bytes, per pool, with running totals), and magpie's of the device
  // memory behind them: reserved bytes (mapped, plus the blocks custom
  // pools hold; the large pool is the large segments and those blocks) and
  // their peak, segments (slabs and large segments),
  // failed requests and device synchronisations.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    c10::CachingDeviceAllocator::DeviceStats out;
    stats.fill(device, out);
    magpie_stats st;
    if (fns.stats_get(device, &st) != 0) return out;
    constexpr size_t kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    constexpr size_t kSmall = static_cast<size_t>(c10::CachingAllocator::StatType::SMALL_POOL);
    constexpr size_t kLarge = static_cast<size_t>(c10::CachingAllocator::StatType::LARGE_POOL);
    auto set = [](c10::CachingAllocator::Stat &s, size_t current, size_t peak) {
      s.current = static_cast<int64_t>(current);
      s.peak = static_cast<int64_t>(peak > current ? peak : current);
    };
    size_t small_reserved = st.reserved_bytes > st.large_mapped_bytes ? st.reserved_bytes - st.large_mapped_bytes : 0;
    size_t custom = fraction.custom(device); /* custom pools' blocks: large segments to PyTorch */
    set(out.reserved_bytes[kAll], st.reserved_bytes + custom, st.peak_reserved_bytes + custom);
    set(out.reserved_bytes[kLarge], st.large_mapped_bytes + custom, 0);
    set(out.reserved_bytes[kSmall], small_reserved, 0);
    set(out.segment[kAll], st.slab_count + st.large_segment_count, 0);
    set(out.segment[kLarge], st.large_segment_count, 0);
    set(out.segment[kSmall], st.slab_count, 0);
    int d = device >= 0 && device < kDevices ? device : 0;
    out.num_ooms = static_cast<int64_t>(st.ladder_steps[5] - ooms_base_[d].load(std::memory_order_relaxed));
    out.num_sync_all_streams = static_cast<int64_t>(st.device_syncs - syncs_base_[d].load(std::memory_order_relaxed));
    out.max_split_size = -1;
    return out;
  }

  // torch.cuda.reset_peak_memory_stats: PyTorch's peaks and magpie's.
  void resetPeakStats(c10::DeviceIndex device) override {
    stats.reset_peaks(device);
    fns.stats_reset_peaks(device);
  }

  // torch.cuda.reset_accumulated_memory_stats: the running totals, failed
  // requests and synchronisations restart at 0.
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    stats.reset_accumulated(device);
    magpie_stats st;
    if (device < 0 || device >= kDevices || fns.stats_get(device, &st) != 0) return;
    ooms_base_[device].store(st.ladder_steps[5], std::memory_order_relaxed);
    syncs_base_[device].store(st.device_syncs, std::memory_order_relaxed);
  }

  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    oom_observers.add(std::move(observer));
  }

  std::string name() override { return "magpie"; }

 private:
  static constexpr int kDevices = 64;
  struct Shard {
    std::mutex lock;
    std::unordered_map<void *, Block> blocks;
  };
  std::array<Shard, 64> shards_;
  std::atomic<bool> enabled_{true};
  std::array<std::atomic<uint64_t>, kDevices> ooms_base_{}, syncs_base_{};
  std::mutex direct_lock_;
  std::unordered_map<void *, int> direct_; // cudaMalloc'd while disabled, by device

  void *direct_alloc(size_t nbytes, int device) {
    void *p = nullptr;
    if (nbytes == 0) return nullptr;
    if (cudaMalloc(&p, nbytes) != cudaSuccess) {
      (void)cudaGetLastError();
      char want[32];
      format_size(want, sizeof want, nbytes);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", want,
                       " with cudaMalloc (torch.cuda.caching_allocator_enable(False))");
    }
    std::lock_guard<std::mutex> g(direct_lock_);
    direct_[p] = device;
    return p;
  }

  bool direct_free(void *p) {
    {
      std::lock_guard<std::mutex> g(direct_lock_);
      if (direct_.erase(p) == 0) return false;
    }
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
    return true;
  }

  struct PoolState : c10::cuda::CUDACachingAllocator::AllocatorState {
    c10::DeviceIndex device = 0;
    PoolId pool{0, 0};
    std::vector<Block> live;
  };

  // The raw interface's blocks and every pool's live block (freed by
  // raw_delete): by pointer, in 64 separately locked shards.
  void remember(const Block &b) {
    Shard &s = shard(b.ptr);
    std::lock_guard<std::mutex> g(s.lock);
    s.blocks[b.ptr] = b;
  }
  void forget(void *p) {
    Shard &s = shard(p);
    std::lock_guard<std::mutex> g(s.lock);
    s.blocks.erase(p);
  }
  bool known(void *p) {
    Shard &s = shard(p);
    std::lock_guard<std::mutex> g(s.lock);
    return s.blocks.count(p) != 0;
  }
  std::vector<Block> live_in(PoolId id) {
    std::vector<Block> out;
    for (Shard &s : shards_) {
      std::lock_guard<std::mutex> g(s.lock);
      for (auto &kv : s.blocks)
        if (kv.second.pool == id) out.push_back(kv.second);
    }
    return out;
  }

  Shard &shard(void *p) { return shards_[(reinterpret_cast<uintptr_t>(p) >> 8) * 0x9E3779B97F4A7C15ull >> 58]; }
};

std::string install_error;

} // namespace

extern "C" {

// The names of the libmagpie.so functions magpie_torch_native_install
// takes, in order, ending with a null: the one list its callers
// (magpie._shim, bench/torch_threads.cpp) look them up by.
__attribute__((visibility("default"))) extern const char *const magpie_torch_native_names[] = {
    "magpie_malloc_async",
    "magpie_free_async",
    "magpie_last_error",
    "magpie_last_error_message",
    "magpie_torch_record_stream",
    "magpie_torch_empty_cache",
    "magpie_torch_set_memory_fraction",
    "magpie_graph_pool_create",
    "magpie_capture_begin",
    "magpie_capture_end",
    "magpie_graph_pool_malloc_async",
    "magpie_graph_pool_release",
    "magpie_stats_get",
    "magpie_stats_reset_peaks",
    "magpie_graph_pool_trim",
    "magpie_graph_pool_blocks",
    "magpie_graph_pool_take",
    "magpie_snapshot_json",
    nullptr};

// Makes MagpieAllocator PyTorch's CUDA allocator. fn: the functions
// magpie_torch_native_names names, in its order. 0; -1 if one is missing;
// -2 if PyTorch refused (e.g. its allocator was already in use), with the
// reason in magpie_torch_native_error(). Nothing is thrown to the caller
// (ctypes).
__attribute__((visibility("default"))) const char *magpie_torch_native_error() { return install_error.c_str(); }

__attribute__((visibility("default"))) int magpie_torch_native_install(void *const *fn) {
  static_assert(sizeof magpie_torch_native_names / sizeof *magpie_torch_native_names == 19,
                "fn[0..17] below follow magpie_torch_native_names");
  for (int i = 0; magpie_torch_native_names[i] != nullptr; i++)
    if (fn[i] == nullptr) return -1;
  fns.malloc_async = reinterpret_cast<void *(*)(size_t, cudaStream_t)>(fn[0]);
  fns.free_async = reinterpret_cast<int (*)(void *, cudaStream_t)>(fn[1]);
  fns.last_error = reinterpret_cast<int (*)()>(fn[2]);
  fns.last_message = reinterpret_cast<const char *(*)()>(fn[3]);
  fns.record_stream = reinterpret_cast<void (*)(void *, cudaStream_t)>(fn[4]);
  fns.empty_cache = reinterpret_cast<void (*)()>(fn[5]);
  fns.memory_fraction = reinterpret_cast<void (*)(double, int)>(fn[6]);
  fns.graph_pool_create = reinterpret_cast<int (*)(int, uint64_t *)>(fn[7]);
  fns.capture_begin = reinterpret_cast<int (*)(uint64_t, cudaStream_t)>(fn[8]);
  fns.capture_end = reinterpret_cast<int (*)(uint64_t, cudaStream_t)>(fn[9]);
  fns.graph_pool_malloc = reinterpret_cast<void *(*)(uint64_t, size_t, cudaStream_t)>(fn[10]);
  fns.graph_pool_release = reinterpret_cast<int (*)(uint64_t)>(fn[11]);
  fns.stats_get = reinterpret_cast<int (*)(int, magpie_stats *)>(fn[12]);
  fns.stats_reset_peaks = reinterpret_cast<int (*)(int)>(fn[13]);
  fns.graph_pool_trim = reinterpret_cast<int (*)(uint64_t)>(fn[14]);
  fns.graph_pool_blocks = reinterpret_cast<int (*)(uint64_t, magpie_pool_block *, size_t, size_t *)>(fn[15]);
  fns.graph_pool_take = reinterpret_cast<int (*)(uint64_t, void *, cudaStream_t, size_t *)>(fn[16]);
  fns.snapshot_json = reinterpret_cast<int (*)(int, FILE *)>(fn[17]);
  history.set_segment_source(
      {magpie_segments, magpie_segment_signature, []() { return (int)c10::cuda::device_count(); }});
  pool_fns = magpie_torch::PoolFns{
      fns.graph_pool_create, fns.capture_begin,     fns.capture_end,  fns.graph_pool_malloc, fns.graph_pool_release,
      fns.graph_pool_trim,   fns.graph_pool_blocks, fns.last_message, fraction_admit,        fraction_held};
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (cuda == nullptr) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (cuda != nullptr) ctx_get_device = reinterpret_cast<ctx_get_device_fn>(dlsym(cuda, "cuCtxGetDevice"));
  try {
    find_roundup_table();
    auto allocator = std::make_shared<MagpieAllocator>();
    new std::shared_ptr<MagpieAllocator>(allocator); /* never released: see fns above */
    allocator->init(c10::cuda::device_count());
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
    /* torch.accelerator's memory functions (memory_stats,
     * reset_peak_memory_stats, ...) ask the allocator registered for the
     * device type, which changeCurrentAllocator leaves as PyTorch's own
     * (PyTorch 2.11: "Invalid device argument" from its uninitialised
     * caching allocator); the pluggable allocator keeps this one alive. */
    c10::SetAllocator(c10::DeviceType::CUDA, allocator.get(), UINT8_MAX);
  } catch (const std::exception &e) {
    install_error = e.what();
    return -2;
  }
  return 0;
}

} // extern "C"
