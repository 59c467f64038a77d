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

from cupy_checks import computations, stream_order  # noqa: E402  (beside this file)


def child(mode, out):
    if mode == "magpie":
        import magpie

        magpie.cupy.use()
    import cupy as cp
    import numpy as np

    results = computations(cp)
    nbad, checks = stream_order(cp)
    # Blocks that outlive their Stream object (as locals do at interpreter
    # exit): the frees must still name a live stream, which the adaptor
    # ensures by holding the stream with the block.
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        held = [cp.empty(4096, dtype=cp.uint8) for _ in range(256)]
    del s
    del held
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
