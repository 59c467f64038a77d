/* The base layer (src/base) through its internal interface: size classes
 * (as magpie's set-up on the deterministic fake device, fake_backend.c,
 * fills their table), the lock-free stack and the page map. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "base/stack.h"
#include "magpie.h"
#include "pool/slab.h"
#include "tests/fake_backend.h"

static void test_sizeclass(void **state) {
  (void)state;
  for (size_t size = 1; size <= SIZECLASS_MAX_SIZE; size += (size < 65536 ? 1 : 97)) {
    unsigned c = sizeclass_of(size);
    assert_true(c < SIZECLASS_COUNT);
    size_t cs = sizeclass_table[c].size;
    assert_true(cs >= size);
    assert_int_equal(cs % 256, 0);
    if (c > 0) assert_true(sizeclass_table[c - 1].size < size);
    /* At most 25 % wasted up to 32 KiB, a third above (two classes per
     * power of two). */
    if (size > 1024 && size <= 32768) assert_true((cs - size) * 4 <= cs);
    if (size > 32768) assert_true((cs - size) * 3 <= cs);
    assert_int_equal(c >= SIZECLASS_FINE_COUNT, size > 32768);
  }
  assert_int_equal(sizeclass_of(SIZECLASS_MAX_SIZE), SIZECLASS_COUNT - 1);
  for (unsigned c = 1; c < SIZECLASS_COUNT; c++) assert_true(sizeclass_table[c].size > sizeclass_table[c - 1].size);
}

static void test_sizeclass_magic_division(void **state) {
  (void)state;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    const sizeclass_info *ci = &sizeclass_table[c];
    assert_true(ci->blocks >= 1 && ci->slab_size < ((size_t)1 << 24));
    assert_true(ci->mag_cap >= (ci->seg ? 1 : 2) && ci->mag_cap <= 64);
    /* Classes above SIZECLASS_SLAB_MAX are class blocks of the segments,
     * magazines of at most SIZECLASS_SEG_MAG_FEW_BYTES, or
     * SIZECLASS_SEG_MAG_BYTES for a thread on one stream (or one block). */
    assert_int_equal(ci->seg, ci->size > SIZECLASS_SLAB_MAX);
    if (ci->seg)
      assert_true(ci->mag_cap <= ci->mag_max &&
                  (ci->mag_cap == 1 || ci->mag_cap * ci->size <= SIZECLASS_SEG_MAG_FEW_BYTES) &&
                  (ci->mag_max == 1 || ci->mag_max * ci->size <= SIZECLASS_SEG_MAG_BYTES));
    for (uint64_t off = 0; off < ci->slab_size; off += (ci->slab_size / 4099) | 1) {
      assert_int_equal((off * ci->magic) >> SIZECLASS_MAGIC_SHIFT, off / ci->size);
    }
    uint64_t last = ci->slab_size - 1;
    assert_int_equal((last * ci->magic) >> SIZECLASS_MAGIC_SHIFT, last / ci->size);
  }
}

typedef struct tnode {
  registry_link link;
  _Atomic int owner;
} tnode;
static registry stack_reg;
static stack test_stack;
#define STACK_NODES 512
#define STACK_THREADS 4
#define STACK_ROUNDS 50000

static void *stack_worker(void *arg) {
  intptr_t me = (intptr_t)arg;
  unsigned seed = (unsigned)me * 7919u;
  tnode *held[8];
  int nh = 0;
  for (int r = 0; r < STACK_ROUNDS; r++) {
    if (nh < 8 && (rand_r(&seed) & 1)) {
      tnode *n = (tnode *)stack_pop(&test_stack, &stack_reg);
      if (n) {
        /* Exclusive ownership: nobody else may hold it. */
        int prev = atomic_exchange(&n->owner, (int)me + 1);
        if (prev != 0) return (void *)1;
        held[nh++] = n;
      }
    } else if (nh > 0) {
      tnode *n = held[--nh];
      atomic_store(&n->owner, 0);
      stack_push(&test_stack, &stack_reg, &n->link);
    }
  }
  while (nh > 0) {
    tnode *n = held[--nh];
    atomic_store(&n->owner, 0);
    stack_push(&test_stack, &stack_reg, &n->link);
  }
  return NULL;
}

static void test_stack_lifo_and_threads(void **state) {
  (void)state;
  registry_init(&stack_reg, sizeof(tnode));
  stack_init(&test_stack);
  tnode *a = registry_new(&stack_reg), *b = registry_new(&stack_reg);
  stack_push(&test_stack, &stack_reg, &a->link);
  stack_push(&test_stack, &stack_reg, &b->link);
  assert_ptr_equal(stack_pop(&test_stack, &stack_reg), &b->link);
  assert_ptr_equal(stack_pop(&test_stack, &stack_reg), &a->link);
  assert_null(stack_pop(&test_stack, &stack_reg));
  stack_push(&test_stack, &stack_reg, &a->link);
  stack_push(&test_stack, &stack_reg, &b->link);
  for (int i = 2; i < STACK_NODES; i++) {
    tnode *n = registry_new(&stack_reg);
    assert_non_null(n);
    stack_push(&test_stack, &stack_reg, &n->link);
  }
  pthread_t t[STACK_THREADS];
  for (intptr_t i = 0; i < STACK_THREADS; i++) pthread_create(&t[i], NULL, stack_worker, (void *)i);
  for (int i = 0; i < STACK_THREADS; i++) {
    void *rv;
    pthread_join(t[i], &rv);
    assert_null(rv);
  }
  /* Every node is back exactly once. */
  char seen[STACK_NODES + 2] = {0};
  int n = 0;
  for (registry_link *l = stack_take_all(&test_stack, &stack_reg); l; l = stack_next(&stack_reg, l)) {
    assert_true(l->idx >= 1 && l->idx <= STACK_NODES);
    assert_int_equal(seen[l->idx], 0);
    seen[l->idx] = 1;
    n++;
  }
  assert_int_equal(n, STACK_NODES);
  assert_int_equal(stack_count(&test_stack), 0);
}

static void test_pagemap(void **state) {
  (void)state;
  slab *fake = (slab *)0x1234;
  uintptr_t base = (uintptr_t)0x7f0000000000ull;
  assert_null(pagemap_lookup(base));
  assert_int_equal(pagemap_set(base, (size_t)6 << 20, fake), MAGPIE_OK);
  assert_ptr_equal(pagemap_lookup(base), fake);
  assert_ptr_equal(pagemap_lookup(base + ((size_t)6 << 20) - 1), fake);
  assert_null(pagemap_lookup(base + ((size_t)6 << 20)));
  assert_null(pagemap_lookup(base - 1));
  assert_null(pagemap_lookup((uintptr_t)1 << 50)); /* beyond 48 bits */
  assert_int_equal(pagemap_set(base, (size_t)6 << 20, NULL), MAGPIE_OK);
  assert_null(pagemap_lookup(base));
}

int main(void) {
  /* Fills the size-class table. */
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sizeclass),
      cmocka_unit_test(test_sizeclass_magic_division),
      cmocka_unit_test(test_stack_lifo_and_threads),
      cmocka_unit_test(test_pagemap),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
