"""PyTorch's memory API under PyTorch's allocator, its cudaMallocAsync
backend and magpie (magpie.torch.use()), each in a process of its own.

    MAGPIE_LIB=path/to/libmagpie.so python3 tests/gpu/torch_memory_api.py

For each allocator, one child process:
  1. allocates 8 tensors of 4 MiB and 64 of 4 KiB and calls every function
     of the memory API (memory_allocated, max_memory_allocated,
     memory_reserved, max_memory_reserved, memory_stats, memory_summary,
     reset_peak_memory_stats, reset_accumulated_memory_stats, mem_get_info,
     memory_snapshot, torch.cuda.memory._snapshot), printing what each
     answers or raises; under magpie the figures are compared with
     magpie.stats();
  2. empty_cache: 1 GiB allocated and deleted, then the device's free memory
     (mem_get_info) before and after torch.cuda.empty_cache();
  3. set_per_process_memory_fraction(0.05), then a tensor of a tenth of the
     device: the exception raised (PyTorch's own allocator raises
     torch.cuda.OutOfMemoryError);
  4. the host cost of torch.empty on the current stream, 4 KiB and 4 MiB
     (mean ns per call over 20,000 calls, tensors dropped at once).
Verdicts at the end; "N passed, N failed".
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
    if os.path.isdir(os.path.join(p, "magpie")):
        sys.path.insert(0, p)
        break

MODES = {
    "native": {},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "magpie": {},
}
API = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_stats",
    "memory_summary",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "mem_get_info",
    "memory_snapshot",
    "_snapshot",
)


def call(torch, name):
    fn = getattr(torch.cuda.memory, name)
    try:
        v = fn()
    except Exception as e:  # reported, not raised: the verdicts decide
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    if name == "memory_stats":
        return {"ok": isinstance(v, dict) and len(v) > 0, "keys": len(v),
                "allocated_bytes.all.current": v.get("allocated_bytes.all.current"),
                "reserved_bytes.all.current": v.get("reserved_bytes.all.current"),
                "num_ooms": v.get("num_ooms")}
    if name == "memory_summary":
        return {"ok": isinstance(v, str) and len(v) > 100, "lines": v.count("\n")}
    if name in ("memory_snapshot", "_snapshot"):
        segs = v if name == "memory_snapshot" else v.get("segments", [])
        return {"ok": isinstance(segs, list), "segments": len(segs),
                "bytes": sum(s.get("total_size", 0) for s in segs),
                "magpie": name == "_snapshot" and "magpie" in v}
    if name == "mem_get_info":
        return {"ok": v[0] > 0 and v[1] >= v[0], "value": list(v)}
    return {"ok": True, "value": v}


def child(mode, out_path):
    import torch

    magpie = None
    if mode == "magpie":
        import magpie

        magpie.torch.use()
    res = {"mode": mode}
    dev = torch.device("cuda")
    keep = [torch.empty(1 << 22, dtype=torch.uint8, device=dev) for _ in range(8)]
    keep += [torch.empty(4096, dtype=torch.uint8, device=dev) for _ in range(64)]
    for t in keep:
        t.fill_(1)
    torch.cuda.synchronize()
    live = 8 * (1 << 22) + 64 * 4096
    res["live_bytes"] = live
    res["api"] = {name: call(torch, name) for name in API if name not in ("reset_peak_memory_stats",
                                                                          "reset_accumulated_memory_stats")}
    if magpie is not None:
        st = magpie.stats()
        res["magpie_stats"] = {k: st[k] for k in ("in_use_bytes", "reserved_bytes", "peak_in_use_bytes",
                                                  "peak_reserved_bytes")}
    peak_before = torch.cuda.max_memory_allocated()
    del keep
    torch.cuda.synchronize()
    res["api"]["reset_peak_memory_stats"] = call(torch, "reset_peak_memory_stats")
    res["api"]["reset_accumulated_memory_stats"] = call(torch, "reset_accumulated_memory_stats")
    res["peak_before_reset"] = peak_before
    res["peak_after_reset"] = torch.cuda.max_memory_allocated()
    res["allocated_after_free"] = torch.cuda.memory_allocated()

    # empty_cache
    big = [torch.empty(1 << 26, dtype=torch.uint8, device=dev) for _ in range(16)]  # 1 GiB
    for t in big:
        t.fill_(2)
    torch.cuda.synchronize()
    del big
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    free_after = torch.cuda.mem_get_info()[0]
    res["empty_cache"] = {"free_before": free_before, "free_after": free_after,
                          "reserved_before": reserved_before, "reserved_after": torch.cuda.memory_reserved()}

    # set_per_process_memory_fraction -> out of memory
    total = torch.cuda.mem_get_info()[1]
    try:
        torch.cuda.set_per_process_memory_fraction(0.05)
        res["fraction_set"] = True
    except Exception as e:
        res["fraction_set"] = f"{type(e).__name__}: {e}"
    try:
        t = torch.empty(total // 10, dtype=torch.uint8, device=dev)
        res["oom"] = {"raised": None, "data_ptr": t.data_ptr()}
        del t
    except Exception as e:
        res["oom"] = {"raised": type(e).__name__, "is_oom": isinstance(e, torch.cuda.OutOfMemoryError),
                      "message": str(e).splitlines()[0][:300]}
    try:
        torch.cuda.set_per_process_memory_fraction(1.0)
    except Exception:
        pass

    # per-call cost of torch.empty
    cost = {}
    for size in (4096, 1 << 22):
        for _ in range(2000):
            torch.empty(size, dtype=torch.uint8, device=dev)
        n = 20000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            torch.empty(size, dtype=torch.uint8, device=dev)
        cost[str(size)] = (time.perf_counter_ns() - t0) / n
    res["torch_empty_ns"] = cost
    with open(out_path, "w") as f:
        json.dump(res, f)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    import tempfile

    passed = failed = 0

    def verdict(name, ok, detail=""):
        nonlocal passed, failed
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        passed, failed = passed + bool(ok), failed + (not ok)

    results = {}
    with tempfile.TemporaryDirectory() as d:
        for mode, extra in MODES.items():
            out = os.path.join(d, mode + ".json")
            env = dict(os.environ, **extra)
            r = subprocess.run([sys.executable, __file__, "--child", mode, out], env=env)
            if r.returncode != 0 or not os.path.exists(out):
                verdict(f"[{mode}] child", False, f"exited {r.returncode}")
                continue
            with open(out) as f:
                results[mode] = json.load(f)
    for mode, res in results.items():
        print(f"== {mode}")
        for name, v in res["api"].items():
            print(f"  {name}: {json.dumps(v)}")
        for k in ("magpie_stats", "peak_before_reset", "peak_after_reset", "allocated_after_free", "empty_cache",
                  "fraction_set", "oom", "torch_empty_ns"):
            if k in res:
                print(f"  {k}: {json.dumps(res[k])}")
    m = results.get("magpie")
    if m is not None:
        api = m["api"]
        bad = [n for n, v in api.items() if not v.get("ok")]
        verdict("[magpie] every memory API call answers", not bad, ", ".join(f"{n}: {api[n].get('error')}" for n in bad))
        alloc = api["memory_allocated"].get("value") or 0
        verdict("[magpie] memory_allocated covers the live tensors and matches magpie.stats()",
                alloc >= m["live_bytes"] and abs(alloc - m["magpie_stats"]["in_use_bytes"]) <= (1 << 20),
                f"{alloc} for {m['live_bytes']} live; magpie in_use {m['magpie_stats']['in_use_bytes']}")
        verdict("[magpie] max >= current, reserved >= allocated",
                (api["max_memory_allocated"].get("value") or 0) >= alloc
                and (api["memory_reserved"].get("value") or 0) >= alloc
                and (api["max_memory_reserved"].get("value") or 0) >= (api["memory_reserved"].get("value") or 0))
        verdict("[magpie] reset_peak_memory_stats restarts the peak", m["peak_after_reset"] < m["peak_before_reset"],
                f"{m['peak_before_reset']} -> {m['peak_after_reset']} (allocated {m['allocated_after_free']})")
        ec = m["empty_cache"]
        verdict("[magpie] empty_cache gives the memory back to the device",
                ec["free_after"] - ec["free_before"] >= (900 << 20) and ec["reserved_after"] < ec["reserved_before"],
                f"device free {ec['free_before'] >> 20} -> {ec['free_after'] >> 20} MiB, "
                f"reserved {ec['reserved_before'] >> 20} -> {ec['reserved_after'] >> 20} MiB")
        oom = m["oom"]
        verdict("[magpie] memory fraction: allocating past it raises torch.cuda.OutOfMemoryError",
                oom.get("is_oom") is True, json.dumps(oom))
    n = results.get("native")
    if n is not None:
        verdict("[native] memory fraction raises OutOfMemoryError (reference)", n["oom"].get("is_oom") is True)
    costs = {mode: r["torch_empty_ns"] for mode, r in results.items()}
    print("torch.empty host ns per call (4 KiB / 4 MiB):",
          ", ".join(f"{mode} {c['4096']:.0f} / {c[str(1 << 22)]:.0f}" for mode, c in costs.items()))
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
