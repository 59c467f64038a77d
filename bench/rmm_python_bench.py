"""What one rmm.DeviceBuffer costs from Python under each RMM resource,
magpie's among them (magpie.rmm), in one process on a GPU.

    python3 bench/rmm_python_bench.py [pairs] [sizes]

Per resource and size: mean ns per DeviceBuffer(size=n, stream=s) + del
(one allocation and one free through RMM's Python and C++ layers), best of
5 rounds of `pairs` pairs after a warm-up, on one created stream. The
resources:
  cuda_async      rmm.mr.CudaAsyncMemoryResource (cudaMallocAsync)
  pool            rmm.mr.PoolMemoryResource over CudaMemoryResource (1 GiB primed)
  arena           rmm.mr.ArenaMemoryResource over CudaMemoryResource
  magpie          magpie.rmm.resource(): RMM's C++ calls magpie directly
  magpie_callback rmm.mr.CallbackMemoryResource calling magpie through
                  ctypes: what RMM's Python API alone allows without a
                  compiled resource
  callback_floor  rmm.mr.CallbackMemoryResource over a bump pointer into
                  one preallocated buffer (no reuse tracking): the cost of
                  RMM's callback path itself
"""
import ctypes
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # an installed package (the wheel) first, else the repository's
    import magpie  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(HERE, "..", "python"))


def resources():
    import magpie
    import magpie._lib as ml
    import rmm

    lib = ml.lib()
    malloc = lib.magpie_malloc_async
    malloc.restype = ctypes.c_void_p
    malloc.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
    free = lib.magpie_free_async
    free.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def m_alloc(size, stream):
        p = malloc(size, stream.__cuda_stream__()[1])
        if not p:
            raise MemoryError(lib.magpie_last_error_message().decode())
        return p

    def m_free(ptr, size, stream):
        free(ptr, stream.__cuda_stream__()[1])

    floor_buf = rmm.DeviceBuffer(size=1 << 30)
    base = floor_buf.ptr
    state = [0]

    def f_alloc(size, stream):
        off = state[0]
        state[0] = (off + ((size + 255) & ~255)) % ((1 << 30) - (64 << 20))
        return base + off

    def f_free(ptr, size, stream):
        pass

    out = [
        ("cuda_async", rmm.mr.CudaAsyncMemoryResource()),
        ("pool", rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=1 << 30)),
        ("arena", rmm.mr.ArenaMemoryResource(rmm.mr.CudaMemoryResource())),
        ("magpie", magpie.rmm.resource()),
        ("magpie_callback", rmm.mr.CallbackMemoryResource(m_alloc, m_free)),
        ("callback_floor", rmm.mr.CallbackMemoryResource(f_alloc, f_free)),
    ]
    return out, floor_buf


def main():
    import rmm
    from rmm.pylibrmm.stream import Stream

    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    sizes = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [256, 65536, 1 << 20, 16 << 20]
    stream = Stream()
    res, keep = resources()
    print(f"rmm {rmm.__version__}; ns per DeviceBuffer alloc+free pair, best of 5 rounds of {pairs}")
    print("resource         " + "".join(f"{s:>12}" for s in sizes))
    for name, mr in res:
        row = []
        for size in sizes:
            for _ in range(200):
                b = rmm.DeviceBuffer(size=size, stream=stream, mr=mr)
                del b
            best = None
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for _ in range(pairs):
                    b = rmm.DeviceBuffer(size=size, stream=stream, mr=mr)
                    del b
                dt = (time.perf_counter_ns() - t0) / pairs
                best = dt if best is None or dt < best else best
            row.append(best)
        stream.synchronize()
        print(f"{name:<17}" + "".join(f"{v:12.0f}" for v in row), flush=True)
    del keep


if __name__ == "__main__":
    main()
