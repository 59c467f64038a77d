"""magpie_test: a cmocka test linked against the library, the simulated
device (//sim) and their internals."""

load("//:defs.bzl", "MAGPIE_COPTS")
load("@cuda//:defs.bzl", "HAVE_CUDA")
load("@rmm//:defs.bzl", "HAVE_RMM")

def magpie_test(name, srcs = None, deps = [], size = "small", tags = [], **kwargs):
    native.cc_test(
        name = name,
        srcs = srcs if srcs != None else [name + ".c"],
        copts = MAGPIE_COPTS,
        deps = [
            "//:internal",
            "//:magpie_with_sim",
            "@system_libs//:cmocka",
        ] + deps,
        size = size,
        # Static: hidden library internals must resolve in the test binary.
        linkstatic = True,
        tags = tags,
        **kwargs
    )

def magpie_variant_library(name, define):
    """magpie and the simulated device in one static library built with
    -D`define`: a deliberate bug (magpie_expected_failure_test) or a
    threshold a test lowers (tests/fuzz/BUILD)."""
    native.cc_library(
        name = name,
        testonly = True,
        srcs = ["//:lib_srcs"],
        # All layers in one library: their headers by "<layer>/<file>.h".
        copts = MAGPIE_COPTS + ["-fvisibility=hidden", "-Isrc", "-D" + define],
        linkopts = ["-lpthread", "-ldl"],
        deps = ["//:sim_header", "@system_libs//:jemalloc_private"],
        alwayslink = True,
        linkstatic = True,
    )

def magpie_fuzz_targets(suffix, lib):
    """The fuzz target alloc_fuzz<suffix> against `lib` (libFuzzer needs
    clang: tagged manual, built with --config=fuzz) and the replay of the
    seed corpus through it, alloc_fuzz_replay<suffix>_test, in every
    configuration of `bazel test //...`."""
    native.cc_binary(
        name = "alloc_fuzz" + suffix,
        testonly = True,
        srcs = ["alloc_fuzz.c"],
        copts = MAGPIE_COPTS,
        linkopts = ["-fsanitize=fuzzer"],
        linkstatic = True,
        tags = ["manual"],
        deps = [lib, "//tests:turns"],
    )
    native.cc_test(
        name = "alloc_fuzz_replay" + suffix + "_test",
        size = "small",
        srcs = [
            "alloc_fuzz.c",
            "replay_main.c",
        ],
        args = ["tests/fuzz/corpus"],
        copts = MAGPIE_COPTS,
        data = native.glob(["corpus/*"]),
        linkopts = ["-lpthread"],
        linkstatic = True,
        deps = [lib, "//tests:turns"],
    )

def magpie_expected_failure_test(name, define, test_srcs, pattern, args = [], env = {}, size = "small"):
    """Builds magpie with `define` (a deliberate bug, see src/pool/epoch.c,
    src/tcache/tcache_slots.c and src/tcache/tdrain.c), links the test sources
    against it, and passes only if that test binary fails with `pattern` in
    its output (tests/expect_failure.sh)."""
    magpie_variant_library(name = name + "_lib", define = define)
    native.cc_binary(
        name = name + "_bin",
        testonly = True,
        srcs = test_srcs,
        copts = MAGPIE_COPTS,
        deps = [
            ":" + name + "_lib",
            "@system_libs//:cmocka",
        ],
        linkstatic = True,
    )
    native.sh_test(
        name = name,
        size = size,
        srcs = ["expect_failure.sh"],
        args = ["$(location :" + name + "_bin)", pattern] + args,
        data = [":" + name + "_bin"],
        env = env,
    )

def magpie_python_test(name, size = "small", data = []):
    """A shell test NAME.sh of the Python package (python/magpie) against
    this build's libmagpie.so on the simulated device: its arguments are the
    library and the package's files; libmagpie_sim.so lies beside
    libmagpie.so, which loads it; tests/python_test_prelude.sh is sourced.
    data: more files it reads."""
    native.sh_test(
        name = name,
        size = size,
        srcs = [name + ".sh"],
        args = [
            "$(location //:libmagpie.so)",
            "$(locations //:python_pkg)",
        ],
        data = [
            "python_test_prelude.sh",
            "//:libmagpie.so",
            "//:libmagpie_sim.so",
            "//:python_pkg",
        ] + data,
    )

def rmm_resource_test(name):
    """The RMM resource (include/magpie_rmm.hpp) on the simulated device,
    defined where RMM's wheels (tools/install_deps.sh fetches them) and the
    CUDA toolkit's headers are. RMM's headers need gcc (clang 14 rejects
    their namespace attributes), so the clang configurations leave it out
    (tag gcc_only, tools/test.sh)."""
    if not (HAVE_RMM and HAVE_CUDA):
        return
    native.cc_test(
        name = name,
        size = "small",
        srcs = [name + ".cpp"],
        copts = ["-std=c++20"],
        deps = [
            "//:magpie_with_sim",
            "//:rmm_header",
            "@cuda//:cudart_static",
            "@cuda//:headers",
            "@rmm",
            "@system_libs//:cmocka",
        ],
        linkstatic = True,
        tags = ["gcc_only"],
    )
