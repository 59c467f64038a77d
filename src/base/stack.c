/* Lock-free tagged stack; see stack.h for the memory-order argument. */
#include "base/stack.h"

#define STACK_IDX(h) ((uint32_t)(h))
#define STACK_TAG(h) ((h) >> 32)
#define STACK_MAKE(tag, idx) (((uint64_t)(tag) << 32) | (uint64_t)(idx))

void stack_init(stack *s) {
  atomic_store_relaxed(&s->head, 0);
  atomic_store_relaxed(&s->count, 0);
}

void stack_push_chain(stack *s, registry *r, registry_link *first, registry_link *last, int64_t n) {
  (void)r;
  uint64_t old = atomic_load_relaxed(&s->head);
  uint64_t neu;
  do {
    /* Relaxed: published by the release half of the CAS below. */
    atomic_store_relaxed(&last->next, STACK_IDX(old));
    neu = STACK_MAKE(STACK_TAG(old) + 1, first->idx);
  } while (!atomic_cas_weak_acq_rel(&s->head, &old, neu));
  atomic_add_relaxed(&s->count, n);
}

void stack_push(stack *s, registry *r, registry_link *node) { stack_push_chain(s, r, node, node, 1); }

registry_link *stack_pop(stack *s, registry *r) {
  uint64_t old = atomic_load_acquire(&s->head);
  for (;;) {
    uint32_t top = STACK_IDX(old);
    if (top == 0) return NULL;
    registry_link *node = registry_get(r, top);
    /* May be stale if another thread pops `node` meanwhile; the tag makes
     * our CAS fail in that case. */
    uint32_t next = atomic_load_relaxed(&node->next);
    if (atomic_cas_weak_acq_rel(&s->head, &old, STACK_MAKE(STACK_TAG(old) + 1, next))) {
      atomic_sub_relaxed(&s->count, 1);
      return node;
    }
  }
}

registry_link *stack_take_all(stack *s, registry *r) {
  uint64_t old = atomic_load_relaxed(&s->head);
  for (;;) {
    if (STACK_IDX(old) == 0) return NULL;
    if (atomic_cas_weak_acq_rel(&s->head, &old, STACK_MAKE(STACK_TAG(old) + 1, 0))) break;
  }
  registry_link *first = registry_get(r, STACK_IDX(old));
  int64_t n = 0;
  for (registry_link *p = first; p; p = stack_next(r, p)) n++;
  atomic_sub_relaxed(&s->count, n);
  return first;
}
