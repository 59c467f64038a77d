// PyTorch's allocation entry point for magpie, built against the installed
// PyTorch by magpie.torch on first use (python/magpie/_shim.py).
//
// Why C++: CUDAPluggableAllocator turns a NULL from the allocation function
// into a tensor whose data pointer is 0 (measured: PyTorch 2.11, H100), which
// the first kernel to touch it turns into an illegal-address error that ends
// the process's CUDA context. PyTorch's own allocator throws
// c10::OutOfMemoryError instead, which Python sees as
// torch.cuda.OutOfMemoryError; only C++ built against c10 can throw it.
//
// magpie's functions are reached through pointers handed over by
// magpie_torch_shim_init (from the libmagpie.so Python loaded), so this
// library does not depend on where libmagpie.so lives.
#include <c10/util/Exception.h>

#include <sys/types.h>

namespace {

using malloc_fn = void *(*)(ssize_t, int, void *);
using free_fn = void (*)(void *, ssize_t, int, void *);
using error_fn = int (*)();
using message_fn = const char *(*)();

malloc_fn shim_malloc;
free_fn shim_free;
error_fn shim_error;
message_fn shim_message;

// MAGPIE_ERR_OUT_OF_MEMORY and MAGPIE_ERR_TOO_LARGE (include/magpie.h).
constexpr int kOutOfMemory = 4;
constexpr int kTooLarge = 5;

} // namespace

extern "C" {

__attribute__((visibility("default"))) int magpie_torch_shim_init(void *m, void *f, void *e, void *s) {
  if (m == nullptr || f == nullptr || e == nullptr || s == nullptr) return -1;
  shim_malloc = reinterpret_cast<malloc_fn>(m);
  shim_free = reinterpret_cast<free_fn>(f);
  shim_error = reinterpret_cast<error_fn>(e);
  shim_message = reinterpret_cast<message_fn>(s);
  return 0;
}

__attribute__((visibility("default"))) void *magpie_torch_shim_malloc(ssize_t size, int device, void *stream) {
  void *p = shim_malloc(size, device, stream);
  if (p != nullptr) return p;
  int code = shim_error();
  const char *message = shim_message();
  TORCH_CHECK_WITH(OutOfMemoryError, code != kOutOfMemory && code != kTooLarge, "CUDA out of memory (magpie). ",
                   message);
  TORCH_CHECK(false, "magpie could not allocate ", size, " bytes on device ", device, ": ", message);
  return nullptr; // not reached: TORCH_CHECK(false, ...) throws
}

__attribute__((visibility("default"))) void magpie_torch_shim_free(void *ptr, ssize_t size, int device, void *stream) {
  shim_free(ptr, size, device, stream);
}

} // extern "C"
