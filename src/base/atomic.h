/* C11 atomics with the memory order in the name, so every call site states
 * which ordering it relies on. Field comments elsewhere say which release a
 * given acquire pairs with. */
#ifndef MAGPIE_ATOMIC_H
#define MAGPIE_ATOMIC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define atomic_load_relaxed(p) atomic_load_explicit((p), memory_order_relaxed)
#define atomic_load_acquire(p) atomic_load_explicit((p), memory_order_acquire)
#define atomic_store_relaxed(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define atomic_store_release(p, v) atomic_store_explicit((p), (v), memory_order_release)
#define atomic_add_relaxed(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define atomic_sub_relaxed(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_relaxed)
#define atomic_add_acq_rel(p, v) atomic_fetch_add_explicit((p), (v), memory_order_acq_rel)
#define atomic_sub_acq_rel(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_acq_rel)
#define atomic_exchange_acq_rel(p, v) atomic_exchange_explicit((p), (v), memory_order_acq_rel)
#define atomic_or_relaxed(p, v) atomic_fetch_or_explicit((p), (v), memory_order_relaxed)
#define atomic_or_acq_rel(p, v) atomic_fetch_or_explicit((p), (v), memory_order_acq_rel)
#define atomic_and_relaxed(p, v) atomic_fetch_and_explicit((p), (v), memory_order_relaxed)
#define atomic_and_release(p, v) atomic_fetch_and_explicit((p), (v), memory_order_release)
/* Sequentially consistent: only where two threads each store one word and
 * load the other's (a store-load pattern no weaker order covers). */
#define atomic_load_seq_cst(p) atomic_load_explicit((p), memory_order_seq_cst)
#define atomic_or_seq_cst(p, v) atomic_fetch_or_explicit((p), (v), memory_order_seq_cst)
#define atomic_and_seq_cst(p, v) atomic_fetch_and_explicit((p), (v), memory_order_seq_cst)
#define atomic_cas_weak_acq_rel(p, exp, des) \
  atomic_compare_exchange_weak_explicit((p), (exp), (des), memory_order_acq_rel, memory_order_acquire)
#define atomic_cas_strong_acq_rel(p, exp, des) \
  atomic_compare_exchange_strong_explicit((p), (exp), (des), memory_order_acq_rel, memory_order_acquire)
#define atomic_cas_weak_relaxed(p, exp, des) \
  atomic_compare_exchange_weak_explicit((p), (exp), (des), memory_order_relaxed, memory_order_relaxed)

/* Owner-only counters read by others: a relaxed load and store (a plain
 * move on x86-64), no read-modify-write, so the hot path stays free of
 * locked instructions while readers see a torn-free value. */
static inline void atomic_owner_add_i64(_Atomic int64_t *p, int64_t v) {
  atomic_store_relaxed(p, atomic_load_relaxed(p) + v);
}

static inline void atomic_owner_inc_u64(_Atomic uint64_t *p) { atomic_store_relaxed(p, atomic_load_relaxed(p) + 1); }

/* Raise *p to at least v (release: a reader that acquires the new maximum
 * sees what the raiser saw). */
static inline void atomic_max_u64_release(_Atomic uint64_t *p, uint64_t v) {
  uint64_t cur = atomic_load_relaxed(p);
  while (cur < v && !atomic_compare_exchange_weak_explicit(p, &cur, v, memory_order_release, memory_order_relaxed)) {
  }
}

static inline void atomic_max_size_relaxed(_Atomic size_t *p, size_t v) {
  size_t cur = atomic_load_relaxed(p);
  while (cur < v && !atomic_cas_weak_relaxed(p, &cur, v)) {
  }
}

/* For arithmetic meant to wrap (hashes): exempt from clang's
 * -fsanitize=unsigned-integer-overflow, which the sanitizer build enables to
 * catch unintended wrap-around in size rounding. */
#if defined(__clang__)
#define MAGPIE_WRAPS __attribute__((no_sanitize("unsigned-integer-overflow")))
#else
#define MAGPIE_WRAPS
#endif

#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)
#define MAGPIE_NOINLINE __attribute__((noinline))
#define MAGPIE_INLINE inline __attribute__((always_inline))
#define MAGPIE_INTERNAL __attribute__((visibility("hidden")))

#endif /* MAGPIE_ATOMIC_H */
