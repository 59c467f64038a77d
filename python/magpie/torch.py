"""magpie as PyTorch's CUDA allocator, through
torch.cuda.memory.CUDAPluggableAllocator.

    import magpie
    magpie.torch.use()     # before the first CUDA allocation

magpie serves PyTorch through C++ built against the installed PyTorch on
first use (_shim.py; a C++ compiler is needed once per PyTorch version):
torch_native.cpp, a CUDAPluggableAllocator whose allocation paths call
magpie without the wrapper's lock, or, where that cannot be built, the
wrapper itself with torch_shim.cpp's allocation functions. Either way,
running out of memory raises torch.cuda.OutOfMemoryError with magpie's
explanation, as PyTorch's own allocator does, instead of handing PyTorch a
null pointer.

use() installs, besides allocation and free, the pluggable allocator's
hooks that PyTorch calls when they are set:
  Tensor.record_stream(s)        -> magpie_record_stream (the tensor's block
                                    is reused by nobody until the work
                                    enqueued on s before its free completed)
  torch.cuda.empty_cache()       -> magpie_trim of every device, keeping 0
  torch.cuda.set_per_process_memory_fraction(f, d)
                                 -> magpie_set_limit_fraction(d, f)
and answers PyTorch's memory API from magpie's statistics (PyTorch's
pluggable allocator raises on them): memory_allocated, max_memory_allocated,
memory_reserved, max_memory_reserved, memory_stats, memory_stats_as_nested_dict,
memory_summary, reset_peak_memory_stats, reset_accumulated_memory_stats,
memory_snapshot and torch.cuda.memory._snapshot. It does so by replacing the
torch._C functions those Python functions call, so every caller of
torch.cuda's API sees magpie's figures whenever it imported them.

torch.cuda.MemPool (magpie's blocks, or a custom allocator's) under
use_mem_pool, and memory history (_record_memory_history, whose trace and
frames _snapshot returns beside magpie's segments), work with magpie's own
allocator: torch_pools.h and torch_history.h say how.

CUDA graphs (torch.cuda.graph, shared pools through pool=...,
torch.cuda.graph_pool_handle, torch.cuda.make_graphed_callables, graph
deletion) work with magpie's own allocator (kind() == "native"): PyTorch's
pool hooks (beginAllocateToPool, endAllocateToPool, releasePool) map each
PyTorch pool onto a magpie graph pool (magpie.h, "CUDA graphs"), and
torch.compile(mode="reduce-overhead")'s cudagraph trees get the allocator
checkpoints they call (getCheckpointState, setCheckpointPoolState,
checkPoolLiveAllocations; torch_native.cpp). The wrapper (kind() == "pluggable") cannot take them from Python in a form C
can call (the begin hook's stream filter is a std::function): under it,
captures are not supported (magpie refuses a capture's allocation that
reaches its slow path, with MAGPIE_ERR_CAPTURE, but one served from a
thread's cache is not seen); use the native allocator for graphs.

PyTorch frees a block on the stream it was allocated on (the pluggable
allocator passes the allocation stream to the free).

use() also makes CUDA tensors travel through torch.multiprocessing (queues,
pipes, spawn arguments), which PyTorch's own reducer cannot do under a
pluggable allocator: magpie_ipc_export with a hold in the sender,
magpie_ipc_import in the receiver (magpie.torch_ipc says how, and what is
decided about lifetime and stream order).
"""
import ctypes
import threading
import warnings

from . import _lib, _shim, torch_ipc

_allocator = None
_kind = None
_lock = threading.Lock()
# Per device: the accumulated figures at the last reset_accumulated_memory_stats.
_accumulated_base = {}

# The hooks use() installs: (setter of CUDAPluggableAllocator._allocator,
# exported C function).
_HOOKS = (
    ("set_record_stream_fn", "magpie_torch_record_stream"),
    ("set_reset_fn", "magpie_torch_empty_cache"),
    ("set_memory_fraction_fn", "magpie_torch_set_memory_fraction"),
)


def _accumulated(s):
    """The memory_stats counters magpie keeps that PyTorch's API resets as
    "accumulated" (reset_accumulated_memory_stats): requests that failed
    (the ladder's last step) and device-wide synchronisations."""
    return {"num_ooms": s["ladder_steps"][5], "num_sync_all_streams": s["device_syncs"]}


def use(native=None):
    """Make PyTorch allocate CUDA memory through magpie. Call it before the
    first CUDA allocation of the process (PyTorch's rule for changing the
    allocator).

    native=None (default): magpie's own PyTorch allocator
    (torch_native.cpp: no lock on the allocation paths), built against the
    installed PyTorch on first use; if it cannot be built, a warning says
    why and PyTorch's CUDAPluggableAllocator wrapper is used instead (one
    lock per allocation and free). native=True: the former or an error;
    native=False: the wrapper. Either way CUDA tensors in magpie's blocks
    can then be sent through torch.multiprocessing (magpie.torch_ipc).
    Returns PyTorch's allocator object."""
    global _allocator, _kind
    import torch as _torch

    with _lock:
        if _allocator is None:
            if native is not False:
                try:
                    _shim.install_native(_torch)
                    _allocator, _kind = _torch.cuda.memory._get_current_allocator(), "native"
                except RuntimeError as e:
                    if native:
                        raise
                    warnings.warn(f"{e}\nmagpie: using PyTorch's CUDAPluggableAllocator wrapper instead "
                                  "(one lock per allocation and free)", RuntimeWarning, stacklevel=2)
            if _allocator is None:
                path, alloc_fn, free_fn = _shim.load(_torch)
                plug = _torch.cuda.memory.CUDAPluggableAllocator(path, alloc_fn, free_fn)
                missing = install_hooks(plug)
                if missing:
                    raise RuntimeError(
                        "this PyTorch's CUDAPluggableAllocator lacks "
                        + ", ".join(missing)
                        + ": Tensor.record_stream, empty_cache or set_per_process_memory_fraction "
                        "would not reach magpie"
                    )
                _torch.cuda.memory.change_current_allocator(plug)
                _allocator, _kind = plug, "pluggable"
            patch_memory_api(_torch)
            torch_ipc.install(_torch)
    return _allocator


def kind():
    """How magpie serves PyTorch: "native" (MagpieAllocator), "pluggable"
    (the CUDAPluggableAllocator wrapper), or None before use()."""
    return _kind


def in_use():
    """Whether magpie is PyTorch's current allocator (set by use())."""
    return _allocator is not None


def install_hooks(plug):
    """Set magpie's record-stream, empty-cache and memory-fraction functions
    on a CUDAPluggableAllocator; returns the setters it lacks."""
    l = _lib.lib()
    missing = []
    for setter, fn in _HOOKS:
        target = getattr(plug._allocator, setter, None)
        if target is None:
            missing.append(setter)
            continue
        target(ctypes.cast(getattr(l, fn), ctypes.c_void_p).value)
    return missing


def record_stream(tensor, stream):
    """Kept for code written before use() installed PyTorch's record-stream
    hook: now the same as tensor.record_stream(stream), which reaches
    magpie by itself."""
    tensor.record_stream(stream)


def _stat(current=0, peak=0):
    # PyTorch's four figures per statistic; magpie keeps current and peak
    # of some, and no running totals of bytes or blocks handed out.
    return {"current": current, "peak": peak, "allocated": 0, "freed": 0}


def _pools(all_stat, large=None, small=None):
    return {
        "all": all_stat,
        "large_pool": large if large is not None else _stat(),
        "small_pool": small if small is not None else _stat(),
    }


def nested_stats(device):
    """torch.cuda.memory_stats_as_nested_dict's answer from magpie_stats.
    PyTorch's key names where magpie has the figure; 0 where it has none
    (as PyTorch's cudaMallocAsync backend reports them): the running totals
    ("allocated", "freed"), block and request counts, per-pool peaks.
    Every scalar of magpie_stats is also under "magpie"."""
    from . import stats as _stats

    s = _stats(device)
    large_in_use = s["large_in_use_bytes"]
    small_in_use = max(0, s["in_use_bytes"] - large_in_use)
    large_reserved = s["large_mapped_bytes"]
    small_reserved = max(0, s["reserved_bytes"] - large_reserved)
    base = _accumulated_base.get(device, {})
    raw = _accumulated(s)
    out = {
        "allocated_bytes": _pools(
            _stat(s["in_use_bytes"], s["peak_in_use_bytes"]), _stat(large_in_use), _stat(small_in_use)
        ),
        "reserved_bytes": _pools(
            _stat(s["reserved_bytes"], s["peak_reserved_bytes"]), _stat(large_reserved), _stat(small_reserved)
        ),
        # Active: handed out, or freed and waiting for a stream's work.
        "active_bytes": _pools(_stat(s["in_use_bytes"] + s["epoch_pending_bytes"])),
        "requested_bytes": _pools(_stat()),
        "inactive_split_bytes": _pools(_stat()),
        "allocation": _pools(_stat()),
        "active": _pools(_stat()),
        "inactive_split": _pools(_stat()),
        "segment": _pools(
            _stat(s["slab_count"] + s["large_segment_count"]),
            _stat(s["large_segment_count"]),
            _stat(s["slab_count"]),
        ),
        "oversize_allocations": _stat(),
        "oversize_segments": _stat(),
        "num_alloc_retries": 0,
        "num_device_alloc": 0,
        "num_device_free": 0,
        "max_split_size": -1,
        "magpie": {k: v for k, v in s.items() if not isinstance(v, list)},
    }
    for k, v in raw.items():
        out[k] = max(0, v - base.get(k, 0))
    return out


def reset_accumulated(device):
    """torch.cuda.reset_accumulated_memory_stats: the counters of
    _accumulated restart from zero (magpie's own counters keep running;
    the Python side remembers where they stood)."""
    from . import stats as _stats

    _accumulated_base[device] = _accumulated(_stats(device))


def reset_peaks(device):
    """torch.cuda.reset_peak_memory_stats: magpie_stats_reset_peaks."""
    from . import _check, _need

    _check(_need("magpie_stats_reset_peaks")(device))


_SNAP_STATE = {
    "in_use": "active_allocated",
    "pending": "active_pending_free",
}


def torch_snapshot(device_count, native=None, args=()):
    """torch.cuda.memory._snapshot's answer: PyTorch's "segments" (one per
    magpie slab or large segment, blocks in address order, magpie's states
    mapped to PyTorch's: in use -> active_allocated, waiting on a stream ->
    active_pending_free, anything cached -> inactive) so that
    torch.cuda.memory_snapshot and PyTorch's memory_viz tools read it, and
    magpie's own snapshot of every device under "magpie" (tools/snapshot_png.py
    draws one; its block states show each layer: a thread's magazine, the
    depot, pending on a stream, limbo).

    native: PyTorch's own torch._C._cuda_memorySnapshot, under magpie's
    native allocator (torch_native.cpp), called with args (a pool id, the
    pool id and include_traces as torch.cuda.memory_snapshot passes them,
    or None). It brings the trace of _record_memory_history with its frames,
    each pool's blocks as segments of that pool (segment_pool_id; a pool's
    block leaves the magpie segment it was carved from), and the frames of
    live allocations, which are put on their blocks. With a pool id, only
    that pool's segments (MemPool.snapshot())."""
    from . import snapshot as _snapshot

    segments, own = [], []
    for d in range(device_count):
        snap = _snapshot(d)
        own.append(snap)
        for seg in snap["segments"]:
            segments.append(_torch_segment(d, snap.get("granule", 0), seg))
    out = {
        "segments": segments,
        "device_traces": [[] for _ in range(device_count)],
        "allocator_settings": {},
        "magpie": own,
    }
    if native is None:
        return out
    t = native(*args)
    # The history's live allocations (segments of pool (0, 0)) give their
    # blocks the frames and the size requested; its segments without blocks,
    # magpie's segments mapped while it recorded, theirs.
    frames, requested, segment_frames, pooled = {}, {}, {}, []
    for seg in t["segments"]:
        if tuple(seg["segment_pool_id"]) == (0, 0):
            if not seg["blocks"]:
                segment_frames[(seg["device"], seg["address"])] = seg.get("frames", [])
            for b in seg["blocks"]:
                frames[(seg["device"], b["address"])] = b.get("frames", [])
                requested[(seg["device"], b["address"])] = b["requested_size"]
        else:
            pooled.append(seg)

    def from_history(seg, blocks):
        for b in blocks:
            key = (seg["device"], b["address"])
            b["frames"] = frames.get(key, [])
            if b["state"] == "active_allocated" and key in requested:
                b["requested_size"] = requested[key]
        seg["requested_size"] = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")

    for seg in pooled:
        from_history(seg, seg["blocks"])
        seg["segment_type"] = "large"
    # A pool id, or PyTorch 2.11's (id, id, include_traces) from
    # torch.cuda.memory_snapshot; (0, 0) is every pool.
    pool_id = tuple(args[0])[:2] if args and args[0] is not None else None
    if pool_id is not None and pool_id != (0, 0):
        out["segments"] = pooled
    else:
        taken = {(s["device"], s["address"]) for s in pooled}
        for seg in segments:
            kept = [b for b in seg["blocks"] if (seg["device"], b["address"]) not in taken]
            seg["total_size"] -= sum(b["size"] for b in seg["blocks"]) - sum(b["size"] for b in kept)
            seg["blocks"] = kept
            seg["allocated_size"] = sum(b["size"] for b in kept if b["state"] == "active_allocated")
            seg["active_size"] = seg["allocated_size"] + sum(
                b["size"] for b in kept if b["state"] == "active_pending_free")
            from_history(seg, kept)
            seg["frames"] = segment_frames.get((seg["device"], seg["address"]), [])
        out["segments"] = [s for s in segments if s["blocks"]] + pooled
    out["device_traces"] = t.get("device_traces", out["device_traces"])
    out["allocator_settings"] = t.get("allocator_settings", {})
    return out


def _torch_segment(device, granule, seg):
    # A slab is mapped whole; a large segment is a reserved range of which
    # only some granules are mapped: its total is what is mapped, and its
    # blocks are listed with their mapped bytes (a free block may span
    # unmapped granules).
    blocks = []
    if seg["kind"] == "slab":
        total = seg["size"]
        pos, bs = seg["base"], seg["block_size"]
        for run in seg["runs"]:
            state, count = run[0], run[1]
            for _ in range(count):
                blocks.append(_block(pos, bs, state))
                pos += bs
        tail = seg["base"] + seg["size"] - pos
        if tail > 0:
            blocks.append(_block(pos, tail, "unused"))
    else:
        # Memory the segment lent to the small classes' spans ("span") is
        # listed as those slabs' segments, so not here too.
        total = sum(r[1] for r in seg["mapped"]) * seg["granule"]
        for b in seg["blocks"]:
            if b["state"] == "span":
                total -= b["mapped"]
            elif b["mapped"] > 0:
                blocks.append(_block(b["base"], min(b["size"], b["mapped"]), b["state"]))
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = allocated + sum(b["size"] for b in blocks if b["state"] == "active_pending_free")
    return {
        "device": device,
        "address": seg["base"],
        "total_size": total,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": allocated,
        "stream": 0,
        "segment_type": "large" if seg["kind"] != "slab" else "small",
        "segment_pool_id": (0, 0),
        "is_expandable": seg["kind"] != "slab",
        "frames": [],
        "blocks": blocks,
        "magpie_kind": seg["kind"],
    }


def _block(addr, size, state):
    return {
        "address": addr,
        "size": size,
        "requested_size": size,
        "state": _SNAP_STATE.get(state, "inactive"),
        "frames": [],
        "magpie_state": state,
    }


def patch_memory_api(torch):
    """Route the torch._C functions behind torch.cuda's memory API to
    magpie (see the module's text). Called by use()."""
    C = torch._C
    if _kind == "native":
        # magpie's allocator answers PyTorch's own functions
        # (torch_native.cpp's getDeviceStats, resetPeakStats,
        # resetAccumulatedStats); magpie's figures are added under "magpie".
        stats_of = C._cuda_memoryStats

        def memory_stats(device):
            from . import stats as _stats

            out = stats_of(device)
            out["magpie"] = {k: v for k, v in _stats(device).items() if not isinstance(v, list)}
            return out

        C._cuda_memoryStats = memory_stats
    else:
        C._cuda_memoryStats = lambda device: nested_stats(device)
        C._cuda_resetPeakMemoryStats = lambda device: reset_peaks(device)
        C._cuda_resetAccumulatedMemoryStats = lambda device: reset_accumulated(device)
    native = C._cuda_memorySnapshot if _kind == "native" else None
    C._cuda_memorySnapshot = lambda *args: torch_snapshot(torch.cuda.device_count(), native, args)
