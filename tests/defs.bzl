"""magpie_test: a cmocka test linked against the library and its internals."""

load("//:defs.bzl", "MAGPIE_COPTS")

def magpie_test(name, srcs = None, deps = [], size = "small", tags = [], **kwargs):
    native.cc_test(
        name = name,
        srcs = srcs if srcs != None else [name + ".c"],
        copts = MAGPIE_COPTS,
        deps = [
            "//:internal",
            "//:magpie",
            "@system_libs//:cmocka",
        ] + deps,
        size = size,
        # Static: hidden library internals must resolve in the test binary.
        linkstatic = True,
        tags = tags,
        **kwargs
    )
