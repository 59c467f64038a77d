/* Magazine objects and the stacks of empty ones. */
#include "pool/magazine.h"

#include "base/assert.h"
#include "base/globals.h"
#include "base/sizeclass.h"
#include "base/stack.h"

/* A constant in all but name: never written (count and cap stay 0). */
magazine magazine_sentinel;

/* Empty magazines (their slots carry no state, so any class may take
 * one). Each class has its own stack on a line of its own, because every
 * depot exchange takes or gives an empty and one shared stack was a line
 * all threads fought over; a class keeps at most MAGAZINE_EMPTIES_KEPT and
 * spills the rest to the shared stack, which also serves a class that has
 * none. */
#define MAGAZINE_EMPTIES_KEPT 64

void magazine_module_init(void) {
  registry_init(&globals.magazine_registry, sizeof(magazine));
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) stack_init(&globals.magazine_empties[c].s);
  stack_init(&globals.magazine_spill.s);
}

magazine *magazine_get_empty(unsigned cls) {
  magazine *m = (magazine *)stack_pop(&globals.magazine_empties[cls].s, &globals.magazine_registry);
  if (m == NULL) m = (magazine *)stack_pop(&globals.magazine_spill.s, &globals.magazine_registry);
  if (m == NULL) m = registry_new(&globals.magazine_registry);
  if (m == NULL) return NULL;
  m->count = 0;
  m->cap = globals.sizeclass_table[cls].mag_cap;
  m->cls = cls;
  m->ticket = (epoch_ticket){0};
  return m;
}

void magazine_put_empty(magazine *m) {
  if (!magazine_is_real(m)) return;
  MAGPIE_ASSERT(m->ticket.rec == NULL); /* an empty carries no seal */
  m->count = 0;
  stack *own = &globals.magazine_empties[m->cls].s;
  stack_push(stack_count(own) < MAGAZINE_EMPTIES_KEPT ? own : &globals.magazine_spill.s, &globals.magazine_registry,
             &m->link);
}
