"""magpie as PyTorch's CUDA allocator, through
torch.cuda.memory.CUDAPluggableAllocator."""
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
