/* Every process-wide variable of the library, in one object.
 *
 * Each field belongs to the module named beside it: only that module reads
 * or writes it (others go through its functions), and the comment says who
 * writes it, who reads it and what orders them. Fields of a layer above
 * base are declared with base's types and forward-declared pointers, so
 * that this header sits at the bottom and every layer can name its part.
 *
 * Not here, and why:
 *   - per-thread variables (error.c's last error, device/detail.c's error
 *     detail, tcache/tcache.c's tcache_tls, backend_cuda.c's cache of special
 *     stream ids): a thread's own, not the process's, and one object cannot
 *     be partly thread-local;
 *   - constants (the device tables, magazine_sentinel, name tables);
 *   - the device interface's one pointer (device/detail.c): that file is
 *     also linked into the simulator's library, which has no globals;
 *   - the CUDA driver loader's table (src/device/cuda_loader.c): a library
 *     of its own, shared with the tools, tests and benchmarks;
 *   - the simulated device's state (sim/): a library of its own.
 *
 * Lock order over the locks here and in the per-device structs:
 * src/README.md ("Lock order"); each file repeats its part. */
#ifndef MAGPIE_GLOBALS_H
#define MAGPIE_GLOBALS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/types.h"
#include "magpie.h"

struct backend_ops;
struct backend_observer;
struct heap;
struct slab;
struct capture_reg;
struct CUctx_st;

/* Operations backend_timed.c times (its enum's TIMED_COUNT). */
#define GLOBALS_TIMED_OPS 21

/* A stack of empty magazines on a line of its own (pool/magazine.c). */
typedef struct globals_mag_stack {
  _Alignas(64) stack s;
} globals_mag_stack;

typedef struct global_vars {
  /* ---- base ---- */
  /* meta.c: written once under meta_once; read after pthread_once (which
   * orders it). */
  pthread_once_t meta_once;
  int meta_arena_index;
  int meta_flags;
  /* sizeclass.c: filled once by sizeclass_init during set-up, before the
   * set-up is published (release); read-only afterwards. */
  sizeclass_info sizeclass_table[SIZECLASS_COUNT];
  /* pagemap.c: the radix root. Leaves are installed with a CAS (acq_rel)
   * and never freed; lookups load them with acquire. */
  _Atomic(pagemap_entry *) pagemap_top[1u << PAGEMAP_TOP_BITS];

  /* ---- device ---- */
  /* backend_cuda.c: cuda_state written by init under cuda_lock (release
   * store, after the fields below are set); read by every operation
   * (acquire load in cuda_ready, pairing with that store). */
  pthread_mutex_t cuda_lock;
  _Atomic int cuda_state;
  /* Set once by init before cuda_state is published; read-only afterwards. */
  int cuda_ndevices;
  int cuda_devices[MAGPIE_MAX_DEVICES];
  int cuda_vmm_off; /* MAGPIE_CUDA_VMM=0: report no VMM support */
  /* init's outcome, replayed by later calls; under cuda_lock. */
  int cuda_init_code;
  char cuda_init_detail[256];
  /* Each device's retained primary context, NULL until first used. Written
   * once by cuda_device_ctx under cuda_lock (release store after the
   * retain); read by any thread needing the context (acquire load). */
  _Atomic(struct CUctx_st *) cuda_ctx[MAGPIE_MAX_DEVICES];
  /* backend_timed.c: set once by backend_timed before the table is used;
   * counters relaxed (statistics only). */
  const struct backend_ops *timed_inner;
  uint64_t timed_threshold_ns;
  _Atomic size_t timed_max_ns[GLOBALS_TIMED_OPS];
  _Atomic size_t timed_calls[GLOBALS_TIMED_OPS];
  _Atomic size_t timed_total_ns[GLOBALS_TIMED_OPS];

  /* ---- pool ---- */
  /* epoch.c: the event nodes (type-stable; grown under its grow lock); the
   * hook that asks for a refill, set once at set-up. */
  registry event_registry;
  void (*epoch_low_hook)(void);
  /* magazine.c: the magazines (type-stable), and the stacks of empty ones
   * (lock-free: release on push, acquire on pop). */
  registry magazine_registry;
  globals_mag_stack magazine_empties[SIZECLASS_COUNT];
  globals_mag_stack magazine_spill;
  /* slab.c: recycled descriptors, under slab_desc_lock (a leaf). */
  pthread_mutex_t slab_desc_lock;
  struct slab *slab_desc_free;

  /* ---- heap ---- */
  /* heap.c: set once by heap_module_init during set-up. */
  const struct backend_ops *heap_ops;
  magpie_config heap_cfg;
  size_t (*heap_threads_reclaim)(struct heap *h);
  /* Heaps by device: written once (release) under heap_create_lock after
   * the heap is fully built; read with acquire. */
  pthread_mutex_t heap_create_lock;
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
  _Atomic int heap_captures;

  /* ---- front ---- */
  /* init.c: global_state_v is read (acquire) on every slow path and
   * written (release) once set-up is complete, under init_lock; the fields
   * after it are written under init_lock before that release. */
  _Atomic int global_state_v;
  pthread_mutex_t init_lock;
  magpie_config global_cfg;
  const struct backend_ops *global_backend;
  int global_err;
  char global_msg[512];
  /* Set once, in a child of fork() (init.c's child handler, the child's
   * only thread); magpie stays unusable there. init_atfork: the handlers
   * are registered (under init_lock). */
  int forked;
  int init_atfork;
  /* The fast paths' one switch (front/alloc.c reads it relaxed: it only
   * decides whether the slow paths are taken): while nonzero, every
   * allocation and free takes its slow path. Bit SLOW_OBSERVE (observe.c
   * attaches the word; device/observer.c sets and clears the bit, RMW)
   * follows the device's observer; bit SLOW_CAPTURE (capture.c, RMW under
   * capture_lock) is set while a capture magpie was told of is under way.
   * observe_hooks is published (release) before the observer's bit can
   * turn on. */
  _Atomic int slow_paths;
  /* capture.c: the captures announced (magpie_capture_begin) and their
   * count, under capture_lock (a leaf: held across stream capture queries,
   * never across a wait or another lock); graph pool ids, fetch_add
   * (relaxed: only uniqueness matters). */
  pthread_mutex_t capture_lock;
  struct capture_reg *capture_regs;
  uint32_t capture_count;
  _Atomic uint64_t capture_next_pool;
  _Atomic(struct backend_observer *) observe_hooks;
} global_vars;

extern global_vars globals;

#endif /* MAGPIE_GLOBALS_H */
