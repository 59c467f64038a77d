"""Test targets that need the CUDA toolkit.

Each macro defines nothing where the toolkit (or the part it needs) is
missing, so the build works without CUDA. GPU tests are tagged
["gpu", "manual"]: `bazel test //...` skips them; tools/gpu_suite.sh builds
them and runs them on a GPU machine.
"""

load("@cuda//:defs.bzl", "CUDA_HOME", "HAVE_CUDA", "HAVE_CUDA_GPU_TESTS", "NVCC")
load("//:defs.bzl", "MAGPIE_COPTS")
load("//tests:defs.bzl", "magpie_test")

GPU_TAGS = ["gpu", "manual"]

def cuda_abi_test(name, srcs):
    """A test of declarations against cuda.h: needs the headers, no GPU.

    Its argument is cudaTypedefs.h, read at run time (which variant of each
    entry point the driver loader gets)."""
    if not HAVE_CUDA:
        return
    magpie_test(
        name = name,
        srcs = srcs,
        deps = ["@cuda//:headers"],
        data = ["@cuda//:include/cudaTypedefs.h"],
        args = ["$(rootpath @cuda//:include/cudaTypedefs.h)"],
    )

def ptx_header(name, src, out, symbol):
    """Compiles src to compute_90 PTX and embeds it as `static const char symbol[]`.

    The driver JITs the PTX for the GPU at hand (sm_90 and later)."""
    if not HAVE_CUDA_GPU_TESTS:
        return
    native.genrule(
        name = name,
        srcs = [src],
        outs = [out],
        cmd = " && ".join([
            "t=$$(mktemp -d)",
            NVCC + " -ptx -arch=compute_90 -o $$t/k.ptx $<",
            "{ echo '/* Generated from " + src + " by nvcc -ptx: do not edit. */'" +
            " && echo 'static const char " + symbol + "[] = {'" +
            " && od -An -v -tx1 $$t/k.ptx | sed -e 's/ *\\([0-9a-f][0-9a-f]\\)/0x\\1,/g'" +
            " && echo '0};'; } > $@",
            "rm -rf $$t",
        ]),
        tags = GPU_TAGS,
        testonly = True,
    )

def gpu_library(name, **kwargs):
    """Code shared by GPU tests: the driver through magpie's one loader
    (//src/device:cuda_driver), cuda.h for its types and constants."""
    if not HAVE_CUDA_GPU_TESTS:
        return
    native.cc_library(
        name = name,
        copts = MAGPIE_COPTS,
        deps = ["//:magpie", "//src/device:cuda_driver", "@cuda//:headers", "@system_libs//:cmocka"],
        tags = GPU_TAGS,
        testonly = True,
        **kwargs
    )

def gpu_test(name, srcs, deps = []):
    """A cmocka test run on a GPU. It calls the driver through magpie's one
    loader (libcuda.so.1 opened at run time; nothing links the stub)."""
    if not HAVE_CUDA_GPU_TESTS:
        return
    magpie_test(
        name = name,
        srcs = srcs,
        deps = deps + ["//src/device:cuda_driver", "@cuda//:headers"],
        size = "medium",
        tags = GPU_TAGS,
        # Linked statically but for cmocka (magpie_test's default), so the
        # binary travels.
        linkopts = ["-lpthread"],
    )

def cuda_program(name, src, out, hdrs = [], cudart = "shared"):
    """An ordinary CUDA program built by nvcc, as a program that LD_PRELOAD
    can interpose on. cudart "shared": against the shared runtime
    (libcudart.so, found at run time in the toolkit's lib64 or the bundle's
    lib/), and libcuda's stub for its driver calls. cudart "static" (nvcc's
    default): the runtime inside the program, which opens libcuda.so.1 and
    reaches the driver through cuGetProcAddress; nothing else links the
    driver. Build the output file (//pkg:out); tools/gpu_suite.sh bundles it
    under bin/."""
    if not HAVE_CUDA_GPU_TESTS:
        return
    if cudart not in ("shared", "static"):
        fail("cuda_program: cudart must be \"shared\" or \"static\", not " + repr(cudart))
    link = [
        "-L" + CUDA_HOME + "/lib64/stubs -lcuda -ldl -lpthread",
        "-Xlinker -rpath=" + CUDA_HOME + "/lib64",
    ] if cudart == "shared" else ["-ldl -lpthread"]
    native.genrule(
        name = name,
        srcs = [src] + hdrs,
        outs = [out],
        cmd = " ".join([
            NVCC,
            "-O2 -std=c++17 -cudart " + cudart,
            "-gencode arch=compute_90,code=[sm_90,compute_90]",
            "-o $@ $(location " + src + ")",
        ] + link),
        executable = True,
        tags = GPU_TAGS,
        testonly = True,
    )
