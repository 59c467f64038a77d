"""Loads libmagpie.so and declares the C functions used from Python."""
import ctypes
import os

_SEARCH = (
    os.environ.get("MAGPIE_LIB", ""),
    os.path.join(os.path.dirname(__file__), "libmagpie.so"),
    os.path.join(os.path.dirname(__file__), "..", "..", "bazel-bin", "libmagpie.so"),
    "libmagpie.so",
)


def library_path():
    """The libmagpie.so that will be used: $MAGPIE_LIB, next to this package,
    the repository's bazel-bin, or the system search path. On the simulated
    device (MAGPIE_BACKEND=sim, or no GPU) the library loads
    libmagpie_sim.so from its own folder, else from the loader's search
    path (LD_LIBRARY_PATH)."""
    for p in _SEARCH:
        if p and os.path.isfile(p):
            return os.path.abspath(p)
    return "libmagpie.so"


class Stats(ctypes.Structure):
    """magpie_stats (include/magpie.h), field for field."""

    _fields_ = [
        ("in_use_bytes", ctypes.c_size_t),
        ("reserved_bytes", ctypes.c_size_t),
        ("peak_in_use_bytes", ctypes.c_size_t),
        ("peak_reserved_bytes", ctypes.c_size_t),
        ("cached_bytes", ctypes.c_size_t),
        ("large_in_use_bytes", ctypes.c_size_t),
        ("slab_count", ctypes.c_uint64),
        ("depot_exchanges", ctypes.c_uint64),
        ("events_recorded", ctypes.c_uint64),
        ("cross_stream_migrations", ctypes.c_uint64),
        ("same_stream_reuses", ctypes.c_uint64),
        ("limbo_magazines", ctypes.c_uint64),
        ("thread_cached_bytes", ctypes.c_size_t),
        ("depot_bytes", ctypes.c_size_t),
        ("epoch_pending_bytes", ctypes.c_size_t),
        ("large_free_bytes", ctypes.c_size_t),
        ("overhead_bytes", ctypes.c_size_t),
        ("large_mapped_bytes", ctypes.c_size_t),
        ("limit_bytes", ctypes.c_size_t),
        ("large_segment_count", ctypes.c_uint64),
        ("slabs_released", ctypes.c_uint64),
        ("large_bytes_unmapped", ctypes.c_uint64),
        ("stream_waits", ctypes.c_uint64),
        ("threads_flushed", ctypes.c_uint64),
        ("threads_stolen", ctypes.c_uint64),
        ("ladder_steps", ctypes.c_uint64 * 8),
        ("class_hits", ctypes.c_uint64 * 64),
        ("class_misses", ctypes.c_uint64 * 64),
        ("event_queries", ctypes.c_uint64),
        ("event_queries_pending", ctypes.c_uint64),
        ("device_syncs", ctypes.c_uint64),
        ("graph_pool_bytes", ctypes.c_size_t),
        ("graph_pools", ctypes.c_uint64),
    ]

    def as_dict(self):
        out = {}
        for name, _ in self._fields_:
            v = getattr(self, name)
            out[name] = list(v) if isinstance(v, ctypes.Array) else v
        return out


# magpie_ipc_handle: MAGPIE_IPC_HANDLE_SIZE plain bytes.
IPC_HANDLE_SIZE = 128
# magpie_ipc_export's flag MAGPIE_IPC_HOLD.
IPC_HOLD = 1


class IpcHandle(ctypes.Structure):
    """magpie_ipc_handle (include/magpie.h)."""

    _fields_ = [("bytes", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


_lib = None


def lib():
    """The loaded library (loaded once)."""
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL(library_path())
        except OSError as e:
            if "static TLS" in str(e):
                raise OSError(
                    f"{e}. This libmagpie.so was built with initial-exec thread-local "
                    "state, which a library loaded after start-up cannot get with "
                    "glibc's defaults; rebuild it (tools/install_deps.sh builds the "
                    "jemalloc it needs), or start Python with "
                    "GLIBC_TUNABLES=glibc.rtld.optional_static_tls=16384."
                ) from e
            raise
        _declare(_lib)
    return _lib


# Functions of newer builds, declared where the library has them:
# name -> (argtypes, restype).
_OPTIONAL = {
    "magpie_record_stream": ([ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int),
    "magpie_stream_retire": ([ctypes.c_void_p], ctypes.c_int),
    "magpie_trim": ([ctypes.c_int, ctypes.c_size_t], ctypes.c_int),
    "magpie_stats_reset_peaks": ([ctypes.c_int], ctypes.c_int),
    "magpie_set_limit": ([ctypes.c_int, ctypes.c_size_t], ctypes.c_int),
    "magpie_set_limit_fraction": ([ctypes.c_int, ctypes.c_double], ctypes.c_int),
    "magpie_device_count": ([], ctypes.c_int),
    "magpie_snapshot_json": ([ctypes.c_int, ctypes.c_void_p], ctypes.c_int),
    "magpie_block_info": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "magpie_ipc_export": ([ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(IpcHandle)], ctypes.c_int),
    "magpie_ipc_revoke": ([ctypes.POINTER(IpcHandle)], ctypes.c_int),
    "magpie_ipc_import": (
        [ctypes.POINTER(IpcHandle), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)],
        ctypes.c_int,
    ),
    "magpie_ipc_close": ([ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int),
    "magpie_device_enable_peer_access": ([ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "magpie_device_disable_peer_access": ([ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "magpie_device_can_access_peer": ([ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
}


def _declare(l):
    l.magpie_stats_get.argtypes = [ctypes.c_int, ctypes.POINTER(Stats)]
    l.magpie_stats_get.restype = ctypes.c_int
    l.magpie_last_error_message.restype = ctypes.c_char_p
    l.magpie_last_error.restype = ctypes.c_int
    l.magpie_version.restype = ctypes.c_char_p
    l.magpie_malloc_async.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
    l.magpie_malloc_async.restype = ctypes.c_void_p
    l.magpie_free_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    l.magpie_free_async.restype = ctypes.c_int
    l.magpie_usable_size.argtypes = [ctypes.c_void_p]
    l.magpie_usable_size.restype = ctypes.c_size_t
    # Present in newer builds only: declared where the library has them.
    for name, (args, res) in _OPTIONAL.items():
        if has(l, name):
            fn = getattr(l, name)
            fn.argtypes, fn.restype = args, res


def has(l, name):
    """Whether the loaded library exports name."""
    try:
        getattr(l, name)
        return True
    except AttributeError:
        return False
