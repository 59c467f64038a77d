/* The allocator's layers against the deterministic fake device
 * (fake_backend.c), each through its internal interface: size classes, the
 * lock-free stack, the page map, epochs and their queries, the depot,
 * magazine capacity, and threads that run dry together sharing one slab
 * carve or one span map. */
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/meta.h"
#include "base/pagemap.h"
#include "base/sizeclass.h"
#include "base/stack.h"
#include "front/init.h"
#include "front/tcache.h"
#include "heap/heap.h"
#include "magpie.h"
#include "pool/depot.h"
#include "pool/epoch.h"
#include "pool/magazine.h"
#include "pool/region.h"
#include "pool/slab.h"
#include "pool/span.h"
#include "tests/fake_backend.h"

static void test_sizeclass(void **state) {
  (void)state;
  for (size_t size = 1; size <= SIZECLASS_MAX_SIZE; size += (size < 65536 ? 1 : 97)) {
    unsigned c = sizeclass_of(size);
    assert_true(c < SIZECLASS_COUNT);
    size_t cs = globals.sizeclass_table[c].size;
    assert_true(cs >= size);
    assert_int_equal(cs % 256, 0);
    if (c > 0) assert_true(globals.sizeclass_table[c - 1].size < size);
    /* At most 25 % wasted up to 32 KiB, a third above (two classes per
     * power of two). */
    if (size > 1024 && size <= 32768) assert_true((cs - size) * 4 <= cs);
    if (size > 32768) assert_true((cs - size) * 3 <= cs);
    assert_int_equal(c >= SIZECLASS_FINE_COUNT, size > 32768);
  }
  assert_int_equal(sizeclass_of(SIZECLASS_MAX_SIZE), SIZECLASS_COUNT - 1);
  for (unsigned c = 1; c < SIZECLASS_COUNT; c++)
    assert_true(globals.sizeclass_table[c].size > globals.sizeclass_table[c - 1].size);
}

static void test_sizeclass_magic_division(void **state) {
  (void)state;
  for (unsigned c = 0; c < SIZECLASS_COUNT; c++) {
    const sizeclass_info *ci = &globals.sizeclass_table[c];
    assert_true(ci->blocks >= 1 && ci->slab_size < ((size_t)1 << 24));
    assert_true(ci->mag_cap >= (ci->seg ? 1 : 2) && ci->mag_cap <= 64);
    /* Classes above SIZECLASS_SLAB_MAX are class blocks of the segments,
     * one magazine of at most SIZECLASS_SEG_MAG_BYTES (or one block). */
    assert_int_equal(ci->seg, ci->size > SIZECLASS_SLAB_MAX);
    if (ci->seg)
      assert_true(ci->mag_max == ci->mag_cap &&
                  (ci->mag_cap == 1 || ci->mag_cap * ci->size <= SIZECLASS_SEG_MAG_BYTES));
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

/* Events on one stream complete in order: once one ticket's event is seen
 * complete, earlier tickets of that stream are complete by comparison, with
 * no further query. Same-stream reuse needs no query at all. */
static void test_epoch_ordering(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(0);
  uint64_t sid = 0;
  assert_int_equal(fake_backend()->stream_id(s, &sid), MAGPIE_OK);
  heap *h = heap_get(0);
  assert_non_null(h);
  stream_rec *r = epoch_stream_acquire(&h->epochs, sid);
  assert_non_null(r);
  epoch_ticket t[3];
  for (int i = 0; i < 3; i++) assert_int_equal(epoch_seal(r, s, &t[i]), MAGPIE_OK);
  assert_true(t[0].seq < t[1].seq && t[1].seq < t[2].seq);
  fake_counters c0, c1;
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[0], sid), EPOCH_READY_SAME);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries);
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[2], EPOCH_NO_STREAM), EPOCH_PENDING);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries + 1); /* t[2] is the newest seal */
  /* Only t[0]'s work completes: the newest seal is still pending, and the
   * ticket's own event decides. */
  assert_int_equal(fake_backend()->event_synchronize(t[0].ev->ev), MAGPIE_OK);
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[0], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries + 2);
  assert_int_equal(atomic_load(&r->done), t[0].seq);
  assert_int_equal(epoch_ready(&t[1], EPOCH_NO_STREAM), EPOCH_PENDING);
  fake_stream_complete(s);
  /* One query, of the newest seal, vouches for every ticket of the stream. */
  fake_get_counters(&c0);
  assert_int_equal(epoch_ready(&t[1], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  assert_int_equal(atomic_load(&r->done), t[2].seq);
  assert_int_equal(epoch_ready(&t[2], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  assert_int_equal(epoch_ready(&t[0], EPOCH_NO_STREAM), EPOCH_READY_DONE);
  fake_get_counters(&c1);
  assert_int_equal(c1.event_queries, c0.event_queries + 1);
  /* Event references: each ticket holds its own; the record holds the
   * newest seal's until it goes, and then the pool has them all back. */
  event_node *newest = t[2].ev, *older = t[0].ev;
  assert_int_equal(atomic_load(&newest->refs), 2);
  assert_int_equal(atomic_load(&older->refs), 1);
  assert_int_equal(atomic_load(&r->refs), 4);
  int64_t pooled = stack_count(&h->epochs.free_events);
  for (int i = 0; i < 3; i++) epoch_ticket_release(&t[i]);
  assert_int_equal(atomic_load(&r->refs), 1);
  assert_int_equal(atomic_load(&newest->refs), 1);
  assert_int_equal(stack_count(&h->epochs.free_events), pooled + 2);
  int64_t live = atomic_load(&h->epochs.live_records);
  epoch_stream_release(r);
  assert_int_equal(atomic_load(&h->epochs.live_records), live - 1);
  assert_int_equal(atomic_load(&newest->refs), 0);
  assert_int_equal(stack_count(&h->epochs.free_events), pooled + 3);
}

/* Two fake streams of device 0 with their ids, and A's stream record
 * (the caller releases it). */
static stream_rec *two_streams(heap *h, cudaStream_t *a, cudaStream_t *b, uint64_t *ida, uint64_t *idb) {
  *a = fake_stream_create(0);
  *b = fake_stream_create(0);
  assert_int_equal(fake_backend()->stream_id(*a, ida), MAGPIE_OK);
  assert_int_equal(fake_backend()->stream_id(*b, idb), MAGPIE_OK);
  return epoch_stream_acquire(&h->epochs, *ida);
}

/* A magazine of class cls holding n fake blocks at addr (never
 * dereferenced; n at most its capacity), sealed on stream s (record r) and
 * put in the depot, where it is pending. */
static magazine *put_pending(heap *h, unsigned cls, stream_rec *r, cudaStream_t s, uint32_t n, uintptr_t addr) {
  magazine *m = magazine_get_empty(cls);
  assert_non_null(m);
  while (m->count < n && m->count < m->cap) m->slots[m->count++] = (void *)addr;
  assert_int_equal(epoch_seal(r, s, &m->ticket), MAGPIE_OK);
  depot_put(&h->depots[m->cls], m);
  return m;
}

/* Magazines: capacity by class, empties recycled. The depot: a magazine
 * sealed by stream A is pending; A takes it back at once, another stream
 * only after A's epoch completed; an unsealed one goes to anyone. */
static void test_magazine_and_depot(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  unsigned cls = sizeclass_of(200000); /* a class no other test uses */
  magazine *m = magazine_get_empty(cls);
  assert_non_null(m);
  assert_int_equal(m->count, 0);
  assert_int_equal(m->cap, globals.sizeclass_table[cls].mag_cap);
  assert_int_equal(m->cls, cls);
  magazine_put_empty(m);
  magazine *again = magazine_get_empty(cls);
  assert_ptr_equal(again, m); /* LIFO reuse of empties */

  cudaStream_t a, b;
  uint64_t ida, idb;
  stream_rec *ra = two_streams(h, &a, &b, &ida, &idb);
  m->slots[m->count++] = (void *)0x1000; /* never dereferenced */
  assert_int_equal(epoch_seal(ra, a, &m->ticket), MAGPIE_OK);
  depot_put(&h->depots[m->cls], m);
  assert_null(depot_take(&h->depots[cls], idb));         /* A's work may be running */
  assert_ptr_equal(depot_take(&h->depots[cls], ida), m); /* A itself: at once */
  assert_null(m->ticket.rec);                            /* handed over without a ticket */

  assert_int_equal(epoch_seal(ra, a, &m->ticket), MAGPIE_OK);
  depot_put(&h->depots[m->cls], m);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  fake_stream_complete(a);
  assert_ptr_equal(depot_take(&h->depots[cls], idb), m); /* A completed: B may */
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.cross_stream_migrations, st0.cross_stream_migrations + 1);

  depot_put(&h->depots[m->cls], m); /* no ticket: ready for anyone */
  assert_ptr_equal(depot_take(&h->depots[cls], EPOCH_NO_STREAM), m);
  assert_null(depot_take(&h->depots[cls], idb));
  m->count = 0;
  magazine_put_empty(m);
  epoch_stream_release(ra);
}

/* The depot's pending list is a LIFO: a taker looks at the newest few
 * magazines one at a time, then sweeps the whole list, so an older
 * magazine whose epoch completed is found under newer pending ones. */
static void test_depot_finds_old_ready_magazine(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  unsigned cls = sizeclass_of(180000); /* a class no other test uses */
  cudaStream_t a, b;
  uint64_t ida, idb;
  stream_rec *ra = two_streams(h, &a, &b, &ida, &idb);
  enum { NEWER = 12 };
  magazine *old = put_pending(h, cls, ra, a, 1, 0x1000);
  fake_stream_complete(a); /* old's epoch is over */
  for (int i = 0; i < NEWER; i++) put_pending(h, cls, ra, a, 1, 0x2000);
  assert_ptr_equal(depot_take(&h->depots[cls], idb), old); /* under 12 pending ones */
  assert_null(old->ticket.rec);
  assert_null(depot_take(&h->depots[cls], idb)); /* the rest still run on A */
  /* Every newer one is still there, and A takes each back at once. */
  int back = 0;
  for (magazine *m; (m = depot_take(&h->depots[cls], ida)) != NULL; back++) {
    assert_null(m->ticket.rec);
    m->count = 0;
    magazine_put_empty(m);
  }
  assert_int_equal(back, NEWER);
  old->count = 0;
  magazine_put_empty(old);
  epoch_stream_release(ra);
}

/* Small blocks still running on another stream: depot_take_waiting hands
 * one over by making the allocating stream wait on its event (no host
 * wait); a refill does so only under pressure. */
static void test_depot_reuse_through_stream_wait(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  assert_int_equal(h->reuse_wait, 1); /* the default */
  unsigned cls = sizeclass_of(20000); /* a slab class no other test uses */
  cudaStream_t a, b;
  uint64_t ida, idb;
  stream_rec *ra = two_streams(h, &a, &b, &ida, &idb);

  /* Direct: one pending magazine, taken by B through a wait. */
  magazine *m = put_pending(h, cls, ra, a, 1, 0x1000);
  fake_counters c0, c1;
  magpie_stats st0, st1;
  fake_get_counters(&c0);
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  assert_null(depot_take(&h->depots[cls], idb));
  assert_ptr_equal(depot_take_waiting(&h->depots[cls], h->ops, idb, b), m);
  assert_null(m->ticket.rec);
  fake_get_counters(&c1);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(c1.stream_waits, c0.stream_waits + 1);
  assert_int_equal(c1.event_syncs, c0.event_syncs); /* no host wait */
  assert_int_equal(st1.stream_waits, st0.stream_waits + 1);
  assert_null(depot_take_waiting(&h->depots[cls], h->ops, idb, b)); /* nothing pending */
  m->count = 0;
  magazine_put_empty(m);

  /* A refill with room on the device maps rather than tie B to A (the
   * pressure case is test_memory_pressure's). */
  m = put_pending(h, cls, ra, a, UINT32_MAX, 0x2000); /* full */
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  magazine *fresh = NULL;
  assert_int_equal(heap_refill(h, cls, idb, b, &fresh), MAGPIE_OK);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.slab_count, st0.slab_count + 1);
  assert_int_equal(st1.stream_waits, st0.stream_waits);
  assert_ptr_not_equal(fresh, m);
  depot_put(&h->depots[fresh->cls], fresh);
  fake_stream_complete(a);
  /* Take the fake blocks back out; the slab's own magazines stay. */
  enum { MAX = 64 };
  magazine *keep[MAX];
  int nkeep = 0, fakes = 0;
  for (magazine *r; (r = depot_take(&h->depots[cls], idb)) != NULL;) {
    if (r->slots[0] == (void *)0x2000) {
      fakes++;
      r->count = 0;
      magazine_put_empty(r);
    } else {
      assert_true(nkeep < MAX);
      keep[nkeep++] = r;
    }
  }
  assert_int_equal(fakes, 1);
  for (int i = 0; i < nkeep; i++) depot_put(&h->depots[keep[i]->cls], keep[i]);
  epoch_stream_release(ra);
}

/* The calling thread's slot of stream s. */
static tslot *own_slot(cudaStream_t s) {
  for (int i = 0; i < TCACHE_SLOTS; i++)
    if (tcache_tls->slots[i].heap != NULL && tcache_tls->slots[i].handle == s) return &tcache_tls->slots[i];
  return NULL;
}

/* Magazine capacity per slot and class: it starts at mag_cap; a slot whose
 * blocks only flow out (frees, no allocations in between) grows it to
 * mag_max; a random walk brings it back. */
static void test_magazine_capacity_adapts(void **state) {
  (void)state;
  unsigned cls = sizeclass_of(30000); /* 32 KiB class, the largest with slabs */
  const sizeclass_info *ci = &globals.sizeclass_table[cls];
  assert_int_equal(ci->mag_cap, 6); /* cbrt(2^23 / 32 KiB) */
  assert_true(ci->mag_max > ci->mag_cap);
  cudaStream_t s = fake_stream_create(0);
  enum { N = 256 };
  void *p[N];
  for (int i = 0; i < N; i++) assert_non_null(p[i] = magpie_malloc_async(30000, s));
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_int_equal(ts->cap[cls], ci->mag_cap);
  for (int i = 0; i < N; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  /* Only frees since the last exchange: the flow grew the capacity. */
  assert_int_equal(ts->cap[cls], ci->mag_max);
  assert_int_equal(ts->cl[cls].loaded->cap, ci->mag_max);
  /* A random walk (many allocations between two exchanges) shrinks it. */
  int live = 0;
  uint64_t r = 12345;
  for (int step = 0; step < 20000; step++) {
    r ^= r << 13; /* xorshift: no wrapping arithmetic (UBSan checks it) */
    r ^= r >> 7;
    r ^= r << 17;
    if ((live < N && (r >> 33) % 2 == 0) || live == 0) {
      assert_non_null(p[live++] = magpie_malloc_async(30000, s));
    } else {
      assert_int_equal(magpie_free_async(p[--live], s), MAGPIE_OK);
    }
  }
  assert_true(ts->cap[cls] < ci->mag_max);
  assert_true(ts->cap[cls] >= ci->mag_cap);
  while (live > 0) assert_int_equal(magpie_free_async(p[--live], s), MAGPIE_OK);
  fake_stream_complete(s);
}

/* Blocks that come and go in bursts shorter than a run of outflow keep
 * the starting capacity, though each burst of frees fills magazines with
 * no allocation between (a rule that grew on that held a slab per thread
 * and class in workload 2). */
static void test_magazine_capacity_bursts(void **state) {
  (void)state;
  /* A class no other test here uses: its magazines all start at mag_cap
   * (a magazine keeps the capacity it was made with). */
  unsigned cls = sizeclass_of(45000); /* 48 KiB */
  const sizeclass_info *ci = &globals.sizeclass_table[cls];
  assert_int_equal(ci->mag_cap, 5);
  cudaStream_t s = fake_stream_create(0);
  enum { BURST = 4 * 5 }; /* four magazines of 5, under a run of 32 */
  void *p[BURST];
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  for (int round = 0; round < 50; round++) {
    for (int i = 0; i < BURST; i++) assert_non_null(p[i] = magpie_malloc_async(45000, s));
    for (int i = 0; i < BURST; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  }
  /* The bursts did overflow both magazines: full ones left them, into the
   * outbox (the allocations of the next burst took them back) or sealed. */
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_true(ts->nout > 0 || st1.events_recorded > st0.events_recorded);
  assert_int_equal(ts->cap[cls], ci->mag_cap);
  fake_stream_complete(s);
}

/* Full magazines leaving a thread wait in its outbox and are sealed
 * together: one event for TCACHE_OUTBOX of them (small blocks, far below
 * TCACHE_OUTBOX_BYTES). Until the freeing stream's work completes,
 * another stream gets none of their blocks. */
enum { OUTBOX_BLOCKS = 4000 };
static void test_outbox_seals_together(void **state) {
  (void)state;
  const size_t size = 700; /* 768 B: a class no other test here uses */
  cudaStream_t s = fake_stream_create(0), t = fake_stream_create(0);
  void **p = calloc(OUTBOX_BLOCKS, sizeof *p);
  assert_non_null(p);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  magpie_stats st0, st;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  int freed = 0;
  for (; freed < OUTBOX_BLOCKS; freed++) {
    assert_int_equal(magpie_free_async(p[freed], s), MAGPIE_OK);
    assert_int_equal(magpie_stats_get(0, &st), MAGPIE_OK);
    if (st.events_recorded != st0.events_recorded) break;
  }
  assert_true(freed < OUTBOX_BLOCKS);
  freed++;
  /* One seal, and it sent a whole outbox to the depot. */
  assert_int_equal(st.events_recorded, st0.events_recorded + 1);
  assert_int_equal(st.depot_exchanges, st0.depot_exchanges + TCACHE_OUTBOX);
  /* s is still running: t must not reuse what s freed. */
  for (int k = 0; k < 256; k++) {
    void *q = magpie_malloc_async(size, t);
    assert_non_null(q);
    for (int i = 0; i < freed; i++) assert_ptr_not_equal(q, p[i]);
    assert_int_equal(magpie_free_async(q, t), MAGPIE_OK);
  }
  for (int i = freed; i < OUTBOX_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
  free(p);
}

/* Before a slot takes memory from what threads share (here a refill of
 * another class), its outbox is sealed and goes to the depot, where its
 * slabs can serve others: one event for all of it. */
static void test_outbox_sealed_before_refill(void **state) {
  (void)state;
  const size_t a = 1400, b = 2900; /* classes no other test here uses */
  cudaStream_t s = fake_stream_create(0);
  void **p = calloc(OUTBOX_BLOCKS, sizeof *p);
  assert_non_null(p);
  for (int i = 0; i < OUTBOX_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(a, s));
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  int freed = 0;
  while (freed < OUTBOX_BLOCKS && ts->nout == 0) assert_int_equal(magpie_free_async(p[freed++], s), MAGPIE_OK);
  assert_int_equal(ts->nout, 1);
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *q = magpie_malloc_async(b, s);
  assert_non_null(q);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(ts->nout, 0);
  assert_int_equal(st1.events_recorded, st0.events_recorded + 1);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  for (int i = freed; i < OUTBOX_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  fake_stream_complete(s);
  free(p);
}

/* Bytes of class cls in the depot, ready and pending. */
static int64_t depot_class_bytes(heap *h, unsigned cls) {
  return atomic_load_relaxed(&h->depots[cls].ready_bytes) + atomic_load_relaxed(&h->depots[cls].pending_bytes);
}

enum { CLASS_BLOCKS = 6 };

/* The class-block tests' start: device 0's heap, CLASS_BLOCKS blocks of
 * size (a class above 32 KiB) allocated on a new stream into p, and what
 * the depot holds of their class before anything is freed. */
typedef struct class_case {
  heap *h;
  unsigned cls;
  cudaStream_t s;
  int64_t depot0;
} class_case;

static class_case class_case_start(size_t size, void **p) {
  class_case k = {.h = heap_get(0), .cls = sizeclass_of(size), .s = fake_stream_create(0)};
  assert_non_null(k.h);
  assert_true(globals.sizeclass_table[k.cls].seg);
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_non_null(p[i] = magpie_malloc_async(size, k.s));
  k.depot0 = depot_class_bytes(k.h, k.cls);
  return k;
}

/* Class blocks (classes above 32 KiB) that come and go in one thread's
 * slot: what leaves the slot is the thread's surplus and goes back to the
 * segments (heap_put), not to the depot, where each class kept its own
 * high-water mark. There they coalesce and serve a large block without
 * mapping more; another stream still waits for the freeing stream's work. */
static void test_class_surplus_back_to_segments(void **state) {
  (void)state;
  const size_t size = 600000; /* the 768 KiB class, which no other test here uses */
  void *p[CLASS_BLOCKS];
  class_case k = class_case_start(size, p);
  heap *h = k.h;
  unsigned cls = k.cls;
  cudaStream_t s = k.s, t = fake_stream_create(0);
  int64_t depot0 = k.depot0;
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_true((ts->round_trip >> cls) & 1);
  /* One block stays loaded, one may wait in the outbox; the rest left in
   * sealed outboxes of two (768 KiB each, TCACHE_OUTBOX_BYTES). */
  assert_int_equal(depot_class_bytes(h, cls), depot0);
  /* Another stream: none of them while s may still run. */
  for (int k = 0; k < CLASS_BLOCKS; k++) {
    void *q = magpie_malloc_async(size, t);
    assert_non_null(q);
    for (int i = 0; i < CLASS_BLOCKS; i++) assert_ptr_not_equal(q, p[i]);
    assert_int_equal(magpie_free_async(q, t), MAGPIE_OK);
  }
  /* s itself: a large block in their coalesced room, nothing mapped. */
  magpie_stats st0, st1;
  assert_int_equal(magpie_stats_get(0, &st0), MAGPIE_OK);
  void *big = magpie_malloc_async((size_t)1400 << 10, s);
  assert_non_null(big);
  assert_int_equal(magpie_stats_get(0, &st1), MAGPIE_OK);
  assert_int_equal(st1.reserved_bytes, st0.reserved_bytes);
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (int i = 0; i < CLASS_BLOCKS; i++) {
    if ((uintptr_t)p[i] < lo) lo = (uintptr_t)p[i];
    if ((uintptr_t)p[i] > hi) hi = (uintptr_t)p[i];
  }
  assert_true((uintptr_t)big >= lo && (uintptr_t)big <= hi);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s);
  fake_stream_complete(t);
}

/* Class blocks that only flow out of a slot (another thread allocated
 * them) go to the depot, where the allocating thread takes them back with
 * no lock. */
static void *free_all_thread(void *arg) {
  void **p = arg;
  cudaStream_t s = p[CLASS_BLOCKS];
  for (int i = 0; i < CLASS_BLOCKS; i++)
    if (magpie_free_async(p[i], s) != MAGPIE_OK) return NULL;
  return arg;
}

static void test_class_outflow_to_depot(void **state) {
  (void)state;
  const size_t size = 400000; /* the 512 KiB class, which no other test here uses */
  void *p[CLASS_BLOCKS + 1];
  class_case k = class_case_start(size, p);
  cudaStream_t s = k.s;
  p[CLASS_BLOCKS] = s;
  pthread_t th;
  void *ret = NULL;
  assert_int_equal(pthread_create(&th, NULL, free_all_thread, p), 0);
  assert_int_equal(pthread_join(th, &ret), 0);
  assert_ptr_equal(ret, p);
  /* Two sealed outboxes of two (512 KiB each) while it ran; what it still
   * held at its exit went to limbo, which the maintenance thread may have
   * drained into the depot since. */
  assert_true(depot_class_bytes(k.h, k.cls) >= k.depot0 + 4 * (int64_t)globals.sizeclass_table[k.cls].size);
  fake_stream_complete(s);
  for (int n = 0; n < 4; n++) {
    void *q = magpie_malloc_async(size, s);
    int found = 0;
    for (int i = 0; i < CLASS_BLOCKS; i++) found |= q == p[i];
    assert_true(found);
    assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  }
}

/* A large allocation first sends the slot's cached class blocks back to
 * their segments (with the outbox it seals anyway), where they coalesce
 * with the free space around them instead of keeping it apart; not to
 * the depot. */
static void test_large_allocation_sends_class_blocks_back(void **state) {
  (void)state;
  const size_t size = 90000; /* the 96 KiB class, which no other test here uses */
  heap *h = heap_get(0);
  unsigned cls = sizeclass_of(size);
  assert_true(globals.sizeclass_table[cls].seg);
  cudaStream_t s = fake_stream_create(0);
  void *p[2];
  for (int i = 0; i < 2; i++) assert_non_null(p[i] = magpie_malloc_async(size, s));
  for (int i = 0; i < 2; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  tslot *ts = own_slot(s);
  assert_non_null(ts);
  assert_true(ts->cl[cls].loaded->count + ts->prev[cls]->count > 0);
  int64_t depot0 = depot_class_bytes(h, cls);
  void *big = magpie_malloc_async((size_t)2 << 20, s);
  assert_non_null(big);
  assert_int_equal(ts->cl[cls].loaded->count + ts->prev[cls]->count, 0);
  assert_int_equal(depot_class_bytes(h, cls), depot0);
  /* The slot's next block of the class comes from the segments. */
  void *q = magpie_malloc_async(size, s);
  assert_non_null(q);
  assert_int_equal(magpie_free_async(q, s), MAGPIE_OK);
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s);
}

/* The round trip's give-back only tries the large cache's lock: while
 * another thread holds it, the surplus goes to the depot instead of
 * waiting, and the next HEAP_PUT_BACKOFF do without trying. */
static void test_class_surplus_to_depot_when_lock_busy(void **state) {
  (void)state;
  const size_t size = 300000; /* the 384 KiB class, which no other test here uses */
  void *p[CLASS_BLOCKS];
  class_case k = class_case_start(size, p);
  heap *h = k.h;
  cudaStream_t s = k.s;
  pthread_mutex_lock(&h->large.lock);
  for (int i = 0; i < CLASS_BLOCKS; i++) assert_int_equal(magpie_free_async(p[i], s), MAGPIE_OK);
  pthread_mutex_unlock(&h->large.lock);
  assert_true(depot_class_bytes(h, k.cls) > k.depot0);
  assert_true(atomic_load_relaxed(&h->put_backoff) > 0);
  atomic_store_relaxed(&h->put_backoff, 0); /* for the tests after this one */
  fake_stream_complete(s);
}

/* Threads that run dry of a class together share one slab: the first maps
 * it (slowly here) while the others wait for its magazines instead of
 * each mapping a slab of its own. On device 2, which no other test here
 * uses: slabs share granules, so on a device with spans already mapped a
 * carve may map nothing at all. */
enum { CARVE_THREADS = 8 };
static pthread_barrier_t carve_start;
static void *carve_thread(void *arg) {
  cudaStream_t s = arg;
  pthread_barrier_wait(&carve_start);
  void *p = magpie_malloc_async(12000, s); /* a class no other test uses */
  if (p != NULL && magpie_free_async(p, s) != MAGPIE_OK) p = NULL;
  return p;
}

static void test_concurrent_refills_share_a_carve(void **state) {
  (void)state;
  cudaStream_t s[CARVE_THREADS];
  pthread_t t[CARVE_THREADS];
  for (int i = 0; i < CARVE_THREADS; i++) s[i] = fake_stream_create(2);
  fake_counters before, after;
  fake_get_counters(&before);
  fake_set_map_delay_us(20000);
  pthread_barrier_init(&carve_start, NULL, CARVE_THREADS);
  for (int i = 0; i < CARVE_THREADS; i++) assert_int_equal(pthread_create(&t[i], NULL, carve_thread, s[i]), 0);
  for (int i = 0; i < CARVE_THREADS; i++) {
    void *p = NULL;
    assert_int_equal(pthread_join(t[i], &p), 0);
    assert_non_null(p);
  }
  pthread_barrier_destroy(&carve_start);
  fake_set_map_delay_us(0);
  fake_get_counters(&after);
  assert_int_equal(after.maps - before.maps, 1);
  for (int i = 0; i < CARVE_THREADS; i++) fake_stream_complete(s[i]);
}

/* Threads of different small classes that find every span full at once
 * share one new span: the first maps it (slowly here) while the others
 * wait and take its spare chunks, instead of each mapping a granule. */
enum { SPAN_THREADS = 4, SPAN_HOLD_MAX = 1024 };
typedef struct span_got {
  uintptr_t base;
  span *sp;
  int rc;
} span_got;
static pthread_barrier_t span_start;
static void *span_thread(void *arg) {
  span_got *g = arg;
  pthread_barrier_wait(&span_start);
  g->rc = span_chunk_get(&heap_get(0)->spans, 1, 1, &g->base, &g->sp);
  return NULL;
}

/* Take every free chunk of h's spans into held (so that the next
 * span_chunk_get needs a new span); returns how many. */
static int hold_free_chunks(heap *h, span_got *held) {
  pthread_mutex_lock(&h->spans.span_lock);
  int free_chunks = 0;
  for (span *sp = h->spans.list; sp; sp = sp->next) free_chunks += (int)sp->nchunks - __builtin_popcountll(sp->used);
  pthread_mutex_unlock(&h->spans.span_lock);
  assert_true(free_chunks <= SPAN_HOLD_MAX);
  for (int i = 0; i < free_chunks; i++)
    assert_int_equal(span_chunk_get(&h->spans, 1, 1, &held[i].base, &held[i].sp), MAGPIE_OK);
  return free_chunks;
}

static void test_concurrent_span_maps_share_a_span(void **state) {
  (void)state;
  heap *h = heap_get(0);
  assert_non_null(h);
  assert_true(h->region.gran / SPAN_CHUNK >= SPAN_THREADS);
  /* Fill every span there is, so that the threads below find none free. */
  static span_got held[SPAN_HOLD_MAX];
  fake_counters before, after;
  fake_get_counters(&before);
  int free_chunks = hold_free_chunks(h, held);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);

  span_got got[SPAN_THREADS];
  pthread_t t[SPAN_THREADS];
  fake_set_map_delay_us(20000);
  pthread_barrier_init(&span_start, NULL, SPAN_THREADS);
  for (int i = 0; i < SPAN_THREADS; i++) assert_int_equal(pthread_create(&t[i], NULL, span_thread, &got[i]), 0);
  for (int i = 0; i < SPAN_THREADS; i++) assert_int_equal(pthread_join(t[i], NULL), 0);
  pthread_barrier_destroy(&span_start);
  fake_set_map_delay_us(0);
  fake_get_counters(&after);
  assert_int_equal(after.maps - before.maps, 1);
  for (int i = 0; i < SPAN_THREADS; i++) {
    assert_int_equal(got[i].rc, MAGPIE_OK);
    assert_ptr_equal(got[i].sp, got[0].sp);
    for (int j = 0; j < i; j++) assert_true(got[j].base != got[i].base);
  }
  for (int i = 0; i < SPAN_THREADS; i++) span_chunk_put(&h->spans, got[i].sp, got[i].base, 1);
  for (int i = 0; i < free_chunks; i++) span_chunk_put(&h->spans, held[i].sp, held[i].base, 1);
}

/* A span the set needs takes a whole mapped granule of a free block of
 * the large segments, ready for every stream once its seal completed,
 * instead of mapping a granule; the granule goes back to the segments,
 * free and ready, when the span is empty. On device 1 (24 MiB), which no
 * other test here uses. */
static void test_span_takes_a_granule_lent_by_the_segments(void **state) {
  (void)state;
  cudaStream_t s = fake_stream_create(1);
  void *big = magpie_malloc_async((size_t)8 << 20, s);
  assert_non_null(big);
  heap *h = heap_get(1);
  assert_non_null(h);
  size_t g = h->region.gran;
  assert_int_equal(magpie_free_async(big, s), MAGPIE_OK);
  fake_stream_complete(s); /* the free's seal completed; no query asked yet */
  /* Every chunk of the spans there are (if any) is taken, so that a new
   * span is needed. */
  static span_got held[SPAN_HOLD_MAX];
  int free_chunks = hold_free_chunks(h, held);
  fake_counters before, after;
  fake_get_counters(&before);
  size_t reserved = atomic_load(&h->region.mapped);
  int64_t overhead = atomic_load(&h->region.overhead);
  uintptr_t base = 0;
  span *sp = NULL;
  /* may_map 0: a lent granule maps nothing, so the ladder's first pass may take it. */
  assert_int_equal(span_chunk_get(&h->spans, 1, 0, &base, &sp), MAGPIE_OK);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);
  assert_int_equal(atomic_load(&h->region.mapped), reserved);
  assert_true(sp->lent);
  assert_true(base >= (uintptr_t)big && base + g <= (uintptr_t)big + ((size_t)8 << 20));
  assert_int_equal(base % g, 0);
  assert_int_equal(atomic_load(&h->large.lent_bytes), g);
  assert_int_equal(atomic_load(&h->region.overhead), overhead + (int64_t)(g - SPAN_CHUNK));
  assert_null(pagemap_lookup(base)); /* no slab claimed its page yet */
  magpie_stats st;
  assert_int_equal(magpie_stats_get(1, &st), MAGPIE_OK);
  assert_int_equal(st.large_in_use_bytes, 0);
  /* Empty again: the granule is the segments' free memory. */
  span_chunk_put(&h->spans, sp, base, 1);
  assert_int_equal(atomic_load(&h->large.lent_bytes), 0);
  assert_int_equal(atomic_load(&h->region.overhead), overhead);
  slab *d = pagemap_lookup(base);
  assert_non_null(d);
  assert_int_equal(d->cls, SLAB_LARGE);
  for (int i = 0; i < free_chunks; i++) span_chunk_put(&h->spans, held[i].sp, held[i].base, 1);
  /* The whole 8 MiB serves one stream again, with no new mapping. */
  fake_get_counters(&before);
  void *again = magpie_malloc_async((size_t)8 << 20, s);
  assert_ptr_equal(again, big);
  fake_get_counters(&after);
  assert_int_equal(after.maps, before.maps);
  assert_int_equal(magpie_free_async(again, s), MAGPIE_OK);
  fake_stream_complete(s);
}

/* A map that fails (the device is full) counts in the region's mapped
 * bytes while it is in flight, so that concurrent maps cannot pass the
 * limit together; it must not raise the peak of reserved memory that
 * another thread's successful map sets meanwhile, nor count in the
 * reserved bytes the statistics report. On device 1 (24 MiB), a region of
 * its own. */
typedef struct failing_map {
  region *r;
  int rc;
} failing_map;
static void *failing_map_thread(void *arg) {
  failing_map *f = arg;
  uintptr_t a, raw;
  size_t raw_size;
  f->rc = region_map(f->r, (size_t)32 << 20, &a, &raw, &raw_size); /* more than the device */
  return NULL;
}

typedef struct unmapping {
  region *r;
  uintptr_t a;
  size_t size;
  uintptr_t raw;
  size_t raw_size;
} unmapping;
static void *unmap_thread(void *arg) {
  unmapping *u = arg;
  region_unmap(u->r, u->a, u->size, u->raw, u->raw_size);
  return NULL;
}

static void test_failed_map_never_raises_the_peak(void **state) {
  (void)state;
  static region r;
  assert_int_equal(region_init(&r, 1, fake_backend(), (size_t)1 << 30, 0), MAGPIE_OK);
  size_t g = r.gran;
  failing_map f = {&r, MAGPIE_OK};
  pthread_t t;
  fake_set_map_delay_us(200000);
  assert_int_equal(pthread_create(&t, NULL, failing_map_thread, &f), 0);
  while (atomic_load(&r.mapped) < ((size_t)32 << 20)) usleep(100); /* committed, inside the slow map */
  fake_set_map_delay_us(0);
  uintptr_t a, raw;
  size_t raw_size;
  assert_int_equal(region_map(&r, g, &a, &raw, &raw_size), MAGPIE_OK);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(f.rc, MAGPIE_ERR_OUT_OF_MEMORY);
  assert_int_equal(atomic_load(&r.mapped), g);
  assert_int_equal(atomic_load(&r.held), g);
  assert_int_equal(atomic_load(&r.peak_held), g);
  /* An unmap stops counting before the driver is asked: the room it makes
   * may be mapped by another thread before it returns. */
  unmapping u = {&r, a, g, raw, raw_size};
  fake_gate_unmap(1);
  assert_int_equal(pthread_create(&t, NULL, unmap_thread, &u), 0);
  while (fake_unmaps_held() == 0) usleep(100);
  assert_int_equal(atomic_load(&r.held), 0);
  assert_int_equal(atomic_load(&r.mapped), g); /* still counted against a limit */
  fake_gate_unmap(0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(atomic_load(&r.mapped), 0);
  assert_int_equal(atomic_load(&r.held), 0);
  assert_int_equal(atomic_load(&r.peak_held), g);
}

int main(void) {
  fake_set_devices(3);
  fake_set_capacity(1, (size_t)24 << 20);
  if (fake_magpie_init(0) != MAGPIE_OK) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sizeclass),
      cmocka_unit_test(test_sizeclass_magic_division),
      cmocka_unit_test(test_stack_lifo_and_threads),
      cmocka_unit_test(test_pagemap),
      cmocka_unit_test(test_epoch_ordering),
      cmocka_unit_test(test_magazine_and_depot),
      cmocka_unit_test(test_depot_finds_old_ready_magazine),
      cmocka_unit_test(test_depot_reuse_through_stream_wait),
      cmocka_unit_test(test_magazine_capacity_adapts),
      cmocka_unit_test(test_magazine_capacity_bursts),
      cmocka_unit_test(test_outbox_seals_together),
      cmocka_unit_test(test_outbox_sealed_before_refill),
      cmocka_unit_test(test_class_surplus_back_to_segments),
      cmocka_unit_test(test_large_allocation_sends_class_blocks_back),
      cmocka_unit_test(test_class_outflow_to_depot),
      cmocka_unit_test(test_class_surplus_to_depot_when_lock_busy),
      cmocka_unit_test(test_concurrent_refills_share_a_carve),
      cmocka_unit_test(test_concurrent_span_maps_share_a_span),
      cmocka_unit_test(test_span_takes_a_granule_lent_by_the_segments),
      cmocka_unit_test(test_failed_map_never_raises_the_peak),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
