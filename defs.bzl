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
# shared object). Thread-local variables through TLS descriptors where the
# compiler has them (gcc; clang 14, used for the sanitizer builds, does
# not): libmagpie.so can then be dlopened after start-up with glibc's
# defaults, which the initial-exec model's static TLS forbade, and the fast
# path's access to its thread cache costs about what initial-exec did, less
# than the default global-dynamic model (bench/DECISIONS.md, "Thread-local
# variables through TLS descriptors"). (Linked into an executable, the
# linker turns every model into local-exec.)
MAGPIE_LIB_COPTS = MAGPIE_COPTS + ["-fvisibility=hidden"] + select({
    "//:compiler_gcc": ["-mtls-dialect=gnu2"],
    "//:compiler_gcc_auto": ["-mtls-dialect=gnu2"],
    "//conditions:default": [],
})

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
