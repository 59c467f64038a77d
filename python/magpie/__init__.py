"""magpie: a lock-free, stream-ordered caching allocator for CUDA device
memory, from Python.

    import magpie
    magpie.torch.use()        # PyTorch: before the first CUDA allocation
    magpie.cupy.use()         # CuPy: before the first allocation
    magpie.rmm.use()          # RAPIDS Memory Manager (cuDF, ...): its device resource
    ...
    print(magpie.stats())

magpie.ipc shares blocks with other processes (magpie.torch.use() routes
CUDA tensors sent through torch.multiprocessing to it: magpie.torch_ipc);
magpie.enable_peer_access and magpie.can_access_peer open a device's memory
to another device's kernels (magpie.disable_peer_access closes it again).

The shared library is found through $MAGPIE_LIB, next to this package, or
the repository's bazel-bin (bazel build //:libmagpie.so). Under
LD_PRELOAD=libmagpie_preload.so, point MAGPIE_LIB at that library so that
these functions report on the allocator the process really uses.
"""
import ctypes
import json
import os
import tempfile

from . import _lib
from . import cupy  # noqa: F401  (magpie.cupy.use)
from . import ipc  # noqa: F401  (magpie.ipc.export, open, revoke)
from . import rmm  # noqa: F401  (magpie.rmm.use; imports rmm only when called)
from . import torch  # noqa: F401  (magpie.torch.use)
from . import torch_ipc  # noqa: F401  (CUDA tensors through torch.multiprocessing)


class MagpieError(RuntimeError):
    def __init__(self, code, message):
        super().__init__(f"{message} (magpie error {code})")
        self.code = code


def _check(rc):
    if rc != 0:
        raise MagpieError(rc, _lib.lib().magpie_last_error_message().decode())


def version():
    return _lib.lib().magpie_version().decode()


def stats(device=0):
    """magpie_stats of one device, as a dict."""
    s = _lib.Stats()
    _check(_lib.lib().magpie_stats_get(device, ctypes.byref(s)))
    return s.as_dict()


def _need(name):
    l = _lib.lib()
    if not _lib.has(l, name):
        raise NotImplementedError(f"{_lib.library_path()} has no {name} (a newer libmagpie.so has it)")
    return getattr(l, name)


def trim(device=0, keep_bytes=0):
    """Give cached device memory back to the driver, keeping at most
    keep_bytes reserved beyond what is in use (magpie_trim)."""
    _check(_need("magpie_trim")(device, keep_bytes))


def reset_peak_stats(device=0):
    """Restart peak_in_use_bytes and peak_reserved_bytes at the current
    figures (magpie_stats_reset_peaks)."""
    _check(_need("magpie_stats_reset_peaks")(device))


def set_limit(device=0, limit_bytes=0):
    """Cap the device memory magpie reserves on device (0: no cap beyond the
    device), while running (magpie_set_limit)."""
    _check(_need("magpie_set_limit")(device, limit_bytes))


def snapshot(device=0):
    """Every segment, slab and block of the device with its state
    (magpie_snapshot_json), parsed."""
    fn = _need("magpie_snapshot_json")
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.TemporaryFile() as f:
        fp = libc.fdopen(os.dup(f.fileno()), b"w")
        if not fp:
            raise OSError("fdopen failed")
        rc = fn(device, fp)
        libc.fclose(fp)
        _check(rc)
        f.seek(0)
        return json.loads(f.read().decode())


def record_stream(ptr, stream):
    """magpie_record_stream: the block at ptr (an int address, the start of
    a block magpie handed out) is not reused by anyone until the work
    enqueued on stream (an int cudaStream_t) before its free has completed.
    For tensors, see magpie.torch.record_stream."""
    _check(_need("magpie_record_stream")(ctypes.c_void_p(ptr), ctypes.c_void_p(stream)))


def stream_retire(stream):
    """magpie_stream_retire: call before destroying stream (an int
    cudaStream_t) that magpie has seen; what magpie holds under its handle
    is sealed while the handle is valid (see magpie.h)."""
    _check(_need("magpie_stream_retire")(ctypes.c_void_p(stream)))


def enable_peer_access(device, peer):
    """magpie_device_enable_peer_access: every mapping of device's memory,
    present and future, becomes readable and writable by kernels on peer,
    until disable_peer_access. MagpieError with MAGPIE_ERR_NO_PEER_ACCESS
    (14) where the hardware cannot connect the two, MAGPIE_ERR_INVALID_ARGUMENT
    (7) for an unknown device or device == peer."""
    _check(_need("magpie_device_enable_peer_access")(device, peer))


def disable_peer_access(device, peer):
    """magpie_device_disable_peer_access: the rights enable_peer_access gave
    are taken back from every mapping of device's memory, present and
    future; no work of peer may still use that memory. Nothing happens if
    they were not given."""
    _check(_need("magpie_device_disable_peer_access")(device, peer))


def can_access_peer(device, peer):
    """magpie_device_can_access_peer: whether enable_peer_access(device,
    peer) can succeed. Raises, as enable_peer_access does, for an unknown
    device or device == peer: those are mistakes, not a "no"."""
    can = ctypes.c_int(0)
    _check(_need("magpie_device_can_access_peer")(device, peer, ctypes.byref(can)))
    return bool(can.value)
