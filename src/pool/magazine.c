/* Magazine objects and the stacks of empty ones. */
#include "pool/magazine.h"

#include "base/assert.h"
#include "base/sizeclass.h"
#include "base/stack.h"

/* A constant in all but name: never written (count and cap stay 0). */
magazine magazine_sentinel;

magazine_state magazine_st;

/* Empty magazines (their slots carry no state, so any class may take
 * one). Each class has its own stack on a line of its own, because every
 * depot exchange takes or gives an empty and one shared stack was a line
 * all threads fought over; a class keeps at most MAGAZINE_EMPTIES_KEPT and
 * spills the rest to the shared stack, which also serves a class that has
 * none. */
#define MAGAZINE_EMPTIES_KEPT 64

void magazine_module_init(void) {
  registry_init(&magazine_st.registry, sizeof(magazine));
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) stack_init(&magazine_st.empties[c].s);
  stack_init(&magazine_st.spill.s);
}

magazine *magazine_get_empty(unsigned cls) {
  magazine *m = (magazine *)stack_pop(&magazine_st.empties[cls].s, &magazine_st.registry);
  if (m == NULL) m = (magazine *)stack_pop(&magazine_st.spill.s, &magazine_st.registry);
  if (m == NULL) m = registry_new(&magazine_st.registry);
  if (m == NULL) return NULL;
  m->count = 0;
  m->cap = sizeclass_table[cls].mag_cap;
  m->cls = cls;
  m->ticket = (epoch_ticket){0};
  return m;
}

void magazine_put_empty(magazine *m) {
  if (!magazine_is_real(m)) return;
  MAGPIE_ASSERT(m->ticket.rec == NULL); /* an empty carries no seal */
  m->count = 0;
  stack *own = &magazine_st.empties[m->cls].s;
  stack_push(stack_count(own) < MAGAZINE_EMPTIES_KEPT ? own : &magazine_st.spill.s, &magazine_st.registry, &m->link);
}
