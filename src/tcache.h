/* Thread caches: per thread, per stream, per size class, a loaded and a
 * previous magazine (Bonwick). The fast paths below touch only memory the
 * calling thread owns: no atomic read-modify-write, no lock, no driver call
 * beyond the backend's stream identity.
 *
 * Stream slots. A slot is (stream id, heap): the magazines of blocks of that
 * heap which that stream may reuse at once. Allocation identifies the stream
 * by id (unique for the process) on every call, so a recycled handle value
 * never reaches an old stream's magazines. Free matches the handle only:
 * a block freed into a slot whose handle was recycled is still caught,
 * because every allocation checks the id first (a mismatch sends the slot's
 * magazines to limbo, which waits for the whole device) and seals use the
 * handle of a free whose id matched. Special handles (0, 1, 2) name different streams on different
 * devices, so their frees always check the id.
 *
 * INVARIANT: every block in slot.loaded/prev may be used by work enqueued on
 *            the slot's stream after now.
 * INVARIANT: tc->last is tc->dummy (whose magazines are the sentinel) or a
 *            slot whose heap is its stream's own device (alloc-capable). */
#ifndef MAGPIE_TCACHE_H
#define MAGPIE_TCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "atomic.h"
#include "backend.h"
#include "heap.h"
#include "magazine.h"
#include "pagemap.h"
#include "sizeclass.h"
#include "slab.h"

#define TCACHE_SLOTS 32

typedef struct tslot {
  uint64_t id;          /* stream id; meaningful while heap != NULL */
  cudaStream_t handle;  /* handle the slot was created with */
  heap *heap;           /* heap of the cached blocks; NULL = unused slot */
  stream_rec *rec;      /* the stream's record (one reference held) */
  _Atomic int64_t *live; /* this thread's in-use counter for heap's device */
  int alloc_ok;         /* heap is the stream's own device */
  magazine *loaded[SIZECLASS_COUNT];
  magazine *prev[SIZECLASS_COUNT];
} tslot;

typedef struct tcache {
  tslot *last; /* the fast paths' slot */
  const backend_ops *ops;
  int check;
  unsigned next_evict;
  /* Bytes handed out minus freed by this thread, per device. Written by the
   * owner only (relaxed load + store); read (relaxed) by statistics under
   * tcache_list_lock. */
  _Atomic int64_t live[HEAP_MAX_DEVICES];
  int64_t published[HEAP_MAX_DEVICES]; /* owner only */
  struct tcache *lnext, *lprev;        /* under tcache_list_lock */
  tslot dummy;
  tslot slots[TCACHE_SLOTS];
} tcache;

extern __thread tcache *tcache_tls __attribute__((tls_model("initial-exec")));

void *tcache_alloc_slow(size_t size, cudaStream_t stream);
int tcache_free_slow(void *ptr, cudaStream_t stream);

static inline int tcache_special_handle(cudaStream_t s) { return (uintptr_t)s <= 2; }

static inline void *tcache_alloc(size_t size, cudaStream_t stream) {
  tcache *tc = tcache_tls;
  /* Size 0 goes to the slow path (a unique minimum block). */
  if (likely(tc != NULL && size != 0 && size <= SIZECLASS_MAX_SIZE)) {
    tslot *ts = tc->last;
    uint64_t id;
    if (likely(tc->ops->stream_id(stream, &id) == MAGPIE_OK && id == ts->id)) {
      unsigned c = sizeclass_of(size);
      magazine *m = ts->loaded[c];
      if (likely(m->count != 0)) {
        atomic_owner_add_i64(ts->live, (int64_t)sizeclass_table[c].size);
        return m->slots[--m->count];
      }
    }
  }
  return tcache_alloc_slow(size, stream);
}

static inline int tcache_free(void *ptr, cudaStream_t stream) {
  tcache *tc = tcache_tls;
  slab *sl = pagemap_lookup((uintptr_t)ptr);
  if (likely(tc != NULL && sl != NULL)) {
    tslot *ts = tc->last;
    uint32_t c = sl->cls;
    uintptr_t off = (uintptr_t)ptr - sl->base;
    uint64_t i = ((uint64_t)off * sl->magic) >> SIZECLASS_MAGIC_SHIFT;
    /* record_stream: slabs with recorded blocks take the slow path
     * (sl->recorded, record.h). */
    if (likely(ts->handle == stream && ts->heap == sl->heap && !tcache_special_handle(stream) &&
               c < SIZECLASS_COUNT && i * sl->bsize == off && i < sl->nblocks &&
               atomic_load_relaxed(&sl->recorded) == 0)) {
      magazine *m = ts->loaded[c];
      if (likely(m->count < m->cap)) {
        m->slots[m->count++] = ptr;
        atomic_owner_add_i64(ts->live, -(int64_t)sl->bsize);
        return MAGPIE_OK;
      }
    }
  }
  return tcache_free_slow(ptr, stream);
}

/* Statistics: this device's live bytes over all threads, past and present. */
int64_t tcache_live_bytes(int device);

#endif /* MAGPIE_TCACHE_H */
