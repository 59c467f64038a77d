"""magpie_test: a cmocka test linked against the library, the simulated
device (//sim) and their internals."""

load("//:defs.bzl", "MAGPIE_COPTS")

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

def magpie_expected_failure_test(name, define, test_srcs, pattern, args = [], env = {}, size = "small"):
    """Builds magpie with `define` (a deliberate bug, see src/pool/epoch.c
    and src/front/tcache.c), links the test sources against it, and passes only if
    that test binary fails with `pattern` in its output
    (tests/expect_failure.sh)."""
    native.cc_library(
        name = name + "_lib",
        testonly = True,
        srcs = ["//:lib_srcs"],
        # All layers in one library: their headers by "<layer>/<file>.h".
        copts = MAGPIE_COPTS + ["-fvisibility=hidden", "-Isrc", "-D" + define],
        linkopts = ["-lpthread", "-ldl"],
        deps = ["//:sim_header", "@system_libs//:jemalloc_private"],
        alwayslink = True,
        linkstatic = True,
    )
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

def magpie_python_test(name, size = "small"):
    """A shell test NAME.sh of the Python package (python/magpie) against
    this build's libmagpie.so on the simulated device: its arguments are the
    library and the package's files; libmagpie_sim.so lies beside
    libmagpie.so, which loads it; tests/python_test_prelude.sh is sourced."""
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
        ],
    )
