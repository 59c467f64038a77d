"""Shared build settings."""

MAGPIE_COPTS = [
    "-std=c11",
    "-D_GNU_SOURCE",
    "-O2",
    "-g",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Werror=implicit-function-declaration",
    "-Werror=incompatible-pointer-types",
]

# The library's own code: internals hidden (only MAGPIE_API names leave a
# shared object).
MAGPIE_LIB_COPTS = MAGPIE_COPTS + ["-fvisibility=hidden"]

# Who may depend on the internals of every layer besides the layers above
# it: the aggregate targets of the root package, tests and benchmarks.
INTERNAL_USERS = [
    "//:__pkg__",
    "//tests:__subpackages__",
    "//bench:__pkg__",
]

def magpie_layer(name, deps, above, srcs = None, hdrs = None, linkopts = []):
    """One layer of src/: a folder of its own, its headers included as
    "<folder>/<file>.h", visible only to the layers above it (`above`,
    package labels) and to INTERNAL_USERS. A lower layer that includes a
    higher one's header fails to build: the header is neither among its
    dependencies' include paths nor in its sandbox."""
    native.cc_library(
        name = name,
        srcs = srcs if srcs != None else native.glob(["*.c"]),
        hdrs = hdrs if hdrs != None else native.glob(["*.h"]),
        copts = MAGPIE_LIB_COPTS,
        strip_include_prefix = "/src",
        linkopts = linkopts,
        deps = deps,
        visibility = [p + ":__pkg__" for p in above] + INTERNAL_USERS,
        alwayslink = True,
        linkstatic = True,
    )

    # The sources, for the deliberately broken builds of tests/BUILD.
    native.filegroup(
        name = name + "_files",
        srcs = native.glob(["*.c", "*.h"]),
        visibility = ["//:__pkg__"],
    )
