"""magpie as CuPy's allocator on a GPU.

    MAGPIE_LIB=path/to/libmagpie.so python3 tests/gpu/cupy_test.py

1. The same computations (elementwise, reductions, matmul, FFT, sort) on
   four streams, under CuPy's memory pool and under magpie.cupy.use(): equal
   results, and magpie served the allocations.
2. Stream order: on each of 8 streams, a block is filled, checked by a
   deliberately slow kernel and dropped (freed on its stream); another
   stream at once allocates the same size and overwrites it. A block handed
   to the other stream before the check ran shows as bad words.
Each allocator runs in its own child process. Ends with "N passed, N failed".
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
    if os.path.isdir(os.path.join(p, "magpie")):
        sys.path.insert(0, p)
        break

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


def child(mode, out):
    if mode == "magpie":
        import magpie

        magpie.cupy.use()
    import cupy as cp
    import numpy as np

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

    kern = cp.RawKernel(SLOW_CHECK, "slow_check")
    bad = cp.zeros(1, dtype=cp.uint64)
    order_streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    checks = 0
    for it in range(400):
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
    # Blocks that outlive their Stream object (as locals do at interpreter
    # exit): the frees must still name a live stream, which the adaptor
    # ensures by holding the stream with the block.
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        held = [cp.empty(4096, dtype=cp.uint8) for _ in range(256)]
    del s
    del held
    nbad = int(bad.get()[0])
    np.save(out, np.array([nbad, checks], dtype=np.int64))
    import pickle

    with open(out + ".pkl", "wb") as f:
        pickle.dump(results, f)
    if mode == "magpie":
        import magpie

        st = magpie.stats()
        print("  [magpie] stats:", {k: st[k] for k in ("in_use_bytes", "reserved_bytes", "events_recorded",
                                                       "cross_stream_migrations", "same_stream_reuses")})
        assert st["reserved_bytes"] > 0, "no allocation went through magpie"
    print(f"  [{mode}] stream-order checks: {checks}, bad words: {nbad}")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    import pickle

    import numpy as np

    passed = failed = 0
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("native", "magpie"):
            out = os.path.join(d, mode + ".npy")
            rc = subprocess.run([sys.executable, __file__, "--child", mode, out]).returncode
            if rc != 0:
                print(f"FAIL cupy [{mode}]: child exited {rc}")
                failed += 1
                continue
            nbad, checks = np.load(out)
            with open(out + ".pkl", "rb") as f:
                res[mode] = pickle.load(f)
            ok = nbad == 0 and checks > 0
            print(f"{'PASS' if ok else 'FAIL'} cupy [{mode}] stream order: {checks} checks, {nbad} bad words")
            passed += ok
            failed += not ok
    if len(res) == 2:
        same = all(np.array_equal(a, b) for ra, rb in zip(res["native"], res["magpie"]) for a, b in zip(ra, rb))
        print(f"{'PASS' if same else 'FAIL'} cupy results under magpie equal CuPy's pool: {same}")
        passed += same
        failed += not same
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
