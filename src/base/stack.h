/* A lock-free LIFO of registry objects (Treiber stack), ABA-safe by a tag.
 *
 * The head packs (tag << 32 | index). Every successful push or pop bumps the
 * tag, so a pop that read head H and then lost the CPU while the top node was
 * popped and pushed back finds a different tag and retries instead of
 * installing a stale `next`. With 32 tag bits a thread would have to sleep
 * through 2^32 operations on one stack for a false match.
 *
 * Memory order: every head update is a CAS with acq_rel and every CAS is a
 * read-modify-write, so all updates form one release sequence: a thread whose
 * acquire (load or CAS) reads a head value synchronises with every earlier
 * push, and sees the pushed node's contents and link as the pusher wrote
 * them. Poppers then own the node exclusively.
 */
#ifndef MAGPIE_STACK_H
#define MAGPIE_STACK_H

#include <stddef.h>
#include <stdint.h>

#include "base/registry.h"
#include "base/types.h"

void stack_init(stack *s);
/* Push one node. */
void stack_push(stack *s, registry *r, registry_link *node);
/* Push a chain first..last already linked through `next` (last's link is
 * overwritten) with one CAS; n nodes. */
void stack_push_chain(stack *s, registry *r, registry_link *first, registry_link *last, int64_t n);
/* Pop one node, or NULL. */
registry_link *stack_pop(stack *s, registry *r);
/* Take the whole stack; returns the first node of the chain (linked through
 * `next`, ending at index 0), or NULL. */
registry_link *stack_take_all(stack *s, registry *r);

static inline int64_t stack_count(const stack *s) {
  return atomic_load_explicit(&((stack *)s)->count, memory_order_relaxed);
}

/* Follow a chain returned by stack_take_all (the caller owns the nodes). */
static inline registry_link *stack_next(registry *r, registry_link *node) {
  uint32_t n = atomic_load_relaxed(&node->next);
  return n ? (registry_link *)registry_get(r, n) : NULL;
}

#endif /* MAGPIE_STACK_H */
