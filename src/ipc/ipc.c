/* Sharing blocks with other processes: magpie_ipc_export, _revoke,
 * _import and _close, and the compact handle's _export_compact,
 * _is_compact and _import_compact (magpie.h; the protocol and the handles'
 * layouts are ipc.h, the exporting side's server ipc_server.c, the holds
 * pool/record.c).
 *
 * Lock order: ipc_st.lock, a leaf (the import list only); the record
 * table's lock (a leaf) is taken with no lock held; no lock is held across
 * a driver or socket call. */
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/error.h"
#include "base/meta.h"
#include "front/block.h"
#include "front/global.h"
#include "heap/heap.h"
#include "ipc/ipc.h"
#include "pool/epoch.h"

/* An import of this process. INVARIANT: on ipc_st.imports (under
 * ipc_lock) from a successful import until its close begins; [base,
 * base+span) is reserved and mapped on device, and sock holds the
 * exporter's hold on the block. */
typedef struct ipc_import {
  uintptr_t ptr; /* what magpie_ipc_import returned */
  uintptr_t base;
  size_t span;
  int device;
  int sock;
  struct ipc_import *next;
} ipc_import;

/* ---- exporting ---- */

/* The export of the block at ptr (fn names the caller in messages), as
 * the long handle's fields: both forms encode the same export. */
static int ipc_export(void *ptr, unsigned flags, const char *fn, ipc_wire_handle *w) {
  if (flags & ~MAGPIE_IPC_HOLD)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: unknown flags %#x (only MAGPIE_IPC_HOLD)", fn, flags);
  slab *sl = NULL;
  size_t bytes = 0;
  int graph = 0;
  int rc = block_resolve(fn, ptr, &sl, &bytes, &graph);
  if (rc != MAGPIE_OK) return rc;
  if (graph)
    return error_set(MAGPIE_ERR_IPC,
                     "%s(%p): a graph pool's block cannot be shared with another process (its pool, not the "
                     "application, decides when it is reused)",
                     fn, ptr);
  heap *h = sl->heap;
  if (!h->region.vmm || !(h->region.map_flags & BACKEND_MAP_EXPORTABLE))
    return error_set(MAGPIE_ERR_IPC, "%s(%p): device %d's memory is not exportable: %s", fn, ptr, h->device,
                     !h->region.vmm               ? "the device has no virtual memory management"
                     : h->ops->export_fds == NULL ? "the device cannot share memory with other processes"
                                                  : "magpie runs with ipc=0 (MAGPIE_CONF); leave it at 1");
  unsigned char uuid[16];
  if (h->ops->device_uuid(h->device, uuid) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_IPC, "%s(%p): %s", fn, ptr, backend_error_detail());
  uint64_t nonce = 0;
  rc = ipc_server_ensure(&nonce);
  if (rc != MAGPIE_OK) return rc;
  unsigned char secret[RECORD_SECRET_LEN], fresh[RECORD_SECRET_LEN];
  if (getrandom(fresh, sizeof fresh, 0) != (ssize_t)sizeof fresh)
    return error_set(MAGPIE_ERR_IPC, "%s(%p): no random bytes for the handle's secret (%s)", fn, ptr, strerror(errno));
  uint64_t id = 0, new_id = atomic_add_relaxed(&ipc_st.next_id, 1) + 1;
  rc = record_export(&h->records, sl, large_block_class(sl, (uintptr_t)ptr), (uintptr_t)ptr, bytes,
                     (flags & MAGPIE_IPC_HOLD) != 0, new_id, fresh, &id, secret);
  if (rc == MAGPIE_ERR_INVALID_POINTER) return error_set(rc, "%s(%p): the block is free", fn, ptr);
  if (rc != MAGPIE_OK) return error_set(rc, "%s(%p): out of host memory", fn, ptr);
  memset(w, 0, sizeof *w);
  w->magic = IPC_MAGIC;
  w->version = IPC_VERSION;
  w->pid = (uint32_t)getpid();
  w->device = h->device;
  w->nonce = nonce;
  memcpy(w->uuid, uuid, sizeof uuid);
  w->export_id = id;
  memcpy(w->secret, secret, sizeof secret);
  w->ptr = (uintptr_t)ptr;
  w->size = bytes;
  return MAGPIE_OK;
}

MAGPIE_API int magpie_ipc_export(void *ptr, unsigned flags, magpie_ipc_handle *out) {
  if (out == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_export: NULL handle");
  ipc_wire_handle w;
  int rc = ipc_export(ptr, flags, "magpie_ipc_export", &w);
  if (rc != MAGPIE_OK) return rc;
  memset(out, 0, sizeof *out);
  memcpy(out->bytes, &w, sizeof w);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_ipc_export_compact(void *ptr, unsigned flags, magpie_ipc_compact *out) {
  if (out == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_export_compact: NULL handle");
  ipc_wire_handle w;
  int rc = ipc_export(ptr, flags, "magpie_ipc_export_compact", &w);
  if (rc != MAGPIE_OK) return rc;
  ipc_compact_wire c;
  memset(&c, 0, sizeof c);
  memcpy(c.tag, IPC_COMPACT_TAG, IPC_COMPACT_TAG_LEN);
  c.version = IPC_VERSION;
  c.pid = w.pid;
  c.nonce = w.nonce;
  c.export_id = w.export_id;
  c.ptr = w.ptr;
  memcpy(c.secret, w.secret, sizeof c.secret);
  c.device = w.device;
  c.check = ipc_compact_check(&c);
  memcpy(out->bytes, &c, sizeof c);
  return MAGPIE_OK;
}

/* What an import needs of a handle, whichever its form. */
typedef struct ipc_target {
  uint32_t pid;
  int32_t device; /* the exporter's ordinal (for messages) */
  uint64_t nonce;
  uint64_t export_id;
  uint64_t ptr;
  unsigned char secret[RECORD_SECRET_LEN];
} ipc_target;

/* The handle's fields, checked for what can be checked locally. */
static int ipc_parse(const magpie_ipc_handle *h, ipc_wire_handle *w, const char *fn) {
  if (h == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: NULL handle", fn);
  memcpy(w, h->bytes, sizeof *w);
  if (w->magic != IPC_MAGIC)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: not a magpie IPC handle (magpie_ipc_export makes them)", fn);
  if (w->version != IPC_VERSION)
    return error_set(MAGPIE_ERR_IPC, "%s: the handle is of version %u; this magpie reads version %u", fn,
                     (unsigned)w->version, IPC_VERSION);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_ipc_is_compact(const void *bytes) {
  if (bytes == NULL) return 0;
  ipc_compact_wire c;
  memcpy(&c, bytes, sizeof c);
  return memcmp(c.tag, IPC_COMPACT_TAG, IPC_COMPACT_TAG_LEN) == 0 && c.check == ipc_compact_check(&c);
}

/* The compact handle's fields as a target, checked as ipc_parse does. */
static int ipc_parse_compact(const magpie_ipc_compact *h, ipc_target *t, const char *fn) {
  if (h == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: NULL handle", fn);
  if (!magpie_ipc_is_compact(h->bytes))
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "%s: not a magpie compact IPC handle (magpie_ipc_export_compact makes them; a CUDA "
                     "cudaIpcMemHandle_t is not one)",
                     fn);
  ipc_compact_wire c;
  memcpy(&c, h->bytes, sizeof c);
  if (c.version != IPC_VERSION || c.zero != 0)
    return error_set(MAGPIE_ERR_IPC, "%s: the handle is of another magpie version (%u%s); this magpie reads version %u",
                     fn, (unsigned)c.version, c.zero != 0 ? ", a later layout" : "", IPC_VERSION);
  *t = (ipc_target){.pid = c.pid, .device = c.device, .nonce = c.nonce, .export_id = c.export_id, .ptr = c.ptr};
  memcpy(t->secret, c.secret, sizeof t->secret);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_ipc_revoke(const magpie_ipc_handle *handle) {
  ipc_wire_handle w;
  int rc = ipc_parse(handle, &w, "magpie_ipc_revoke");
  if (rc == MAGPIE_OK) rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&ipc_st.lock);
  int mine = ipc_st.started && w.pid == (uint32_t)getpid() && w.nonce == ipc_st.nonce;
  pthread_mutex_unlock(&ipc_st.lock);
  if (!mine)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "magpie_ipc_revoke: the handle was exported by process %u; only that process can revoke it",
                     (unsigned)w.pid);
  slab *sl = pagemap_lookup((uintptr_t)w.ptr);
  if (sl == NULL || record_revoke(&sl->heap->records, (uintptr_t)w.ptr, w.export_id, w.secret) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT,
                     "magpie_ipc_revoke: no such export (its block was freed and went back to the pools)");
  return MAGPIE_OK;
}

/* ---- importing ---- */

/* This process's device with the UUID the exporter's reply gave. */
static int ipc_find_device(const ipc_target *t, const unsigned char uuid[16], const char *fn, int *device) {
  const backend_ops *ops = global_ops();
  int n = 0;
  if (ops->device_count(&n) != MAGPIE_OK) n = 0;
  for (int d = 0; d < n; d++) {
    unsigned char u[16];
    if (ops->device_uuid(d, u) == MAGPIE_OK && memcmp(u, uuid, sizeof u) == 0) {
      *device = d;
      return MAGPIE_OK;
    }
  }
  return error_set(MAGPIE_ERR_IPC,
                   "%s: the block's device (device %d of process %u) is not visible in this process "
                   "(CUDA_VISIBLE_DEVICES?)",
                   fn, (int)t->device, (unsigned)t->pid);
}

/* Connects to the exporter's server and asks for the export: the reply and
 * its descriptors (*fds, meta_alloc'd, r->nfds of them); *sock stays open
 * (the hold) on success. */
static int ipc_request_export(const ipc_target *t, const char *fn, int *sock, ipc_reply *r, int **fds) {
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return error_set(MAGPIE_ERR_IPC, "%s: socket: %s", fn, strerror(errno));
  /* An exporter that stopped answering must not hang the importer. */
  struct timeval tv = {.tv_sec = 30};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_un a;
  unsigned len = ipc_socket_name(t->pid, t->nonce, &a);
  if (connect(s, (struct sockaddr *)&a, len) != 0) {
    int e = errno;
    close(s);
    return error_set(MAGPIE_ERR_IPC,
                     "%s: the exporting process (pid %u) is gone, or serves no exports under this handle (%s)", fn,
                     (unsigned)t->pid, strerror(e));
  }
  ipc_request q = {.magic = IPC_MAGIC, .version = IPC_VERSION, .ptr = t->ptr, .export_id = t->export_id};
  memcpy(q.secret, t->secret, sizeof q.secret);
  int *v = NULL;
  size_t got = 0, nf = 0;
  int e = ipc_send(s, &q, sizeof q, NULL, 0);
  if (e == 0 && (v = meta_alloc(IPC_FDS_PER_MSG * sizeof *v)) == NULL) e = ENOMEM;
  if (e == 0) e = ipc_recv(s, r, sizeof *r, &got, v, IPC_FDS_PER_MSG, &nf);
  if (e == 0 && (got != sizeof *r || r->magic != IPC_MAGIC)) e = EPROTO;
  if (e == 0 && r->status == RECORD_IMPORT_OK) {
    size_t want = r->nfds;
    if (want == 0 || want != r->span_size / (r->gran ? r->gran : 1) || nf > want) e = EPROTO;
    int *all = e == 0 ? meta_alloc(want * sizeof *all) : NULL;
    if (e == 0 && all == NULL) e = ENOMEM;
    size_t have = 0;
    if (e == 0) {
      memcpy(all, v, nf * sizeof *v);
      have = nf;
    }
    while (e == 0 && have < want) {
      uint32_t magic = 0;
      e = ipc_recv(s, &magic, sizeof magic, &got, all + have, want - have, &nf);
      have += nf;
      if (e == 0 && (magic != IPC_MAGIC || nf == 0)) e = EPROTO;
    }
    if (e != 0) {
      for (size_t i = 0; i < have; i++) close(all[i]);
      meta_free(all);
    } else {
      *fds = all;
    }
    nf = 0; /* moved or closed */
  }
  for (size_t i = 0; i < nf; i++) close(v[i]);
  meta_free(v);
  if (e != 0) {
    close(s);
    return error_set(MAGPIE_ERR_IPC, "%s: no answer from the exporting process (pid %u): %s", fn, (unsigned)t->pid,
                     e == EAGAIN ? "timed out" : strerror(e));
  }
  if (r->status != RECORD_IMPORT_OK) {
    close(s);
    r->message[sizeof r->message - 1] = 0;
    return error_set(MAGPIE_ERR_IPC, "%s: the exporting process (pid %u) refused: %s", fn, (unsigned)t->pid,
                     r->message);
  }
  *sock = s;
  return MAGPIE_OK;
}

/* peer (-1: none) checked as an import's extra device: a device of this
 * process that can be connected to device's memory. */
static int ipc_check_peer(const backend_ops *ops, int device, int peer, const char *fn) {
  int n = 0, can = 0;
  if (peer < 0 || peer == device) return MAGPIE_OK;
  if (ops->device_count(&n) != MAGPIE_OK || peer >= n || peer >= MAGPIE_MAX_DEVICES)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s: peer device %d does not exist", fn, peer);
  if (ops->can_access_peer == NULL || ops->can_access_peer(device, peer, &can) != MAGPIE_OK || !can)
    return error_set(MAGPIE_ERR_NO_PEER_ACCESS,
                     "%s: the block is on device %d and device %d cannot be given access to it (no peer-to-peer "
                     "path); open it with device %d current, or copy it",
                     fn, device, peer, device);
  return MAGPIE_OK;
}

/* The import of t, mapped on this process's device with the exporter's
 * UUID for that device's peers and peer (-1: none). */
static int ipc_import_target(const ipc_target *t, int peer, const char *fn, void **ptr, size_t *size) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  const backend_ops *ops = global_ops();
  if (ops->device_uuid == NULL || ops->import_map == NULL)
    return error_set(MAGPIE_ERR_IPC, "%s: the %s device cannot map another process's memory", fn, ops->name);
  ipc_import *imp = meta_alloc(sizeof *imp);
  if (imp == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  int sock = -1, *fds = NULL, device = -1;
  ipc_reply r;
  rc = ipc_request_export(t, fn, &sock, &r, &fds);
  if (rc != MAGPIE_OK) {
    meta_free(imp);
    return rc;
  }
  rc = ipc_find_device(t, r.uuid, fn, &device);
  if (rc == MAGPIE_OK) rc = ipc_check_peer(ops, device, peer, fn);
  uintptr_t base = 0;
  if (rc == MAGPIE_OK) {
    /* Mapped for this process's peers of the device too, as its own
     * memory is (magpie_device_enable_peer_access), and for peer. */
    heap *h = heap_peek(device);
    uint64_t peers = h != NULL ? atomic_load_seq_cst(&h->region.peers) : 0;
    if (peer >= 0 && peer != device) peers |= (uint64_t)1 << peer;
    rc = ops->reserve(device, r.span_size, &base);
    if (rc == MAGPIE_OK) {
      rc = ops->import_map(device, base, r.span_size, fds, peers);
      if (rc != MAGPIE_OK) ops->unreserve(device, base, r.span_size);
    }
    if (rc != MAGPIE_OK)
      rc = error_set(rc, "%s: cannot map the block on device %d: %s", fn, device, backend_error_detail());
  }
  for (size_t i = 0; i < r.nfds; i++) close(fds[i]);
  meta_free(fds);
  if (rc != MAGPIE_OK) {
    close(sock); /* gives the exporter's hold back */
    meta_free(imp);
    return rc;
  }
  *imp = (ipc_import){.ptr = base + (uintptr_t)(t->ptr - r.span_base),
                      .base = base,
                      .span = r.span_size,
                      .device = device,
                      .sock = sock};
  pthread_mutex_lock(&ipc_st.lock);
  imp->next = ipc_st.imports;
  ipc_st.imports = imp;
  pthread_mutex_unlock(&ipc_st.lock);
  *ptr = (void *)imp->ptr;
  if (size != NULL) *size = r.bytes;
  return MAGPIE_OK;
}

MAGPIE_API int magpie_ipc_import(const magpie_ipc_handle *handle, void **ptr, size_t *size) {
  if (ptr == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_import: NULL ptr");
  *ptr = NULL;
  ipc_wire_handle w;
  int rc = ipc_parse(handle, &w, "magpie_ipc_import");
  if (rc != MAGPIE_OK) return rc;
  ipc_target t = {.pid = w.pid, .device = w.device, .nonce = w.nonce, .export_id = w.export_id, .ptr = w.ptr};
  memcpy(t.secret, w.secret, sizeof t.secret);
  return ipc_import_target(&t, -1, "magpie_ipc_import", ptr, size);
}

MAGPIE_API int magpie_ipc_import_compact(const magpie_ipc_compact *handle, int peer, void **ptr, size_t *size) {
  if (ptr == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_import_compact: NULL ptr");
  *ptr = NULL;
  ipc_target t;
  int rc = ipc_parse_compact(handle, &t, "magpie_ipc_import_compact");
  if (rc == MAGPIE_OK && peer < -1)
    rc = error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_import_compact: peer %d (-1 for none)", peer);
  if (rc != MAGPIE_OK) return rc;
  return ipc_import_target(&t, peer, "magpie_ipc_import_compact", ptr, size);
}

/* Waits for the work enqueued on stream so far: one seal from the stream's
 * heap (its pooled events, as every other wait of magpie's; creating an
 * event can stall behind a busy device), then a wait on it. */
static int ipc_stream_wait(const backend_ops *ops, cudaStream_t stream) {
  uint64_t id = 0;
  int dev = -1;
  if (backend_capture_state(ops, stream, &id) != BACKEND_CAPTURE_NONE) return MAGPIE_ERR_CAPTURE;
  if (ops->stream_id(stream, &id) != MAGPIE_OK || ops->stream_device(stream, &dev) != MAGPIE_OK)
    return MAGPIE_ERR_INVALID_STREAM;
  heap *h = heap_get(dev);
  if (h == NULL) return magpie_last_error();
  stream_rec *rec = epoch_stream_acquire(&h->epochs, id);
  if (rec == NULL) return MAGPIE_ERR_OUT_OF_MEMORY;
  epoch_ticket tk;
  int rc = epoch_seal(rec, stream, &tk);
  epoch_stream_release(rec); /* the ticket holds its own reference */
  if (rc != MAGPIE_OK) return rc;
  rc = epoch_wait(&tk);
  epoch_ticket_release(&tk);
  return rc;
}

MAGPIE_API int magpie_ipc_close(void *ptr, cudaStream_t stream) {
  int rc = global_ensure();
  if (rc != MAGPIE_OK) return rc;
  pthread_mutex_lock(&ipc_st.lock);
  ipc_import **pp = &ipc_st.imports;
  while (*pp != NULL && (*pp)->ptr != (uintptr_t)ptr) pp = &(*pp)->next;
  ipc_import *imp = *pp;
  if (imp != NULL) *pp = imp->next; /* a racing second close now fails */
  pthread_mutex_unlock(&ipc_st.lock);
  if (imp == NULL)
    return error_set(MAGPIE_ERR_INVALID_POINTER,
                     "magpie_ipc_close(%p): not an address magpie_ipc_import returned (or closed already)", ptr);
  const backend_ops *ops = global_ops();
  rc = ipc_stream_wait(ops, stream);
  if (rc != MAGPIE_OK) {
    pthread_mutex_lock(&ipc_st.lock);
    imp->next = ipc_st.imports;
    ipc_st.imports = imp;
    pthread_mutex_unlock(&ipc_st.lock);
    return error_set(rc,
                     rc == MAGPIE_ERR_CAPTURE ? "magpie_ipc_close(%p): stream %p is capturing a CUDA graph; close the "
                                                "import after the capture, on a stream that is not capturing"
                                              : "magpie_ipc_close(%p): cannot wait for stream %p: %s; the import "
                                                "stays open",
                     ptr, (void *)stream, backend_error_detail());
  }
  rc = ops->unmap(imp->device, imp->base, imp->span);
  if (rc == MAGPIE_OK) ops->unreserve(imp->device, imp->base, imp->span);
  close(imp->sock); /* the exporter's server releases the hold */
  meta_free(imp);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_ipc_close(%p): unmapping failed: %s (the address range stays reserved)", ptr,
                     backend_error_detail());
  return MAGPIE_OK;
}
