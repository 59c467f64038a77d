// C++ threads allocating through libtorch's CUDA allocator, one stream per
// thread (made current), 1-16 threads, in three forms: the tensor path
// (allocator->allocate(size), a DataPtr dropped at once: what a tensor's
// storage does), a whole tensor (at::empty of size bytes on the GPU,
// dropped at once: the dispatcher, the tensor's objects and its storage's
// allocation) and the raw interface (raw_alloc_with_stream / raw_delete).
// Allocators: PyTorch's own caching allocator, magpie behind
// PyTorch's CUDAPluggableAllocator (one std::mutex and an unordered_map
// update per call), magpie's own PyTorch allocator (python/magpie/
// torch_native.cpp, as magpie.torch.use() installs it: no lock on the
// allocation paths), and magpie called directly (no PyTorch at all).
//
// Built on a machine with PyTorch (bench/torch_threads.sh); run:
//   torch_threads MODE LIBMAGPIE [SIZE] [SECONDS]
//   MODE: native | pluggable | magpie | direct
//   (magpie: $MAGPIE_TORCH_NATIVE names the built torch_native library)
// Prints one line per form: total alloc+free pairs per second at each thread
// count ($MAGPIE_BENCH_THREADS, default 1 2 4 8 16). $MAGPIE_BENCH_FORMS
// ("allocate", "empty", "raw") runs only the forms it names.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/types.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using malloc_fn = void *(*)(ssize_t, int, cudaStream_t);
using free_fn = void (*)(void *, ssize_t, int, cudaStream_t);
using direct_malloc_fn = void *(*)(size_t, cudaStream_t);
using direct_free_fn = int (*)(void *, cudaStream_t);

direct_malloc_fn direct_malloc;
direct_free_fn direct_free;

enum class Form { allocate, empty, raw };

double run(const std::string &mode, Form form, int threads, size_t size, double seconds) {
  std::atomic<bool> go{false}, stop{false};
  std::atomic<int> ready{0};
  std::vector<unsigned long long> counts(threads, 0);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; t++) {
    ts.emplace_back([&, t] {
      cudaSetDevice(0);
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromExternal(s, 0));
      auto *allocator = c10::cuda::CUDACachingAllocator::get();
      const bool direct = mode == "direct";
      auto pair = [&] {
        if (direct) {
          direct_free(direct_malloc(size, s), s);
        } else if (form == Form::raw) {
          c10::cuda::CUDACachingAllocator::raw_delete(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size, s));
        } else if (form == Form::empty) {
          at::Tensor t =
              at::empty({static_cast<int64_t>(size)}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0));
        } else {
          c10::DataPtr d = allocator->allocate(size);
        }
      };
      for (int i = 0; i < 1000; i++) pair(); // warm: caches, maps
      ready++;
      while (!go.load()) std::this_thread::yield();
      unsigned long long n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        for (int i = 0; i < 256; i++) pair();
        n += 256;
      }
      counts[t] = n;
      cudaStreamSynchronize(s);
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  auto t0 = std::chrono::steady_clock::now();
  go = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto &t : ts) t.join();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  unsigned long long total = 0;
  for (auto c : counts) total += c;
  return total / dt;
}

} // namespace

int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s native|pluggable|magpie|direct LIBMAGPIE [SIZE] [SECONDS]\n", argv[0]);
    return 2;
  }
  std::string mode = argv[1];
  size_t size = argc > 3 ? std::strtoull(argv[3], nullptr, 0) : 4096;
  double seconds = argc > 4 ? std::atof(argv[4]) : 1.0;
  cudaSetDevice(0);
  if (mode != "native") {
    void *lib = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::fprintf(stderr, "dlopen %s: %s\n", argv[2], dlerror());
      return 1;
    }
    auto m = reinterpret_cast<malloc_fn>(dlsym(lib, "magpie_torch_malloc"));
    auto f = reinterpret_cast<free_fn>(dlsym(lib, "magpie_torch_free"));
    direct_malloc = reinterpret_cast<direct_malloc_fn>(dlsym(lib, "magpie_malloc_async"));
    direct_free = reinterpret_cast<direct_free_fn>(dlsym(lib, "magpie_free_async"));
    if (mode == "pluggable")
      torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
          torch::cuda::CUDAPluggableAllocator::createCustomAllocator(m, f));
    if (mode == "magpie") {
      const char *path = std::getenv("MAGPIE_TORCH_NATIVE");
      void *nat = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
      auto install =
          nat ? reinterpret_cast<int (*)(void *const *)>(dlsym(nat, "magpie_torch_native_install")) : nullptr;
      auto names = nat ? reinterpret_cast<const char *const *>(dlsym(nat, "magpie_torch_native_names")) : nullptr;
      std::vector<void *> fn;
      for (int i = 0; names != nullptr && names[i] != nullptr; i++) fn.push_back(dlsym(lib, names[i]));
      if (install == nullptr || names == nullptr || install(fn.data()) != 0) {
        std::fprintf(stderr, "cannot install magpie's allocator from %s\n",
                     path ? path : "(MAGPIE_TORCH_NATIVE unset)");
        return 1;
      }
    }
  }
  if (mode != "magpie") c10::cuda::CUDACachingAllocator::init(1);
  std::vector<int> counts; // MAGPIE_BENCH_THREADS: the thread counts, e.g. "1 16" (default 1 2 4 8 16)
  for (const char *t = std::getenv("MAGPIE_BENCH_THREADS"); t != nullptr && *t != '\0';) {
    char *end;
    long n = std::strtol(t, &end, 10);
    if (end == t) break;
    if (n > 0) counts.push_back(static_cast<int>(n));
    t = end;
  }
  if (counts.empty()) counts = {1, 2, 4, 8, 16};
  const char *forms = std::getenv("MAGPIE_BENCH_FORMS"); // "allocate", "empty", "raw" (default: all)
  const struct {
    Form form;
    const char *name;
  } all[] = {{Form::allocate, "allocate"}, {Form::empty, "empty"}, {Form::raw, "raw"}};
  for (const auto &f : all) {
    if (f.form != Form::allocate && mode == "direct") break;
    if (forms != nullptr && std::strstr(forms, f.name) == nullptr) continue;
    std::printf("%s, %s, %zu-byte blocks, one stream per thread, M pairs/s at", mode.c_str(),
                mode == "direct"        ? "magpie_malloc_async/magpie_free_async"
                : f.form == Form::raw   ? "raw_alloc_with_stream"
                : f.form == Form::empty ? "at::empty"
                                        : "allocate",
                size);
    for (int threads : counts) std::printf(" %d", threads);
    std::printf(" threads:");
    for (int threads : counts) std::printf(" %.2f", run(mode, f.form, threads, size, seconds) / 1e6);
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}
