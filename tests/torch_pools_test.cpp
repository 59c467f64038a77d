// python/magpie/torch_pools.h's custom-allocator pools (torch.cuda.MemPool
// with an allocator) against fakes of CUDA's events and of the allocator:
// a free block splits for smaller requests and merges again, serves its
// own stream at once and another only once its free's event completed,
// neighbours freed on two streams merge only once both are ready, a free
// during a capture waits for a device synchronisation, and segments go
// back to the allocator only whole. tests/gpu/torch_mempool_test.py checks
// the same pools under PyTorch on a GPU.
#include <stdlib.h>

#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <vector>

#include "magpie.h"
#include "magpie_test_check.h"
#include "torch_pools.h"

namespace {

// ---- CUDA's events, faked: an event completes when the test says its
// stream's work did (finish) or at a device synchronisation.
struct FakeEvent {
  cudaStream_t stream;
  bool done;
};
std::set<FakeEvent *> events;
std::set<cudaStream_t> capturing;
int device_syncs = 0;
bool bad_event = false; // a call on an event destroyed or never made

bool known(cudaEvent_t e) {
  bool ok = events.count(reinterpret_cast<FakeEvent *>(e)) != 0;
  if (!ok) bad_event = true;
  return ok;
}

void finish(cudaStream_t s) {
  for (FakeEvent *e : events)
    if (e->stream == s) e->done = true;
}

struct FakeAllocator : c10::cuda::CUDACachingAllocator::CUDAAllocator {
  int allocs = 0, frees = 0;
  size_t live = 0;
  std::map<void *, size_t> blocks;
  void *raw_alloc_with_stream(size_t n, cudaStream_t) override {
    void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    blocks[p] = n;
    allocs++;
    live += n;
    return p;
  }
  void raw_delete(void *p) override {
    auto it = blocks.find(p);
    CHECK(it != blocks.end()); // only whole segments go back
    if (it == blocks.end()) return;
    live -= it->second;
    blocks.erase(it);
    frees++;
    free(p);
  }
};

bool admit_all = true;
int64_t held = 0;
bool admit(int, size_t) { return admit_all; }
void hold(int, int64_t bytes) { held += bytes; }
const char *no_message() { return ""; }

const magpie_torch::PoolFns fns = {nullptr, nullptr, nullptr,    nullptr, nullptr,
                                   nullptr, nullptr, no_message, admit,   hold};

constexpr size_t kMiB = size_t(1) << 20;
cudaStream_t s1 = reinterpret_cast<cudaStream_t>(0x1000), s2 = reinterpret_cast<cudaStream_t>(0x2000),
             s3 = reinterpret_cast<cudaStream_t>(0x3000);

struct Fixture {
  magpie_torch::Pools pools{&fns};
  std::shared_ptr<FakeAllocator> fake = std::make_shared<FakeAllocator>();
  magpie_torch::PoolId id{0, 7};
  Fixture() {
    pools.create_or_incref(0, id, fake);
    pools.begin(0, id, [](cudaStream_t) { return true; });
  }
  void *alloc(size_t size, cudaStream_t s) {
    bool routed = false, custom = false;
    magpie_torch::PoolId pool{0, 0};
    void *p = pools.alloc(size, s, &routed, &pool, &custom);
    CHECK(routed && custom && pool == id);
    return p;
  }
  void release(void *p) { CHECK(pools.free_custom(p)); }
  // use_mem_pool's end, then the MemPool's: the pool is no longer used.
  void close() {
    pools.end(id);
    pools.release(id);
    pools.release(id);
  }
  // The pool's blocks of segment seg: (offset, size, used).
  std::vector<std::tuple<size_t, size_t, bool>> pieces(void *seg) {
    std::vector<std::tuple<size_t, size_t, bool>> out;
    for (const magpie_torch::PoolBlock &b : pools.blocks(id))
      if (b.segment == seg) out.emplace_back(static_cast<char *>(b.ptr) - static_cast<char *>(seg), b.size, b.used);
    return out;
  }
};

void test_split_and_merge() {
  Fixture f;
  char *seg = static_cast<char *>(f.alloc(40 * kMiB, s1));
  CHECK(seg != nullptr && f.fake->allocs == 1);
  f.release(seg);
  // Its own stream takes it at once, split, before the free's work ran.
  void *b = f.alloc(20 * kMiB, s1), *c = f.alloc(20 * kMiB, s1);
  CHECK(b == seg && c == seg + 20 * kMiB && f.fake->allocs == 1);
  using P = std::tuple<size_t, size_t, bool>;
  CHECK((f.pieces(seg) == std::vector<P>{P{0, 20 * kMiB, true}, P{20 * kMiB, 20 * kMiB, true}}));
  // A small request leaves a rest of 512 bytes or more; a large one a rest
  // past 1 MiB, else it takes the block whole.
  f.release(c);
  void *d = f.alloc(1000, s1);
  CHECK(d == seg + 20 * kMiB);
  CHECK((f.pieces(seg)[1] == P{20 * kMiB, 1024, true}));
  f.release(d);
  void *e = f.alloc(19 * kMiB + kMiB / 2, s1);
  CHECK(e == seg + 20 * kMiB && std::get<1>(f.pieces(seg)[1]) == 20 * kMiB);
  f.release(e);
  f.release(b);
  // Freed on one stream, the halves are one block again.
  CHECK((f.pieces(seg) == std::vector<P>{P{0, 40 * kMiB, false}}));
  CHECK(f.alloc(40 * kMiB, s1) == seg && f.fake->allocs == 1);
  f.release(seg);
  finish(s1);
  f.close();
  f.pools.empty_cache({0, 0});
  CHECK(f.fake->live == 0 && f.fake->frees == 1 && held == 0);
}

void test_other_stream_waits() {
  Fixture f;
  char *seg = static_cast<char *>(f.alloc(8 * kMiB, s1));
  f.release(seg);
  // Another stream: not before the free's event completed.
  void *other = f.alloc(8 * kMiB, s2);
  CHECK(other != seg && f.fake->allocs == 2);
  f.release(other);
  finish(s1);
  CHECK(f.alloc(8 * kMiB, s3) == seg && f.fake->allocs == 2);
  f.release(seg);
  finish(s2);
  finish(s3);
  f.pools.empty_cache(f.id);
  CHECK(f.fake->live == 0 && f.fake->frees == 2);
  f.close();
}

void test_streams_merge_once_ready() {
  Fixture f;
  char *seg = static_cast<char *>(f.alloc(40 * kMiB, s1));
  f.release(seg);
  finish(s1);
  void *x = f.alloc(20 * kMiB, s2), *y = f.alloc(20 * kMiB, s3);
  CHECK(x == seg && y == seg + 20 * kMiB && f.fake->allocs == 1);
  f.release(x);
  f.release(y);
  // Freed on two streams whose work has not run: two blocks, and neither
  // serves a third stream.
  CHECK(f.pieces(seg).size() == 2);
  void *z = f.alloc(40 * kMiB, s1);
  CHECK(z != seg && f.fake->allocs == 2);
  f.release(z);
  finish(s2);
  finish(s3);
  // (Asked on s2: on s1, z's own block would serve as well.)
  CHECK(f.alloc(40 * kMiB, s2) == seg && f.fake->allocs == 2);
  CHECK(f.pieces(seg).size() == 1);
  f.release(seg);
  finish(s1);
  finish(s2);
  f.pools.empty_cache(f.id);
  CHECK(f.fake->live == 0);
  f.close();
}

void test_capture_free_waits_for_sync() {
  Fixture f;
  char *seg = static_cast<char *>(f.alloc(4 * kMiB, s1));
  capturing.insert(s1);
  f.release(seg); // no event can be recorded: the capture would hold it
  capturing.erase(s1);
  void *other = f.alloc(4 * kMiB, s2);
  CHECK(other != seg && f.fake->allocs == 2);
  f.release(other);
  finish(s2);
  int syncs = device_syncs;
  f.pools.empty_cache(f.id);
  CHECK(device_syncs > syncs && f.fake->live == 0 && f.fake->frees == 2);
  f.close();
}

void test_fraction_takes_any_size() {
  Fixture f;
  char *seg = static_cast<char *>(f.alloc(40 * kMiB, s1));
  f.release(seg);
  finish(s1);
  admit_all = false; // the memory fraction leaves no room for a new segment
  void *b = f.alloc(20 * kMiB, s2), *c = f.alloc(20 * kMiB, s2);
  CHECK(b == seg && c == seg + 20 * kMiB && f.fake->allocs == 1);
  void *d = f.alloc(kMiB, s2);
  CHECK(d == nullptr && magpie_torch::Pools::refused());
  admit_all = true;
  f.release(b);
  f.release(c);
  finish(s2);
  f.close();
  f.pools.empty_cache({0, 0});
  CHECK(f.fake->live == 0 && held == 0);
}

} // namespace

// ---- the fakes' definitions of CUDA's calls
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
  *status = capturing.count(stream) != 0 ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int) {
  FakeEvent *e = new FakeEvent{nullptr, true};
  events.insert(e);
  *event = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (!known(event)) return cudaSuccess;
  auto *e = reinterpret_cast<FakeEvent *>(event);
  e->stream = stream;
  e->done = false;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  return known(event) && reinterpret_cast<FakeEvent *>(event)->done ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (known(event)) reinterpret_cast<FakeEvent *>(event)->done = true;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (!known(event)) return cudaSuccess;
  events.erase(reinterpret_cast<FakeEvent *>(event));
  delete reinterpret_cast<FakeEvent *>(event);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  device_syncs++;
  for (FakeEvent *e : events) e->done = true;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }

int main() {
  test_split_and_merge();
  test_other_stream_waits();
  test_streams_merge_once_ready();
  test_capture_free_waits_for_sync();
  test_fraction_takes_any_size();
  CHECK(events.empty() && !bad_event); // every event destroyed once
  return magpie_test::check_report("torch_pools_test");
}
