/* record_stream: blocks used on more streams than the one they are freed on
 * (magpie_record_stream, like PyTorch's Tensor.record_stream), and blocks
 * shared with other processes, which park the same way ("exports" below).
 *
 * magpie_record_stream(p, S) remembers S for the block at p. When p is
 * freed on stream F, one event is sealed on F and one on every recorded
 * stream (epoch tickets), and the block is parked in its heap's deferred
 * list instead of a magazine: nobody, F included, gets it back until every
 * ticket has completed. The deferred list is polled (event queries, never a
 * wait) from the heap's refill slow paths, and ready blocks go back to the
 * normal pools: small blocks in magazines to the depot's full stack, large
 * blocks to the large cache with no ticket. No stream is made to wait and
 * nothing synchronises the host.
 *
 * The free fast path sees recorded blocks through slab.recorded (a count of
 * entries for the slab's blocks) and leaves them to the slow path, which
 * calls record_free.
 *
 * A recorded stream destroyed before the free cannot be sealed: its handle
 * no longer names it (the handle may even name a newer stream by then,
 * which a seal would wrongly vouch for). magpie_stream_retire, called
 * before the destroy, seals it while the handle is valid (record_retire).
 * Without it, record_free checks each recorded handle's id against the
 * record's (on a GPU that query crashes the process if no stream has the
 * handle value any more; the simulated device answers it); a stream that
 * is gone, or whose seal fails, is covered instead by a device
 * synchronisation: the block waits on the table's sync list until the
 * heap's maintenance thread has synchronised the device (record_sync_take
 * / record_sync_done; the hook given to record_table_init wakes it), then
 * joins the parked blocks and waits for its other tickets as they do. Such a free succeeds, and the
 * block is reused by nobody before the destroyed stream's work completed.
 *
 * Lock order: record_table.lock is a leaf. No driver call is made while it
 * is held (seals and event queries happen outside). */
#ifndef MAGPIE_RECORD_H
#define MAGPIE_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include <pthread.h>

#include "device/backend.h"
#include "pool/depot.h"
#include "pool/epoch.h"
#include "pool/large.h"
#include "pool/slab.h"

#define RECORD_BUCKETS 256

struct record_entry;

/* One device's recorded blocks. */
typedef struct record_table {
  pthread_mutex_t lock;
  struct record_entry *buckets[RECORD_BUCKETS]; /* under lock */
  struct record_entry *parked;                  /* under lock */
  struct record_entry *sync;                    /* parked, waiting for a device synchronisation; under lock */
  /* Entries on sync: written under lock; read relaxed by the heap's
   * maintenance thread and ladder to decide whether to synchronise. */
  _Atomic size_t sync_count;
  _Atomic uint64_t sync_total; /* blocks ever sent to sync (relaxed; tests and diagnostics) */
  void (*sync_hook)(void *);   /* asks for a device synchronisation; set once */
  void *sync_arg;
  /* Written under lock; read relaxed by record_poll's early exit (a stale
   * zero only delays the hand-back to a later slow path) and by
   * statistics. */
  _Atomic size_t parked_count;
  _Atomic size_t parked_bytes;
  _Atomic size_t parked_large_bytes; /* part of parked_bytes */
} record_table;

/* sync_hook(sync_arg) is called (no lock held) when a block joins the
 * sync list: it must arrange for record_sync_take, a device
 * synchronisation and record_sync_done, soon and off the caller's path. */
void record_table_init(record_table *t, void (*sync_hook)(void *), void *sync_arg);

/* Remember that the block at p (start of a handed-out block of sl, of size
 * class cls or SLAB_LARGE, bytes long) is used on stream `handle`
 * (stream_rec of the block's heap). Takes
 * its own reference to rec. MAGPIE_ERR_INVALID_POINTER if the block is
 * parked (freed). */
int record_add(record_table *t, slab *sl, unsigned cls, uintptr_t p, size_t bytes, stream_rec *rec,
               cudaStream_t handle);

/* Free of a block of sl whose slab has recorded blocks (slab.recorded != 0).
 * If p has recorded streams, seals the freeing stream (frec, handle, id
 * matched by the caller; frec NULL: handle is capturing a graph, and a
 * synchronisation of every device covers it instead) and every recorded
 * stream that is not capturing (one that is, or is gone, is covered by a
 * synchronisation of the block's device), parks the block and
 * sets *parked to its size; the caller then only adjusts its live bytes.
 * *parked = 0: not recorded, free normally. A parked small block leaves
 * the freeing thread's cached bytes through d (its class's depot; NULL for
 * a large block). owner (the freeing thread's cache, or NULL) and the
 * freeing stream are kept for record_claim. A nonzero return is an error
 * already reported with error_set; the block then stays allocated. */
int record_free(record_table *t, depot *d, slab *sl, uintptr_t p, stream_rec *frec, cudaStream_t handle,
                const void *owner, size_t *parked);

/* Return parked blocks whose tickets have all completed to the normal
 * pools (small ones to depots[class], large ones to lc). Never blocks; at
 * most one event query per pending ticket. Called from the heap's refill
 * slow paths; a relaxed check when nothing is parked. */
void record_poll(record_table *t, depot *depots, large_cache *lc);
/* Pressure: wait (blocking on events, off every fast path) until every
 * parked block's streams completed, then hand them all back as
 * record_poll does. Returns bytes handed back. */
size_t record_wait(record_table *t, depot *depots, large_cache *lc);

/* Up to max parked blocks of class cls freed on stream stream_id whose
 * tickets all completed, into out (their addresses), for the allocating
 * thread's magazine of that stream: they leave the table and enter the
 * thread's cached bytes through d (cls's depot). *mine: owner's blocks
 * still parked or waiting for a synchronisation afterwards, counted under
 * the lock (those another thread is polling at that moment are missed).
 * Takes the table's lock (waiting if held), never waits for an event; one
 * event query per candidate's ticket. Returns how many. */
unsigned record_claim(record_table *t, depot *d, const void *owner, uint64_t stream_id, unsigned cls, void **out,
                      unsigned max, unsigned *mine);

/* The stream rec (handle, still valid) is about to be destroyed
 * (magpie_stream_retire): one event is recorded on it now, and every
 * block recorded on it and not yet freed keeps that event's ticket in
 * place of the handle, so its free never names the handle. Nonzero: the
 * seal failed (backend error, reported by the caller); nothing changed. */
int record_retire(record_table *t, stream_rec *rec, cudaStream_t handle);

/* The device synchronisation that covers destroyed recorded streams.
 * record_sync_wanted: blocks waiting for one (relaxed). record_sync_take:
 * takes them all, before the synchronisation starts (so that every one was
 * freed, and its streams' work enqueued, before it). record_sync_done:
 * with ok, the synchronisation completed and they join the parked blocks
 * (their live streams' tickets still count); without, they go back to the
 * sync list for the next one. */
size_t record_sync_wanted(const record_table *t);
/* The devices besides the table's own that the entries of chain (from
 * record_sync_take) wait for. */
uint64_t record_sync_devs(const struct record_entry *chain);
struct record_entry *record_sync_take(record_table *t);
void record_sync_done(record_table *t, struct record_entry *chain, int ok);

/* Calls fn for every block freed and waiting for its recorded streams (the
 * parked and sync lists; blocks a poller has taken off them for the moment
 * are not seen), under t's lock: fn must take no magpie lock. stream: one
 * stream the block waits for (0 when it waits for a device
 * synchronisation only). For snapshots. */
typedef void (*record_parked_fn)(void *ctx, uintptr_t p, struct slab *sl, uint64_t stream);
void record_parked_each(record_table *t, record_parked_fn fn, void *ctx);

/* ---- exports: blocks shared with other processes (front/ipc.c) ----
 * An exported block has an entry (so its free takes the slow path and
 * parks it) carrying the export's id and secret. Each import made in
 * another process is a hold, and so is each MAGPIE_IPC_HOLD export until
 * an import takes it over (pending); a parked block goes back to the pools
 * only once its tickets completed and it has no hold. An import of a block
 * already freed is refused unless a pending hold is left for it. */
#define RECORD_SECRET_LEN 16
enum {
  RECORD_IMPORT_OK = 0,
  RECORD_IMPORT_UNKNOWN = 1, /* no such export: wrong secret, or the block went back and was reused */
  RECORD_IMPORT_FREED = 2,   /* freed by the exporter before this import */
  RECORD_IMPORT_REVOKED = 3, /* revoked by the exporter */
};
/* Marks the live block p (as record_add's arguments) exported, with
 * new_id/new_secret unless it already carries an export (not revoked), and
 * gives the export's id and secret; hold: one pending hold more.
 * MAGPIE_ERR_INVALID_POINTER if the block is parked (freed). */
int record_export(record_table *t, slab *sl, unsigned cls, uintptr_t p, size_t bytes, int hold, uint64_t new_id,
                  const unsigned char new_secret[RECORD_SECRET_LEN], uint64_t *id,
                  unsigned char secret[RECORD_SECRET_LEN]);
/* An import of export (p, id, secret) begins: a RECORD_IMPORT_* answer;
 * with OK the import holds the block (*bytes: its size) until
 * record_import_release. */
int record_import_hold(record_table *t, uintptr_t p, uint64_t id, const unsigned char secret[RECORD_SECRET_LEN],
                       size_t *bytes);
void record_import_release(record_table *t, uintptr_t p, uint64_t id);
/* Drops the export's pending holds and refuses its later imports.
 * MAGPIE_ERR_INVALID_ARGUMENT if p carries no such export. */
int record_revoke(record_table *t, uintptr_t p, uint64_t id, const unsigned char secret[RECORD_SECRET_LEN]);

/* Bytes parked (freed, waiting for recorded streams) in t. */
size_t record_pending_bytes(const record_table *t);
/* The same split: small blocks (out of the threads' magazines) and large
 * blocks (still counted in use by the large cache). For statistics. */
void record_pending(const record_table *t, size_t *small, size_t *large);

#endif /* MAGPIE_RECORD_H */
