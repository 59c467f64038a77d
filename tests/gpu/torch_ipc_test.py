"""CUDA tensors through torch.multiprocessing under magpie.torch.use() on a
GPU (magpie.torch_ipc).

    MAGPIE_LIB=path/to/libmagpie.so python3 tests/gpu/torch_ipc_test.py

This process calls magpie.torch.use(); its children are started with the
"spawn" method and receive tensors through magpie's reducers:
1. reducers: use() registered magpie's reducer for torch.Tensor,
   torch.nn.Parameter and torch.UntypedStorage with ForkingPickler; a CPU
   tensor's reduction is still PyTorch's.
2. queue: a child that did not call use() gets, through a Queue, a small
   float32 tensor, a 64 MiB one, a non-contiguous view with a storage
   offset, float16, int64 (values past 2^40), a tensor that requires grad
   and a Parameter. It checks each against the same tensor computed on its
   GPU (dtype, shape, stride, storage offset, requires_grad, class, values),
   doubles it in place with a kernel, synchronises and answers; this
   process must then see the doubled values in its own tensor (for the
   view: the viewed elements doubled, the others unchanged).
3. spawn argument: a tensor passed to torch.multiprocessing.spawn, doubled
   by the child, seen doubled here.
4. hold: 32 MiB tensors sent through a Pipe (pickled at once) and a Queue
   (pickled by its feeder thread) and dropped here right after; four new
   tensors of the same size are allocated and filled meanwhile and must
   not get their blocks. The child (under magpie.torch.use() itself) waits
   for that, then receives both intact, and its attempt to send a received
   tensor on to another process is refused with magpie's message.
5. CPU tensor: through a Queue as always (PyTorch's shared memory): the
   child's in-place doubling is seen here.
6. reuse: once the children exited, the held blocks' memory comes back to
   new allocations of their size (a new block lies on it), and magpie
   reports no more in use than before the tests.
7. with two GPUs or more: a tensor of cuda:1 reaches a child whose
   CUDA_VISIBLE_DEVICES lists the GPUs in reverse order, on its device of
   the same UUID (its cuda:0 when there are two), and the child's doubling
   is seen here; magpie.can_access_peer / enable_peer_access between
   cuda:0 and cuda:1 answer.

    python3 tests/gpu/torch_ipc_test.py --wrapper   # the same under use(native=False)

Ends with "N passed, M failed".
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
    if os.path.isdir(os.path.join(p, "magpie")):
        sys.path.insert(0, p)
        break

MiB = 1 << 20
TIMEOUT = 180  # seconds for any one answer of a child
QUEUE_CASES = ("small", "large", "view", "half", "int64", "grad", "param")
HELD_ELEMS = 8 * MiB  # float32: 32 MiB


def make(name, device):
    """The tensor of each case, computed on device: (tensor to send, the
    tensor holding its storage, as a view keeps its base)."""
    import torch

    if name == "small":
        t = torch.arange(1000, dtype=torch.float32, device=device)
    elif name == "large":
        t = torch.arange(16 * MiB, dtype=torch.float32, device=device)  # 64 MiB, exact in float32
    elif name == "view":
        base = torch.arange(64 * 64, dtype=torch.float32, device=device).reshape(64, 64)
        return base[3:, 1::3], base
    elif name == "half":
        t = torch.arange(1024, dtype=torch.float16, device=device)  # exact, and doubled too
    elif name == "int64":
        t = torch.arange(1 << 20, dtype=torch.int64, device=device) * 3 + (1 << 40)
    elif name == "grad":
        t = (torch.arange(4096, dtype=torch.float32, device=device) - 2048).requires_grad_()
    elif name == "param":
        t = torch.nn.Parameter(torch.arange(256, dtype=torch.float32, device=device) / 4)
    elif name == "spawn":
        t = torch.arange(1 << 20, dtype=torch.float32, device=device) * 0.5
    else:
        raise KeyError(name)
    return t, t


def describe(t):
    return {
        "dtype": str(t.dtype),
        "shape": tuple(t.shape),
        "stride": tuple(t.stride()),
        "offset": t.storage_offset(),
        "requires_grad": t.requires_grad,
        "class": type(t).__name__,
    }


def check_received(name, t):
    """What is wrong with received tensor t of case name (a list of
    strings), compared with the case computed here on t's device."""
    import torch

    problems = []
    if not t.is_cuda:
        return [f"arrived on {t.device}"]
    want, _ = make(name, t.device)
    got, exp = describe(t), describe(want)
    for k in exp:
        if got[k] != exp[k]:
            problems.append(f"{k} {got[k]} (sent: {exp[k]})")
    if not torch.equal(t.detach(), want.detach()):
        problems.append("values differ")
    return problems


def double_in_place(t):
    import torch

    with torch.no_grad():
        t.mul_(2)
    torch.cuda.synchronize()


# ---- children (spawned: top-level functions) ----


def queue_consumer(inq, outq, count):
    """Case 2 and 5, without magpie.torch.use(): check, double, answer."""
    import torch

    for _ in range(count):
        name, t = inq.get(timeout=TIMEOUT)
        try:
            if name == "cpu":
                problems = [] if torch.equal(t, torch.arange(1000, dtype=torch.float32)) else ["values differ"]
                t.mul_(2)
            else:
                problems = check_received(name, t)
                double_in_place(t)
        except Exception as e:
            problems = [f"{type(e).__name__}: {e}"]
        del t  # closes the import (after the current stream's work)
        outq.put((name, problems))


def device_consumer(inq, outq):
    """Case 7: CUDA_VISIBLE_DEVICES reversed here; report where the tensor
    arrived (this process's ordinal and the device's UUID), then double it."""
    import torch

    try:
        t = inq.get(timeout=TIMEOUT)
        where = (t.device.index, str(torch.cuda.get_device_properties(t.device.index).uuid))
        want = torch.arange(1 << 16, dtype=torch.float32, device=t.device) + 5
        problems = [] if torch.equal(t, want) else ["values differ"]
        double_in_place(t)
        del t
    except Exception as e:
        where, problems = None, [f"{type(e).__name__}: {e}"]
    outq.put((where, problems))


def spawn_consumer(rank, t, outq):
    """Case 3: the tensor came as an argument of torch.multiprocessing.spawn."""
    try:
        problems = check_received("spawn", t)
        double_in_place(t)
    except Exception as e:
        problems = [f"{type(e).__name__}: {e}"]
    outq.put(("spawn", problems))


def held_consumer(conn, inq, go, outq):
    """Case 4, under magpie.torch.use() too: wait until the sender dropped
    its tensors and reallocated, then receive them."""
    import torch

    import magpie
    from multiprocessing.reduction import ForkingPickler

    magpie.torch.use()
    problems = []
    try:
        if not go.wait(TIMEOUT):
            raise TimeoutError("no word from the sender")
        got = [("pipe", conn.recv()), ("queue", inq.get(timeout=TIMEOUT))]
        for how, t in got:
            if t.numel() != HELD_ELEMS or not bool((t == 7.0).all()):
                problems.append(f"{how}: a held tensor changed before its import (or arrived wrong)")
        try:
            ForkingPickler.dumps(got[0][1])
            problems.append("a received tensor was pickled for a third process")
        except RuntimeError as e:
            if "cannot be sent on" not in str(e):
                problems.append(f"sending a received tensor on: {e}")
        del got, t
        torch.cuda.synchronize()
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
    outq.put(("held", problems))


# ---- this process ----


from verdicts import Results  # noqa: E402  (beside this file, in the repository and the bundle)


def stop(proc):
    proc.join(TIMEOUT)
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
        return "did not exit"
    return "" if proc.exitcode == 0 else f"exit code {proc.exitcode}"


def run_reducers(r, torch, magpie):
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions as reductions

    own = magpie.torch_ipc
    table = getattr(ForkingPickler, "_extra_reducers", {})
    regs = {c.__name__: table.get(c) for c in (torch.Tensor, torch.nn.Parameter, torch.UntypedStorage)}
    r.verdict(
        "reducers: magpie's registered for Tensor, Parameter and UntypedStorage",
        own.installed()
        and regs["Tensor"] is own._reduce_tensor
        and regs["Parameter"] is own._reduce_tensor
        and regs["UntypedStorage"] is own._reduce_storage,
        str({k: getattr(v, "__module__", None) for k, v in regs.items()}),
    )
    fn, _ = own._reduce_tensor(torch.arange(10.0))
    r.verdict("reducers: a CPU tensor goes to PyTorch's reducer", fn is reductions.rebuild_tensor, repr(fn))


def run_queue(r, torch, ctx):
    inq, outq = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=queue_consumer, args=(inq, outq, len(QUEUE_CASES) + 1))
    proc.start()
    try:
        for name in QUEUE_CASES:
            t, base = make(name, "cuda")
            before = base.detach().clone()
            t0 = time.perf_counter()
            inq.put((name, t))
            got, problems = outq.get(timeout=TIMEOUT)
            ms = (time.perf_counter() - t0) * 1e3
            r.verdict(f"queue: {name} arrives intact ({describe(t)['shape']}, {t.dtype})", got == name and not problems,
                      f"{'; '.join(problems)} (round trip {ms:.0f} ms)" if problems else f"round trip {ms:.0f} ms")
            torch.cuda.synchronize()
            want = before.clone()
            if name == "view":
                want[3:, 1::3] *= 2
            else:
                want *= 2
            ok = torch.equal(base.detach(), want)
            r.verdict(f"queue: the child's doubling of {name} is seen here", ok,
                      "" if ok else f"first elements here {base.detach().flatten()[:4].tolist()}")
        cpu = torch.arange(1000, dtype=torch.float32)
        inq.put(("cpu", cpu))
        got, problems = outq.get(timeout=TIMEOUT)
        ok = got == "cpu" and not problems and torch.equal(cpu, torch.arange(1000, dtype=torch.float32) * 2)
        r.verdict("CPU tensor: through PyTorch's reducer, the child's doubling seen here", ok, "; ".join(problems))
    finally:
        err = stop(proc)
    r.verdict("queue: the child exited cleanly", not err, err)


def run_spawn(r, torch):
    import torch.multiprocessing as mp

    t, _ = make("spawn", "cuda")
    outq = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(spawn_consumer, args=(t, outq), nprocs=1, join=True)
        name, problems = outq.get()
    except Exception as e:
        name, problems = "spawn", [f"{type(e).__name__}: {e}"]
    r.verdict("spawn argument: arrives intact", not problems, "; ".join(problems))
    torch.cuda.synchronize()
    r.verdict("spawn argument: the child's doubling is seen here",
              torch.equal(t, make("spawn", "cuda")[0] * 2))


def run_held(r, torch, ctx):
    """Returns the addresses of the held blocks (for run_reuse)."""
    inq, outq, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=held_consumer, args=(theirs, inq, go, outq))
    proc.start()
    ptrs = []
    try:
        # Control: without an export, a dropped block is the next one of
        # its size (else the check below would prove nothing).
        x = torch.full((HELD_ELEMS,), 1.0, device="cuda")
        p = x.data_ptr()
        del x
        y = torch.full((HELD_ELEMS,), 1.0, device="cuda")
        r.verdict("hold: control: a dropped block not sent is handed out again at once", y.data_ptr() == p)
        del y
        a = torch.full((HELD_ELEMS,), 7.0, device="cuda")
        ptrs.append(a.data_ptr())
        mine.send(a)  # pickled here and now: exported with a hold
        del a
        b = torch.full((HELD_ELEMS,), 7.0, device="cuda")
        ptrs.append(b.data_ptr())
        inq.put(b)  # pickled by the queue's feeder thread
        del b
        time.sleep(0.5)  # let the feeder thread pickle it and drop it
        churn = [torch.full((HELD_ELEMS,), -1.0, device="cuda") for _ in range(4)]
        torch.cuda.synchronize()
        size = HELD_ELEMS * 4  # no new block may lie on a held block's memory, at any offset
        reused = [c.data_ptr() for c in churn if any(p < c.data_ptr() + size and c.data_ptr() < p + size for p in ptrs)]
        r.verdict("hold: blocks dropped after sending are not handed out before the child imports them",
                  not reused, f"reused {len(reused)}" if reused else "")
        go.set()
        name, problems = outq.get(timeout=TIMEOUT)
        r.verdict("hold: the child receives both intact (Pipe and Queue), and cannot send them on", not problems,
                  "; ".join(problems))
        del churn
    except Exception as e:
        r.verdict("hold", False, f"{type(e).__name__}: {e}")
    finally:
        err = stop(proc)
    r.verdict("hold: the child exited cleanly", not err, err)
    return ptrs


def run_reuse(r, torch, magpie, ptrs, in_use_before):
    # The child's closes reach this process's server asynchronously, and a
    # block comes back once an allocation finds it free of holds: try a
    # while, keeping what was taken so that each try is a new block.
    # A held block is back once a new block lies on its memory: magpie
    # places a block in a free range by its own rules (src/pool/large.c),
    # so the held blocks, merged with their free neighbours, may come back
    # at other offsets.
    torch.cuda.synchronize()
    taken, back = [], set()
    size = HELD_ELEMS * 4
    for _ in range(40):
        t = torch.empty(HELD_ELEMS, dtype=torch.float32, device="cuda")
        taken.append(t)
        back.update(p for p in ptrs if p < t.data_ptr() + size and t.data_ptr() < p + size)
        if len(back) == len(ptrs):
            break
        time.sleep(0.05)
    st = magpie.stats()
    where = " ".join(f"{(t.data_ptr() - ptrs[0]) >> 20:+d}" for t in taken[:12])
    r.verdict("reuse: the held blocks come back after the child closed them", len(back) == len(ptrs),
              f"{len(back)} of {len(ptrs)} after {len(taken)} allocations (held at +0 and "
              f"{(ptrs[-1] - ptrs[0]) >> 20:+d} MiB; taken at {where} MiB; pending {st['epoch_pending_bytes'] >> 20} "
              f"MiB, large free {st['large_free_bytes'] >> 20} MiB)")
    del taken, t
    torch.cuda.synchronize()
    in_use = magpie.stats()["in_use_bytes"]
    r.verdict("reuse: magpie has no more in use than before the tests", in_use <= in_use_before,
              f"{in_use} bytes in use (before: {in_use_before})")


def run_devices(r, torch, magpie, ctx):
    n = torch.cuda.device_count()
    if n < 2:
        print("one GPU: the second-device cases are skipped", flush=True)
        return
    can = magpie.can_access_peer(0, 1)
    if can:
        magpie.enable_peer_access(0, 1)
    r.verdict("peer: can_access_peer(0, 1) answers; enable_peer_access(0, 1) where it can", isinstance(can, bool),
              f"can: {can}")
    try:
        magpie.enable_peer_access(0, 0)
        r.verdict("peer: enable_peer_access(0, 0) is refused", False)
    except magpie.MagpieError as e:
        r.verdict("peer: enable_peer_access(0, 0) is refused", e.code == 7, str(e))
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda:1") + 5
    uuid = str(torch.cuda.get_device_properties(1).uuid)
    inq, outq = ctx.Queue(), ctx.Queue()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = saved.split(",") if saved else [str(d) for d in range(n)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(reversed(order))
    expect = len(order) - 2  # this process's cuda:1 there
    try:
        proc = ctx.Process(target=device_consumer, args=(inq, outq))
        proc.start()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    try:
        inq.put(t)
        where, problems = outq.get(timeout=TIMEOUT)
        ok = not problems and where == (expect, uuid)
        r.verdict("second device: arrives on the child's device of the same UUID", ok,
                  f"{'; '.join(problems)} child's device {where}, expected ({expect}, {uuid})")
        torch.cuda.synchronize(1)
        r.verdict("second device: the child's doubling is seen here",
                  torch.equal(t, (torch.arange(1 << 16, dtype=torch.float32, device="cuda:1") + 5) * 2))
    finally:
        err = stop(proc)
    r.verdict("second device: the child exited cleanly", not err, err)


def main():
    import torch
    import torch.multiprocessing as mp

    import magpie

    r = Results()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    magpie.torch.use(native=False if "--wrapper" in sys.argv[1:] else None)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
          f"magpie {magpie.version()} ({magpie.torch.kind()})", flush=True)
    torch.cuda.synchronize()
    in_use_before = magpie.stats()["in_use_bytes"]
    ctx = mp.get_context("spawn")
    steps = [
        ("reducers", lambda: run_reducers(r, torch, magpie)),
        ("queue", lambda: run_queue(r, torch, ctx)),
        ("spawn", lambda: run_spawn(r, torch)),
        ("devices", lambda: run_devices(r, torch, magpie, ctx)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception:
            r.verdict(name, False, traceback.format_exc())
    try:
        ptrs = run_held(r, torch, ctx)
        run_reuse(r, torch, magpie, ptrs, in_use_before)
    except Exception:
        r.verdict("hold and reuse", False, traceback.format_exc())
    print(f"{r.passed} passed, {r.failed} failed")
    return 0 if r.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
