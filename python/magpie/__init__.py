"""magpie: a lock-free, stream-ordered caching allocator for CUDA device
memory, from Python.

    import magpie
    magpie.torch.use()        # before the first CUDA allocation
    ...
    print(magpie.stats())

The shared library is found through $MAGPIE_LIB, next to this package, or
the repository's bazel-bin (bazel build //:libmagpie.so).
"""
import ctypes

from . import _lib
from . import torch  # noqa: F401  (magpie.torch.use)


class MagpieError(RuntimeError):
    pass


def version():
    return _lib.lib().magpie_version().decode()


def stats(device=0):
    """magpie_stats of one device, as a dict."""
    s = _lib.Stats()
    rc = _lib.lib().magpie_stats_get(device, ctypes.byref(s))
    if rc != 0:
        raise MagpieError(_lib.lib().magpie_last_error_message().decode())
    return s.as_dict()
