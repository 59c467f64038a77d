"""torch.distributed (NCCL) on two GPUs under PyTorch's allocator and under
magpie.torch.use(): the same collectives and tensor-parallel forward give
the same bits, and each rank's memory comes from magpie's heap of its own
device only.

    MAGPIE_LIB=path/to/libmagpie.so python3 tests/gpu/torch_multi_gpu_test.py
    python3 tests/gpu/torch_multi_gpu_test.py --wrapper   # magpie under use(native=False)
    options: --variants pytorch,magpie (default both), --timeout S (per variant, default 300)

Needs two GPUs (fewer: a SKIP line, "0 passed, 0 failed", exit status 0),
PyTorch built with NCCL, no network (the ranks meet through a file://
store in a temporary folder). NVLink multicast stays off:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set here before CUDA starts, and the ranks
inherit them.

Each variant is one torch.multiprocessing.spawn of two ranks, rank r on
cuda:r, process group "nccl" with device_id=cuda:r: "pytorch" (PyTorch's
own allocator, the reference), then "magpie" (magpie.torch.use() before
anything else touches CUDA). In each rank:
1. collectives on deterministic data (CPU generators, moved to the GPU):
   all_reduce SUM of float32 (1M elements), int64 (values past 2^40),
   float16 (1M) and a 64 MiB float32 tensor; all_gather_into_tensor of
   float32 and int64; reduce_scatter_tensor SUM of float32 and int64;
   broadcast of float32 from rank 0 and int64 from rank 1;
2. a tensor-parallel MLP forward: 4 blocks of hidden 1024, FFN 4096, batch
   64, weights built identically in both ranks from one seeded CPU
   generator; per block a column-parallel first linear (this rank's half
   of the FFN rows and bias), exact GELU, a row-parallel second linear
   (this rank's half of the FFN columns), all_reduce SUM, then the second
   bias. TF32 is off (full float32 matmuls);
3. every tensor it holds (inputs, outputs, weights, the MLP output) is
   looked up with magpie_block_info on its storage's data_ptr: under magpie
   MAGPIE_OK with the rank's own device, under PyTorch's allocator not a
   magpie block;
4. under magpie, magpie.stats of its own device after the collectives (in
   use covers the tensors held) and after dropping them (gc.collect,
   torch.cuda.synchronize; in use falls by at least their bytes), and of
   the other device (in use and reserved 0: never touched);
5. timings, for information only: 20 in-place all_reduce of a 64 MiB
   float32 tensor, and 20 of a fresh 64 MiB tensor allocated each time.
The ranks save their results on the CPU (torch.save) and a JSON report;
a rank's exception is reported with its traceback, and a rank that does not
finish within the timeout is terminated and reported (a hang is a FAIL).

This process then checks: each collective of each variant equals the CPU
reference (integers, gathers and broadcasts exactly; float sums within a
tolerance of the float64 sum); the magpie variant's results equal the
pytorch variant's bit for bit (same data, same NCCL order, same kernels);
the MLP output of every rank matches a single-device float64 CPU reference
(rtol 1e-3, atol 1e-4 of the largest output), both ranks agree bit for bit, and magpie's equals PyTorch's
bit for bit. Ends with "N passed, M failed"; exit status 1 if any failed.
"""
import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback

# Before anything initialises CUDA, here and (inherited) in the ranks.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
    if os.path.isdir(os.path.join(p, "magpie")):
        sys.path.insert(0, p)
        break

WORLD = 2
MiB = 1 << 20
N = 1 << 20  # elements of the small collectives (per rank)
BIG = 16 * MiB  # float32 elements: 64 MiB
HIDDEN, FFN, BATCH, LAYERS = 1024, 4096, 64, 4
BENCH_ITERS = 20
FREE_WAIT_S = 10.0  # how long a rank waits for its dropped tensors to leave magpie's in-use figure
GRACE_S = 15.0  # once a rank failed, how long its peer may take to exit before it is terminated

# name: (what it is, compared exactly with the CPU reference?)
COLLECTIVES = {
    "ar_f32": ("all_reduce SUM float32, 1M elements", False),
    "ar_i64": ("all_reduce SUM int64, 1M elements", True),
    "ar_f16": ("all_reduce SUM float16, 1M elements", False),
    "ar_big": ("all_reduce SUM float32, 64 MiB", False),
    "ag_f32": ("all_gather_into_tensor float32, 1M per rank", True),
    "ag_i64": ("all_gather_into_tensor int64, 1M per rank", True),
    "rs_f32": ("reduce_scatter_tensor SUM float32, 2M -> 1M", False),
    "rs_i64": ("reduce_scatter_tensor SUM int64, 2M -> 1M", True),
    "bc_f32": ("broadcast float32 from rank 0, 1M elements", True),
    "bc_i64": ("broadcast int64 from rank 1, 1M elements", True),
}
BROADCAST_SRC = {"bc_f32": 0, "bc_i64": 1}


# ---- deterministic data (the ranks and this process build the same) ----


def rank_inputs(torch, rank):
    """Every collective's input of rank, on the CPU."""

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    ar = torch.arange(N, dtype=torch.int64)
    return {
        "ar_f32": torch.randn(N, generator=gen(100 + rank)),
        "ar_i64": ar * (rank + 1) + (rank << 40),
        "ar_f16": torch.randn(N, generator=gen(200 + rank)).half(),
        "ar_big": torch.randn(BIG, generator=gen(300 + rank)),
        "ag_f32": torch.randn(N, generator=gen(400 + rank)),
        "ag_i64": ar * 7 - rank * (1 << 33),
        "rs_f32": torch.randn(WORLD * N, generator=gen(500 + rank)),
        "rs_i64": torch.arange(WORLD * N, dtype=torch.int64) * (rank + 3) - (rank << 35),
        "bc_f32": torch.randn(N, generator=gen(600)) if rank == 0 else torch.zeros(N),
        "bc_i64": ar * 5 + (1 << 41) if rank == 1 else torch.full((N,), -1, dtype=torch.int64),
    }


def expected_results(torch, inputs):
    """Per rank, each collective's expected result (CPU; float sums in
    float64). inputs: rank_inputs of every rank."""
    out = []
    for rank in range(WORLD):
        exp = {}
        for name in ("ar_f32", "ar_i64", "ar_f16", "ar_big"):
            xs = [inputs[q][name] for q in range(WORLD)]
            exp[name] = sum(x.double() for x in xs) if xs[0].is_floating_point() else sum(xs)
        for name in ("ag_f32", "ag_i64"):
            exp[name] = torch.cat([inputs[q][name] for q in range(WORLD)])
        for name in ("rs_f32", "rs_i64"):
            xs = [inputs[q][name][rank * N:(rank + 1) * N] for q in range(WORLD)]
            exp[name] = sum(x.double() for x in xs) if xs[0].is_floating_point() else sum(xs)
        for name, src in BROADCAST_SRC.items():
            exp[name] = inputs[src][name]
        out.append(exp)
    return out


def mlp_params(torch):
    """The MLP's input (BATCH x HIDDEN) and full weights, on the CPU."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, HIDDEN, generator=g)
    layers = []
    for _ in range(LAYERS):
        w1 = torch.randn(FFN, HIDDEN, generator=g) / HIDDEN ** 0.5
        b1 = torch.randn(FFN, generator=g) * 0.1
        w2 = torch.randn(HIDDEN, FFN, generator=g) / FFN ** 0.5
        b2 = torch.randn(HIDDEN, generator=g) * 0.1
        layers.append((w1, b1, w2, b2))
    return x, layers


def mlp_shard(layers, rank):
    """rank's half: FFN rows of the first linear (column-parallel) and FFN
    columns of the second (row-parallel); the second bias whole (added once,
    after the all_reduce)."""
    part = FFN // WORLD
    sl = slice(rank * part, (rank + 1) * part)
    return [(w1[sl].contiguous(), b1[sl].contiguous(), w2[:, sl].contiguous(), b2) for w1, b1, w2, b2 in layers]


def mlp_reference(torch):
    """The whole MLP on one device: the CPU, in float64."""
    import torch.nn.functional as F

    x, layers = mlp_params(torch)
    x = x.double()
    for w1, b1, w2, b2 in layers:
        h = F.gelu(F.linear(x, w1.double(), b1.double()))
        x = F.linear(h, w2.double(), b2.double())
    return x


# ---- the ranks (spawned: top-level functions) ----


def _storages(tensors):
    """Distinct storages of tensors: {data_ptr: nbytes}."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def _block_info(lib, ptr):
    import ctypes

    size, device = ctypes.c_size_t(0), ctypes.c_int(-1)
    rc = lib.magpie_block_info(ctypes.c_void_p(ptr), ctypes.byref(size), ctypes.byref(device))
    return rc, device.value, size.value


def _stats(magpie, device):
    try:
        st = magpie.stats(device)
        return {k: st[k] for k in ("in_use_bytes", "reserved_bytes", "peak_in_use_bytes")}
    except Exception as e:  # a device magpie cannot report on: recorded, judged by the parent
        return {"error": f"{type(e).__name__}: {e}"}


def _torch_allocated(torch, device):
    try:
        return torch.cuda.memory_allocated(device)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def rank_main(rank, variant, wrapper, tmpdir, timeout_s):
    """Entry of each rank (torch.multiprocessing.spawn calls fn(rank, ...)).
    Writes <variant>.rank<r>.json (report, "error" with the traceback if it
    failed) and <variant>.rank<r>.pt (results on the CPU)."""
    info = {"rank": rank, "variant": variant, "pid": os.getpid()}
    ok = True
    try:
        _rank_body(rank, variant, wrapper, tmpdir, timeout_s, info)
    except BaseException:
        ok = False
        info["error"] = traceback.format_exc()
    with open(os.path.join(tmpdir, f"{variant}.rank{rank}.json"), "w") as f:
        json.dump(info, f)
    if not ok:
        last = info["error"].strip().splitlines()[-1]
        sys.stderr.write(f"[{variant} rank {rank}] failed ({last}); its traceback is in the FAIL line\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # The peer may be blocked in a collective: leave without the process
        # group's teardown (the parent terminates the peer after a grace period).
        os._exit(1)


def _collectives(torch, dist, rank, dev, held, results):
    """Step 1: every collective's result into results, its separate input
    (gathers, reduce-scatters) into held."""
    cpu_in = rank_inputs(torch, rank)
    for name in ("ar_f32", "ar_i64", "ar_f16", "ar_big"):
        t = cpu_in[name].to(dev)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        results[name] = t
    for name in ("ag_f32", "ag_i64"):
        src = cpu_in[name].to(dev)
        out = torch.empty(WORLD * src.numel(), dtype=src.dtype, device=dev)
        dist.all_gather_into_tensor(out, src)
        held[name + "_in"] = src
        results[name] = out
    for name in ("rs_f32", "rs_i64"):
        src = cpu_in[name].to(dev)
        out = torch.empty(src.numel() // WORLD, dtype=src.dtype, device=dev)
        dist.reduce_scatter_tensor(out, src, op=dist.ReduceOp.SUM)
        held[name + "_in"] = src
        results[name] = out
    for name, src_rank in BROADCAST_SRC.items():
        t = cpu_in[name].to(dev)
        dist.broadcast(t, src=src_rank)
        results[name] = t


def _mlp(torch, dist, rank, dev, held, results):
    """Step 2: the tensor-parallel forward; its weights into held, its
    output into results["mlp_out"]."""
    import torch.nn.functional as F

    x_cpu, layers = mlp_params(torch)
    x = x_cpu.to(dev)
    for i, layer in enumerate(mlp_shard(layers, rank)):
        w1, b1, w2, b2 = (w.to(dev) for w in layer)
        held.update({f"mlp{i}_w1": w1, f"mlp{i}_b1": b1, f"mlp{i}_w2": w2, f"mlp{i}_b2": b2})
        h = F.gelu(F.linear(x, w1, b1))  # column-parallel: this rank's FFN/2 features
        y = F.linear(h, w2)  # row-parallel: partial sums over this rank's FFN/2
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        x = y + b2
    results["mlp_out"] = x


def _blocks(lib, held):
    """Step 3: magpie_block_info of every held tensor's storage."""
    blocks = {}
    for name, t in held.items():
        s = t.untyped_storage()
        rc, device, size = _block_info(lib, s.data_ptr())
        blocks[name] = {"rc": rc, "device": device, "size": size, "nbytes": s.nbytes()}
    return blocks


def _timings(torch, dist, dev):
    """Step 5: information only."""
    timings = {}
    bench = torch.ones(BIG, device=dev)
    for _ in range(3):
        dist.all_reduce(bench)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(BENCH_ITERS):
        dist.all_reduce(bench)
    torch.cuda.synchronize()
    timings["inplace_ms"] = (time.perf_counter() - t0) * 1e3 / BENCH_ITERS
    del bench
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(BENCH_ITERS):
        y = torch.ones(BIG, device=dev)
        dist.all_reduce(y)
        del y
    torch.cuda.synchronize()
    timings["fresh_ms"] = (time.perf_counter() - t0) * 1e3 / BENCH_ITERS
    return timings


def _rank_body(rank, variant, wrapper, tmpdir, timeout_s, info):
    import torch
    import torch.distributed as dist

    import magpie
    from magpie import _lib

    if variant == "magpie":
        magpie.torch.use(native=False if wrapper else None)
        info["kind"] = magpie.torch.kind()
        lib = _lib.lib()
        if not _lib.has(lib, "magpie_block_info"):
            raise RuntimeError(f"{_lib.library_path()} has no magpie_block_info")
    else:
        # Only to ask whether PyTorch's blocks are magpie's (they must not
        # be): magpie_block_info has no side effects and answers before
        # magpie starts. Without the library that check is left out.
        try:
            lib = _lib.lib()
            if not _lib.has(lib, "magpie_block_info"):
                raise RuntimeError(f"{_lib.library_path()} has no magpie_block_info")
        except Exception as e:
            lib = None
            info["blocks_skipped"] = f"{type(e).__name__}: {e}"
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    other = (rank + 1) % WORLD
    torch.set_float32_matmul_precision("highest")  # full float32 matmuls (no TF32), both variants

    dist.init_process_group(
        "nccl",
        init_method="file://" + os.path.join(tmpdir, f"rendezvous-{variant}"),
        rank=rank,
        world_size=WORLD,
        # Below the parent's deadline: a collective that hangs is reported
        # by the process group's watchdog before the parent terminates it.
        timeout=datetime.timedelta(seconds=max(30.0, 0.8 * timeout_s)),
        device_id=dev,
    )
    dist.barrier()
    torch.cuda.synchronize()
    if variant == "magpie":
        info["stats_start"] = _stats(magpie, rank)

    held = {}  # every GPU tensor kept until the memory checks
    results = {}  # the ones saved for the parent
    _collectives(torch, dist, rank, dev, held, results)
    _mlp(torch, dist, rank, dev, held, results)
    torch.cuda.synchronize()
    held.update(results)
    if lib is not None:
        info["blocks"] = _blocks(lib, held)

    # Step 4: memory figures with everything held, then after dropping it.
    info["live_bytes"] = sum(_storages(held.values()).values())
    info["torch_allocated_after"] = _torch_allocated(torch, rank)
    if variant == "magpie":
        info["stats_after"] = _stats(magpie, rank)
        info["stats_other_after"] = _stats(magpie, other)
    torch.save({name: t.cpu() for name, t in results.items()}, os.path.join(tmpdir, f"{variant}.rank{rank}.pt"))
    results.clear()
    held.clear()
    deadline = time.monotonic() + FREE_WAIT_S
    while True:
        # The process group may keep a reference to a collective's tensors
        # until its watchdog sees the work complete: wait a little for it.
        gc.collect()
        torch.cuda.synchronize()
        if variant != "magpie":
            break
        st = _stats(magpie, rank)
        if "error" in st or time.monotonic() > deadline:
            break
        if info["stats_after"].get("in_use_bytes", 0) - st["in_use_bytes"] >= info["live_bytes"]:
            break
        time.sleep(0.1)
    info["torch_allocated_freed"] = _torch_allocated(torch, rank)
    if variant == "magpie":
        info["stats_freed"] = _stats(magpie, rank)
        info["stats_other_freed"] = _stats(magpie, other)

    info["timings"] = _timings(torch, dist, dev)
    dist.barrier()
    torch.cuda.synchronize()
    dist.destroy_process_group()


# ---- this process ----


from verdicts import Results  # noqa: E402  (beside this file, in the repository and the bundle)


def wait_ranks(procs, timeout_s):
    """Join the ranks: at most timeout_s in all, and GRACE_S once one has
    failed; the rest are terminated. Returns, per rank, "" or what went
    wrong with its process."""
    import multiprocessing.connection

    deadline = time.monotonic() + timeout_s
    failed_at = None
    pending = dict(enumerate(procs))
    while pending:
        limit = deadline if failed_at is None else min(deadline, failed_at + GRACE_S)
        left = limit - time.monotonic()
        if left <= 0:
            break
        multiprocessing.connection.wait([p.sentinel for p in pending.values()], timeout=min(left, 1.0))
        for r, p in list(pending.items()):
            if p.exitcode is not None:
                p.join()
                del pending[r]
                if p.exitcode != 0 and failed_at is None:
                    failed_at = time.monotonic()
    why = [""] * len(procs)
    for r, p in pending.items():
        p.terminate()
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(10)
        if failed_at is None:
            why[r] = f"did not finish within {timeout_s:.0f} s (terminated)"
        else:
            why[r] = f"still running {GRACE_S:.0f} s after its peer failed (terminated)"
    for r, p in enumerate(procs):
        if not why[r] and p.exitcode != 0:
            why[r] = f"exit code {p.exitcode}"
    return why


def run_variant(variant, wrapper, tmpdir, timeout_s):
    """Spawn the two ranks of variant; returns, per rank, (report dict or
    None, results dict or None, what went wrong with the process)."""
    import torch
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    ctx = mp.spawn(rank_main, args=(variant, wrapper, tmpdir, timeout_s), nprocs=WORLD, join=False)
    why = wait_ranks(ctx.processes, timeout_s)
    print(f"[{variant}] ranks done in {time.perf_counter() - t0:.1f} s", flush=True)
    out = []
    for r in range(WORLD):
        info = res = None
        path = os.path.join(tmpdir, f"{variant}.rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                info = json.load(f)
        path = os.path.join(tmpdir, f"{variant}.rank{r}.pt")
        if os.path.exists(path) and info is not None and "error" not in info:
            res = torch.load(path)
        out.append((info, res, why[r]))
    return out


def compare(torch, got, want, exact, dtype_name):
    """(ok, detail) of got against the CPU reference want."""
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if exact:
        ok = torch.equal(got, want.to(got.dtype))
        wrong = int((got != want.to(got.dtype)).sum()) if not ok else 0
        return ok, f"exact, {wrong} of {got.numel()} elements differ"
    rtol, atol = (2e-3, 2e-3) if got.dtype == torch.float16 else (1e-5, 1e-6)
    diff = (got.double() - want.double()).abs()
    ok = bool((diff <= atol + rtol * want.double().abs()).all())
    return ok, f"{dtype_name} rtol {rtol:g} atol {atol:g}, max abs difference {diff.max().item():.3g}"


def check_variant(r, torch, variant, ranks, expected, mlp_ref):
    """Verdicts of one variant whose ranks all finished."""
    for name, (what, exact) in COLLECTIVES.items():
        oks, details = [], []
        for rank, (_, res, _) in enumerate(ranks):
            got = res.get(name)
            if got is None:
                oks.append(False)
                details.append(f"rank {rank}: missing")
                continue
            ok, detail = compare(torch, got, expected[rank][name], exact, str(got.dtype).replace("torch.", ""))
            oks.append(ok)
            details.append(f"rank {rank}: {detail}")
        r.verdict(f"[{variant}] {name} ({what}) equals the CPU reference", all(oks), "; ".join(details))

    outs = [res["mlp_out"] for _, res, _ in ranks]
    scale = mlp_ref.abs().max().item()
    details, oks = [], []
    for rank, out in enumerate(outs):
        diff = (out.double() - mlp_ref).abs()
        ok = out.shape == mlp_ref.shape and bool((diff <= 1e-3 * mlp_ref.abs() + 1e-4 * scale).all())
        oks.append(ok)
        details.append(f"rank {rank} max abs difference {diff.max().item():.3g}")
    r.verdict(f"[{variant}] tensor-parallel MLP ({LAYERS} blocks, hidden {HIDDEN}, FFN {FFN}, batch {BATCH}) "
              f"matches the float64 CPU reference (rtol 1e-3)", all(oks),
              "; ".join(details) + f" (largest output {scale:.3g})")
    r.verdict(f"[{variant}] tensor-parallel MLP: both ranks' outputs identical bit for bit",
              all(torch.equal(outs[0], o) for o in outs[1:]))

    for rank, (info, _, _) in enumerate(ranks):
        blocks = info.get("blocks")
        if blocks is None:
            if variant == "magpie":
                r.verdict(f"[magpie] rank {rank}: storages looked up with magpie_block_info", False, "no lookup")
            else:
                print(f"  [pytorch] rank {rank}: storages not looked up ({info.get('blocks_skipped')})", flush=True)
            continue
        if variant == "magpie":
            bad = {n: b for n, b in blocks.items()
                   if b["rc"] != 0 or b["device"] != rank or b["size"] < b["nbytes"]}
            r.verdict(f"[magpie] rank {rank}: every tensor's storage is a magpie block of cuda:{rank}",
                      not bad, f"{len(blocks)} storages" + (f"; not: {json.dumps(bad)}" if bad else ""))
        else:
            bad = sorted(n for n, b in blocks.items() if b["rc"] == 0)
            r.verdict(f"[pytorch] rank {rank}: no tensor's storage is a magpie block (PyTorch's allocator served)",
                      not bad, f"{len(blocks)} storages" + (f"; magpie's: {', '.join(bad)}" if bad else ""))


def check_magpie_memory(r, ranks):
    for rank, (info, _, _) in enumerate(ranks):
        other = (rank + 1) % WORLD
        live = info["live_bytes"]
        after, freed = info.get("stats_after", {}), info.get("stats_freed", {})
        start = info.get("stats_start", {})
        print(f"  [magpie] rank {rank} cuda:{rank} in use: start {start.get('in_use_bytes')}, "
              f"after the collectives {after.get('in_use_bytes')}, after freeing {freed.get('in_use_bytes')} bytes; "
              f"reserved {freed.get('reserved_bytes')}, peak in use {freed.get('peak_in_use_bytes')}; "
              f"tensors held {live} bytes; torch.cuda.memory_allocated {info.get('torch_allocated_after')} -> "
              f"{info.get('torch_allocated_freed')}", flush=True)
        ok = "error" not in after and after["in_use_bytes"] >= live
        r.verdict(f"[magpie] rank {rank}: in use on cuda:{rank} after the collectives covers the tensors held", ok,
                  f"{after.get('in_use_bytes', after.get('error'))} bytes in use, {live} held")
        ok = "error" not in after and "error" not in freed and after["in_use_bytes"] - freed["in_use_bytes"] >= live
        r.verdict(f"[magpie] rank {rank}: dropping the tensors gives their bytes back (gc + synchronize)", ok,
                  f"in use {after.get('in_use_bytes', after.get('error'))} -> "
                  f"{freed.get('in_use_bytes', freed.get('error'))} bytes, {live} dropped")
        figures = [info.get("stats_other_after", {}), info.get("stats_other_freed", {})]
        # A device magpie has no heap for answers zeros; a failing call also
        # means magpie holds nothing there.
        ok = all("error" in s or (s["in_use_bytes"] == 0 and s["reserved_bytes"] == 0) for s in figures)
        r.verdict(f"[magpie] rank {rank}: cuda:{other}'s heap untouched (in use and reserved 0)", ok,
                  f"after the collectives {json.dumps(figures[0])}, after freeing {json.dumps(figures[1])}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wrapper", action="store_true", help="magpie.torch.use(native=False)")
    ap.add_argument("--variants", default="pytorch,magpie")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in ("pytorch", "magpie")]
    if unknown:
        ap.error(f"unknown variants {unknown}")

    import torch
    import torch.distributed as dist

    r = Results()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < WORLD:
        print(f"SKIP: this test needs {WORLD} GPUs, {n} found")
        print(f"{r.passed} passed, {r.failed} failed")
        return 0
    if not dist.is_available() or not dist.is_nccl_available():
        r.verdict("torch.distributed with NCCL available", False, f"torch {torch.__version__}")
        print(f"{r.passed} passed, {r.failed} failed")
        return 1

    import magpie
    from magpie import _lib

    try:
        mver = f"magpie {magpie.version()} ({_lib.library_path()})"
    except Exception as e:
        mver = f"magpie library not loaded: {e}"
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:
        nccl = "?"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
          f"{n} GPUs: {', '.join(torch.cuda.get_device_name(d) for d in range(WORLD))}; {mver}; "
          f"magpie variant: {'use(native=False)' if args.wrapper else 'use()'}", flush=True)

    # CPU references
    t0 = time.perf_counter()
    inputs = [rank_inputs(torch, rank) for rank in range(WORLD)]
    expected = expected_results(torch, inputs)
    del inputs
    mlp_ref = mlp_reference(torch)
    print(f"CPU references built in {time.perf_counter() - t0:.1f} s", flush=True)

    runs = {}
    with tempfile.TemporaryDirectory(prefix="magpie-multi-gpu-") as d:
        for variant in variants:
            try:
                ranks = run_variant(variant, args.wrapper, d, args.timeout)
            except Exception:
                r.verdict(f"[{variant}] spawn the ranks", False, traceback.format_exc())
                continue
            done = True
            for rank, (info, res, why) in enumerate(ranks):
                problems = []
                if why:
                    problems.append(why)
                if info is None:
                    problems.append("no report")
                elif "error" in info:
                    problems.append("raised:\n" + info["error"])
                elif res is None:
                    problems.append("no results")
                extra = f" ({info['kind']} allocator)" if info and info.get("kind") else ""
                r.verdict(f"[{variant}] rank {rank} on cuda:{rank} ran to the end{extra}", not problems,
                          "; ".join(problems))
                done = done and not problems
            if done:
                runs[variant] = ranks
                try:
                    check_variant(r, torch, variant, ranks, expected, mlp_ref)
                    if variant == "magpie":
                        check_magpie_memory(r, ranks)
                except Exception:
                    r.verdict(f"[{variant}] checks", False, traceback.format_exc())
            else:
                print(f"[{variant}] a rank did not finish: its checks are skipped", flush=True)

    if "pytorch" in runs and "magpie" in runs:
        try:
            for name in list(COLLECTIVES) + ["mlp_out"]:
                same = []
                for rank in range(WORLD):
                    a, b = runs["pytorch"][rank][1][name], runs["magpie"][rank][1][name]
                    same.append(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
                what = COLLECTIVES[name][0] if name in COLLECTIVES else "tensor-parallel MLP output"
                r.verdict(f"[magpie = pytorch] {name} ({what}) identical bit for bit", all(same),
                          ", ".join(f"rank {k}: {'same' if s else 'differs'}" for k, s in enumerate(same)))
        except Exception:
            r.verdict("[magpie = pytorch] comparison", False, traceback.format_exc())

    print("timings (information only; 64 MiB float32 all_reduce, "
          f"mean of {BENCH_ITERS}; bus bandwidth = 2(n-1)/n x bytes / time):")
    for variant, ranks in runs.items():
        for rank, (info, _, _) in enumerate(ranks):
            tm = info.get("timings", {})
            if not tm:
                continue
            busbw = lambda ms: (BIG * 4) * 2 * (WORLD - 1) / WORLD / (ms * 1e-3) / 1e9
            print(f"  [{variant}] rank {rank}: in place {tm['inplace_ms']:.3f} ms ({busbw(tm['inplace_ms']):.1f} GB/s), "
                  f"fresh tensor each time {tm['fresh_ms']:.3f} ms ({busbw(tm['fresh_ms']):.1f} GB/s)")
    print(f"{r.passed} passed, {r.failed} failed")
    return 0 if r.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
