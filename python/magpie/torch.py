"""magpie as PyTorch's CUDA allocator, through
torch.cuda.memory.CUDAPluggableAllocator.

PyTorch frees a block on the stream it was allocated on. Tensor.record_stream
does not reach a pluggable allocator from Python: CUDAPluggableAllocator's
recordStream calls a record-stream hook only when one was set with the C++
method set_record_stream_fn, which torch.cuda.memory.CUDAPluggableAllocator
(path, alloc_fn_name, free_fn_name) never sets, so it is a no-op. For a
tensor used on another stream, call magpie.torch.record_stream(t, stream)
(it also calls t.record_stream, so the code stays right under PyTorch's own
allocator), or order the allocation stream after the use
(alloc_stream.wait_stream(other)) before the tensor is freed.
"""
import ctypes

from . import _lib

_allocator = None


def use():
    """Make PyTorch allocate CUDA memory through magpie. Call it before the
    first CUDA allocation of the process (PyTorch's rule for changing the
    allocator). Returns the CUDAPluggableAllocator."""
    global _allocator
    import torch as _torch

    if _allocator is None:
        _allocator = _torch.cuda.memory.CUDAPluggableAllocator(
            _lib.library_path(), "magpie_torch_malloc", "magpie_torch_free"
        )
        _torch.cuda.memory.change_current_allocator(_allocator)
    return _allocator


def in_use():
    """Whether magpie is PyTorch's current allocator (set by use())."""
    return _allocator is not None


def record_stream(tensor, stream):
    """Tensor.record_stream that also works under magpie: the tensor's
    memory is not reused until the work enqueued on stream (a
    torch.cuda.Stream) before the tensor is freed has completed.

    Calls tensor.record_stream(stream) (PyTorch's own allocator acts on it)
    and, when magpie is PyTorch's allocator, magpie_record_stream on the
    tensor's block (the storage's start, which is what magpie handed out)."""
    tensor.record_stream(stream)
    if _allocator is None:
        return
    l = _lib.lib()
    if not _lib.has(l, "magpie_record_stream"):
        raise NotImplementedError(f"{_lib.library_path()} has no magpie_record_stream")
    ptr = tensor.untyped_storage().data_ptr()
    rc = l.magpie_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"magpie_record_stream: {l.magpie_last_error_message().decode()}")
