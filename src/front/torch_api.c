/* The hooks of PyTorch's pluggable allocator beyond allocation and free
 * (magpie_torch_malloc and magpie_torch_free are in alloc.c, beside the
 * fast path they share). PyTorch calls them through C function pointers
 * that python/magpie/torch.py sets with CUDAPluggableAllocator's
 * set_record_stream_fn, set_reset_fn and set_memory_fraction_fn; they
 * return nothing, so errors are kept in magpie_last_error. Takes no lock of
 * its own. */
#include "base/error.h"
#include "front/global.h"
#include "heap/heap.h"
#include "pool/region.h"

/* Tensor.record_stream(stream): PyTorch passes the storage's pointer, the
 * start of the block magpie handed out. */
MAGPIE_API void magpie_torch_record_stream(void *ptr, cudaStream_t stream) { (void)magpie_record_stream(ptr, stream); }

/* torch.cuda.empty_cache(): every device's cached memory goes back to the
 * driver (magpie_trim keeping nothing beyond what is in use). */
MAGPIE_API void magpie_torch_empty_cache(void) {
  if (global_ensure() != MAGPIE_OK) return;
  int n = 0;
  if (global_ops()->device_count(&n) != MAGPIE_OK) return;
  for (int d = 0; d < n && d < HEAP_MAX_DEVICES; d++)
    if (heap_peek(d) != NULL) (void)magpie_trim(d, 0);
}

/* torch.cuda.set_per_process_memory_fraction(fraction, device): the
 * device's limit becomes fraction of its memory (0 refuses every mapping,
 * as PyTorch's allocator then refuses every allocation). A fraction
 * outside [0, 1] changes nothing (MAGPIE_ERR_INVALID_ARGUMENT). */
MAGPIE_API void magpie_torch_set_memory_fraction(double fraction, int device) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    error_set(MAGPIE_ERR_INVALID_ARGUMENT, "set_per_process_memory_fraction: %g is not in [0, 1]", fraction);
    return;
  }
  if (global_device_check(device, "set_per_process_memory_fraction") != MAGPIE_OK) return;
  heap *h = heap_get(device);
  if (h == NULL) return;
  region_set_limit(&h->region, (size_t)(fraction * (double)h->total_mem));
}
