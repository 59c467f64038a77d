"""Sharing magpie blocks with other processes (magpie.h, "Sharing blocks
with other processes (IPC)"), from Python.

    # the process that allocated the block
    h = magpie.ipc.export(ptr)              # 128 bytes: send them by any channel
    # another process of the same user on the machine
    with magpie.ipc.open(h) as imp:         # the block's memory, mapped here
        ... imp.ptr, imp.size ...           # closed (unmapped) on leaving the block

export() makes a handle for the block that starts at ptr (an int address
magpie handed out); open() maps that block into the calling process, on its
device with the same UUID, whatever its ordinal there. The exporting process
serves imports from a thread of its own, so it must still run when the
handle is opened; its block stays out of reuse while any process has it
open, even after the exporter freed it. An open after the exporter freed
the block fails, unless the export was made with hold=True: the block is
then also held from the export until its first open (or revoke()), for a
handle that reaches its importer later than the exporter drops the block.
Each hold=True export is one hold, taken over by one open: a handle
exported with hold=True that is never opened keeps its block out of reuse
until revoke() or until the exporting process exits.

Ordering between the processes' streams is the application's: finish the
work that writes a block before sending its handle, and close an import
after the work that uses it, or name that work's stream to close(), which
waits for it.

Failures raise magpie.MagpieError with magpie's message and code
(MAGPIE_ERR_IPC, 13, when the exporter is gone or refuses; 7 for a handle
that is not one). For PyTorch tensors, see magpie.torch_ipc (installed by
magpie.torch.use()).
"""
import ctypes
import threading

from . import _lib

HANDLE_SIZE = _lib.IPC_HANDLE_SIZE


def _fn(name):
    # Resolved at call time: the package's __init__ imports this module
    # before it defines _need.
    from . import _need

    return _need(name)


def _check(rc):
    from . import _check as check

    check(rc)


def _handle(handle):
    """handle (bytes-like, HANDLE_SIZE bytes) as a magpie_ipc_handle."""
    b = bytes(handle)
    if len(b) != HANDLE_SIZE:
        raise ValueError(f"a magpie IPC handle has {HANDLE_SIZE} bytes, not {len(b)}")
    return _lib.IpcHandle.from_buffer_copy(b)


def export(ptr, hold=False):
    """magpie_ipc_export: the handle (HANDLE_SIZE bytes) of the block that
    starts at ptr (an int address magpie handed out). hold=True: the block is
    held from now until an import takes the hold over (or revoke()), so it
    can be freed here before the other process opens the handle. Exporting a
    block again gives the same handle, and with hold=True a new hold."""
    h = _lib.IpcHandle()
    _check(_fn("magpie_ipc_export")(ctypes.c_void_p(ptr), _lib.IPC_HOLD if hold else 0, ctypes.byref(h)))
    return bytes(h.bytes)


def revoke(handle):
    """magpie_ipc_revoke: drops the handle's holds that no import took over
    and makes later opens of it fail; imports already open stay valid. Only
    in the process that exported it."""
    h = _handle(handle)
    _check(_fn("magpie_ipc_revoke")(ctypes.byref(h)))


def open(handle):  # noqa: A001  (magpie.ipc.open, the counterpart of export)
    """magpie_ipc_import: maps the block named by handle (bytes from
    export() in another process) into this process; returns an Imported.
    Opening the same handle twice maps it twice."""
    h = _handle(handle)
    p, n = ctypes.c_void_p(), ctypes.c_size_t()
    _check(_fn("magpie_ipc_import")(ctypes.byref(h), ctypes.byref(p), ctypes.byref(n)))
    return Imported(p.value, n.value, bytes(handle))


class Imported:
    """A block of another process mapped into this one (open()).

    ptr: its address here (int); size: the block's size in bytes; handle: the
    handle it was opened with. close(stream) unmaps it once the work enqueued
    on stream has completed; it may be called again (it then does nothing),
    and leaving a with-block closes it. An import dropped without close() is
    closed when garbage-collected, on stream 0: the last resort, since the
    work that used the memory may run on another stream (and the collection
    may come late, keeping the exporter's block out of reuse meanwhile)."""

    def __init__(self, ptr, size, handle):
        self.ptr = ptr
        self.size = size
        self.handle = handle
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self):
        return self._closed

    def close(self, stream=0):
        """magpie_ipc_close: waits for the work enqueued on stream (an int
        cudaStream_t; 0 the legacy default stream) and unmaps the block; the
        exporter may reuse it once no other import holds it. A failure (a
        stream that is capturing a CUDA graph, say) raises and leaves the
        import open."""
        with self._lock:
            if self._closed:
                return
            _check(_fn("magpie_ipc_close")(ctypes.c_void_p(self.ptr), ctypes.c_void_p(stream)))
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Also reached during interpreter shutdown, when the package may be
        # half torn down: nothing can be reported then.
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<magpie.ipc.Imported {state} ptr={self.ptr:#x} size={self.size}>"
