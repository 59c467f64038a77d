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
        linkstatic = True,
        tags = tags,
        **kwargs
    )
