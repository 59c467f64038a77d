#!/usr/bin/env bash
# magpie.torch against a stand-in for torch, on the simulated device (no
# GPU, no PyTorch): use() installs the record-stream, empty-cache and
# memory-fraction hooks on the pluggable allocator, and PyTorch's memory
# API (the stand-in's copies of torch.cuda.memory's memory_stats,
# memory_summary and the reset functions, which reach magpie through the
# torch._C functions use() replaces) answers with magpie's figures. The
# hooks are called through their C function pointers, as PyTorch calls
# them. tests/gpu/torch_memory_api.py checks the same with PyTorch on a GPU.
set -euo pipefail
. "$(dirname "$0")/python_test_prelude.sh"
lib=$1
shift
pkg=$(python_test_pkg "$@")
python_test_skip_sanitized "$lib"
tmp=${TEST_TMPDIR:-$(mktemp -d)}
fake=$tmp/fake_torch
mkdir -p "$fake/torch/cuda" "$fake/torch/include/c10/util" "$fake/torch/lib"
# What magpie's C++ entry point (python/magpie/torch_shim.cpp) needs of
# PyTorch's C++ side: c10's checks that throw, and a libc10 to link.
cat > "$fake/torch/include/c10/util/Exception.h" <<'H'
#include <sstream>
#include <stdexcept>
#include <string>
namespace c10 {
struct OutOfMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
}  // namespace c10
template <class... A> std::string stand_in_cat(const A &...a) {
  std::ostringstream o;
  (o << ... << a);
  return o.str();
}
#define TORCH_CHECK_WITH(E, cond, ...) \
  if (!(cond)) throw c10::E(stand_in_cat(__VA_ARGS__))
#define TORCH_CHECK(cond, ...) \
  if (!(cond)) throw std::runtime_error(stand_in_cat(__VA_ARGS__))
H
cc -shared -fPIC -o "$fake/torch/lib/libc10.so" -x c /dev/null
# The stand-in: what magpie.torch touches, and torch.cuda.memory's
# functions as PyTorch 2.11 writes them (they call torch._C at call time).
cat > "$fake/torch/__init__.py" <<'PY'
import types
from . import cuda  # noqa: F401

__version__ = "0.0+stand.in"

def _unsupported(name):
    def f(*a):
        raise RuntimeError(f"CUDAPluggableAllocator does not yet support {name}")
    return f

_C = types.ModuleType("torch._C")
_C._cuda_memoryStats = _unsupported("getDeviceStats")
_C._cuda_resetPeakMemoryStats = _unsupported("resetPeakStats")
_C._cuda_resetAccumulatedMemoryStats = _unsupported("resetAccumulatedStats")
_C._cuda_memorySnapshot = _unsupported("snapshot")
_C._GLIBCXX_USE_CXX11_ABI = True
PY
cat > "$fake/torch/cuda/__init__.py" <<'PY'
from . import memory  # noqa: F401
from .memory import memory_stats, memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved  # noqa: F401
from .memory import reset_peak_memory_stats, reset_accumulated_memory_stats, memory_summary, memory_snapshot  # noqa: F401

def device_count():
    return 1
PY
cat > "$fake/torch/cuda/memory.py" <<'PY'
import collections
import torch

current = None

class _Plug:
    def __init__(self):
        self.hooks = {}
    def __getattr__(self, name):
        if name.startswith("set_"):
            return lambda fn: self.hooks.__setitem__(name, fn)
        raise AttributeError(name)

class CUDAPluggableAllocator:
    def __init__(self, path, alloc, free):
        self.path, self.alloc, self.free = path, alloc, free
        self._allocator = _Plug()

def change_current_allocator(a):
    global current
    current = a

def memory_stats_as_nested_dict(device=None):
    return torch._C._cuda_memoryStats(device or 0)

def memory_stats(device=None):
    result = []
    def rec(prefix, obj):
        if isinstance(obj, dict):
            if prefix:
                prefix += "."
            for k, v in obj.items():
                rec(prefix + str(k), v)
        else:
            result.append((prefix, obj))
    rec("", memory_stats_as_nested_dict(device))
    result.sort()
    return collections.OrderedDict(result)

def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)
def max_memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.peak", 0)
def memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.current", 0)
def max_memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.peak", 0)
def reset_peak_memory_stats(device=None):
    return torch._C._cuda_resetPeakMemoryStats(device or 0)
def reset_accumulated_memory_stats(device=None):
    return torch._C._cuda_resetAccumulatedMemoryStats(device or 0)
def memory_snapshot():
    return torch._C._cuda_memorySnapshot((0, 0, True))["segments"]
def _snapshot(device=None):
    return torch._C._cuda_memorySnapshot(None)

def memory_summary(device=None, abbreviated=False):
    # The keys PyTorch 2.11's memory_summary reads.
    stats = memory_stats(device)
    lines = []
    for m in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
              "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            p = f"{m}.{pool}."
            lines.append(f"{m} {pool} {stats[p + 'current']} {stats[p + 'peak']} {stats[p + 'allocated']} {stats[p + 'freed']}")
    for m in ("oversize_allocations", "oversize_segments"):
        lines.append(f"{m} {stats[m + '.current']} {stats[m + '.peak']} {stats[m + '.allocated']} {stats[m + '.freed']}")
    lines.append(f"ooms {stats['num_ooms']} retries {stats['num_alloc_retries']}")
    return "\n".join(lines)
PY
export MAGPIE_LIB=$PWD/$lib MAGPIE_BACKEND=sim MAGPIE_SIM_MEMORY=256m PYTHONPATH=$fake:$PWD/$pkg
export MAGPIE_CACHE_DIR=$tmp/cache
unset GLIBC_TUNABLES
simlib=$(dirname "$MAGPIE_LIB")/libmagpie_sim.so
export MAGPIE_SIM_LIB=$simlib
python3 - <<'PY'
import ctypes
import os
import threading
import time

import torch
import magpie
from magpie import _lib

l = _lib.lib()
sim = ctypes.CDLL(os.environ["MAGPIE_SIM_LIB"])
sim.magpie_sim_stream_create.restype = ctypes.c_void_p
a = ctypes.c_void_p(sim.magpie_sim_stream_create())
b = ctypes.c_void_p(sim.magpie_sim_stream_create())

# Before use(): the stand-in raises as PyTorch's pluggable allocator does.
try:
    torch.cuda.memory_allocated()
    raise AssertionError("the stand-in should raise before use()")
except RuntimeError:
    pass

# magpie's own allocator (torch_native.cpp) needs PyTorch's C++ headers,
# which the stand-in lacks: use() says so and takes the pluggable wrapper.
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plug = magpie.torch.use()
assert magpie.torch.kind() == "pluggable", magpie.torch.kind()
assert any("torch_native.cpp" in str(w.message) and "CUDAPluggableAllocator wrapper" in str(w.message)
           for w in caught), [str(w.message)[:200] for w in caught]
assert magpie.torch.use() is plug  # once per process
assert torch.cuda.memory.current is plug
# Allocation goes through the C++ entry point, built into the cache once.
cache = os.environ["MAGPIE_CACHE_DIR"]
assert os.path.dirname(plug.path) == cache and (plug.alloc, plug.free) == (
    "magpie_torch_shim_malloc", "magpie_torch_shim_free"), (plug.path, plug.alloc, plug.free)
built = os.stat(plug.path).st_mtime_ns
assert magpie._shim.build(torch) == plug.path and os.stat(plug.path).st_mtime_ns == built, "built twice"
assert [f for f in os.listdir(cache) if f.startswith(".build-")] == []
shim = ctypes.CDLL(plug.path)
addr = lambda name: ctypes.cast(getattr(l, name), ctypes.c_void_p).value
saddr = lambda name: ctypes.cast(getattr(shim, name), ctypes.c_void_p).value
hooks = plug._allocator.hooks
assert hooks == {
    "set_record_stream_fn": addr("magpie_torch_record_stream"),
    "set_reset_fn": addr("magpie_torch_empty_cache"),
    "set_memory_fraction_fn": addr("magpie_torch_set_memory_fraction"),
}, hooks
alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(saddr(plug.alloc))
free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(saddr(plug.free))
# A failure would throw through ctypes (PyTorch catches it; ctypes cannot):
# the out-of-memory checks below call magpie's C entry point instead.
c_alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)(addr("magpie_torch_malloc"))
record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hooks["set_record_stream_fn"])
empty_cache = ctypes.CFUNCTYPE(None)(hooks["set_reset_fn"])
fraction = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)(hooks["set_memory_fraction_fn"])

# record_stream: without it a block freed on A comes back to A's next
# allocation at once; recorded on B, it is parked until B's work is done
# (work held on B by a gate, as PyTorch's own test holds its stream with a
# sleeping kernel), then it is A's next allocation again.
p = alloc(4096, 0, a)
free(p, 4096, 0, a)
assert alloc(4096, 0, a) == p, "control: a plain free is reused by its stream at once"
gate = threading.Event()
HOLD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
hold = HOLD(lambda _: gate.wait(30))
sim.magpie_sim_launch.argtypes = [ctypes.c_void_p, HOLD, ctypes.c_void_p]
assert sim.magpie_sim_launch(b, hold, None) == 0
record(p, b)
free(p, 4096, 0, a)
q = alloc(4096, 0, a)
assert q != p, "Tensor.record_stream did not reach magpie: the recorded block was reused at once"
gate.set()
assert sim.magpie_sim_stream_synchronize(b) == 0 and sim.magpie_sim_stream_synchronize(a) == 0
time.sleep(0.01)  # past the interval at which a thread looks for its parked blocks
r = alloc(4096, 0, a)
assert r == p, "the recorded block did not come back to its stream once B's work completed"
free(q, 4096, 0, a)
free(r, 4096, 0, a)

# The memory API.
blocks = [alloc(3 << 20, 0, a) for _ in range(4)] + [alloc(8192, 0, a) for _ in range(16)]
assert all(blocks)
st = magpie.stats()
ms = torch.cuda.memory_stats()
assert torch.cuda.memory_allocated() == ms["allocated_bytes.all.current"]
assert ms["allocated_bytes.all.current"] >= 4 * (3 << 20) + 16 * 8192, ms["allocated_bytes.all.current"]
assert abs(ms["allocated_bytes.all.current"] - st["in_use_bytes"]) <= 64 * 8192, (ms, st)
assert ms["allocated_bytes.large_pool.current"] >= 4 * (3 << 20)
assert ms["allocated_bytes.large_pool.current"] + ms["allocated_bytes.small_pool.current"] == ms["allocated_bytes.all.current"]
assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
assert ms["segment.all.current"] >= 1
assert ms["magpie.reserved_bytes"] == ms["reserved_bytes.all.current"]
summary = torch.cuda.memory_summary()
assert "allocated_bytes all" in summary
peak_before = torch.cuda.max_memory_allocated()
for x in blocks:
    free(x, 0, 0, a)
torch.cuda.reset_peak_memory_stats()
after = torch.cuda.max_memory_allocated()
assert after < peak_before, (after, peak_before)
assert after >= torch.cuda.memory_allocated()
assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()

# Snapshot: PyTorch's segments, magpie's own under "magpie".
snap = torch.cuda.memory._snapshot()
assert snap["magpie"][0]["magpie_snapshot"] == 1
segs = torch.cuda.memory_snapshot()
own = snap["magpie"][0]
# Everything mapped but what no segment lists (the unused part of the chunks
# slabs are carved from, counted as overhead).
total, st0 = sum(s["total_size"] for s in segs), own["stats"]
assert st0["reserved_bytes"] - st0["overhead_bytes"] <= total <= st0["reserved_bytes"], (total, st0)
assert sum(s["allocated_size"] for s in segs) == own["stats"]["in_use_bytes"], ([(s["magpie_kind"], s["allocated_size"]) for s in segs], own["stats"]["in_use_bytes"])
for s in segs:
    assert sum(b["size"] for b in s["blocks"]) <= s["total_size"], s["address"]
    assert {b["state"] for b in s["blocks"]} <= {"active_allocated", "active_pending_free", "inactive"}

# empty_cache: reserved memory drops to what is in use (nothing here).
reserved = torch.cuda.memory_reserved()
empty_cache()
assert torch.cuda.memory_reserved() < reserved, (torch.cuda.memory_reserved(), reserved)
print(f"empty_cache: reserved {reserved} -> {torch.cuda.memory_reserved()}")

# set_per_process_memory_fraction: the limit is half the 256 MiB device;
# 160 MiB cannot be had, counted as an out-of-memory failure.
fraction(0.5, 0)
assert magpie.stats()["limit_bytes"] == 128 << 20, magpie.stats()["limit_bytes"]
ooms = torch.cuda.memory_stats()["num_ooms"]
assert c_alloc(160 << 20, 0, a) is None
assert l.magpie_last_error() == 4  # MAGPIE_ERR_OUT_OF_MEMORY
assert "limit" in l.magpie_last_error_message().decode()
assert torch.cuda.memory_stats()["num_ooms"] == ooms + 1
torch.cuda.reset_accumulated_memory_stats()
assert torch.cuda.memory_stats()["num_ooms"] == 0
p = alloc(100 << 20, 0, a)
assert p, l.magpie_last_error_message()
free(p, 0, 0, a)
fraction(1.0, 0)
assert magpie.stats()["limit_bytes"] == 256 << 20
# A bad fraction changes nothing and leaves an error (PyTorch checks the range first).
fraction(1.5, 0)
assert l.magpie_last_error() == 7 and magpie.stats()["limit_bytes"] == 256 << 20

# The old entry point still works.
class T:
    def record_stream(self, s):
        self.s = s
t = T()
magpie.torch.record_stream(t, "s")
assert t.s == "s"
print("python torch: hooks, memory API, snapshot, empty_cache and memory fraction OK")
PY
# Under magpie's own allocator (kind "native"), _snapshot merges what
# PyTorch's snapshot() of that allocator gives (torch_native.cpp: the
# trace, each pool's blocks as segments of their pool, live allocations'
# frames as segments of pool (0, 0)) into magpie's segments. The native
# half is stood in for here with what PyTorch's _cuda_memorySnapshot makes
# of it; tests/gpu/torch_mempool_test.py checks it with PyTorch.
python3 - <<'PY'
import ctypes

import magpie
import magpie.torch as mt

l = magpie._lib.lib()
s = None  # the simulated device's default stream
a, b, c = (l.magpie_malloc_async(n, s) for n in (4096, 3 << 20, 5 << 20))
assert a and b and c
frames = [{"name": "probe", "filename": "x.py", "line": 7}]
made = [{"name": "maker", "filename": "x.py", "line": 9}]
# The magpie segment that holds a: the history names its making.
holder = [seg["address"] for seg in mt.torch_snapshot(1)["segments"]
          if any(bl["address"] == a for bl in seg["blocks"])]
assert len(holder) == 1, holder


def native(*args):
    pool_seg = {"device": 0, "address": b, "total_size": 3 << 20, "allocated_size": 3 << 20,
                "active_size": 3 << 20, "requested_size": 3 << 20, "stream": 0, "segment_type": "large",
                "segment_pool_id": (0, 9), "is_expandable": False, "frames": [],
                "blocks": [{"address": b, "size": 3 << 20, "requested_size": 3 << 20, "state": "active_allocated",
                            "frames": []}]}
    carriers = [{"device": 0, "address": p, "total_size": n, "allocated_size": n, "active_size": n,
                 "requested_size": n, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                 "is_expandable": False, "frames": frames,
                 "blocks": [{"address": p, "size": n, "requested_size": n - 96, "state": "active_allocated",
                             "frames": frames}]} for p, n in ((a, 4096), (b, 3 << 20))]
    maker = {"device": 0, "address": holder[0], "total_size": 0, "allocated_size": 0, "active_size": 0,
             "requested_size": 0, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
             "is_expandable": False, "frames": made, "blocks": []}
    return {"segments": [pool_seg] + carriers + [maker],
            "device_traces": [[{"action": "alloc", "addr": a, "size": 4096, "stream": 0, "time_us": 1,
                                "frames": frames}]],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}


whole = mt.torch_snapshot(1, native, (None,))
blocks = {bl["address"]: (seg, bl) for seg in whole["segments"] for bl in seg["blocks"]}
# The pool's block is a segment of its pool, and only there.
pool_segs = [seg for seg in whole["segments"] if tuple(seg["segment_pool_id"]) == (0, 9)]
assert len(pool_segs) == 1 and pool_segs[0]["blocks"][0]["address"] == b, pool_segs
assert sum(1 for seg in whole["segments"] for bl in seg["blocks"] if bl["address"] == b) == 1
# Blocks carry their allocation frames; the others none.
assert blocks[a][1]["frames"] == frames and blocks[b][1]["frames"] == frames, blocks[a]
assert blocks[c][1]["frames"] == [] and blocks[c][1]["state"] == "active_allocated"
# The sizes asked (the history's), and the frames of the segment's making.
assert blocks[a][1]["requested_size"] == 4096 - 96 and blocks[c][1]["requested_size"] == blocks[c][1]["size"]
assert blocks[a][0]["frames"] == made and blocks[c][0]["frames"] in ([], made), blocks[a][0]["frames"]
# torch.cuda.memory_snapshot (PyTorch 2.11) passes (0, 0, include_traces):
# every segment, as with no pool id.
every = mt.torch_snapshot(1, native, ((0, 0, True),))
assert sorted(seg["address"] for seg in every["segments"]) == sorted(seg["address"] for seg in whole["segments"])
# magpie's segments keep consistent figures after the pool block left them.
for seg in whole["segments"]:
    assert seg["allocated_size"] == sum(bl["size"] for bl in seg["blocks"] if bl["state"] == "active_allocated")
    assert sum(bl["size"] for bl in seg["blocks"]) <= seg["total_size"]
assert whole["device_traces"][0][0]["action"] == "alloc" and "magpie" in whole
# A pool's own snapshot (MemPool.snapshot()) lists that pool's segments only.
mine = mt.torch_snapshot(1, native, ((0, 9),))
assert [seg["address"] for seg in mine["segments"]] == [b], mine["segments"]
mine = mt.torch_snapshot(1, native, ((0, 9, True),))
assert [seg["address"] for seg in mine["segments"]] == [b], mine["segments"]
for p in (a, b, c):
    assert l.magpie_free_async(p, s) == 0
# Memory a large segment lent to the small classes' spans is listed as
# their slabs' segments: not as a block of the segment, nor in its total.
g, at = 2 << 20, 1 << 40
lent = {"kind": "large_segment", "base": at, "size": 2 * g, "vmm": 1, "granule": g, "mapped": [[0, 1]],
        "blocks": [{"base": at, "size": g // 2, "mapped": g // 2, "state": "in_use"},
                   {"base": at + g // 2, "size": g // 8, "mapped": g // 8, "state": "span"},
                   {"base": at + g // 2 + g // 8, "size": g + g // 2 - g // 8, "mapped": g // 2 - g // 8,
                    "state": "free"}]}
ts = mt._torch_segment(0, g, lent)
assert ts["total_size"] == g - g // 8, ts
assert [bl["address"] for bl in ts["blocks"]] == [at, at + g // 2 + g // 8], ts["blocks"]
print("python torch: the native allocator's snapshot merge OK")
PY
