/* Checked invariants.
 *
 * MAGPIE_ASSERT(cond) states what an INVARIANT comment or a layer's
 * contract says must hold. It is compiled only where MAGPIE_DEBUG is
 * defined (`bazel test --config=debug`, which tools/test.sh runs); elsewhere
 * the condition is not evaluated (some conditions walk a whole segment) and
 * costs nothing. A failing assertion prints the condition and where it
 * failed and aborts: a debug build exists to stop at the first broken
 * invariant. Release builds never abort the host program. */
#ifndef MAGPIE_ASSERT_H
#define MAGPIE_ASSERT_H

#ifdef MAGPIE_DEBUG
#define MAGPIE_ASSERT(cond) ((cond) ? (void)0 : assert_fail(#cond, __FILE__, __LINE__, __func__))
#define MAGPIE_DEBUG_ONLY(x) x
#else
/* sizeof: the operands stay referenced (no unused warnings) and unevaluated. */
#define MAGPIE_ASSERT(cond) ((void)sizeof(!(cond)))
#define MAGPIE_DEBUG_ONLY(x)
#endif

void assert_fail(const char *cond, const char *file, int line, const char *func) __attribute__((noreturn, cold));

#endif /* MAGPIE_ASSERT_H */
