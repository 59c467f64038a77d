/* Magazines: fixed arrays of free blocks of one size class (Bonwick).
 *
 * A magazine is owned by exactly one party at a time: a thread's stream slot
 * (loaded or previous magazine), or a depot stack. Ownership passes only
 * through the lock-free stacks (release on push, acquire on pop), so the
 * fields below are plain: only the owner reads or writes them.
 *
 * INVARIANT: 0 <= count <= cap <= MAGAZINE_MAX; slots[0..count) are distinct
 *            free blocks of class `cls` of heap `heap`.
 * INVARIANT: ticket.rec == NULL means every block is reusable by any stream
 *            now; otherwise they are reusable by stream ticket.rec->id now
 *            and by others once the ticket's epoch has completed. */
#ifndef MAGPIE_MAGAZINE_H
#define MAGPIE_MAGAZINE_H

#include <stddef.h>
#include <stdint.h>

#include "base/assert.h"
#include "base/registry.h"
#include "base/sizeclass.h"
#include "base/stack.h"

#define MAGAZINE_MAX SIZECLASS_MAG_MAX

struct stream_rec;
struct event_node;
struct heap;

/* A point in a stream's order: work enqueued on rec's stream before epoch
 * `seq` was sealed; ev completes when that work has. */
typedef struct epoch_ticket {
  struct stream_rec *rec;
  uint64_t seq;
  struct event_node *ev;
} epoch_ticket;

/* Cache-line aligned: magazines of different threads sit side by side in
 * the registry, and a shared line would make their owners' plain writes
 * contend. */
typedef struct magazine {
  _Alignas(64) registry_link link; /* must be first: stack node */
  uint32_t count;
  uint32_t cap;
  uint32_t cls;
  epoch_ticket ticket;
  /* In a heap's limbo only: the devices whose synchronisation covers the
   * last uses of its blocks (bit d for device d; heap/heap.h, "Limbo"). */
  uint64_t sync_devs;
  void *slots[MAGAZINE_MAX];
} magazine;

/* The shared empty magazine a fresh slot starts with: count 0 and cap 0, so
 * the fast paths' own bounds checks send the first alloc and free to the
 * slow path without a separate NULL test. Never written. */
extern magazine magazine_sentinel;

/* INVARIANT (above): count within cap, cap within the slots, class in range. */
#define MAGAZINE_ASSERT_VALID(m) \
  MAGPIE_ASSERT((m)->count <= (m)->cap && (m)->cap <= MAGAZINE_MAX && (m)->cls < SIZECLASS_COUNT)

static inline int magazine_is_real(const magazine *m) { return m != &magazine_sentinel; }

/* Magazines live in one registry (type-stable, indexed). */

/* A stack of empty magazines on a line of its own (magazine.c). */
typedef struct magazine_stack {
  _Alignas(64) stack s;
} magazine_stack;

/* The magazines' process-wide state, owned by this module (defined in
 * magazine.c): the magazines (type-stable), and the stacks of empty ones
 * (lock-free: release on push, acquire on pop). The registry is shared:
 * every stack of magazines is popped and pushed through it (the depot, slab
 * release, the heap's limbo, snapshots); the stacks of empty ones are
 * magazine.c's alone. */
typedef struct magazine_state {
  registry registry;
  magazine_stack empties[SIZECLASS_COUNT];
  magazine_stack spill;
} magazine_state;

extern magazine_state magazine_st;

void magazine_module_init(void);
/* An empty magazine for class cls (reused or new); NULL if the host is out
 * of memory. */
magazine *magazine_get_empty(unsigned cls);
/* Give an empty magazine back for reuse. */
void magazine_put_empty(magazine *m);

#endif /* MAGPIE_MAGAZINE_H */
