/* What heap.c and heap_limbo.c share: the layer's state and the calls
 * between them. Not the layer's interface (heap.h); included by those two
 * files only. */
#ifndef MAGPIE_HEAP_INTERNAL_H
#define MAGPIE_HEAP_INTERNAL_H

#include <pthread.h>

#include "device/backend.h"
#include "magpie.h"

struct heap;

/* This layer's process-wide state (defined in heap.c, shared with
 * heap_limbo.c). */
typedef struct heap_state {
  /* Set once by heap_module_init during set-up. */
  const backend_ops *ops;
  magpie_config cfg;
  size_t (*threads_reclaim)(struct heap *h);
  /* Heaps by device: written once (release) under create_lock after the
   * heap is fully built; read with acquire. */
  pthread_mutex_t create_lock;
  _Atomic(struct heap *) heaps[MAGPIE_MAX_DEVICES];
  /* The maintenance thread, all under reaper_lock (a leaf): started, work
   * asked, timed (some heap has a release threshold), stop (process exit:
   * keep off the driver), busy (a round of driver calls under way; the
   * exit handler waits on reaper_idle_cv while it is set). */
  pthread_mutex_t reaper_lock;
  pthread_cond_t reaper_cv;
  pthread_cond_t reaper_idle_cv;
  int reaper_started;
  int reaper_work;
  int reaper_timed;
  int reaper_stop;
  int reaper_busy;
  /* Captures under way that magpie was told of (heap_capture_hold: seq_cst
   * RMW, then it reads each heap's reaping count); heap_reap raises its
   * reaping count, then reads this (seq_cst both: one of the two sees the
   * other) and makes no device synchronisation while it is nonzero. */
  _Atomic int captures;
} heap_state;

extern heap_state heap_st;

void heap_events_low(void);
void heap_reap_wait(struct heap *h);
void heap_records_sync(void *arg);
void heap_wake_maintenance(void);

#endif /* MAGPIE_HEAP_INTERNAL_H */
