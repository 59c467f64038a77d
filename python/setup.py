"""How `pip install ./python` puts magpie's shared libraries into the
package (the metadata is in pyproject.toml).

The libraries come from $MAGPIE_PREBUILT (a folder holding libmagpie.so and
libmagpie_sim.so, and magpie.h there or in ../include) or, without it, from
`bazel build -c opt` in the repository above this folder. magpie.h goes
into the package too: the PyTorch allocator built on first use
(torch_native.cpp) reads magpie_stats through it. The wheel is tagged py3-none-<platform>: the
libraries are plain C and use no Python API, so one wheel serves every
Python 3 on the platform. Its version is magpie's (MAGPIE_VERSION_STRING in
include/magpie.h, or the library's magpie_version())."""
import ctypes
import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBS = ("libmagpie.so", "libmagpie_sim.so")


def libs_dir():
    d = os.environ.get("MAGPIE_PREBUILT")
    if d:
        return os.path.abspath(d)
    if not os.path.isfile(os.path.join(ROOT, "WORKSPACE")):
        raise SystemExit("magpie: set MAGPIE_PREBUILT to a folder with libmagpie.so and libmagpie_sim.so "
                         "(this copy of the package is not inside magpie's repository, where they are built)")
    targets = ["//:libmagpie.so", "//:libmagpie_sim.so"]
    subprocess.run(["bazel", "build", "-c", "opt"] + targets, cwd=ROOT, check=True)
    r = subprocess.run(["bazel", "info", "-c", "opt", "bazel-bin"], cwd=ROOT, check=True, capture_output=True,
                       text=True)
    return r.stdout.strip()


def version():
    header = os.path.join(ROOT, "include", "magpie.h")
    if os.path.isfile(header):
        with open(header) as f:
            m = re.search(r'#define MAGPIE_VERSION_STRING "([^"]+)"', f.read())
        if m:
            return m.group(1)
    lib = ctypes.CDLL(os.path.join(libs_dir(), "libmagpie.so"))
    lib.magpie_version.restype = ctypes.c_char_p
    return lib.magpie_version().decode()


class BuildPy(build_py):
    def run(self):
        super().run()
        src = libs_dir()
        dest = os.path.join(self.build_lib, "magpie")
        for name in LIBS:
            path = os.path.join(src, name)
            if not os.path.isfile(path):
                raise SystemExit(f"magpie: {path} not found")
            out = os.path.join(dest, name)
            shutil.copyfile(path, out)
            if shutil.which("strip"):  # debug sections: most of the bytes, none of the code
                subprocess.run(["strip", "--strip-debug", out], check=True)
        # The public header, for the PyTorch allocator built on first use
        # (torch_native.cpp reads magpie_stats through it).
        headers = [os.path.join(d, "magpie.h") for d in (os.path.join(ROOT, "include"), src,
                                                        os.path.join(os.path.dirname(src), "include"))]
        for header in headers:
            if os.path.isfile(header):
                shutil.copyfile(header, os.path.join(dest, "magpie.h"))
                # The RMM resource, beside it (magpie.rmm builds against it).
                rmm = os.path.join(os.path.dirname(header), "magpie_rmm.hpp")
                if os.path.isfile(rmm):
                    shutil.copyfile(rmm, os.path.join(dest, "magpie_rmm.hpp"))
                break
        else:
            raise SystemExit("magpie: magpie.h not found (looked for " + ", ".join(headers) + ")")


class BdistWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(version=version(), cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel}, distclass=BinaryDistribution)
