"""torch.cuda.MemPool and memory history under magpie (magpie.torch.use()),
each check in this one process, on a GPU.

    MAGPIE_LIB=path/to/libmagpie.so MEMPOOL_ALLOC_LIB=path/to/libmempool_alloc.so \\
        python3 tests/gpu/torch_mempool_test.py [OUT_DIR]

MemPool of magpie's blocks:
  own          tensors under use_mem_pool come from the pool (its snapshot
               lists them, with its id), others do not; use_count as PyTorch
               counts it; the pool's memory goes back when the pool ends
  nested       an inner use_mem_pool gets the inner pool's blocks, the outer
               one again after it
  threads      four threads, a pool each: each pool holds its thread's
               tensors only, four distinct ids
  graph        torch.cuda.graph(pool=pool.id) captures into a MemPool and
               replays correctly
MemPool with a custom allocator (mempool_alloc.c, cuMemAlloc behind
CUDAPluggableAllocator, as vLLM's sleep mode makes one):
  custom       tensors under use_mem_pool come from the allocator and hold
               their data; a freed block serves the next request of its size
               without a call; the allocator gets everything back when the
               pool ends
  split        a freed 40 MiB segment serves two 20 MiB tensors without a
               call (one segment, two blocks, in the snapshot); freed, the
               halves merge and serve 40 MiB again; at the memory fraction,
               a use_on_oom pool's freed segment serves two tensors made
               outside it (PyTorch's test_deleted_mempool_not_used_on_oom)
Memory history:
  history      _record_memory_history(context "all", stacks "all"): the trace
               has an alloc and free_completed per tensor with this file's
               Python frames and C++ frames, a segment_alloc with the frames
               of the allocation that made a segment (which the segment
               carries) and a segment_free with empty_cache's frames for
               each segment it released, live blocks carry their frames,
               _dump_snapshot writes PyTorch's pickle, torch.cuda._memory_viz
               draws its trace and segments (HTML in OUT_DIR), and magpie's
               layers are in the same snapshot ("magpie")
Verdicts at the end; "N passed, N failed".
"""
import ctypes
import gc
import os
import pickle
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
    if os.path.isdir(os.path.join(p, "magpie")):
        sys.path.insert(0, p)
        break

import magpie  # noqa: E402
import magpie.torch  # noqa: E402
import torch  # noqa: E402

results = []


def check(name, ok, detail=""):
    results.append((name, bool(ok)))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + str(detail) if detail else ''}", flush=True)


def pool_addresses(pool):
    out = set()
    for seg in pool.snapshot():
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out.add(b["address"])
    return out


def test_own():
    pool = torch.cuda.MemPool()
    check("own: use_count after creation", pool.use_count() == 1, pool.use_count())
    outside = torch.empty(1 << 20, device="cuda")
    with torch.cuda.use_mem_pool(pool):
        check("own: use_count inside use_mem_pool", pool.use_count() == 2, pool.use_count())
        x = torch.full((1 << 20,), 3.0, device="cuda")
        y = torch.empty(1000, device="cuda")
    inside = pool_addresses(pool)
    check("own: the pool's snapshot lists its tensors", {x.data_ptr(), y.data_ptr()} <= inside, inside)
    check("own: a tensor outside is not the pool's", outside.data_ptr() not in inside)
    ids = {tuple(s["segment_pool_id"]) for s in pool.snapshot()}
    check("own: segments carry the pool's id", ids == {tuple(pool.id)}, ids)
    whole = torch.cuda.memory._snapshot()["segments"]
    tagged = [s for s in whole if tuple(s["segment_pool_id"]) == tuple(pool.id)]
    check("own: the whole snapshot has the pool's segments", len(tagged) >= 2, len(tagged))
    check("own: data", bool((x == 3.0).all()))
    pool_bytes = sum(s["total_size"] for s in pool.snapshot())
    check("own: the pool's figures", pool_bytes >= x.nbytes + y.nbytes, pool_bytes)
    del x, y
    torch.cuda.synchronize()
    check("own: freed blocks stay in the pool", len(pool.snapshot()) >= 2)
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) != (0, 0)]
    check("own: the ended pool's blocks went back to magpie", not left and magpie.stats()["graph_pool_bytes"] == 0,
          (len(left), magpie.stats()["graph_pool_bytes"]))


def test_nested():
    p1, p2 = torch.cuda.MemPool(), torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(p1):
        a = torch.empty(1 << 18, device="cuda")
        with torch.cuda.use_mem_pool(p2):
            b = torch.empty(1 << 18, device="cuda")
        c = torch.empty(1 << 18, device="cuda")
    s1, s2 = pool_addresses(p1), pool_addresses(p2)
    check("nested: outer pool", a.data_ptr() in s1 and c.data_ptr() in s1, (len(s1), len(s2)))
    check("nested: inner pool", b.data_ptr() in s2 and b.data_ptr() not in s1)
    del a, b, c, p1, p2


def test_threads():
    pools, tensors, errors = [None] * 4, [None] * 4, []

    def work(i):
        try:
            pools[i] = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pools[i]):
                tensors[i] = [torch.full((1 << 16,), float(i), device="cuda") for _ in range(3)]
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check("threads: no error", not errors, errors)
    if errors:
        return
    ids = {tuple(p.id) for p in pools}
    check("threads: four pool ids", len(ids) == 4, ids)
    ok = all({t.data_ptr() for t in tensors[i]} == pool_addresses(pools[i]) for i in range(4))
    check("threads: each pool holds its thread's tensors only", ok)
    check("threads: data", all(bool((t == float(i)).all()) for i in range(4) for t in tensors[i]))


def test_graph():
    pool = torch.cuda.MemPool()
    x = torch.ones(1 << 16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            y = x * 2  # warm-up, as PyTorch's docs do
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        y = x * 2 + 1
    x.fill_(5.0)
    g.replay()
    torch.cuda.synchronize()
    check("graph: replay into a MemPool", bool((y == 11.0).all()))
    check("graph: the output is the pool's", y.data_ptr() in pool_addresses(pool))
    del g, y, pool


def custom_allocator():
    """mempool_alloc.c's library (its call counters) and a
    CUDAPluggableAllocator over it."""
    path = os.environ.get("MEMPOOL_ALLOC_LIB") or os.path.join(HERE, "bin", "libmempool_alloc.so")
    lib = ctypes.CDLL(path)
    for fn in ("mempool_allocs", "mempool_frees", "mempool_live_bytes"):
        getattr(lib, fn).restype = ctypes.c_long
    return lib, torch.cuda.memory.CUDAPluggableAllocator(path, "mempool_alloc", "mempool_free")


def test_custom():
    lib, alloc = custom_allocator()
    pool = torch.cuda.MemPool(allocator=alloc.allocator())
    a0 = lib.mempool_allocs()
    with torch.cuda.use_mem_pool(pool):
        x = torch.full((1 << 20,), 7.0, device="cuda")
        y = torch.full((1 << 10,), 2.0, device="cuda")
    check("custom: the allocator served the pool's tensors", lib.mempool_allocs() - a0 == 2, lib.mempool_allocs() - a0)
    check("custom: data", bool((x == 7.0).all()) and bool((y == 2.0).all()))
    check("custom: the pool's snapshot lists them", {x.data_ptr(), y.data_ptr()} <= pool_addresses(pool))
    z = torch.empty(1 << 20, device="cuda")
    usable = magpie._lib.lib().magpie_usable_size
    usable.restype, usable.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    check("custom: a tensor outside the pool is magpie's", usable(z.data_ptr()) >= z.nbytes)
    check("custom: the pool's tensors are not magpie's", usable(y.data_ptr()) == 0)
    del x
    f0 = lib.mempool_frees()
    with torch.cuda.use_mem_pool(pool):
        x2 = torch.full((1 << 20,), 8.0, device="cuda")
    check("custom: a freed block served the next request (no call)", lib.mempool_allocs() - a0 == 2,
          lib.mempool_allocs() - a0)
    check("custom: nothing given back while the pool lives", lib.mempool_frees() == f0)
    check("custom: data after reuse", bool((x2 == 8.0).all()))
    del x2, y
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    check("custom: everything back to the allocator when the pool ended", lib.mempool_live_bytes() == 0,
          (lib.mempool_allocs(), lib.mempool_frees(), lib.mempool_live_bytes()))


def test_split():
    lib, alloc = custom_allocator()
    mib = 1 << 20
    pool = torch.cuda.MemPool(allocator=alloc.allocator())
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(40 * mib, dtype=torch.uint8, device="cuda")
    base, calls = a.data_ptr(), lib.mempool_allocs()
    del a
    with torch.cuda.use_mem_pool(pool):
        b = torch.full((20 * mib,), 1, dtype=torch.uint8, device="cuda")
        c = torch.full((20 * mib,), 2, dtype=torch.uint8, device="cuda")
    check("split: two 20 MiB tensors from the freed 40 MiB, no call",
          lib.mempool_allocs() == calls and {b.data_ptr(), c.data_ptr()} == {base, base + 20 * mib},
          (lib.mempool_allocs() - calls, hex(base), hex(b.data_ptr()), hex(c.data_ptr())))
    check("split: data", bool((b == 1).all()) and bool((c == 2).all()))
    segs = pool.snapshot()
    states = [blk["state"] for s in segs for blk in s["blocks"]]
    check("split: the snapshot shows one 40 MiB segment with both blocks",
          len(segs) == 1 and segs[0]["total_size"] == 40 * mib and states.count("active_allocated") == 2,
          [(s["total_size"], [(blk["size"], blk["state"]) for blk in s["blocks"]]) for s in segs])
    del b, c
    with torch.cuda.use_mem_pool(pool):
        d = torch.empty(40 * mib, dtype=torch.uint8, device="cuda")
    check("split: the freed halves merged: 40 MiB again, no call",
          d.data_ptr() == base and lib.mempool_allocs() == calls, (hex(d.data_ptr()), lib.mempool_allocs() - calls))
    del d, pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    check("split: the segment went back whole when the pool ended", lib.mempool_live_bytes() == 0,
          lib.mempool_live_bytes())

    # PyTorch's test_deleted_mempool_not_used_on_oom: room for 40 MiB more
    # than magpie holds; a use_on_oom pool's freed 40 MiB serves what magpie
    # cannot.
    fraction = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((40 * mib + torch.cuda.memory_reserved()) / total)
    try:
        oom = torch.cuda.MemPool(allocator=alloc.allocator(), use_on_oom=True)
        with torch.cuda.use_mem_pool(oom):
            a = torch.empty(40 * mib, dtype=torch.uint8, device="cuda")
        base = a.data_ptr()
        del a
        b = torch.empty(20 * mib, dtype=torch.uint8, device="cuda")
        c = torch.empty(20 * mib, dtype=torch.uint8, device="cuda")
        check("split: at the memory fraction, the use_on_oom pool's freed segment serves two tensors",
              {b.data_ptr(), c.data_ptr()} == {base, base + 20 * mib}, (hex(base), hex(b.data_ptr()), hex(c.data_ptr())))
        del b, c, oom
    except torch.OutOfMemoryError as e:
        check("split: at the memory fraction, the use_on_oom pool's freed segment serves two tensors", False,
              str(e)[:300])
    finally:
        torch.cuda.set_per_process_memory_fraction(fraction)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    check("split: everything back to the allocator", lib.mempool_live_bytes() == 0, lib.mempool_live_bytes())


def probe_frames():
    return torch.empty(3 << 20, device="cuda")


def probe_segment():
    return torch.empty(40 << 10, dtype=torch.uint8, device="cuda")


def test_history(out_dir):
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all")
    keep = probe_frames()
    gone = torch.empty(1 << 12, device="cuda")
    del gone
    seg_probe = probe_segment()
    snap = torch.cuda.memory._snapshot()
    made = [e for e in snap["device_traces"][torch.cuda.current_device()] if e["action"] == "segment_alloc"]
    holder = [s for s in snap["segments"] if any(b["address"] == seg_probe.data_ptr() for b in s["blocks"])]
    check("history: a segment magpie made is a segment_alloc, with the allocation's frames",
          any("probe_segment" in [f["name"] for f in e.get("frames", [])] for e in made),
          [(e["addr"], e["size"], [f["name"] for f in e.get("frames", [])][:3]) for e in made][:4])
    check("history: the segment carries the frames of its making",
          bool(holder) and any(f["name"] == "probe_segment" for f in holder[0].get("frames", [])),
          [f["name"] for f in holder[0].get("frames", [])][:6] if holder else "no segment holds the block")
    del seg_probe
    torch.cuda.empty_cache()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    released = [e for e in trace if e["action"] == "segment_free"]
    check("history: a segment empty_cache released is a segment_free, with its caller's frames",
          any("empty_cache" in [f["name"] for f in e.get("frames", [])] for e in released),
          [(e["addr"], e["size"], [f["name"] for f in e.get("frames", [])][:4]) for e in released][:4])
    path = os.path.join(out_dir, "magpie_snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)  # while recording: turning it off forgets the trace, as PyTorch's does
    torch.cuda.memory._record_memory_history(enabled=None)
    check("history: turning it off forgets the trace",
          not any(torch.cuda.memory._snapshot()["device_traces"]))
    trace = snap["device_traces"][torch.cuda.current_device()]
    actions = {}
    for e in trace:
        actions[e["action"]] = actions.get(e["action"], 0) + 1
    check("history: alloc and free_completed recorded", actions.get("alloc", 0) >= 2 and
          actions.get("free_completed", 0) >= 1, actions)
    mine = [e for e in trace if e["action"] == "alloc" and e["addr"] == keep.data_ptr()]
    frames = mine[0]["frames"] if mine else []
    names = [f["name"] for f in frames]
    files = [f["filename"] for f in frames]
    check("history: Python frames", "probe_frames" in names and any(f.endswith("torch_mempool_test.py") for f in files),
          names[:8])
    check("history: C++ frames", any("::" in n for n in names), [n for n in names if "::" in n][:4])
    live = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == keep.data_ptr()]
    check("history: the live block carries its frames", bool(live) and any(
        f["name"] == "probe_frames" for f in live[0].get("frames", [])))
    check("history: magpie's layers in the same snapshot", "magpie" in snap and "segments" in snap["magpie"][0])
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    check("history: _dump_snapshot writes PyTorch's format, with the trace",
          set(loaded) >= {"segments", "device_traces"} and len(loaded["device_traces"][torch.cuda.current_device()]) >= 3)
    from torch.cuda import _memory_viz

    for name, fn in (("trace", _memory_viz.trace_plot), ("segments", _memory_viz.segment_plot)):
        html = fn(loaded)
        with open(os.path.join(out_dir, f"memory_viz_{name}.html"), "w") as f:
            f.write(html)
        check(f"history: memory_viz draws the {name}", len(html) > 1000, len(html))
    del keep


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    magpie.torch.use()
    print(f"magpie {magpie.version()}, kind {magpie.torch.kind()}, torch {torch.__version__}", flush=True)
    for name, fn in (("own", test_own), ("nested", test_nested), ("threads", test_threads), ("graph", test_graph),
                     ("custom", test_custom), ("split", test_split), ("history", lambda: test_history(out_dir))):
        try:
            fn()
        except Exception as e:  # a failure of one check group, reported as such
            import traceback

            traceback.print_exc()
            check(f"{name}: raised", False, repr(e)[:300])
    passed = sum(1 for _, ok in results if ok)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
