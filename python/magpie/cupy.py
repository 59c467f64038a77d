"""magpie as CuPy's device allocator.

    import magpie
    magpie.cupy.use()      # before the first allocation
    import cupy as cp
    x = cp.arange(10)      # served by magpie on CuPy's current stream

Each allocation is made on CuPy's current stream
(cupy.cuda.get_current_stream()) and freed on that same stream when CuPy
drops the memory, the contract of CuPy's own memory pool: memory used on
another stream must be ordered (an event or Stream.wait_event) before it is
freed, or its block recorded with magpie.record_stream(ptr, stream.ptr).
A block keeps its CuPy stream object alive until it is freed: a stream
destroyed first (at interpreter exit, locals go in no useful order) would
leave the free a dangling handle, which magpie, like cudaFreeAsync, must
not be given.
"""
import ctypes

from . import _lib

_installed = False


class _Block:
    """Owner of one magpie block; frees it on its stream when CuPy lets go.
    Holds the cupy Stream object, so the stream outlives the block."""

    __slots__ = ("ptr", "stream", "free")

    def __init__(self, ptr, stream, free):
        self.ptr = ptr
        self.stream = stream
        self.free = free

    def __del__(self):
        self.free(ctypes.c_void_p(self.ptr), ctypes.c_void_p(self.stream.ptr))


def _make_malloc(cupy):
    l = _lib.lib()
    malloc, free = l.magpie_malloc_async, l.magpie_free_async
    memory = cupy.cuda.memory

    def magpie_malloc(size):
        stream = cupy.cuda.get_current_stream()
        ptr = malloc(size, ctypes.c_void_p(stream.ptr))
        if not ptr:
            raise memory.OutOfMemoryError(size, 0, 0) if _lib.lib().magpie_last_error() == 4 else RuntimeError(
                "magpie_malloc_async(%d): %s" % (size, _lib.lib().magpie_last_error_message().decode())
            )
        owner = _Block(ptr, stream, free)
        mem = memory.UnownedMemory(ptr, size, owner, cupy.cuda.Device().id)
        return memory.MemoryPointer(mem, 0)

    return magpie_malloc


def use():
    """Make CuPy allocate device memory through magpie (and leave CuPy's
    pinned host memory pool as it is). Call before the first allocation:
    memory CuPy's pool already holds stays with it."""
    global _installed
    import cupy

    if not _installed:
        cupy.cuda.set_allocator(_make_malloc(cupy))
        _installed = True


def in_use():
    return _installed
