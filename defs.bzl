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
]
