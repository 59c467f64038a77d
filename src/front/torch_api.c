/* The hooks of PyTorch's pluggable allocator beyond allocation and free
 * (magpie_torch_malloc and magpie_torch_free are in alloc.c, beside the
 * fast path they share): adapters over the public API, nothing more.
 * PyTorch calls them through C function pointers that python/magpie/torch.py
 * sets with CUDAPluggableAllocator's set_record_stream_fn, set_reset_fn and
 * set_memory_fraction_fn; they return nothing, so errors stay in
 * magpie_last_error. */
#include "magpie.h"

/* Tensor.record_stream(stream): PyTorch passes the storage's pointer, the
 * start of the block magpie handed out. */
MAGPIE_API void magpie_torch_record_stream(void *ptr, cudaStream_t stream) { (void)magpie_record_stream(ptr, stream); }

/* torch.cuda.empty_cache(): every device's cached memory goes back to the
 * driver. magpie_trim does nothing on a device magpie has not served, so no
 * context is made for one. */
MAGPIE_API void magpie_torch_empty_cache(void) {
  int n = magpie_device_count();
  for (int d = 0; d < n; d++) (void)magpie_trim(d, 0);
}

/* torch.cuda.set_per_process_memory_fraction(fraction, device): 0 refuses
 * every mapping, as PyTorch's allocator then refuses every allocation. */
MAGPIE_API void magpie_torch_set_memory_fraction(double fraction, int device) {
  (void)magpie_set_limit_fraction(device, fraction);
}
