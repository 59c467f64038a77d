"""Builds and loads torch_shim.cpp against the installed PyTorch (see the
file's header for why it exists), once per PyTorch version: the library is
kept in $MAGPIE_CACHE_DIR, else $XDG_CACHE_HOME/magpie, else
~/.cache/magpie, under a name made of PyTorch's version, its C++ ABI and a
hash of the source, so a new PyTorch or a new magpie builds it again.
Needs a C++ compiler ($CXX, else c++); takes a few seconds the first time.
"""
import ctypes
import hashlib
import os
import subprocess
import tempfile

from . import _lib

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_shim.cpp")


def cache_dir():
    d = os.environ.get("MAGPIE_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "magpie")
    return d


def _flags(torch):
    root = os.path.dirname(os.path.abspath(torch.__file__))
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    lib = os.path.join(root, "lib")
    return abi, [
        "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem", os.path.join(root, "include"),
        "-L" + lib, "-Wl,-rpath," + lib, "-lc10",
    ]


def build(torch):
    """The path of the shim for this PyTorch, built if needed. Raises
    RuntimeError with the compiler's output if it cannot be built."""
    with open(_SRC, "rb") as f:
        src = f.read()
    abi, flags = _flags(torch)
    tag = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    version = str(getattr(torch, "__version__", "unknown")).replace("/", "_").replace("+", "_")
    d = cache_dir()
    out = os.path.join(d, f"libmagpie_torch-{version}-abi{abi}-{tag}.so")
    if os.path.isfile(out):
        return out
    os.makedirs(d, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=d)
    os.close(fd)
    try:
        r = subprocess.run([cxx, _SRC, "-o", tmp] + flags, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"magpie: building {_SRC} against PyTorch {version} failed ({cxx} exited {r.returncode}):\n"
                + (r.stderr or r.stdout)[-4000:]
            )
        os.replace(tmp, out)  # atomic: processes building at once each install a whole file
    except FileNotFoundError as e:
        raise RuntimeError(
            f"magpie: no C++ compiler ({cxx}) to build its PyTorch entry point; install one (Debian: g++) "
            "or set CXX"
        ) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(torch):
    """Build if needed, load, and hand the shim magpie's functions.
    Returns (path, malloc name, free name) for CUDAPluggableAllocator."""
    path = build(torch)
    shim = ctypes.CDLL(path)
    l = _lib.lib()
    addr = lambda name: ctypes.cast(getattr(l, name), ctypes.c_void_p).value
    shim.magpie_torch_shim_init.argtypes = [ctypes.c_void_p] * 4
    rc = shim.magpie_torch_shim_init(
        addr("magpie_torch_malloc"), addr("magpie_torch_free"), addr("magpie_last_error"),
        addr("magpie_last_error_message"),
    )
    if rc != 0:
        raise RuntimeError(f"magpie: {path} refused magpie's functions")
    return path, "magpie_torch_shim_malloc", "magpie_torch_shim_free"
