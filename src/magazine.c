/* Magazine objects and the global stack of empty ones. */
#include "magazine.h"

#include "sizeclass.h"
#include "stack.h"

magazine magazine_sentinel;
registry magazine_registry;

/* Empty magazines of any class and heap (their slots carry no state). */
static stack magazine_empties;

void magazine_module_init(void) {
  registry_init(&magazine_registry, sizeof(magazine));
  stack_init(&magazine_empties);
}

magazine *magazine_get_empty(unsigned cls) {
  magazine *m = (magazine *)stack_pop(&magazine_empties, &magazine_registry);
  if (m == NULL) m = registry_new(&magazine_registry);
  if (m == NULL) return NULL;
  m->count = 0;
  m->cap = sizeclass_table[cls].mag_cap;
  m->cls = cls;
  m->ticket = (epoch_ticket){0};
  return m;
}

void magazine_put_empty(magazine *m) {
  if (!magazine_is_real(m)) return;
  m->count = 0;
  stack_push(&magazine_empties, &magazine_registry, &m->link);
}
