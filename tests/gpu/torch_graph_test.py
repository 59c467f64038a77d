"""CUDA graphs under PyTorch's caching allocator, its cudaMallocAsync backend
and magpie (magpie.torch.use()), each case of each allocator in a process of
its own (the allocator must be chosen before the first CUDA allocation).

    python3 tests/gpu/torch_graph_test.py
    python3 tests/gpu/torch_graph_test.py --variants magpie --cases a,b

Variants: pytorch (PyTorch's caching allocator), async
(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), magpie (magpie.torch.use();
the child prints magpie.torch.kind()).

Cases:
  (a) capture: a model of Linear+GELU+LayerNorm blocks (hidden 1024, batch 8,
      fp32) whose step allocates and frees temporaries; three warm-up
      iterations on a side stream, capture with torch.cuda.graph into static
      input/output tensors; then 64 eager tensors of varied sizes are
      allocated and filled; 50 replays, each with a fresh random input copied
      into the static input and eager temporaries allocated and filled right
      after the replay, the output compared with eager execution of the model
      (torch.allclose, rtol = atol = 1e-3); the 64 tensors are checked after
      every replay and at the end. A second graph is captured into the first
      one's pool (pool=g.pool()), the two are replayed alternately (20 times)
      and both outputs checked after each pair. Then both graphs are deleted
      (del, gc.collect(), torch.cuda.synchronize()). Under magpie, magpie's
      statistics (in_use_bytes, reserved_bytes, graph_pool_bytes, graph_pools)
      are printed after each capture and after the deletion, and the case
      requires that both captures allocated from one magpie graph pool and
      that graph_pools and graph_pool_bytes come back (polled for at most
      10 s: magpie returns a released pool after a background device
      synchronisation) to where they stood after a first capture made and
      deleted beforehand (what the first capture on torch.cuda.graph's
      capture stream keeps, such as that stream's cuBLAS workspace, does not
      count).
  (b) vLLM-style decode: one decode step (MLP, residual, LayerNorm, softmax
      over a 4096-token vocabulary; fp16) captured for batch sizes
      32, 16, 8, 4, 2, 1 (largest first) into one shared pool
      (torch.cuda.graph_pool_handle()); then 3000 steps each pick a batch size,
      copy a fresh input into the static input slice, replay and compare the
      output with eager execution, while 2 other Python threads run eager work
      (allocate, compute, check, free) on their own streams the whole time;
      mismatches of either are counted. Under magpie the six captures must
      make one magpie graph pool, and its memory must come back once the
      graphs are deleted (as in (a)).
  (c) torch.cuda.make_graphed_callables on a small module with backward:
      10 SGD steps of the graphed module and of an eager copy; eager tensors
      are allocated and filled between forward and backward; losses,
      gradients and parameters are compared.
  (d) timing: mean time of a capture of the (a) graph (10 fresh captures,
      each into a new pool, after warm-up), of deleting such a graph, of
      g.replay() + synchronize (200 replays), of g.replay() alone (200
      replays, one synchronize), and of the eager step; a table at the end
      shows the variants side by side. The case fails only if the graph's
      output is wrong or something raises.
  (e) torch.compile(mode="reduce-overhead") of a tiny function (cudagraph
      trees), called 8 times and compared with eager; SKIP when Triton or
      inductor is unavailable; FAIL when inductor skipped cudagraphs
      (counters["inductor"]["cudagraph_skips"]). magpie's allocator answers
      the allocator checkpoints cudagraph trees call.
  (f) the same with torch._inductor.config.triton.cudagraph_trees = False:
      inductor then captures each compiled function with torch.cuda.graph
      (the pool hooks), not through cudagraph trees, which need the
      allocator's checkpoint calls (getCheckpointState,
      setCheckpointPoolState, checkPoolLiveAllocations) that
      CUDAPluggableAllocator and the cudaMallocAsync backend lack.

Every case runs in its own child process; an exception, a crash or a
timeout of the child is reported as a FAIL of that case. The exit status is
0 when no magpie case failed (when magpie is not among the variants: when no
case failed); failures under the reference allocators are listed apart.
MAGPIE_GRAPH_TEST_TIMEOUT (seconds, default 600) bounds each child.
"""
import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

VARIANTS = {
    "pytorch": {},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "magpie": {},
}
CASES = {
    "a": "capture, replay with eager tensors alive, second graph in the same pool, release",
    "b": "vLLM-style decode graphs in one shared pool, 2 eager threads",
    "c": "make_graphed_callables with backward",
    "d": "capture / replay timing",
    "e": "torch.compile(mode='reduce-overhead')",
    "f": "torch.compile(mode='reduce-overhead') without cudagraph trees",
}
POOL_RETURN_S = 10.0


def _find_magpie():
    """Use the installed magpie package; from a source checkout (no package
    installed), the repository's python/ folder."""
    import importlib.util

    if importlib.util.find_spec("magpie") is not None:
        return
    for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
        if os.path.isdir(os.path.join(p, "magpie")):
            sys.path.insert(0, p)
            return


class Ctx:
    """What a case gets: torch, the magpie module (or None), the options, and
    a log that goes to stdout and into the result."""

    def __init__(self, variant, torch, magpie, args):
        self.variant, self.torch, self.magpie, self.args = variant, torch, magpie, args
        self.lines = []

    def log(self, msg):
        line = f"  [{self.variant}] {msg}"
        print(line, flush=True)
        self.lines.append(msg)


def result(status, detail, **metrics):
    return {"status": status, "detail": detail, "metrics": metrics}


def setup(variant):
    import torch

    magpie = None
    if variant == "magpie":
        _find_magpie()
        import magpie

        magpie.torch.use()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "allocator backend": torch.cuda.get_allocator_backend(),
    }
    if magpie is not None:
        info["magpie.torch.kind()"] = magpie.torch.kind()
        info["magpie"] = magpie.version()
    print(f"  [{variant}] " + ", ".join(f"{k}: {v}" for k, v in info.items()), flush=True)
    return torch, magpie, info


# ---- helpers shared by the cases --------------------------------------------


def mstats(magpie):
    s = magpie.stats()
    return {k: s.get(k) for k in ("in_use_bytes", "reserved_bytes", "graph_pool_bytes", "graph_pools")}


def fmt_stats(s):
    return ", ".join(f"{k} {v}" for k, v in s.items())


def wait_pools_back(magpie, base):
    """Polls magpie's statistics until graph_pools and graph_pool_bytes are back
    at base (or below); returns (back, seconds, last stats)."""
    t0 = time.perf_counter()
    while True:
        s = mstats(magpie)
        if s["graph_pools"] <= base["graph_pools"] and s["graph_pool_bytes"] <= base["graph_pool_bytes"]:
            return True, time.perf_counter() - t0, s
        if time.perf_counter() - t0 > POOL_RETURN_S:
            return False, time.perf_counter() - t0, s
        time.sleep(0.05)


def settle(magpie):
    """magpie's statistics once graph_pools and graph_pool_bytes stopped
    changing (three equal readings 0.5 s apart; at most 10 s)."""
    last, same, t0 = mstats(magpie), 0, time.perf_counter()
    while time.perf_counter() - t0 < POOL_RETURN_S and same < 2:
        time.sleep(0.5)
        s = mstats(magpie)
        same = same + 1 if (s["graph_pools"], s["graph_pool_bytes"]) == (last["graph_pools"], last["graph_pool_bytes"]) else 0
        last = s
    return last


def warm_capture(torch, magpie, fn, static_in, ctx):
    """One capture, deleted at once, before the measured ones: what the first
    capture on torch.cuda.graph's capture stream allocates for good (the
    cuBLAS workspace of that stream, in the first graph's pool) then does
    not count against the release checks. Returns magpie's statistics
    afterwards (None for the other allocators)."""
    g, out = capture(torch, fn, static_in)
    g.replay()
    torch.cuda.synchronize()
    del g, out
    gc.collect()
    torch.cuda.synchronize()
    if magpie is None:
        return None
    s = settle(magpie)
    ctx.log(f"magpie after a first capture, deleted: {fmt_stats(s)}")
    return s


def make_model(torch, hidden, layers, dtype):
    """Blocks of Linear(h, 2h) + GELU + Linear(2h, h) + residual + LayerNorm:
    every step allocates and frees temporaries."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(hidden, 2 * hidden)
            self.fc2 = nn.Linear(2 * hidden, hidden)
            self.norm = nn.LayerNorm(hidden)

        def forward(self, x):
            t = torch.nn.functional.gelu(self.fc1(x))
            return self.norm(x + self.fc2(t))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(layers)]).to("cuda", dtype).eval()


def capture(torch, fn, static_in, pool=None, warmup=3):
    """PyTorch's documented pattern: warm-up iterations on a side stream, then
    the capture (torch.cuda.graph captures on a stream of its own)."""
    if warmup:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn(static_in)
        torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn(static_in)
    return g, out


# 64 sizes (float32 elements, 12 B to 8 MiB, 53 MiB in all) in a fixed mixed order.
FILL_SIZES = [(16 << (i % 18)) + 4 * i if i % 3 else (3 << (i % 20)) + 5 * i for i in range(64)]


def churn(torch):
    """Eager temporaries allocated and filled at once, then freed: a graph
    pool block handed to eager work would be overwritten here."""
    junk = [torch.full((n,), -7.5, device="cuda") for n in (1 << 8, 1 << 12, 1 << 16, 1 << 20, 3 << 20)]
    del junk


# ---- (a) --------------------------------------------------------------------


def case_a(ctx):
    torch, magpie = ctx.torch, ctx.magpie
    H, B, replays, pair_replays = 1024, 8, 50, 20
    tol = dict(rtol=1e-3, atol=1e-3)
    problems = []
    with torch.no_grad():
        model = make_model(torch, H, 4, torch.float32)

        def fn(x):
            return model(x)

        def fn2(x):
            return torch.softmax(model(x * 0.5), dim=-1) * 100.0

        static_in = torch.randn(B, H, device="cuda")
        base = warm_capture(torch, magpie, fn, static_in, ctx)
        g, static_out = capture(torch, fn, static_in)
        torch.cuda.synchronize()
        if magpie:
            after1 = mstats(magpie)
            ctx.log(f"magpie after the capture: {fmt_stats(after1)}")
            if not (after1["graph_pools"] >= 1 and after1["graph_pool_bytes"] > base["graph_pool_bytes"]):
                problems.append("the capture did not allocate from a magpie graph pool "
                                f"(graph_pools {base['graph_pools']} -> {after1['graph_pools']}, "
                                f"graph_pool_bytes {base['graph_pool_bytes']} -> {after1['graph_pool_bytes']})")
        else:
            ctx.log(f"after the capture: memory_allocated {torch.cuda.memory_allocated()}, "
                    f"memory_reserved {torch.cuda.memory_reserved()}")

        fills = []
        for i, n in enumerate(FILL_SIZES):
            v = float(i + 1) * 3.0 + 0.25
            fills.append((torch.empty(n, device="cuda").fill_(v), v))
        corrupted = torch.zeros(len(fills), dtype=torch.bool, device="cuda")

        def check_fills():
            corrupted.logical_or_(torch.stack([(t != v).any() for t, v in fills]))

        wrong, maxdiff = 0, 0.0
        for _ in range(replays):
            x = torch.randn(B, H, device="cuda")
            static_in.copy_(x)
            g.replay()
            churn(torch)
            check_fills()
            ref = fn(x)
            maxdiff = max(maxdiff, float((static_out - ref).abs().max()))
            if not torch.allclose(static_out, ref, **tol):
                wrong += 1
        torch.cuda.synchronize()
        check_fills()
        n_corrupt = int(corrupted.sum())
        ctx.log(f"{replays} replays: {wrong} wrong outputs (max |graph - eager| {maxdiff:.3g}), "
                f"{n_corrupt}/{len(fills)} eager tensors corrupted")

        static_in2 = torch.randn(B, H, device="cuda")
        g2, static_out2 = capture(torch, fn2, static_in2, pool=g.pool(), warmup=1)
        torch.cuda.synchronize()
        if magpie:
            after2 = mstats(magpie)
            ctx.log(f"magpie after the second capture (same pool): {fmt_stats(after2)}")
            if after2["graph_pools"] > after1["graph_pools"]:
                problems.append(f"the second capture into g.pool() made another magpie pool "
                                f"({after1['graph_pools']} -> {after2['graph_pools']})")
        wrong2 = 0
        for _ in range(pair_replays):
            x1 = torch.randn(B, H, device="cuda")
            x2 = torch.randn(B, H, device="cuda")
            static_in.copy_(x1)
            static_in2.copy_(x2)
            g.replay()
            g2.replay()
            churn(torch)
            check_fills()
            wrong2 += not torch.allclose(static_out, fn(x1), **tol)
            wrong2 += not torch.allclose(static_out2, fn2(x2), **tol)
        torch.cuda.synchronize()
        check_fills()
        n_corrupt = int(corrupted.sum())
        ctx.log(f"shared pool, {pair_replays} alternate replays of both graphs: {wrong2}/{2 * pair_replays} "
                f"wrong outputs; eager tensors corrupted so far: {n_corrupt}/{len(fills)}")

        if magpie:
            before_del = mstats(magpie)
        else:
            before_del = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        del g, g2, static_out, static_out2
        gc.collect()
        torch.cuda.synchronize()
        if magpie:
            ctx.log(f"magpie before the deletion: {fmt_stats(before_del)}")
            ctx.log(f"magpie right after del + gc + synchronize: {fmt_stats(mstats(magpie))}")
            back, secs, last = wait_pools_back(magpie, base)
            ctx.log(f"magpie {secs:.2f} s later: {fmt_stats(last)}")
            if not back:
                problems.append(f"graph pool memory not back after {POOL_RETURN_S:.0f} s "
                                f"(graph_pools {last['graph_pools']}, graph_pool_bytes {last['graph_pool_bytes']}; "
                                f"before the captures {base['graph_pools']}, {base['graph_pool_bytes']})")
        else:
            after = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
            torch.cuda.empty_cache()
            ctx.log(f"memory_allocated / reserved before the deletion {before_del[0]} / {before_del[1]}, "
                    f"after {after[0]} / {after[1]}, after empty_cache {torch.cuda.memory_allocated()} / "
                    f"{torch.cuda.memory_reserved()}")
        ok = wrong == 0 and wrong2 == 0 and n_corrupt == 0 and not problems
        detail = (f"{wrong}/{replays} wrong outputs, {n_corrupt}/{len(fills)} eager tensors corrupted, "
                  f"shared pool {wrong2}/{2 * pair_replays} wrong")
        if problems:
            detail += "; " + "; ".join(problems)
        return result("PASS" if ok else "FAIL", detail, wrong=wrong, wrong_shared=wrong2, corrupted=n_corrupt,
                      max_diff=maxdiff)


# ---- (b) --------------------------------------------------------------------


def case_b(ctx):
    torch, magpie = ctx.torch, ctx.magpie
    nn = torch.nn
    H, V = 1024, 4096
    sizes = [32, 16, 8, 4, 2, 1]
    steps = ctx.args.steps_b

    class Decode(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(H, 4 * H)
            self.fc2 = nn.Linear(4 * H, H)
            self.norm = nn.LayerNorm(H)
            self.head = nn.Linear(H, V)

        def forward(self, x):
            h = self.fc2(torch.nn.functional.silu(self.fc1(x)))
            h = h + x
            return torch.softmax(self.head(self.norm(h)).float(), dim=-1)

    torch.manual_seed(0)
    model = Decode().to("cuda", torch.float16).eval()
    stop = threading.Event()
    tstats = [{"iters": 0, "bad": 0, "error": None} for _ in range(2)]

    def worker(tid):
        st = tstats[tid]
        try:
            s = torch.cuda.Stream()
            elems = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 3 << 20]
            k = 256
            with torch.cuda.stream(s):
                while not stop.is_set():
                    n = elems[st["iters"] % len(elems)]
                    v = float(st["iters"] % 7 + 10 * tid + 1)
                    a = torch.full((n,), v, device="cuda")
                    b = a * 3.0 + 1.0
                    keep = torch.empty(n // 2 + 1, device="cuda").fill_(v)
                    m = torch.full((k, k), 1.0 / k, device="cuda")
                    r = m @ m  # exact in fp32: 256 products of 2^-16
                    ok = (b == 3.0 * v + 1.0).all() & (keep == v).all() & (r == 1.0 / k).all()
                    if not bool(ok):
                        st["bad"] += 1
                    del a, b, keep, m, r
                    st["iters"] += 1
        except Exception as e:  # reported by the case
            st["error"] = f"{type(e).__name__}: {e}"

    problems = []
    with torch.no_grad():
        static_in = torch.zeros(max(sizes), H, device="cuda", dtype=torch.float16)
        base = warm_capture(torch, magpie, model, static_in[:1], ctx)
        pool = torch.cuda.graph_pool_handle()
        graphs, outs = {}, {}
        for bs in sorted(sizes, reverse=True):
            graphs[bs], outs[bs] = capture(torch, model, static_in[:bs], pool=pool, warmup=2)
        torch.cuda.synchronize()
        if magpie:
            after = mstats(magpie)
            ctx.log(f"magpie after {len(sizes)} captures into one pool: {fmt_stats(after)}")
            if after["graph_pools"] - base["graph_pools"] != 1 or after["graph_pool_bytes"] <= base["graph_pool_bytes"]:
                problems.append(f"{len(sizes)} captures into one pool: graph_pools "
                                f"{base['graph_pools']} -> {after['graph_pools']}, graph_pool_bytes "
                                f"{base['graph_pool_bytes']} -> {after['graph_pool_bytes']} (one more pool expected)")
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        rng = random.Random(3)
        mism, maxdiff = 0, 0.0
        t0 = time.perf_counter()
        try:
            for _ in range(steps):
                bs = rng.choice(sizes)
                x = torch.randn(bs, H, device="cuda", dtype=torch.float16)
                static_in[:bs].copy_(x)
                graphs[bs].replay()
                ref = model(x)
                if not bool(torch.isclose(outs[bs], ref, rtol=1e-2, atol=1e-4).all()):
                    mism += 1
                    maxdiff = max(maxdiff, float((outs[bs] - ref).abs().max()))
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        secs = time.perf_counter() - t0
        torch.cuda.synchronize()
        ctx.log(f"{steps} decode steps in {secs:.1f} s: {mism} mismatches"
                + (f" (max |graph - eager| {maxdiff:.3g})" if mism else "")
                + "; eager threads: " + ", ".join(f"{st['iters']} iterations {st['bad']} wrong" for st in tstats))
        for i, st in enumerate(tstats):
            if st["error"]:
                problems.append(f"eager thread {i} raised {st['error']}")
            elif st["iters"] == 0:
                problems.append(f"eager thread {i} made no progress")
            if st["bad"]:
                problems.append(f"eager thread {i}: {st['bad']} wrong results")
        if any(t.is_alive() for t in threads):
            problems.append("an eager thread did not stop")
        del graphs, outs
        gc.collect()
        torch.cuda.synchronize()
        if magpie:
            back, secs, last = wait_pools_back(magpie, base)
            ctx.log(f"magpie {secs:.2f} s after deleting the graphs: {fmt_stats(last)}")
            if not back:
                problems.append(f"graph pool memory not back after {POOL_RETURN_S:.0f} s")
    ok = mism == 0 and not problems
    detail = f"{mism}/{steps} decode mismatches, eager threads " + ", ".join(
        f"{st['iters']} it/{st['bad']} wrong" for st in tstats)
    if problems:
        detail += "; " + "; ".join(problems)
    return result("PASS" if ok else "FAIL", detail, mismatches=mism,
                  thread_iters=[st["iters"] for st in tstats], thread_bad=[st["bad"] for st in tstats])


# ---- (c) --------------------------------------------------------------------


def case_c(ctx):
    import copy

    torch = ctx.torch
    nn, F = torch.nn, torch.nn.functional
    D, Hd, N, steps = 512, 1024, 64, 10
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(D, Hd), nn.GELU(), nn.Linear(Hd, Hd), nn.LayerNorm(Hd), nn.Linear(Hd, D)).cuda()
    ref = copy.deepcopy(module)
    sample = torch.randn(N, D, device="cuda")
    graphed = torch.cuda.make_graphed_callables(module, (sample,))
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    bad_loss = bad_grad = 0
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(N, D, device="cuda")
        y = torch.randn(N, D, device="cuda")
        losses, grads = [], []
        for m, opt in ((graphed, opt_g), (ref, opt_r)):
            opt.zero_grad(set_to_none=True)
            out = m(x)
            # Eager work between forward and backward: the graphed forward's
            # saved tensors live in the graph pool until the backward replay.
            junk = [torch.full((n,), 9.0, device="cuda") for n in (1 << 12, 1 << 16, 1 << 20)]
            loss = F.mse_loss(out, y)
            loss.backward()
            del junk
            losses.append(loss.detach().clone())
            grads.append([p.grad.detach().clone() for p in m.parameters()])
            opt.step()
        if not torch.allclose(losses[0], losses[1], rtol=1e-4, atol=1e-6):
            bad_loss += 1
        for gg, gr in zip(grads[0], grads[1]):
            worst = max(worst, float((gg - gr).abs().max()))
            if not torch.allclose(gg, gr, rtol=1e-4, atol=1e-5):
                bad_grad += 1
    bad_param = sum(not torch.allclose(p, q, rtol=1e-4, atol=1e-5)
                    for p, q in zip(graphed.parameters(), ref.parameters()))
    n_params = len(list(ref.parameters()))
    ctx.log(f"{steps} training steps: {bad_loss} loss mismatches, {bad_grad}/{steps * n_params} gradient "
            f"mismatches (max |diff| {worst:.3g}), {bad_param}/{n_params} parameters differ at the end")
    ok = bad_loss == 0 and bad_grad == 0 and bad_param == 0
    return result("PASS" if ok else "FAIL",
                  f"{bad_loss}/{steps} losses, {bad_grad}/{steps * n_params} gradients, "
                  f"{bad_param}/{n_params} parameters differ from the eager copy",
                  bad_loss=bad_loss, bad_grad=bad_grad, bad_param=bad_param, max_grad_diff=worst)


# ---- (d) --------------------------------------------------------------------


def case_d(ctx):
    torch = ctx.torch
    H, B = 1024, 8
    n_cap, n_rep = max(1, ctx.args.captures), max(1, ctx.args.replays)
    perf = time.perf_counter
    with torch.no_grad():
        model = make_model(torch, H, 4, torch.float32)

        def fn(x):
            return model(x)

        static_in = torch.randn(B, H, device="cuda")
        g, out = capture(torch, fn, static_in)  # warm-up, capture path included
        g.replay()
        torch.cuda.synchronize()
        del g, out
        gc.collect()

        caps, cap_t = [], []
        for _ in range(n_cap):
            torch.cuda.synchronize()
            t0 = perf()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):  # a new private pool each time
                out = fn(static_in)
            torch.cuda.synchronize()
            cap_t.append(perf() - t0)
            caps.append((g, out))
        del g, out
        del_t = []
        while caps:
            g, out = caps.pop()
            torch.cuda.synchronize()
            t0 = perf()
            del g, out
            del_t.append(perf() - t0)
        gc.collect()

        g, out = capture(torch, fn, static_in, warmup=0)
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        t0 = perf()
        for _ in range(n_rep):
            g.replay()
            torch.cuda.synchronize()
        rep_sync = (perf() - t0) / n_rep
        t0 = perf()
        for _ in range(n_rep):
            g.replay()
        launch = (perf() - t0) / n_rep
        torch.cuda.synchronize()
        rep_only = (perf() - t0) / n_rep
        for _ in range(20):
            fn(static_in)
        torch.cuda.synchronize()
        t0 = perf()
        for _ in range(n_rep):
            fn(static_in)
        torch.cuda.synchronize()
        eager = (perf() - t0) / n_rep

        x = torch.randn(B, H, device="cuda")
        static_in.copy_(x)
        g.replay()
        ok = torch.allclose(out, fn(x), rtol=1e-3, atol=1e-3)
    m = {
        "capture_ms": 1e3 * sum(cap_t) / len(cap_t),
        "capture_ms_min": 1e3 * min(cap_t),
        "destroy_ms": 1e3 * sum(del_t) / len(del_t),
        "replay_sync_us": 1e6 * rep_sync,
        "replay_launch_us": 1e6 * launch,
        "replay_us": 1e6 * rep_only,
        "eager_us": 1e6 * eager,
    }
    ctx.log("capture {capture_ms:.2f} ms (min {capture_ms_min:.2f}), destroy {destroy_ms:.3f} ms, "
            "replay+sync {replay_sync_us:.1f} us, replay {replay_us:.1f} us (host {replay_launch_us:.1f} us), "
            "eager step {eager_us:.1f} us".format(**m))
    return result("PASS" if ok else "FAIL",
                  "timed; graph output " + ("matches eager" if ok else "differs from eager"), **m)


# ---- (e) --------------------------------------------------------------------


def case_e(ctx, trees=True):
    torch = ctx.torch
    try:
        from torch.utils._triton import has_triton

        if not has_triton():
            return result("SKIP", "Triton is not available (torch.utils._triton.has_triton() is False)")
        import torch._inductor  # noqa: F401
        from torch._dynamo.utils import counters
    except Exception as e:  # inductor missing or broken
        return result("SKIP", f"inductor is not available: {type(e).__name__}: {e}")

    def f(x, w):
        h = torch.nn.functional.gelu(x @ w)
        return h * torch.sigmoid(h.sum(-1, keepdim=True) * 0.01) + 1.0

    if not trees:
        torch._inductor.config.triton.cudagraph_trees = False
    cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    w = torch.randn(256, 256, device="cuda")
    bad, worst, calls = 0, 0.0, 8
    for _ in range(calls):
        x = torch.randn(64, 256, device="cuda")
        out = cf(x, w).clone()  # cudagraph trees reuse the output's memory on the next call
        churn(torch)
        ref = f(x, w)
        worst = max(worst, float((out - ref).abs().max()))
        if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
            bad += 1
    skips = int(dict(counters.get("inductor", {})).get("cudagraph_skips", 0))
    ctx.log(f"{calls} calls: {bad} wrong (max |compiled - eager| {worst:.3g}), cudagraph_skips {skips}")
    if bad:
        return result("FAIL", f"{bad}/{calls} outputs differ from eager", wrong=bad, cudagraph_skips=skips)
    if skips:
        return result("FAIL", f"outputs right but inductor did not use CUDA graphs (cudagraph_skips {skips}; "
                              "TORCH_LOGS=perf_hints shows why)", wrong=0, cudagraph_skips=skips)
    return result("PASS", f"{calls} calls match eager, CUDA graphs used", wrong=0, cudagraph_skips=0)


def case_f(ctx):
    return case_e(ctx, trees=False)


CASE_FNS = {"a": case_a, "b": case_b, "c": case_c, "d": case_d, "e": case_e, "f": case_f}


def child(args):
    variant, case, out = args.child
    res = None
    try:
        torch, magpie, info = setup(variant)
        ctx = Ctx(variant, torch, magpie, args)
        try:
            res = CASE_FNS[case](ctx)
        except Exception as e:  # a failed capture etc.: the case's FAIL, not a crash
            traceback.print_exc()
            first = (str(e).strip().splitlines() or [""])[0][:400]
            res = result("FAIL", f"{type(e).__name__}: {first}")
        res["log"] = ctx.lines
        res["info"] = info
    except Exception as e:
        traceback.print_exc()
        res = result("FAIL", f"setup: {type(e).__name__}: {str(e).strip()[:400]}")
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


def run_child(variant, case, args, tmp):
    out = os.path.join(tmp, f"{variant}-{case}.json")
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    env.update(VARIANTS[variant])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, case, out,
           "--steps-b", str(args.steps_b), "--captures", str(args.captures), "--replays", str(args.replays)]
    print(f"-- [{variant}] ({case}) {CASES[case]}", flush=True)
    try:
        r = subprocess.run(cmd, env=env, timeout=args.timeout)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        return result("FAIL", f"timed out after {args.timeout} s")
    if not os.path.exists(out):
        return result("FAIL", f"the child process exited with status {rc} before reporting")
    with open(out) as f:
        res = json.load(f)
    if rc != 0:
        res["status"] = "FAIL"
        res["detail"] += f"; the child process then exited with status {rc}"
    return res


# Limitations documented elsewhere, by (variant, case): reported as KNOWN,
# not counted as a failure, only with one of the listed errors; a case
# that passes one day says so and fails, so the documentation is updated.
# None today: cudagraph trees' allocator checkpoints, once one, are served.
KNOWN_LIMITS = {}


def known_limit(variant, case, res):
    marks = KNOWN_LIMITS.get((variant, case))
    if marks is None:
        return res
    if res["status"] == "FAIL" and any(m in res["detail"] for m in marks):
        res["status"] = "KNOWN"
        res["detail"] = "known limitation: " + res["detail"]
    elif res["status"] == "PASS":
        res["status"] = "FAIL"
        res["detail"] = "passed, but is documented as a known limitation: update the documentation"
    return res


TIMING_ROWS = (
    ("capture_ms", "capture (ms, mean)", "{:.2f}"),
    ("capture_ms_min", "capture (ms, min)", "{:.2f}"),
    ("destroy_ms", "graph deletion (ms)", "{:.3f}"),
    ("replay_sync_us", "replay + sync (us)", "{:.1f}"),
    ("replay_us", "replay throughput (us)", "{:.1f}"),
    ("replay_launch_us", "replay host launch (us)", "{:.1f}"),
    ("eager_us", "eager step (us)", "{:.1f}"),
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "CASE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--variants", default="pytorch,async,magpie")
    ap.add_argument("--cases", default="a,b,c,d,e,f")
    ap.add_argument("--steps-b", type=int, default=3000, help="decode steps of case (b)")
    ap.add_argument("--captures", type=int, default=10, help="timed captures of case (d)")
    ap.add_argument("--replays", type=int, default=200, help="timed replays of case (d)")
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("MAGPIE_GRAPH_TEST_TIMEOUT", "600")),
                    help="seconds per child process")
    args = ap.parse_args()
    if args.child:
        return child(args)
    variants = [v for v in args.variants.split(",") if v]
    cases = [c for c in args.cases.split(",") if c]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            for c in cases:
                res = known_limit(v, c, run_child(v, c, args, tmp))
                results[(v, c)] = res
                print(f"{res['status']} [{v}] ({c}) {CASES[c]}: {res['detail']}", flush=True)

    print("\n== results")
    for c in cases:
        for v in variants:
            res = results[(v, c)]
            print(f"{res['status']} [{v}] ({c}) {CASES[c]}: {res['detail']}")
    if "d" in cases:
        print("\n== timing, case (d) (same process per variant)")
        width = max(len(r[1]) for r in TIMING_ROWS) + 2
        print(" " * width + "".join(f"{v:>12}" for v in variants))
        for key, label, fmtx in TIMING_ROWS:
            cells = []
            for v in variants:
                val = results[(v, "d")].get("metrics", {}).get(key)
                cells.append(f"{fmtx.format(val) if isinstance(val, (int, float)) else '-':>12}")
            print(f"{label:<{width}}" + "".join(cells))
        devs = {results[(v, "d")].get("info", {}).get("device") for v in variants} - {None}
        if devs:
            print(f"device: {', '.join(sorted(devs))}")

    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("PASS", "FAIL", "SKIP", "KNOWN")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, "
          f"{counts['KNOWN']} known limitations")
    decisive = "magpie" if "magpie" in variants else None
    failed = [(v, c) for (v, c), r in results.items() if r["status"] == "FAIL" and (decisive is None or v == decisive)]
    refs = [(v, c) for (v, c), r in results.items() if r["status"] == "FAIL" and decisive is not None and v != decisive]
    if refs:
        print("failures under the reference allocators (they do not decide the exit status): "
              + ", ".join(f"[{v}] ({c})" for v, c in refs))
    if failed:
        print("FAILED: " + ", ".join(f"[{v}] ({c})" for v, c in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
