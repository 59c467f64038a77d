"""magpie as RAPIDS Memory Manager's device memory resource.

    import magpie
    magpie.rmm.use()          # RMM's current device resource is magpie's
    import cudf               # every RMM allocation (Python and C++) is magpie's

use() sets, for the current device (or the device given), a
MagpieMemoryResource: a subclass of RMM's DeviceMemoryResource whose C++
resource (include/magpie_rmm.hpp) calls magpie_malloc_async and
magpie_free_async directly, so RMM's C++ code reaches magpie with no Python
call and no GIL. The class is compiled on first use (Cython, then the C++
compiler, against the installed rmm package) and kept in magpie's cache
folder (magpie._shim.cache_dir()), once per rmm and Python version; it needs
`pip install cython` and a C++ compiler ($CXX, else c++), like
magpie.torch's allocator.

RMM's resource adaptors work over it as over RMM's own resources:
rmm.mr.StatisticsResourceAdaptor(magpie.rmm.resource()), and so on.
"""
import glob
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile

from . import _lib
from . import _shim

_HERE = os.path.dirname(os.path.abspath(__file__))
_PYX = os.path.join(_HERE, "rmm_resource.pyx")
_MODULE = None


def _import_rmm():
    try:
        import rmm  # noqa: F401
        import rmm.mr  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "magpie.rmm needs RAPIDS Memory Manager's Python package (pip install rmm-cu13, "
            f"or rmm-cu12 for CUDA 12): {e}"
        ) from e
    return sys.modules["rmm"]


def _package_dir(name):
    try:
        mod = __import__(name)
    except ImportError:
        return None
    return os.path.dirname(os.path.abspath(mod.__file__))


def _cuda_dirs():
    """(include dirs, the CUDA runtime library) for the headers magpie_rmm.hpp
    includes and the runtime calls it makes (cudaStreamSynchronize)."""
    sites = [p for p in sys.path if p.endswith("-packages")]
    libs = []
    for r in _shim.cuda_roots():
        libs += [os.path.join(r, "lib64", "libcudart.so"), os.path.join(r, "lib", "libcudart.so")]
    for s in sites:
        libs += sorted(glob.glob(os.path.join(s, "nvidia", "*", "lib", "libcudart.so*")))
    lib = [f for f in libs if os.path.isfile(f)]
    return _shim.cuda_include_dirs(sites), (lib[0] if lib else None)


def _flags(header_dir):
    librmm = _package_dir("librmm")
    logger = _package_dir("rapids_logger")
    if librmm is None or not os.path.isdir(os.path.join(librmm, "include", "rmm")):
        raise RuntimeError("magpie.rmm: librmm's headers not found (pip install librmm-cu13, which rmm-cu13 brings)")
    cuda_inc, cudart = _cuda_dirs()
    if not cuda_inc or cudart is None:
        raise RuntimeError(
            "magpie.rmm: the CUDA runtime's headers and library were not found "
            "($CUDA_HOME, /usr/local/cuda or the nvidia pip packages)"
        )
    inc = os.path.join(librmm, "include")
    flags = ["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-I", header_dir,
             "-isystem", os.path.join(inc, "rapids"), "-isystem", inc]
    if logger is not None:
        flags += ["-isystem", os.path.join(logger, "include")]
    for d in cuda_inc:
        flags += ["-isystem", d]
    flags += ["-isystem", sysconfig.get_paths()["include"]]
    rmm_lib = os.path.join(librmm, "lib64")
    flags += ["-L" + rmm_lib, "-Wl,-rpath," + rmm_lib, "-lrmm"]
    if logger is not None:
        log_lib = os.path.join(logger, "lib64")
        flags += ["-L" + log_lib, "-Wl,-rpath," + log_lib]
    # The libmagpie.so this package uses, by path: the loader then finds
    # the copy already loaded through ctypes, not a second one.
    lib = _lib.library_path()
    if not os.path.isfile(lib):
        raise RuntimeError(f"magpie.rmm: {lib} is not a file: set MAGPIE_LIB to the libmagpie.so to build against")
    flags += [lib, "-Wl,-rpath," + os.path.dirname(lib)]
    flags += [cudart, "-Wl,-rpath," + os.path.dirname(cudart)]
    return flags


def _build():
    rmm = _import_rmm()
    try:
        import Cython
    except ImportError as e:
        raise RuntimeError("magpie.rmm builds its resource with Cython on first use: pip install cython") from e
    header_dir = _shim._header_dir()
    if header_dir is None or not os.path.isfile(os.path.join(header_dir, "magpie_rmm.hpp")):
        raise RuntimeError("magpie.rmm: magpie_rmm.hpp not found beside magpie.h (a newer magpie package has it)")
    flags = _flags(header_dir)
    src = b""
    for path in (_PYX, os.path.join(header_dir, "magpie_rmm.hpp"), os.path.join(header_dir, "magpie.h")):
        with open(path, "rb") as f:
            src += f.read()
    key = src + " ".join(flags).encode() + rmm.__version__.encode() + Cython.__version__.encode()
    tag = hashlib.sha256(key).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    d = _shim.cache_dir()
    out = os.path.join(d, f"rmm_resource-rmm{rmm.__version__}-{tag}{suffix}")
    if os.path.isfile(out):
        return out
    os.makedirs(d, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".rmm-build-", dir=d)
    try:
        pyx = os.path.join(work, "rmm_resource.pyx")
        with open(_PYX, "rb") as f, open(pyx, "wb") as g:
            g.write(f.read())
        cpp = os.path.join(work, "rmm_resource.cpp")
        r = subprocess.run([sys.executable, "-m", "cython", "--cplus", "-3", "--module-name", "rmm_resource",
                            pyx, "-o", cpp], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("magpie.rmm: Cython failed on rmm_resource.pyx:\n" + (r.stderr or r.stdout)[-4000:])
        cxx = os.environ.get("CXX", "c++")
        so = os.path.join(work, "rmm_resource" + suffix)
        try:
            r = subprocess.run([cxx, cpp, "-o", so] + flags, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise RuntimeError(f"magpie.rmm: no C++ compiler ({cxx}); install one (Debian: g++) or set CXX") from e
        if r.returncode != 0:
            raise RuntimeError(f"magpie.rmm: compiling the resource failed ({cxx} exited {r.returncode}):\n"
                               + (r.stderr or r.stdout)[-4000:])
        os.replace(so, out)  # atomic: processes building at once each install a whole file
    finally:
        for f in glob.glob(os.path.join(work, "*")):
            os.unlink(f)
        os.rmdir(work)
    return out


def _module():
    global _MODULE
    if _MODULE is None:
        path = _build()
        loader = importlib.machinery.ExtensionFileLoader("rmm_resource", path)
        spec = importlib.util.spec_from_file_location("rmm_resource", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        _MODULE = mod
    return _MODULE


def resource():
    """A new MagpieMemoryResource (an rmm.mr.DeviceMemoryResource)."""
    return _module().MagpieMemoryResource()


def use(device=None):
    """Make magpie RMM's memory resource for device (default: the current
    device), for Python and C++ callers alike. Returns the resource."""
    rmm = _import_rmm()
    mr = resource()
    if device is None:
        rmm.mr.set_current_device_resource(mr)
    else:
        rmm.mr.set_per_device_resource(device, mr)
    return mr


def in_use(device=None):
    """Is RMM's resource for device (default: the current one) magpie's?"""
    rmm = _import_rmm()
    mr = rmm.mr.get_current_device_resource() if device is None else rmm.mr.get_per_device_resource(device)
    return _MODULE is not None and isinstance(mr, _MODULE.MagpieMemoryResource)
