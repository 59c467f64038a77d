"""CUDA tensors sent to other processes through torch.multiprocessing
(Queue, Pipe, spawn arguments) when magpie serves PyTorch.

PyTorch's own reducer shares a CUDA tensor with storage._share_cuda_(),
which PyTorch's pluggable allocator refuses. magpie.torch.use() therefore
registers magpie's reducers with multiprocessing's ForkingPickler (the
pickler torch.multiprocessing's queues, pipes and spawned processes use)
for torch.Tensor, torch.nn.Parameter and torch.UntypedStorage (TypedStorage
and the legacy typed storages pickle through their UntypedStorage). They
take a CUDA tensor or storage whose storage starts a magpie block
(magpie_block_info answers MAGPIE_OK for its address) and hand anything
else, CPU tensors and CUDA memory magpie did not allocate included, to the
reducer registered before them (PyTorch's), which behaves as it always did.

Sending (the reducer, in the sending process):
  1. it synchronises the current stream of the tensor's device, so the
     receiver sees the writes enqueued before the send. That is the current
     stream of the thread that pickles: a Queue pickles in its feeder
     thread, whose current stream is the device's default stream, so work
     on other streams that writes the tensor must be ordered before put()
     (s.synchronize(), or torch.cuda.current_stream().wait_stream(s)), as
     with PyTorch's own allocator;
  2. it exports the storage's block with a hold (magpie.ipc.export(ptr,
     hold=True)): the block stays out of reuse in the sender from now until
     the receiver has imported it, even if the sender drops the tensor at
     once (a Queue drops its reference as soon as it has pickled it), and
     afterwards until the receiver closed its import. Each pickling is one
     hold, taken over by one unpickling: if the message is never unpickled
     (the receiving process dies first, a queue item nobody gets), its
     block stays held, out of reuse, until the sending process exits;
  3. the pickle carries the handle, the device (ordinal and UUID), the
     storage's size, and the tensor's dtype, size, stride, storage offset,
     requires_grad and class (Tensor or Parameter).
Receiving (the rebuild functions, in the receiving process, which needs
the magpie package and NumPy, through which PyTorch reads
__cuda_array_interface__, but need not have called magpie.torch.use()):
  1. CUDA is initialised, the handle imported (magpie.ipc.open) onto the
     device with the sender's UUID, and the import wrapped in an object
     exposing __cuda_array_interface__, from which torch.as_tensor makes a
     uint8 tensor over the whole storage without a copy. PyTorch keeps that
     object alive as long as the storage: when the storage dies, the import
     is closed (magpie_ipc_close) on the current stream of its device in the
     thread that drops it, so the receiver's work enqueued on that stream
     completes first; work on other streams must be ordered before the last
     reference is dropped, as for any tensor freed under a caching
     allocator. The sender's block becomes reusable once every receiver
     closed it (or exited).
  2. The tensor is set on that storage with the sender's dtype, size,
     stride and storage offset (a view arrives as a view), and
     requires_grad is restored (a Parameter is rebuilt as a Parameter).
Both processes then use the same device memory: the receiver's writes are
the sender's, and ordering them is the application's (synchronise before
signalling the other side, as above).

Limits:
  - the "fork" start method cannot carry CUDA tensors, as with PyTorch:
    a forked child cannot use CUDA (nor magpie). Use "spawn" or
    "forkserver" (torch.multiprocessing.spawn uses spawn);
  - each tensor received is its own import: two tensors sent from one
    storage share memory in the receiver but not a storage object, and a
    tensor received this way cannot be sent on to a third process (the
    reducer says so; send a clone);
  - a tensor that requires grad and is not a leaf, nested, sparse, quantized
    or named tensors are left to PyTorch's reducer (which refuses most of
    them when they are on CUDA).
"""
import ctypes
import threading
import warnings

from . import _lib

_lock = threading.Lock()
_installed = False
# The reducers registered before magpie's, by class (PyTorch's).
_previous = {}
# Addresses of the imports this process received whose storage is alive,
# so that sending one on is refused with a clear message.
_received = set()
_received_lock = threading.Lock()
# Imports whose close failed when their storage died: kept open here (the
# process's exit closes them) rather than closed on a stream chosen blindly.
_unclosed = []
# This process's device UUIDs, by ordinal (filled on first use).
_uuids = None

_NEEDED = ("magpie_block_info", "magpie_ipc_export", "magpie_ipc_import", "magpie_ipc_close")


def install(torch):
    """Register magpie's reducers with ForkingPickler (see the module's
    text); called by magpie.torch.use(). Returns whether they are
    registered: not where this torch has no torch.multiprocessing or the
    loaded libmagpie.so has no IPC (an older build), where PyTorch's
    reducers stay."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing.reductions as reductions
        except ImportError:
            return False
        if not all(_lib.has(_lib.lib(), n) for n in _NEEDED):
            return False
        registered = getattr(ForkingPickler, "_extra_reducers", {})
        for cls, own, fallback in (
            (torch.Tensor, _reduce_tensor, reductions.reduce_tensor),
            (torch.nn.parameter.Parameter, _reduce_tensor, reductions.reduce_tensor),
            (torch.UntypedStorage, _reduce_storage, reductions.reduce_storage),
        ):
            prev = registered.get(cls, fallback)
            _previous[cls] = fallback if prev in (_reduce_tensor, _reduce_storage) else prev
            ForkingPickler.register(cls, own)
        _installed = True
        return True


def installed():
    """Whether install() registered magpie's reducers in this process."""
    return _installed


# ---- sending ----


def _block(storage):
    """The address of storage's data if it starts a live magpie block of this
    process; None for anything PyTorch's reducer should take."""
    if storage.device.type != "cuda":
        return None
    ptr = storage.data_ptr()
    if ptr == 0:
        return None
    size, device = ctypes.c_size_t(0), ctypes.c_int(-1)
    rc = _lib.lib().magpie_block_info(ctypes.c_void_p(ptr), ctypes.byref(size), ctypes.byref(device))
    if rc != 0:
        with _received_lock:
            forwarded = ptr in _received
        if forwarded:
            raise RuntimeError(
                "magpie: this CUDA tensor was received from another process (magpie.ipc) and cannot be sent on "
                "to a third; send a copy of it (tensor.clone())"
            )
        return None
    if storage.nbytes() > size.value:
        return None
    return ptr


def _device_uuid(torch, index):
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # a PyTorch without the property: the ordinal decides
        return None


def _export(torch, storage, ptr):
    """Steps 1 and 2 of sending: the storage's description for the rebuild."""
    from . import ipc

    index = storage.device.index
    torch.cuda.current_stream(index).synchronize()
    handle = ipc.export(ptr, hold=True)
    return (handle, _device_uuid(torch, index), index, storage.nbytes())


def _shareable(torch, tensor):
    """tensor's storage address when magpie shares it, else None."""
    if not tensor.is_cuda or tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized:
        return None
    if tensor.requires_grad and not tensor.is_leaf:
        return None  # PyTorch's reducer refuses it, with its reason
    if any(n is not None for n in tensor.names):
        return None
    return _block(tensor.untyped_storage())


def _reduce_tensor(tensor):
    import torch

    ptr = _shareable(torch, tensor)
    if ptr is None:
        return _previous[type(tensor)](tensor)
    warn_hooks = getattr(torch.utils.hooks, "warn_if_has_hooks", None)
    if warn_hooks is not None:
        warn_hooks(tensor)  # hooks are not sent, as with PyTorch
    storage = _export(torch, tensor.untyped_storage(), ptr)
    return (
        _rebuild_tensor,
        (
            type(tensor),
            storage,
            tensor.dtype,
            tuple(tensor.size()),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.requires_grad,
        ),
    )


def _reduce_storage(storage):
    import torch

    ptr = _block(storage)
    if ptr is None:
        return _previous[type(storage)](storage)
    return (_rebuild_storage, (_export(torch, storage, ptr),))


# ---- receiving ----


def _local_device(torch, uuid, index):
    """This process's ordinal of the sender's device: the one with its UUID
    (CUDA_VISIBLE_DEVICES may differ between the processes), else the
    sender's ordinal."""
    global _uuids
    if _uuids is None:
        _uuids = [_device_uuid(torch, d) for d in range(torch.cuda.device_count())]
    if uuid is not None and uuid in _uuids:
        return _uuids.index(uuid)
    return index


class _Mapping:
    """An import seen by PyTorch through __cuda_array_interface__ as nbytes
    of uint8. torch.as_tensor keeps it referenced from the storage's
    deleter, so it dies with the storage and closes the import then."""

    def __init__(self, torch, imported, nbytes, device):
        self._torch = torch
        self._imported = imported
        self._device = device
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (imported.ptr, False),
            "strides": None,
            "version": 3,
            # The sender synchronised before sending: nothing to wait for.
            "stream": None,
        }
        with _received_lock:
            _received.add(imported.ptr)

    def __del__(self):
        imp = getattr(self, "_imported", None)
        if imp is None:
            return
        try:
            with _received_lock:
                _received.discard(imp.ptr)
            try:
                stream = self._torch.cuda.current_stream(self._device).cuda_stream
            except Exception:  # PyTorch torn down at exit: its work is over
                stream = 0
            imp.close(stream)
        except Exception as e:
            # Reached from PyTorch's deleter: nothing can be raised. Keep
            # the import open (mapped, and its block held in the sender)
            # until this process exits rather than close it on another
            # stream while its work may still run.
            _unclosed.append(imp)
            try:
                warnings.warn(f"magpie: a received CUDA tensor's import stays open until exit: {e}", RuntimeWarning)
            except Exception:
                pass


def _open_storage(storage):
    """Step 1 of receiving: an UntypedStorage over the sender's memory."""
    import torch

    from . import ipc

    handle, uuid, index, nbytes = storage
    torch.cuda.init()
    imp = ipc.open(handle)
    try:
        device = _local_device(torch, uuid, index)
        if imp.size < nbytes:
            raise RuntimeError(f"magpie: the imported block has {imp.size} bytes; the storage sent has {nbytes}")
        mapping = _Mapping(torch, imp, nbytes, device)
    except BaseException:
        imp.close()
        raise
    base = torch.as_tensor(mapping, device=torch.device("cuda", device))
    if base.data_ptr() != imp.ptr:
        # torch.as_tensor copied (the memory is on another device than
        # expected): the tensor would not share the sender's memory.
        raise RuntimeError(
            f"magpie: PyTorch copied the imported block instead of mapping it (cuda:{device} holds a copy); "
            "the sender's device is not the one found here by its UUID"
        )
    return base.untyped_storage()


def _rebuild_storage(storage):
    return _open_storage(storage)


def _rebuild_tensor(cls, storage, dtype, size, stride, storage_offset, requires_grad):
    import torch

    s = _open_storage(storage)
    t = torch.empty((0,), dtype=dtype, device=s.device)
    t.set_(s, storage_offset, size, stride)
    if cls is torch.nn.parameter.Parameter:
        # Passed to the constructor: an integer Parameter must get
        # requires_grad=False there, not later.
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = requires_grad
    return t
