"""CuPy workloads shared by the GPU tests of allocators under CuPy
(cupy_test.py: magpie.cupy; rmm_test.py: RMM's CuPy allocator on magpie).
Each runs with whatever allocator CuPy has been given."""

SLOW_CHECK = r"""
extern "C" __global__ void slow_check(const unsigned int *p, unsigned long long n, unsigned int v,
                                      unsigned long long spin_ns, unsigned long long *bad) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { __nanosleep(1000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < spin_ns);
  unsigned long long mine = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    mine += ((volatile const unsigned int *)p)[i] != v;
  if (mine) atomicAdd(bad, mine);
}
"""


def computations(cp):
    """Elementwise, reductions, matmul, FFT and sort on four streams,
    three times each; the results as host arrays (compare allocators by
    them)."""
    results = []
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    for i, s in enumerate(streams * 3):
        with s:
            rs = cp.random.RandomState(seed=i)
            a = rs.standard_normal((256 + 32 * i, 256), dtype=cp.float32)
            b = rs.standard_normal((256, 128), dtype=cp.float32)
            c = a @ b
            f = cp.fft.rfft(c, axis=0)
            r = [c.sum(axis=1), cp.abs(f).max(axis=0), cp.sort(c.ravel())[:1000], cp.tanh(c).mean()]
            results.append([cp.asnumpy(x) for x in r])
    for s in streams:
        s.synchronize()
    return results


def stream_order(cp, rounds=400):
    """On each of 8 streams a block is filled, checked by a deliberately
    slow kernel and dropped (freed on its stream); another stream at once
    allocates the same size and overwrites it. A block handed to the other
    stream before the check ran shows as bad words. Returns (bad words,
    checks)."""
    kern = cp.RawKernel(SLOW_CHECK, "slow_check")
    bad = cp.zeros(1, dtype=cp.uint64)
    order_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    checks = 0
    for it in range(rounds):
        sa, sb = order_streams[it % 8], order_streams[(it + 3) % 8]
        n = 1 << (10 + it % 12)
        with sa:
            x = cp.full(n, it, dtype=cp.uint32)
            kern((64,), (256,), (x, cp.uint64(n), cp.uint32(it), cp.uint64(100000 if it % 4 == 0 else 0), bad))
            checks += 1
            del x  # freed on sa
        with sb:
            y = cp.full(n, 0xFFFFFFFF, dtype=cp.uint32)  # must not be x's block yet
            del y
    cp.cuda.Device().synchronize()
    return int(bad.get()[0]), checks
