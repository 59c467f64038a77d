// The macros of PyTorch's c10/macros/Macros.h that python/magpie's
// headers use, as PyTorch defines them for gcc and clang.
#ifndef MAGPIE_TEST_TORCH_STUB_MACROS_H
#define MAGPIE_TEST_TORCH_STUB_MACROS_H

#define C10_LIKELY(expr) (__builtin_expect(static_cast<bool>(expr), 1))
#define C10_UNLIKELY(expr) (__builtin_expect(static_cast<bool>(expr), 0))
#define C10_ALWAYS_INLINE inline __attribute__((__always_inline__))

#endif
