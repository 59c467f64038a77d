/* A custom allocator for torch.cuda.MemPool(allocator=...) in
 * torch_mempool_test.py, as vLLM's sleep mode writes one: the driver's
 * cuMemAlloc / cuMemFree behind CUDAPluggableAllocator's two functions,
 * counting calls and bytes so the test can tell when the pool asked for
 * memory and when it gave it back. Built by tools/gpu_dropin.sh. */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int (*mem_alloc_fn)(uint64_t *, size_t);
typedef int (*mem_free_fn)(uint64_t);

static mem_alloc_fn mem_alloc;
static mem_free_fn mem_free;
static atomic_long allocs, frees, live_bytes;

static int load(void) {
  if (mem_alloc != NULL) return 1;
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (cuda == NULL) return 0;
  mem_free = (mem_free_fn)dlsym(cuda, "cuMemFree_v2");
  mem_alloc = (mem_alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
  return mem_alloc != NULL && mem_free != NULL;
}

__attribute__((visibility("default"))) void *mempool_alloc(ssize_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  uint64_t p = 0;
  if (size <= 0 || !load() || mem_alloc(&p, (size_t)size) != 0) return NULL;
  atomic_fetch_add(&allocs, 1);
  atomic_fetch_add(&live_bytes, size);
  return (void *)(uintptr_t)p;
}

__attribute__((visibility("default"))) void mempool_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)device;
  (void)stream;
  if (ptr == NULL || !load()) return;
  mem_free((uint64_t)(uintptr_t)ptr);
  atomic_fetch_add(&frees, 1);
  atomic_fetch_sub(&live_bytes, size);
}

__attribute__((visibility("default"))) long mempool_allocs(void) { return atomic_load(&allocs); }
__attribute__((visibility("default"))) long mempool_frees(void) { return atomic_load(&frees); }
__attribute__((visibility("default"))) long mempool_live_bytes(void) { return atomic_load(&live_bytes); }
