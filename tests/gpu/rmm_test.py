"""magpie as RAPIDS Memory Manager's resource (magpie.rmm.use()) on a GPU.

    python3 tests/gpu/rmm_test.py        (rmm-cu13, cupy and cython installed)

Each case runs in a child process, under RMM's default resource
(CudaMemoryResource) and under magpie.rmm.use():
1. CuPy through RMM's CuPy allocator (rmm.allocators.cupy): the same
   computations on four streams give equal results, and magpie served them.
2. Stream order through RMM: on each of 8 streams a block is filled,
   checked by a deliberately slow kernel and dropped (freed on its stream);
   another stream at once allocates the same size and overwrites it. A
   block handed to the other stream before the check ran shows as bad words.
3. rmm.DeviceBuffer on streams: host data in and out, byte for byte.
4. RMM's adaptors over magpie's resource from Python: statistics counts,
   a limit raising MemoryError.
5. More than the device: MemoryError carrying magpie's account.
Ends with "N passed, N failed".
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
try:  # an installed package (the wheel) first, else the repository's
    import magpie  # noqa: F401
except ImportError:
    for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
        if os.path.isdir(os.path.join(p, "magpie")):
            sys.path.insert(0, p)
            break

from cupy_checks import computations, stream_order  # noqa: E402  (beside this file)


def child(mode, out):
    import pickle

    import cupy as cp
    import numpy as np
    import rmm
    from rmm.allocators.cupy import rmm_cupy_allocator
    from rmm.pylibrmm.stream import Stream

    if mode == "magpie":
        import magpie

        print(f"  [magpie] package {magpie.__file__}, library {magpie._lib.library_path()}")
        mr = magpie.rmm.use()
        assert magpie.rmm.in_use(), "RMM's current resource is not magpie's"
        assert rmm.mr.get_current_device_resource() is mr
    cp.cuda.set_allocator(rmm_cupy_allocator)
    report = {}

    # 1. computations through RMM's CuPy allocator; 2. stream order
    results = computations(cp)
    report["bad_words"], report["checks"] = stream_order(cp)

    # 3. DeviceBuffer on RMM's own streams
    ok = True
    rstreams = [Stream() for _ in range(3)]
    for i in range(60):
        st = rstreams[i % 3]
        host = np.random.default_rng(i).integers(0, 255, size=(1 << (8 + i % 16)) + i, dtype=np.uint8)
        buf = rmm.DeviceBuffer(size=host.nbytes, stream=st)
        buf.copy_from_host(host, stream=st)
        back = buf.copy_to_host(stream=st)
        st.synchronize()
        ok &= bool(np.array_equal(np.asarray(back), host))
        del buf
    report["device_buffer_ok"] = ok

    # 4. adaptors over the current resource
    upstream = rmm.mr.get_current_device_resource()
    stats = rmm.mr.StatisticsResourceAdaptor(upstream)
    bufs = [rmm.DeviceBuffer(size=1 << 20, mr=stats) for _ in range(5)]
    counts = stats.allocation_counts
    report["stats_current_bytes"] = int(counts.current_bytes)
    report["stats_current_count"] = int(counts.current_count)
    del bufs
    report["stats_after_bytes"] = int(stats.allocation_counts.current_bytes)
    limit = rmm.mr.LimitingResourceAdaptor(upstream, allocation_limit=4 << 20)
    keep = rmm.DeviceBuffer(size=3 << 20, mr=limit)
    try:
        rmm.DeviceBuffer(size=2 << 20, mr=limit)
        report["limit_raised"] = False
    except MemoryError:
        report["limit_raised"] = True
    del keep

    # 5. out of memory
    free, total = cp.cuda.runtime.memGetInfo()
    try:
        rmm.DeviceBuffer(size=2 * total)
        report["oom"] = "no error"
    except MemoryError as e:
        report["oom"] = str(e)

    if mode == "magpie":
        import magpie

        st = magpie.stats()
        report["magpie_reserved"] = st["reserved_bytes"]
        print("  [magpie] stats:", {k: st[k] for k in ("in_use_bytes", "reserved_bytes", "peak_in_use_bytes",
                                                       "events_recorded", "same_stream_reuses")})
    with open(out, "wb") as f:
        pickle.dump((results, report), f)
    print(f"  [{mode}] {report}")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    import pickle

    import numpy as np

    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        print(f"{'PASS' if ok else 'FAIL'} {what}")
        passed += bool(ok)
        failed += not ok

    res = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("rmm", "magpie"):
            out = os.path.join(d, mode + ".pkl")
            rc = subprocess.run([sys.executable, __file__, "--child", mode, out]).returncode
            if rc != 0:
                check(False, f"rmm [{mode}]: child exited {rc}")
                continue
            with open(out, "rb") as f:
                res[mode] = pickle.load(f)
    if "magpie" in res:
        rep = res["magpie"][1]
        check(rep["bad_words"] == 0 and rep["checks"] > 0,
              f"rmm [magpie] stream order: {rep['checks']} checks, {rep['bad_words']} bad words")
        check(rep["device_buffer_ok"], "rmm [magpie] DeviceBuffer contents on three streams")
        check(rep["stats_current_bytes"] == 5 << 20 and rep["stats_current_count"] == 5
              and rep["stats_after_bytes"] == 0, "rmm [magpie] StatisticsResourceAdaptor over magpie")
        check(rep["limit_raised"], "rmm [magpie] LimitingResourceAdaptor over magpie raises MemoryError")
        check("out_of_memory" in rep["oom"] and "magpie" in rep["oom"],
              f"rmm [magpie] out of memory: {rep['oom'][:300]}")
        check(rep.get("magpie_reserved", 0) > 0, "rmm [magpie] magpie served the allocations")
    if len(res) == 2:
        same = all(np.array_equal(a, b) for ra, rb in zip(res["rmm"][0], res["magpie"][0]) for a, b in zip(ra, rb))
        check(same, "rmm: CuPy results through RMM on magpie equal those on RMM's default resource")
        rep = res["rmm"][1]
        check(rep["bad_words"] == 0, f"rmm [rmm] stream order (the reference): {rep['bad_words']} bad words")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
