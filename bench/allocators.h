/* The allocators the suite compares, behind one table.
 *
 *   magpie           magpie_malloc_async / magpie_free_async
 *   cudaMalloc       cudaMalloc / cudaFree (synchronous, no caching)
 *   cudaMallocAsync  cudaMallocAsync / cudaFreeAsync on the device's default
 *                    pool, release threshold at its maximum (it caches)
 *   pytorch          c10::cuda::CUDACachingAllocator raw_alloc_with_stream /
 *                    raw_delete through bench/torch_shim.cpp, a shared
 *                    library built on the GPU machine against the installed
 *                    PyTorch and loaded with dlopen
 *   noop             the floor: a bump pointer over memory allocated once,
 *                    no reuse tracking (each thread bumps through its own
 *                    slice of the arena and wraps around; blocks may alias)
 *   bestfit          the reference for memory (bestfit.c): an ideal best fit
 *                    that gives each granule back the moment it empties and
 *                    reuses across streams at once; its addresses name no
 *                    memory, so only workloads 2 and 5 run it
 *
 * The CUDA references need a GPU; the PyTorch one needs the shim. The
 * table says which are available in this run and why not. */
#ifndef MAGPIE_BENCH_ALLOCATORS_H
#define MAGPIE_BENCH_ALLOCATORS_H

#include <stddef.h>
#include <stdint.h>

#include "magpie.h"

enum { BA_MAGPIE, BA_CUDA_MALLOC, BA_CUDA_ASYNC, BA_TORCH, BA_NOOP, BA_BESTFIT, BA_COUNT };

/* Does allocator w hand out memory a workload may touch? (bestfit does not.) */
static inline int bench_alloc_touchable(int w) { return w != BA_BESTFIT; }

typedef struct bench_alloc {
  const char *name;
  int available;
  char why_not[160]; /* when not available */
  void *(*alloc)(size_t size, cudaStream_t s);
  /* Free a block whose last use is on s, the stream it was allocated on. */
  void (*free)(void *p, size_t size, cudaStream_t s);
  /* Free a block allocated on alloc_stream whose last use is on use_stream
   * (handed over with an event and a stream wait). Each allocator gets the
   * pattern its users write: magpie and cudaFreeAsync free on the stream of
   * last use; PyTorch's allocator always frees on the allocation stream, so
   * the allocation stream first waits for the use (what record_stream
   * arranges); cudaFree synchronises the device itself. */
  void (*free_cross)(void *p, size_t size, cudaStream_t alloc_stream, cudaStream_t use_stream);
  /* Before a measurement: give back what can be given back and restart the
   * peak of reserved memory, where the allocator allows it. */
  void (*reset)(void);
  /* Peak reserved bytes since the last reset (since the process started
   * where reset cannot restart it); 0 when the allocator cannot say. */
  uint64_t (*peak_reserved)(void);
} bench_alloc;

/* Sets up every allocator (after bench_dev_init). torch_shim: path of the
 * shim library or NULL. noop_arena: bytes of the no-op reference's arena. */
void bench_allocs_init(const char *torch_shim, size_t noop_arena);
bench_alloc *bench_allocs(void); /* BA_COUNT entries */
/* Failed allocations (NULL returned) so far, per allocator. */
uint64_t bench_alloc_failures(int which);
void bench_alloc_note_failure(int which);

#endif
