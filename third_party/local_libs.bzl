"""Repository rules for what magpie takes from the host system.

system_libs: jemalloc (as a private, symbol-localized archive: the one
tools/build_jemalloc.sh builds into .jemalloc/, without initial-exec TLS)
and cmocka.
cuda_toolkit: the CUDA toolkit's headers, driver stub and nvcc, honouring
CUDA_HOME; optional (defs.bzl says what was found).
rmm_wheels: RMM's headers and librmm.so from its PyPI wheels, unpacked by
integrations/rmm/fetch_rmm.sh (tools/install_deps.sh runs it) into
.rmm/whl/; optional (defs.bzl says whether they were found).
"""

# jemalloc entry points magpie calls; everything else in the archive is made
# local so the application's malloc is never replaced (see README).
_JE_SYMS = ["mallocx", "dallocx", "sdallocx", "sallocx", "mallctl"]

def _find(rctx, name):
    cc = rctx.os.environ.get("CC", "gcc")
    res = rctx.execute([cc, "-print-file-name=" + name])
    path = res.stdout.strip()
    if res.return_code != 0 or not path.startswith("/"):
        return None
    return path

def _system_libs_impl(rctx):
    # jemalloc built by tools/build_jemalloc.sh (Debian's source, prefix
    # mpje_, no initial-exec TLS, so libmagpie.so can be dlopened after
    # start-up with glibc's defaults).
    je = str(rctx.path(Label("@//:WORKSPACE")).dirname) + "/.jemalloc/lib/libjemalloc_pic.a"
    if not rctx.path(je).exists:
        fail("%s not found: run tools/install_deps.sh (tools/build_jemalloc.sh builds it from Debian's jemalloc source)" % je)
    rctx.execute(["mkdir", "-p", "je_objs", "include"])
    res = rctx.execute(["ar", "x", je], working_directory = "je_objs")
    if res.return_code != 0:
        fail("ar x failed: " + res.stderr)
    objs = [o for o in rctx.execute(["ls", "je_objs"]).stdout.split("\n") if o.endswith(".o") and "cpp" not in o]
    res = rctx.execute(["ld", "-r", "-o", "je_all.o"] + ["je_objs/" + o for o in objs])
    if res.return_code != 0:
        fail("ld -r failed: " + res.stderr)
    args = ["objcopy"]
    for s in _JE_SYMS:
        args += ["--redefine-sym", "%s=mpje_%s" % (s, s)]
    res = rctx.execute(args + ["je_all.o", "je_renamed.o"])
    if res.return_code != 0:
        fail("objcopy failed: " + res.stderr)
    args = ["objcopy"]
    for s in _JE_SYMS:
        args += ["--keep-global-symbol=mpje_" + s]
    res = rctx.execute(args + ["je_renamed.o", "je_private.o"])
    if res.return_code != 0:
        fail("objcopy failed: " + res.stderr)
    res = rctx.execute(["ar", "rcs", "libmagpie_jemalloc.a", "je_private.o"])
    if res.return_code != 0:
        fail("ar rcs failed: " + res.stderr)
    rctx.execute(["rm", "-rf", "je_objs", "je_all.o", "je_renamed.o", "je_private.o"])

    cmocka = _find(rctx, "libcmocka.so")
    if cmocka == None:
        fail("libcmocka.so not found: install Debian's libcmocka-dev")
    rctx.symlink(cmocka, "libcmocka.so")
    for h in ["cmocka.h", "cmocka_pbc.h"]:
        for d in ["/usr/include", "/usr/local/include"]:
            if rctx.path(d + "/" + h).exists:
                rctx.symlink(d + "/" + h, "include/" + h)
                break

    rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "jemalloc_private",
    srcs = ["libmagpie_jemalloc.a"],
    linkopts = ["-lpthread", "-ldl", "-lm"],
    linkstatic = True,
)

cc_library(
    name = "cmocka",
    srcs = ["libcmocka.so"],
    hdrs = glob(["include/*.h"]),
    strip_include_prefix = "include",
)
""")

system_libs = repository_rule(
    implementation = _system_libs_impl,
    environ = ["CC"],
    local = True,
)

def _cuda_toolkit_impl(rctx):
    home = rctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    have = rctx.path(home + "/include/cuda.h").exists
    if have:
        rctx.symlink(home + "/include", "include")
    else:
        rctx.file("include/.none", "")

    # The driver stub (the nvcc-built drop-in program, tests/gpu/preload_prog.cu,
    # links it; the real libcuda.so.1 answers at run time; magpie, its tools
    # and the GPU tests load the driver with dlopen and link nothing of it)
    # and nvcc (GPU test kernels): both optional.
    stub = home + "/lib64/stubs/libcuda.so"
    have_stub = have and rctx.path(stub).exists
    if have_stub:
        rctx.symlink(stub, "lib64/stubs/libcuda.so")

    # The runtime, statically (the RMM resource's synchronous calls).
    cudart = home + "/lib64/libcudart_static.a"
    if have and rctx.path(cudart).exists:
        rctx.symlink(cudart, "lib64/libcudart_static.a")
    nvcc = home + "/bin/nvcc"
    have_nvcc = have and rctx.path(nvcc).exists
    rctx.file("defs.bzl", "\n".join([
        "HAVE_CUDA = %s" % have,
        "CUDA_HOME = %r" % home,
        "# The GPU tests need nvcc and the drop-in program the driver stub besides the headers.",
        "HAVE_CUDA_GPU_TESTS = %s" % (have_stub and have_nvcc),
        "NVCC = %r" % (nvcc if have_nvcc else ""),
        "",
    ]))
    rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["include/*.h", "include/*.hpp", "include/crt/*.h", "include/crt/*.hpp"]),
    strip_include_prefix = "include",
)

# Empty where the toolkit has no stub.
cc_library(
    name = "driver_stub",
    srcs = glob(["lib64/stubs/libcuda.so"]),
)

# The CUDA runtime, linked statically; empty where the toolkit lacks it.
cc_library(
    name = "cudart_static",
    srcs = glob(["lib64/libcudart_static.a"]),
    linkopts = ["-lrt", "-ldl", "-lpthread"],
)
""")

cuda_toolkit = repository_rule(
    implementation = _cuda_toolkit_impl,
    environ = ["CUDA_HOME"],
    local = True,
)

def _rmm_wheels_impl(rctx):
    whl = str(rctx.path(Label("@//:WORKSPACE")).dirname) + "/.rmm/whl"
    have = (rctx.path(whl + "/librmm/include/rmm/version_config.hpp").exists and
            rctx.path(whl + "/librmm/lib64/librmm.so").exists and
            rctx.path(whl + "/rapids_logger/lib64/librapids_logger.so").exists)
    if have:
        rctx.symlink(whl + "/librmm/include", "include")
        rctx.symlink(whl + "/rapids_logger/include", "logger_include")
        rctx.symlink(whl + "/librmm/lib64/librmm.so", "lib/librmm.so")
        rctx.symlink(whl + "/rapids_logger/lib64/librapids_logger.so", "lib/librapids_logger.so")
    else:
        rctx.file("include/.none", "")
        rctx.file("logger_include/.none", "")
    rctx.file("defs.bzl", "HAVE_RMM = %s\n" % have)
    rctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

# RMM's headers (with the CCCL release it ships under include/rapids, which
# must come before the CUDA toolkit's own) and librmm.so.
cc_library(
    name = "rmm",
    hdrs = glob(["include/**/*", "logger_include/**/*"], exclude = ["**/.none"]),
    includes = ["include/rapids", "include", "logger_include"],
    srcs = glob(["lib/*.so"]),
)
""")

rmm_wheels = repository_rule(
    implementation = _rmm_wheels_impl,
    local = True,
)
