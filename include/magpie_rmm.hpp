/* magpie as an RMM memory resource (RAPIDS Memory Manager 26.10).
 *
 *   #include <magpie_rmm.hpp>
 *   magpie::rmm_memory_resource mr;
 *   rmm::mr::set_current_device_resource(mr);   // or any adaptor over it
 *   rmm::device_buffer buf(1 << 20, stream, mr);
 *
 * Header-only over magpie's C API (magpie.h); link libmagpie.so beside
 * librmm. The resource satisfies cuda::mr::resource_with<...,
 * cuda::mr::device_accessible> (RMM 26.10's resource concept), so it
 * converts to rmm::device_async_resource_ref and works under RMM's
 * adaptors (statistics, tracking, logging, limiting, aligned, ...).
 *
 * Semantics are magpie's, which are those of cuda_async_memory_resource:
 *   allocate(stream, n, a)     magpie_malloc_async(n, stream): usable by
 *                              work enqueued on stream after the call;
 *   deallocate(stream, p, ...) magpie_free_async(p, stream): stream is the
 *                              last one using p; p serves that stream again
 *                              at once, others once stream's earlier work
 *                              completed;
 *   allocate_sync / deallocate_sync: the same on the legacy default stream,
 *                              followed by cudaStreamSynchronize on it, as
 *                              RMM's own cuda_async resource does.
 * The device is the stream's (the current device for the default streams).
 *
 * Equality: every magpie resource can free what any other handed out (the
 * block's address names its device), so all compare equal.
 *
 * Alignment: magpie's blocks are 256-byte aligned (rmm::CUDA_ALLOCATION_
 * ALIGNMENT). A larger power-of-two alignment allocates alignment - 256
 * bytes more and returns the aligned address inside the block; the block's
 * start is kept in a table (one mutex, only on that path) so that the
 * deallocation finds it. The table is per program image: pass such
 * pointers back through a resource built in the same shared object (every
 * call through one rmm::device_async_resource_ref does).
 *
 * Errors: allocations that fail throw rmm::out_of_memory (magpie's
 * MAGPIE_ERR_OUT_OF_MEMORY / MAGPIE_ERR_TOO_LARGE) or rmm::bad_alloc, with
 * magpie's message (what is in use, what is cached where, the limit); an
 * alignment that is not a power of two throws rmm::logic_error. A
 * deallocation magpie rejects (a pointer it never handed out, a second
 * free) cannot throw (RMM's deallocate is noexcept): the block is left
 * alone and magpie's message goes to stderr. */
#ifndef MAGPIE_RMM_HPP
#define MAGPIE_RMM_HPP

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda_runtime_api.h>
#include <rmm/aligned.hpp>
#include <rmm/detail/error.hpp>
#include <rmm/error.hpp>
#include <rmm/resource_ref.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

#include "magpie.h"

namespace magpie {

namespace rmm_detail {

/* Blocks handed out at an alignment above 256 bytes: aligned address ->
 * the block's start. */
struct aligned_table {
  std::mutex lock;
  std::unordered_map<std::uintptr_t, void *> start;
};

inline aligned_table &aligned_blocks() {
  static aligned_table *t = new aligned_table(); /* never destroyed: frees may run at exit */
  return *t;
}

[[noreturn]] inline void throw_alloc_error(std::size_t bytes, std::size_t alignment) {
  int code = magpie_last_error();
  std::string msg = std::string("magpie: allocating ") + std::to_string(bytes) + " bytes (alignment " +
                    std::to_string(alignment) + ") failed: " + magpie_error_string(code) + ": " +
                    magpie_last_error_message();
  if (code == MAGPIE_ERR_OUT_OF_MEMORY || code == MAGPIE_ERR_TOO_LARGE || code == MAGPIE_ERR_SIZE_OVERFLOW)
    throw rmm::out_of_memory(msg); /* what(): "std::bad_alloc: out_of_memory: " + msg */
  throw rmm::bad_alloc(msg);
}

inline void report_free_error(void *ptr, std::size_t bytes) noexcept {
  std::fprintf(stderr, "magpie: deallocating %p (%zu bytes) through the RMM resource failed: %s\n", ptr, bytes,
               magpie_last_error_message());
}

} // namespace rmm_detail

class rmm_memory_resource {
 public:
  rmm_memory_resource() = default;

  void *allocate(cuda::stream_ref stream, std::size_t bytes, std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) {
    if (!rmm::is_supported_alignment(alignment))
      throw rmm::logic_error("magpie: alignment " + std::to_string(alignment) + " is not a power of two");
    cudaStream_t s = stream.get();
    if (alignment > rmm::CUDA_ALLOCATION_ALIGNMENT) return allocate_aligned(s, bytes, alignment);
    void *p = magpie_malloc_async(bytes, s);
    if (p == nullptr) rmm_detail::throw_alloc_error(bytes, alignment);
    return p;
  }

  void deallocate(cuda::stream_ref stream, void *ptr, std::size_t bytes,
                  std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept {
    if (ptr == nullptr) return;
    void *start = ptr;
    if (alignment > rmm::CUDA_ALLOCATION_ALIGNMENT) {
      rmm_detail::aligned_table &t = rmm_detail::aligned_blocks();
      std::lock_guard<std::mutex> g(t.lock);
      auto it = t.start.find(reinterpret_cast<std::uintptr_t>(ptr));
      if (it == t.start.end()) {
        std::fprintf(stderr,
                     "magpie: deallocating %p (%zu bytes, alignment %zu) through the RMM resource: no block was "
                     "handed out at this address with this alignment; left alone\n",
                     ptr, bytes, alignment);
        return;
      }
      start = it->second;
      t.start.erase(it);
    }
    if (magpie_free_async(start, stream.get()) != MAGPIE_OK) rmm_detail::report_free_error(ptr, bytes);
  }

  void *allocate_sync(std::size_t bytes, std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) {
    void *p = allocate(cuda::stream_ref{cudaStream_t{nullptr}}, bytes, alignment);
    cudaError_t e = cudaStreamSynchronize(cudaStream_t{nullptr});
    if (e != cudaSuccess) {
      deallocate(cuda::stream_ref{cudaStream_t{nullptr}}, p, bytes, alignment);
      throw rmm::cuda_error(std::string("magpie: cudaStreamSynchronize after allocate_sync: ") + cudaGetErrorString(e));
    }
    return p;
  }

  void deallocate_sync(void *ptr, std::size_t bytes, std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept {
    deallocate(cuda::stream_ref{cudaStream_t{nullptr}}, ptr, bytes, alignment);
    cudaError_t e = cudaStreamSynchronize(cudaStream_t{nullptr});
    if (e != cudaSuccess)
      std::fprintf(stderr, "magpie: cudaStreamSynchronize after deallocate_sync: %s\n", cudaGetErrorString(e));
  }

  bool operator==(rmm_memory_resource const &) const noexcept { return true; }
  bool operator!=(rmm_memory_resource const &) const noexcept { return false; }

  friend void get_property(rmm_memory_resource const &, cuda::mr::device_accessible) noexcept {}

 private:
  /* alignment: a power of two above 256. */
  void *allocate_aligned(cudaStream_t s, std::size_t bytes, std::size_t alignment) {
    std::size_t extra = alignment - rmm::CUDA_ALLOCATION_ALIGNMENT;
    if (bytes > SIZE_MAX - extra) {
      throw rmm::out_of_memory("magpie: allocating " + std::to_string(bytes) + " bytes at alignment " +
                               std::to_string(alignment) + " overflows the size");
    }
    void *start = magpie_malloc_async(bytes + extra, s);
    if (start == nullptr) rmm_detail::throw_alloc_error(bytes, alignment);
    std::uintptr_t a = (reinterpret_cast<std::uintptr_t>(start) + alignment - 1) & ~(std::uintptr_t)(alignment - 1);
    try {
      rmm_detail::aligned_table &t = rmm_detail::aligned_blocks();
      std::lock_guard<std::mutex> g(t.lock);
      t.start.emplace(a, start);
    } catch (...) {
      magpie_free_async(start, s);
      throw;
    }
    return reinterpret_cast<void *>(a);
  }
};

static_assert(cuda::mr::resource_with<rmm_memory_resource, cuda::mr::device_accessible>,
              "magpie::rmm_memory_resource must satisfy RMM's resource concept");
static_assert(cuda::mr::synchronous_resource_with<rmm_memory_resource, cuda::mr::device_accessible>,
              "magpie::rmm_memory_resource must satisfy RMM's synchronous resource concept");

} // namespace magpie

#endif /* MAGPIE_RMM_HPP */
