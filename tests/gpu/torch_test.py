"""magpie under PyTorch on a GPU.

    MAGPIE_LIB=path/to/libmagpie.so \\
    [MAGPIE_PRELOAD_LIB=path/to/libmagpie_preload.so] python3 tests/gpu/torch_test.py

1. Inference: a small transformer-style model runs on 4 threads with 2
   streams each; every step hands its hidden state to the thread's other
   stream (wait_stream + record_stream) and keeps a tensor allocated on one
   thread that another thread frees. Its outputs must equal those of
   PyTorch's own allocator bit for bit, under:
     magpie          magpie.torch.use() (CUDAPluggableAllocator)
     preload         LD_PRELOAD=libmagpie_preload.so, PyTorch's caching
                     allocator getting its segments from cudaMalloc
     preload-async   the same with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync:
                     every tensor is a cudaMallocAsync/cudaFreeAsync on
                     its stream, served by magpie
   (the preload modes run when MAGPIE_PRELOAD_LIB is set).
2. record_stream: a tensor allocated on stream A is read late on stream B
   (after torch.cuda._sleep), recorded on B and deleted; A at once
   allocates a tensor of the same size and fills it. Under PyTorch's
   allocator the block is not reused and B reads the right values; under
   magpie too, as magpie.torch.use() installs the pluggable allocator's
   record-stream hook. magpie.torch.record_stream (kept for code written
   before the hook) gives the same.

Each case runs in its own child process (the allocator must be chosen before
the first CUDA allocation). Ends with "N passed, N failed".
"""
import json
import os
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
    if os.path.isdir(os.path.join(p, "magpie")):
        sys.path.insert(0, p)
        break

THREADS = 4
ITEMS = 16


def setup(mode):
    """Choose the allocator; returns the magpie module when magpie serves."""
    if mode == "magpie":
        import magpie

        magpie.torch.use()
        return magpie
    if mode.startswith("preload"):
        import magpie  # MAGPIE_LIB points at the preloaded library

        return magpie
    return None


def infer(mode, out_path):
    import torch

    magpie = setup(mode)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = torch.nn.Sequential(
        *[torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True) for _ in range(2)]
    ).to(dev).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 32 + 16 * (i % 6), 256, generator=gen) for i in range(ITEMS)]
    results = [None] * ITEMS
    parked = []  # tensors allocated by one thread and freed by another
    lock = threading.Lock()
    errors = []

    def record(t, s):
        t.record_stream(s)

    def worker(tid):
        try:
            s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
            for k in range(tid, ITEMS, THREADS):
                with torch.no_grad(), torch.cuda.stream(s1):
                    x = inputs[k].to(dev, non_blocking=False)
                    h = layers(x)
                    keep = torch.empty(1 << (16 + k % 5), device=dev).fill_(float(k))
                s2.wait_stream(s1)
                with torch.no_grad(), torch.cuda.stream(s2):
                    record(h, s2)
                    y = layers(h * 0.5)
                    results[k] = y.float().cpu()
                    assert float(keep[-1]) == float(k)
                del h, y, x
                with lock:
                    parked.append((keep, s1))
                    if len(parked) > 2:
                        old, _ = parked.pop(0)
                        del old  # freed by a thread that did not allocate it
        except Exception as e:  # reported by the parent
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    parked.clear()
    if errors:
        raise RuntimeError("; ".join(errors))
    torch.save(results, out_path)
    if magpie is not None:
        st = magpie.stats()
        print(f"  [{mode}] magpie stats:", {k: st[k] for k in ("in_use_bytes", "reserved_bytes", "peak_in_use_bytes",
                                                            "events_recorded", "cross_stream_migrations")})
        assert st["reserved_bytes"] > 0, "no allocation went through magpie"


def record_demo(mode, use_magpie_record, out_path):
    import torch

    magpie = setup(mode)
    n = 1 << 22  # 16 MiB of float32: a large block
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        x = torch.full((n,), 1.0, device="cuda")
    b.wait_stream(a)
    with torch.cuda.stream(b):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before B reads x
        y = x * 2
    if use_magpie_record:
        magpie.torch.record_stream(x, b)
    else:
        x.record_stream(b)
    ptr = x.untyped_storage().data_ptr()
    del x  # freed on A, the allocation stream, while B has not read it yet
    with torch.cuda.stream(a):
        z = torch.full((n,), 7.0, device="cuda")
    reused = z.untyped_storage().data_ptr() == ptr
    torch.cuda.synchronize()
    correct = bool((y == 2).all().item())
    with open(out_path, "w") as f:
        json.dump({"reused": reused, "correct": correct}, f)


def pool_figures(out_path):
    """Under LD_PRELOAD with the cudaMallocAsync backend, PyTorch reads its
    figures from the default pool's attributes, which the preload library
    answers with magpie's: a 64 MiB tensor must show in
    torch.cuda.memory_allocated (it read 0 before)."""
    import torch

    import magpie  # MAGPIE_LIB points at the preloaded library

    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    res = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
           "magpie_in_use": magpie.stats()["in_use_bytes"]}
    del x
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    res["allocated_after_free"] = torch.cuda.memory_allocated()
    res["peak_after_reset"] = torch.cuda.max_memory_allocated()
    with open(out_path, "w") as f:
        json.dump(res, f)


DEMOS = {
    "native": ["tensor_record"],
    "magpie": ["tensor_record", "magpie_record"],
    "preload-async": ["tensor_record"],
}


def child(argv):
    """One process per allocator: the inference, then its record_stream
    demonstrations (written to out + '.<how>.json')."""
    mode, out = argv[0], argv[1]
    infer(mode, out)
    for how in DEMOS.get(mode, []):
        record_demo(mode, how == "magpie_record", f"{out}.{how}.json")
    if mode == "preload-async":
        pool_figures(f"{out}.pool.json")


def run_child(args, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, __file__, "--child"] + args, env=env)
    return r.returncode


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return 0
    import torch

    passed = failed = 0

    def verdict(name, ok, detail=""):
        nonlocal passed, failed
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        if ok:
            passed += 1
        else:
            failed += 1

    preload = os.environ.get("MAGPIE_PRELOAD_LIB")
    modes = {"native": {}, "magpie": {}}
    if preload:
        base = {"LD_PRELOAD": preload, "MAGPIE_LIB": preload}
        modes["preload"] = dict(base)
        modes["preload-async"] = dict(base, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    else:
        print("MAGPIE_PRELOAD_LIB not set: the LD_PRELOAD cases are skipped")

    with tempfile.TemporaryDirectory() as d:
        outs = {}
        for mode, env in modes.items():
            path = os.path.join(d, mode + ".pt")
            rc = run_child([mode, path], env)
            if rc != 0:
                verdict(f"inference [{mode}]", False, f"child exited {rc}")
                continue
            outs[mode] = torch.load(path)
        if "native" in outs:
            for mode in modes:
                if mode == "native" or mode not in outs:
                    continue
                same = all(torch.equal(a, b) for a, b in zip(outs["native"], outs[mode]))
                diff = max((a - b).abs().max().item() for a, b in zip(outs["native"], outs[mode]))
                # Bit-identical is expected; 1e-5 allows a library choosing
                # another kernel for another pointer alignment.
                verdict(f"inference [{mode}] equals PyTorch's allocator", diff <= 1e-5,
                        f"{THREADS} threads x 2 streams, {ITEMS} items, identical: {same}, "
                        f"max abs difference {diff:.3g}")

        def demo(mode, how):
            path = os.path.join(d, f"{mode}.pt.{how}.json")
            if not os.path.exists(path):
                return None
            with open(path) as f:
                return json.load(f)

        r = demo("native", "tensor_record")
        verdict("record_stream [native] Tensor.record_stream", r is not None and not r["reused"] and r["correct"],
                str(r))
        r = demo("magpie", "tensor_record")
        verdict("record_stream [magpie] Tensor.record_stream", r is not None and not r["reused"] and r["correct"],
                str(r))
        r = demo("magpie", "magpie_record")
        verdict("record_stream [magpie] magpie.torch.record_stream", r is not None and not r["reused"] and r["correct"],
                str(r))
        if preload:
            r = demo("preload-async", "pool")
            verdict("memory API [preload-async] torch.cuda.memory_allocated sees magpie's blocks",
                    r is not None and r["allocated"] >= (64 << 20)
                    and abs(r["allocated"] - r["magpie_in_use"]) <= (1 << 20) and r["reserved"] >= r["allocated"]
                    and r["peak_after_reset"] < r["allocated"], str(r))
            r = demo("preload-async", "tensor_record")
            verdict("record_stream [preload-async] Tensor.record_stream (PyTorch orders the free)",
                    r is not None and r["correct"], str(r))
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
