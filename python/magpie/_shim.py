"""Builds and loads magpie's C++ entry points for PyTorch against the
installed PyTorch (see each file's header for why it exists), once per
PyTorch version:
  torch_native.cpp  magpie as PyTorch's allocator without the pluggable
                    wrapper's lock (magpie.torch.use()'s default);
  torch_shim.cpp    allocation functions for the pluggable wrapper that
                    throw PyTorch's out-of-memory error (the fallback).
A library is kept in $MAGPIE_CACHE_DIR, else $XDG_CACHE_HOME/magpie, else
~/.cache/magpie, under a name made of the source's name, PyTorch's version,
its C++ ABI and a hash of the source and flags, so a new PyTorch or a new
magpie builds it again. Needs a C++ compiler ($CXX, else c++); takes a few
seconds the first time (torch_native.cpp also needs the CUDA runtime's
headers: $CUDA_HOME/include, /usr/local/cuda/include or the nvidia pip
packages').
"""
import ctypes
import glob
import hashlib
import os
import platform
import subprocess
import tempfile

from . import _lib

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(_HERE, "torch_shim.cpp")
_NATIVE = os.path.join(_HERE, "torch_native.cpp")
_NATIVE_HEADERS = ("torch_history.h", "torch_pools.h", "torch_stats.h")  # included by torch_native.cpp


def _header_dir():
    """The folder holding magpie.h: the installed package's copy (setup.py
    puts it beside this file), else the repository's include/; None if
    neither has it (the build then fails, naming the missing header)."""
    for d in (_HERE, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "include")):
        if os.path.isfile(os.path.join(d, "magpie.h")):
            return d
    return None


def cache_dir():
    d = os.environ.get("MAGPIE_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "magpie")
    return d


def cuda_roots():
    """Where a CUDA toolkit may be: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    return [os.environ[v] for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)] + ["/usr/local/cuda"]


def cuda_include_dirs(sites):
    """The folders holding the CUDA runtime's headers: a toolkit's
    (cuda_roots), then the nvidia pip packages' under each site-packages
    folder of sites."""
    dirs = [os.path.join(r, "include") for r in cuda_roots()]
    for site in sites:
        dirs += sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    return [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))]


def _cuda_includes(torch_root):
    out = []
    for d in cuda_include_dirs([os.path.dirname(torch_root)]):
        out += ["-isystem", d]
    return out


def _tls_flags(cxx):
    """Thread-local variables through TLS descriptors where the compiler
    has them (gcc on x86-64; aarch64 uses them already), as libmagpie.so's
    are (defs.bzl). The library is dlopened: with the default model every
    access of the tensor path's thread-local records and counters calls
    __tls_get_addr, which a descriptor's call undercuts by about a
    nanosecond (bench/DECISIONS.md, "PyTorch's tensor path: where the time
    goes"). A compiler that refuses the option builds without it. Asked only when a build happens: like the compiler
    itself, the answer is not part of the cached library's name, so a
    process that finds its library built starts no compiler."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flag = "-mtls-dialect=gnu2"
    try:
        r = subprocess.run([cxx, flag, "-x", "c++", "-c", "-o", os.devnull, "-"], input="", capture_output=True,
                           text=True)
    except OSError:
        return []
    return [flag] if r.returncode == 0 else []


def _flags(torch, native, header_dir=None):
    root = os.path.dirname(os.path.abspath(torch.__file__))
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    lib = os.path.join(root, "lib")
    flags = [
        "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem", os.path.join(root, "include"),
        "-L" + lib, "-Wl,-rpath," + lib,
    ]
    if native:
        flags += ["-I", header_dir] if header_dir is not None else []
        flags += ["-isystem", os.path.join(root, "include", "torch", "csrc", "api", "include")]
        flags += _cuda_includes(root) + ["-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-ldl"]
    return abi, flags + ["-lc10"]


def build(torch, source=_SRC):
    """The path of the library built from source (torch_shim.cpp or
    torch_native.cpp) for this PyTorch, built if needed. Raises
    RuntimeError with the compiler's output if it cannot be built."""
    with open(source, "rb") as f:
        src = f.read()
    native = source == _NATIVE
    header_dir = _header_dir() if native else None
    abi, flags = _flags(torch, native, header_dir)
    if header_dir is not None:
        with open(os.path.join(header_dir, "magpie.h"), "rb") as f:
            src += f.read()  # the struct layouts it compiles against
        for h in _NATIVE_HEADERS:
            with open(os.path.join(_HERE, h), "rb") as f:
                src += f.read()
    tag = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    version = str(getattr(torch, "__version__", "unknown")).replace("/", "_").replace("+", "_")
    name = os.path.splitext(os.path.basename(source))[0]
    d = cache_dir()
    out = os.path.join(d, f"lib{name}-{version}-abi{abi}-{tag}.so")
    if os.path.isfile(out):
        return out
    os.makedirs(d, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=d)
    os.close(fd)
    try:
        r = subprocess.run([cxx, source, "-o", tmp] + _tls_flags(cxx) + flags, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"magpie: building {source} against PyTorch {version} failed ({cxx} exited {r.returncode}):\n"
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


def install_native(torch):
    """Build torch_native.cpp if needed and make its allocator PyTorch's
    (MagpieAllocator: no lock on the allocation paths). Returns the
    library's path. Raises RuntimeError if it cannot be built or PyTorch
    refuses it."""
    path = build(torch, _NATIVE)
    native = ctypes.CDLL(path)
    l = _lib.lib()
    listed = ctypes.cast(
        ctypes.addressof(ctypes.c_char_p.in_dll(native, "magpie_torch_native_names")), ctypes.POINTER(ctypes.c_char_p)
    )
    names = []
    while listed[len(names)] is not None:
        names.append(listed[len(names)].decode())
    fns = (ctypes.c_void_p * len(names))(*[ctypes.cast(getattr(l, n), ctypes.c_void_p).value for n in names])
    native.magpie_torch_native_error.restype = ctypes.c_char_p
    rc = native.magpie_torch_native_install(fns)
    if rc != 0:
        raise RuntimeError(f"magpie: PyTorch refused magpie's allocator: {native.magpie_torch_native_error().decode()}")
    return path
