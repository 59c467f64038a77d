"""Runs the CUDA graph tests of PyTorch's test/test_cuda.py under one
allocator and compares the outcomes of two runs (torch_upstream_graphs.sh
drives it).

    torch_upstream_run.py drive   --mode MODE --test-file test_cuda.py --out MODE.jsonl [--log MODE.log]
    torch_upstream_run.py compare pytorch.jsonl magpie.jsonl

MODE: pytorch (PyTorch's caching allocator), async
(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) or magpie
(magpie.torch.use() before test_cuda.py is imported, so before it touches
CUDA).

drive starts a child process that imports test_cuda.py, selects the tests
and runs them with unittest, class by class (setUpClass / tearDownClass
as usual), writing one JSON line as each test starts and one as it ends
(outcome: pass, fail, error, skip with its reason, xfail, xpass). It does
not go through common_utils.run_tests, whose command line (its own flags,
then unittest's) it does not need. A test that runs past --timeout
seconds ends the child (faulthandler prints every thread's stack to the
log); a test after which CUDA no longer works (a sticky error such as an
illegal address) ends it too. drive then records that test as timeout or
crash and starts a new child that goes on with the tests not yet run,
until all ran or --budget seconds have passed (then the rest is "notrun").

Selection (--pattern, a regular expression searched case-insensitively in
"Class.test_name"): by default every test whose class or name contains
"graph" (TestCuda's test_graph_* and test_cuda_graph_*, TestMemPool's
graph capture tests, TestCudaOptimsCUDA's test_graph_* optimizer tests,
TestCachingHostAllocatorCudaGraph, TestCudaDeviceParametrizedCUDA's
external-event graph test) and all of TestBlockStateAbsorption (the
private pool checkpointing behind torch.compile's CUDA graph trees).

compare prints every selected test's outcome under each run, the counts,
the tests that pass under the first run but not under the second, and
skips that differ (test_cuda.py skips some tests for a non-native
allocator, through TEST_CUDAMALLOCASYNC; under magpie that flag reads
torch.cuda.get_allocator_backend(), which the child reports).
"""
import argparse
import faulthandler
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PATTERN = r"graph|^TestBlockStateAbsorption\."
OK = ("pass", "xfail")
BAD = ("fail", "error", "xpass", "timeout", "crash")
EXIT_BROKEN = 3

# Tests whose assertions are about PyTorch's caching allocator itself (its
# statistics, segments, block reuse or checkpoint API) rather than about
# graphs computing the right thing; shown beside their outcome.
NOTES = {
    "test_graph_concurrent_replay": "expects corruption (assertNotEqual) when two graphs sharing a pool replay at once",
    "test_graph_three_successive": "expects a shared pool's block reused by a later capture (out-of-order replay "
                                   "corrupts)",
    "test_graph_two_successive": "checks reserved_bytes deltas of the caching allocator (kSmallBuffer)",
    "test_graph_memory_stats_and_use_result_after_destroy_graph": "checks caching allocator segment / reserved / "
                                                                  "active statistics",
    "test_memory_stats_of_multiple_generators_and_graphs": "checks active block / byte statistics",
    "test_cuda_graph_allocator_propagates_stream": "reads segment_pool_id from memory_snapshot()",
    "test_graph_capture_reclaim_2_streams": "checks exact block reuse (data_ptr) with graph_capture_record_stream_reuse",
    "test_graph_capture_reclaim_4_streams": "checks exact block reuse (data_ptr) with graph_capture_record_stream_reuse",
    "test_repeat_graph_capture_cublas_workspace_memory": "device memory (mem_get_info) may grow < 0.1 GB over 100 "
                                                         "captures",
    "test_graph_capture_oom": "expects the message 'out of memory'",
    "TestBlockStateAbsorption": "caching allocator checkpoint API (_cuda_getCheckpointState / "
                                "_cuda_setCheckpointPoolState) and memory_snapshot segments per pool",
}


def note_for(test_id):
    cls, _, name = test_id.partition(".")
    if cls in NOTES:
        return NOTES[cls]
    for key, text in NOTES.items():
        if name == key or name.startswith(key + "_"):
            return text
    return None


# ---- the child: runs tests in this process ----------------------------------


def read_records(path):
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        recs.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut short by a crash
    return recs


class Writer:
    def __init__(self, path):
        self.f = open(path, "a")

    def __call__(self, **rec):
        rec["t"] = time.time()
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def stub_missing_modules(shims):
    """Modules the torch wheel does not depend on: test_cuda.py imports psutil
    (used by TestGDS only), common_utils imports expecttest (its TestCase
    base class; assertExpectedInline, which no graph test uses). numpy,
    which common_utils also needs, cannot be stood in for."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        mod = types.ModuleType("psutil")
        mod.disk_partitions = lambda *a, **k: []
        sys.modules["psutil"] = mod
        shims.append("psutil (not installed): stub")
    try:
        import expecttest  # noqa: F401
    except ImportError:
        mod = types.ModuleType("expecttest")
        mod.TestCase = unittest.TestCase
        mod.ACCEPT = False
        sys.modules["expecttest"] = mod
        shims.append("expecttest (not installed): stub, TestCase = unittest.TestCase")
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise SystemExit("numpy is not installed: torch.testing._internal.common_utils needs it")


def _passthrough(*args, **kwargs):
    """Stand-in for a missing decorator, with or without arguments."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


def _flag_value(name):
    """Names test_cuda.py may import from common_utils that an older PyTorch
    defines in test_cuda.py itself: the same value, computed the same way."""
    import torch

    if name == "TEST_CUDAMALLOCASYNC":
        return torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    return False


def import_test_module(path, shims):
    """Imports test_cuda.py as module test_cuda. A name it imports from
    torch.testing._internal that this PyTorch lacks (the file may be from a
    slightly different version) is supplied: TEST_CUDAMALLOCASYNC as
    test_cuda.py of PyTorch 2.11 computes it, False for other flags
    (upper-case names), a pass-through otherwise; each is reported."""
    import importlib.util

    stub_missing_modules(shims)
    saved_argv = sys.argv
    sys.argv = [path]  # common_utils parses the command line
    try:
        for _ in range(30):
            spec = importlib.util.spec_from_file_location("test_cuda", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["test_cuda"] = mod
            try:
                spec.loader.exec_module(mod)
                return mod
            except ImportError as e:
                m = re.search(r"cannot import name '(\w+)' from '([\w.]+)'", str(e))
                if not m or not m.group(2).startswith("torch.testing._internal"):
                    raise
                name, modname = m.group(1), m.group(2)
                target = sys.modules[modname]
                value = _flag_value(name) if name.upper() == name else _passthrough
                setattr(target, name, value)
                shims.append(f"{modname}.{name} missing in this PyTorch: {value!r}")
        raise RuntimeError("too many missing names: " + "; ".join(shims))
    finally:
        sys.argv = saved_argv


def select_tests(mod, pattern):
    """[(class, [test names])] in a stable order."""
    rx = re.compile(pattern, re.IGNORECASE)
    loader = unittest.TestLoader()
    out = []
    for cname in sorted(vars(mod)):
        cls = getattr(mod, cname)
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
            continue
        if getattr(cls, "__module__", None) != mod.__name__:
            continue  # imported base classes (TestCase, TestAutocast)
        names = [n for n in loader.getTestCaseNames(cls) if rx.search(f"{cname}.{n}")]
        if names:
            out.append((cls, names))
    return out


def cuda_healthy(torch):
    try:
        if torch.cuda.is_current_stream_capturing():
            return False
        torch.cuda.synchronize()
        return float(torch.ones(1024, device="cuda").sum().item()) == 1024.0
    except Exception:
        return False


def short(err):
    """The exception's first two lines (type and message)."""
    etype, value, _ = err
    text = "".join(traceback.format_exception_only(etype, value)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "PYTORCH_PRINT_REPRO_ON_FAILURE" not in ln]
    return (" | ".join(lines[:2]) if lines else etype.__name__)[:500]


class Recorder(unittest.TestResult):
    def __init__(self, write, timeout, deadline, torch):
        super().__init__()
        self.write, self.timeout, self.deadline, self.torch = write, timeout, deadline, torch
        self.outcome = self.detail = None
        self.t0 = 0.0

    def startTest(self, test):
        super().startTest(test)
        self.outcome, self.detail = "pass", ""
        self.t0 = time.time()
        self.write(event="start", id=test_id(test))
        print(f"== {test_id(test)}", flush=True)
        faulthandler.dump_traceback_later(self.timeout, exit=True)

    def _set(self, outcome, detail):
        # keep the worst: a failing subtest is not undone by a later success
        if self.outcome in ("fail", "error") and outcome not in ("fail", "error"):
            return
        self.outcome, self.detail = outcome, detail

    def addSuccess(self, test):
        super().addSuccess(test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set("fail", short(err))
        traceback.print_exception(*err)

    def addError(self, test, err):
        super().addError(test, err)
        if isinstance(test, unittest.TestCase):
            self._set("error", short(err))
            traceback.print_exception(*err)
        else:  # setUpClass / tearDownClass of a class (an _ErrorHolder)
            self.write(event="class_error", id=str(test), detail=short(err))
            traceback.print_exception(*err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        if isinstance(test, unittest.TestCase) and self.outcome is not None:
            self._set("skip", str(reason)[:300])
        else:  # setUpClass raised SkipTest (an _ErrorHolder): the class's tests do not run
            self.write(event="class_skip", id=str(test), detail=str(reason)[:300])

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set("xfail", short(err))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set("xpass", "unexpected success of a test marked expectedFailure")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            failure = issubclass(err[0], test.failureException)
            self._set("fail" if failure else "error", f"{subtest.id()}: {short(err)}")
            traceback.print_exception(*err)

    def stopTest(self, test):
        faulthandler.cancel_dump_traceback_later()
        super().stopTest(test)
        if self.outcome is None:
            return
        tid = test_id(test)
        self.write(event="end", id=tid, outcome=self.outcome, detail=self.detail, seconds=round(time.time() - self.t0, 3))
        print(f"   {self.outcome.upper()} {tid} ({time.time() - self.t0:.1f} s) {self.detail}", flush=True)
        broken = self.outcome in ("fail", "error") and not cuda_healthy(self.torch)
        self.outcome = None
        if broken:
            self.write(event="broken", id=tid)
            print("   CUDA no longer works in this process: starting a new one", flush=True)
            sys.stdout.flush()
            os._exit(EXIT_BROKEN)
        if time.time() > self.deadline:
            self.write(event="deadline")
            self.stop()


def test_id(test):
    return f"{type(test).__name__}.{getattr(test, '_testMethodName', str(test))}"


def child(args):
    write = Writer(args.out)
    done = {r["id"] for r in read_records(args.out) if r.get("event") == "end"}
    shims = []
    import torch

    magpie = None
    if args.mode == "magpie":
        import importlib.util

        if importlib.util.find_spec("magpie") is None:
            for p in (os.path.join(HERE, "..", "..", "python"), os.path.join(HERE, "python")):
                if os.path.isdir(os.path.join(p, "magpie")):
                    sys.path.insert(0, p)
                    break
        import magpie

        magpie.torch.use()  # before test_cuda.py touches CUDA
    mod = import_test_module(os.path.abspath(args.test_file), shims)
    from torch.testing._internal import common_utils as cu

    selected = select_tests(mod, args.pattern)
    ids = [f"{cls.__name__}.{n}" for cls, names in selected for n in names]
    with open(args.test_file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    write(event="env", mode=args.mode, torch=torch.__version__, cuda=torch.version.cuda,
          device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
          allocator_backend=torch.cuda.get_allocator_backend() if torch.cuda.is_available() else None,
          magpie_kind=magpie.torch.kind() if magpie else None,
          TEST_CUDAMALLOCASYNC=bool(getattr(cu, "TEST_CUDAMALLOCASYNC", False)),
          TEST_CUDA_GRAPH=bool(getattr(cu, "TEST_CUDA_GRAPH", False)),
          test_file=os.path.abspath(args.test_file), test_file_sha256=digest, shims=shims, pattern=args.pattern)
    write(event="selected", ids=ids)
    for s in shims:
        print(f"shim: {s}", flush=True)
    result = Recorder(write, args.timeout, args.deadline, torch)
    # One suite, classes in order: unittest calls each class's setUpClass and
    # tearDownClass once around its tests.
    suite = unittest.TestSuite(cls(n) for cls, names in selected for n in names if f"{cls.__name__}.{n}" not in done)
    suite.run(result)
    sys.stdout.flush()
    if result.shouldStop and time.time() <= args.deadline:
        # stopped by PyTorch's TestCase (torch.cuda.synchronize() failed after a test): a new process goes on
        write(event="broken", id=None)
        sys.stderr.flush()
        os._exit(EXIT_BROKEN)
    write(event="child_done")
    return 0


# ---- drive: children until every test ran -----------------------------------


def mode_env(mode):
    env = dict(os.environ)
    # CI: PyTorch's TestCase reruns failing tests when it is set.
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_TEST_CUDA_MEM_LEAK_CHECK",
              "PYTORCH_TEST_WITH_SLOW", "PYTORCH_TEST_SKIP_CUDAGRAPH", "CI"):
        env.pop(k, None)
    if mode == "async":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    env["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "cuda"  # no CPU copies of the device-type test classes
    return env


def drive(args):
    if os.path.exists(args.out):
        os.remove(args.out)
    log_path = args.log or os.path.splitext(args.out)[0] + ".log"
    deadline = time.time() + args.budget
    children = ended_before = 0
    print(f"[{args.mode}] running the selected tests of {args.test_file}; log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        while True:
            children += 1
            cmd = [sys.executable, os.path.abspath(__file__), "child", "--mode", args.mode,
                   "--test-file", args.test_file, "--out", args.out, "--timeout", str(args.timeout),
                   "--deadline", str(deadline), "--pattern", args.pattern]
            log.write(f"\n#### child {children}: {' '.join(cmd)}\n")
            log.flush()
            try:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=mode_env(args.mode),
                                     timeout=max(60, deadline - time.time()) + args.timeout + 120)
            except subprocess.TimeoutExpired:
                rc = "killed"
            recs = read_records(args.out)
            ended = {r["id"] for r in recs if r.get("event") == "end"}
            progress = len(ended) > ended_before
            ended_before = len(ended)
            started = [r for r in recs if r.get("event") == "start" and r["id"] not in ended]
            if started:
                last = started[-1]
                secs = time.time() - last["t"]
                outcome = "timeout" if rc in (1, "killed") and secs >= args.timeout * 0.9 else "crash"
                Writer(args.out)(event="end", id=last["id"], outcome=outcome, seconds=round(secs, 1),
                                 detail=f"the process ended (status {rc}) during the test; see {log_path}")
                print(f"[{args.mode}] {outcome.upper()} {last['id']} (status {rc}); going on in a new process",
                      flush=True)
            if rc == 0 or any(r.get("event") == "deadline" for r in recs):
                break
            selected = next((r["ids"] for r in recs if r.get("event") == "selected"), None)
            if selected is None:
                Writer(args.out)(event="abort", detail=f"the child exited with status {rc} before selecting tests; "
                                                       f"see {log_path}")
                print(f"[{args.mode}] the child exited with status {rc} before selecting tests; see {log_path}")
                break
            if not started and (rc != EXIT_BROKEN or not progress):
                Writer(args.out)(event="abort", detail=f"the child exited with status {rc} between tests")
                print(f"[{args.mode}] the child exited with status {rc} between tests; see {log_path}")
                break
            if time.time() > deadline or children >= args.max_children:
                break
    recs = read_records(args.out)
    outcomes = final_outcomes(recs)
    counts = {}
    for o, _ in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    print(f"[{args.mode}] {len(outcomes)} tests: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
          + f" ({children} process{'es' if children > 1 else ''})", flush=True)
    return 0


def final_outcomes(recs):
    """{test id: (outcome, detail)} over the selected tests, notrun for those
    without an end record."""
    selected = next((r["ids"] for r in recs if r.get("event") == "selected"), [])
    res = {tid: ("notrun", "") for tid in selected}
    for r in recs:
        ev = r.get("event")
        if ev == "end" and r.get("id") in res:
            res[r["id"]] = (r.get("outcome", "?"), r.get("detail", ""))
        elif ev in ("class_error", "class_skip"):
            # "setUpClass (test_cuda.TestFoo)": the class's tests that did not run
            m = re.search(r"\(([\w.]+)\)", r.get("id") or "")
            cls = m.group(1).rsplit(".", 1)[-1] if m else None
            for tid, (o, _) in res.items():
                if cls and tid.startswith(cls + ".") and o == "notrun":
                    res[tid] = ("error" if ev == "class_error" else "skip", r.get("detail", ""))
    return res


# ---- compare ----------------------------------------------------------------


def compare(args):
    runs = []
    for path in args.results:
        recs = read_records(path)
        env = next((r for r in recs if r.get("event") == "env"), {})
        name = env.get("mode") or os.path.splitext(os.path.basename(path))[0]
        runs.append((name, env, final_outcomes(recs), [r for r in recs if r.get("event") in ("abort", "class_error")]))
    for name, env, outcomes, problems in runs:
        print(f"== {name}: torch {env.get('torch')} (CUDA {env.get('cuda')}), {env.get('device')}, "
              f"allocator backend {env.get('allocator_backend')!r}"
              + (f", magpie kind {env.get('magpie_kind')!r}" if env.get("magpie_kind") else "")
              + f", TEST_CUDAMALLOCASYNC {env.get('TEST_CUDAMALLOCASYNC')}, TEST_CUDA_GRAPH {env.get('TEST_CUDA_GRAPH')}")
        if env.get("test_file"):
            print(f"   {env['test_file']} (sha256 {env.get('test_file_sha256')}), pattern {env.get('pattern')!r}")
        for s in env.get("shims") or []:
            print(f"   shim: {s}")
        for p in problems:
            print(f"   {p.get('event')}: {p.get('id', '')} {p.get('detail', '')}")
    ids = []
    for _, _, outcomes, _ in runs:
        ids += [t for t in outcomes if t not in ids]
    names = [r[0] for r in runs]
    print("\n== per test")
    print("  ".join(f"{n:<8}" for n in names) + "  test")
    for tid in ids:
        cells = [r[2].get(tid, ("-", ""))[0] for r in runs]
        print("  ".join(f"{c:<8}" for c in cells) + f"  {tid}")
    print("\n== counts")
    for name, _, outcomes, _ in runs:
        counts = {}
        for o, _ in outcomes.values():
            counts[o] = counts.get(o, 0) + 1
        print(f"{name}: {len(outcomes)} selected: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    if len(runs) < 2:
        return 0
    (an, _, a, _), (bn, _, b, _) = runs[0], runs[1]
    regress = [t for t in ids if a.get(t, ("-",))[0] in OK and b.get(t, ("-",))[0] not in OK + ("skip", "notrun")]
    print(f"\n== pass under {an} but not under {bn}: {len(regress)}")
    for t in regress:
        o, d = b.get(t, ("-", ""))
        note = note_for(t)
        print(f"{t}: {o}: {d}" + (f"\n    (allocator-specific: {note})" if note else ""))
    skip_diff = [t for t in ids if (a.get(t, ("-",))[0] == "skip") != (b.get(t, ("-",))[0] == "skip")]
    print(f"\n== skipped under one run only: {len(skip_diff)}")
    for t in skip_diff:
        for n, o in ((an, a), (bn, b)):
            oc, d = o.get(t, ("-", ""))
            if oc == "skip":
                print(f"{t}: skipped under {n} ({d}); under the other: "
                      f"{(b if o is a else a).get(t, ('-',))[0]}")
    better = [t for t in ids if b.get(t, ("-",))[0] in OK and a.get(t, ("-",))[0] in BAD]
    if better:
        print(f"\n== pass under {bn} but not under {an}: {len(better)}")
        for t in better:
            print(f"{t}: {a[t][0]}: {a[t][1]}")
    notrun = [t for t in ids if "notrun" in (a.get(t, ("-",))[0], b.get(t, ("-",))[0])]
    if notrun:
        print(f"\n== not run (budget or an aborted process): {len(notrun)}")
        for t in notrun:
            print(f"{t}: {an} {a.get(t, ('-',))[0]}, {bn} {b.get(t, ('-',))[0]}")
    both_bad = [t for t in ids if a.get(t, ("-",))[0] in BAD and b.get(t, ("-",))[0] in BAD]
    if both_bad:
        print(f"\n== failing under both: {len(both_bad)}")
        for t in both_bad:
            print(f"{t}: {an} {a[t][0]} ({a[t][1][:160]}); {bn} {b[t][0]} ({b[t][1][:160]})")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("drive", "child"):
        p = sub.add_parser(cmd)
        p.add_argument("--mode", choices=("pytorch", "async", "magpie"), required=True)
        p.add_argument("--test-file", required=True)
        p.add_argument("--out", required=True, help="JSON lines, one per event")
        p.add_argument("--timeout", type=float, default=90.0, help="seconds per test")
        p.add_argument("--pattern", default=DEFAULT_PATTERN)
        if cmd == "drive":
            p.add_argument("--log")
            p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
            p.add_argument("--max-children", type=int, default=40)
        else:
            p.add_argument("--deadline", type=float, default=float("inf"))
    p = sub.add_parser("compare")
    p.add_argument("results", nargs="+", help="JSON lines of the reference run first")
    args = ap.parse_args()
    return {"drive": drive, "child": child, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
