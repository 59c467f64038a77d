/* Sharing blocks with other processes: magpie_ipc_export, _revoke,
 * _import and _close (magpie.h; the protocol is ipc.h, the exporting
 * side's server ipc_server.c, the holds pool/record.c).
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

MAGPIE_API int magpie_ipc_export(void *ptr, unsigned flags, magpie_ipc_handle *out) {
  if (out == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_export: NULL handle");
  if (flags & ~MAGPIE_IPC_HOLD)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_export: unknown flags %#x (only MAGPIE_IPC_HOLD)", flags);
  slab *sl = NULL;
  size_t bytes = 0;
  int graph = 0;
  int rc = block_resolve("magpie_ipc_export", ptr, &sl, &bytes, &graph);
  if (rc != MAGPIE_OK) return rc;
  if (graph)
    return error_set(MAGPIE_ERR_IPC,
                     "magpie_ipc_export(%p): a graph pool's block cannot be shared with another process (its "
                     "pool, not the application, decides when it is reused)",
                     ptr);
  heap *h = sl->heap;
  if (!h->region.vmm || !(h->region.map_flags & BACKEND_MAP_EXPORTABLE))
    return error_set(MAGPIE_ERR_IPC, "magpie_ipc_export(%p): device %d's memory is not exportable: %s", ptr, h->device,
                     !h->region.vmm               ? "the device has no virtual memory management"
                     : h->ops->export_fds == NULL ? "the device cannot share memory with other processes"
                                                  : "magpie runs with ipc=0 (MAGPIE_CONF); leave it at 1");
  unsigned char uuid[16];
  if (h->ops->device_uuid(h->device, uuid) != MAGPIE_OK)
    return error_set(MAGPIE_ERR_IPC, "magpie_ipc_export(%p): %s", ptr, backend_error_detail());
  uint64_t nonce = 0;
  rc = ipc_server_ensure(&nonce);
  if (rc != MAGPIE_OK) return rc;
  unsigned char secret[RECORD_SECRET_LEN], fresh[RECORD_SECRET_LEN];
  if (getrandom(fresh, sizeof fresh, 0) != (ssize_t)sizeof fresh)
    return error_set(MAGPIE_ERR_IPC, "magpie_ipc_export(%p): no random bytes for the handle's secret (%s)", ptr,
                     strerror(errno));
  uint64_t id = 0, new_id = atomic_add_relaxed(&ipc_st.next_id, 1) + 1;
  rc = record_export(&h->records, sl, large_block_class(sl, (uintptr_t)ptr), (uintptr_t)ptr, bytes,
                     (flags & MAGPIE_IPC_HOLD) != 0, new_id, fresh, &id, secret);
  if (rc == MAGPIE_ERR_INVALID_POINTER) return error_set(rc, "magpie_ipc_export(%p): the block is free", ptr);
  if (rc != MAGPIE_OK) return error_set(rc, "magpie_ipc_export(%p): out of host memory", ptr);
  ipc_wire_handle w;
  memset(&w, 0, sizeof w);
  w.magic = IPC_MAGIC;
  w.version = IPC_VERSION;
  w.pid = (uint32_t)getpid();
  w.device = h->device;
  w.nonce = nonce;
  memcpy(w.uuid, uuid, sizeof uuid);
  w.export_id = id;
  memcpy(w.secret, secret, sizeof secret);
  w.ptr = (uintptr_t)ptr;
  w.size = bytes;
  memset(out, 0, sizeof *out);
  memcpy(out->bytes, &w, sizeof w);
  return MAGPIE_OK;
}

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

/* This process's device with the exporter's UUID. */
static int ipc_find_device(const ipc_wire_handle *w, int *device) {
  const backend_ops *ops = global_ops();
  int n = 0;
  if (ops->device_uuid == NULL || ops->import_map == NULL)
    return error_set(MAGPIE_ERR_IPC, "magpie_ipc_import: the %s device cannot map another process's memory", ops->name);
  if (ops->device_count(&n) != MAGPIE_OK) n = 0;
  for (int d = 0; d < n; d++) {
    unsigned char u[16];
    if (ops->device_uuid(d, u) == MAGPIE_OK && memcmp(u, w->uuid, sizeof u) == 0) {
      *device = d;
      return MAGPIE_OK;
    }
  }
  return error_set(MAGPIE_ERR_IPC,
                   "magpie_ipc_import: the block's device (device %d of process %u) is not visible in this process "
                   "(CUDA_VISIBLE_DEVICES?)",
                   (int)w->device, (unsigned)w->pid);
}

/* Connects to the exporter's server and asks for the export: the reply and
 * its descriptors (*fds, meta_alloc'd, r->nfds of them); *sock stays open
 * (the hold) on success. */
static int ipc_request_export(const ipc_wire_handle *w, int *sock, ipc_reply *r, int **fds) {
  int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (s < 0) return error_set(MAGPIE_ERR_IPC, "magpie_ipc_import: socket: %s", strerror(errno));
  /* An exporter that stopped answering must not hang the importer. */
  struct timeval tv = {.tv_sec = 30};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_un a;
  unsigned len = ipc_socket_name(w->pid, w->nonce, &a);
  if (connect(s, (struct sockaddr *)&a, len) != 0) {
    int e = errno;
    close(s);
    return error_set(MAGPIE_ERR_IPC,
                     "magpie_ipc_import: the exporting process (pid %u) is gone, or serves no exports under this "
                     "handle (%s)",
                     (unsigned)w->pid, strerror(e));
  }
  ipc_request q = {.magic = IPC_MAGIC, .version = IPC_VERSION, .ptr = w->ptr, .export_id = w->export_id};
  memcpy(q.secret, w->secret, sizeof q.secret);
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
    return error_set(MAGPIE_ERR_IPC, "magpie_ipc_import: no answer from the exporting process (pid %u): %s",
                     (unsigned)w->pid, e == EAGAIN ? "timed out" : strerror(e));
  }
  if (r->status != RECORD_IMPORT_OK) {
    close(s);
    r->message[sizeof r->message - 1] = 0;
    return error_set(MAGPIE_ERR_IPC, "magpie_ipc_import: the exporting process (pid %u) refused: %s", (unsigned)w->pid,
                     r->message);
  }
  *sock = s;
  return MAGPIE_OK;
}

MAGPIE_API int magpie_ipc_import(const magpie_ipc_handle *handle, void **ptr, size_t *size) {
  if (ptr == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_ipc_import: NULL ptr");
  *ptr = NULL;
  ipc_wire_handle w;
  int rc = ipc_parse(handle, &w, "magpie_ipc_import");
  if (rc == MAGPIE_OK) rc = global_ensure();
  int device = -1;
  if (rc == MAGPIE_OK) rc = ipc_find_device(&w, &device);
  if (rc != MAGPIE_OK) return rc;
  const backend_ops *ops = global_ops();
  ipc_import *imp = meta_alloc(sizeof *imp);
  if (imp == NULL) return error_set(MAGPIE_ERR_OUT_OF_MEMORY, "magpie_ipc_import: out of host memory");
  int sock = -1, *fds = NULL;
  ipc_reply r;
  rc = ipc_request_export(&w, &sock, &r, &fds);
  if (rc != MAGPIE_OK) {
    meta_free(imp);
    return rc;
  }
  uintptr_t base = 0;
  /* Mapped for this process's peers of the device too, as its own
   * memory is (magpie_device_enable_peer_access). */
  heap *h = heap_peek(device);
  uint64_t peers = h != NULL ? atomic_load_seq_cst(&h->region.peers) : 0;
  rc = ops->reserve(device, r.span_size, &base);
  if (rc == MAGPIE_OK) {
    rc = ops->import_map(device, base, r.span_size, fds, peers);
    if (rc != MAGPIE_OK) ops->unreserve(device, base, r.span_size);
  }
  for (size_t i = 0; i < r.nfds; i++) close(fds[i]);
  meta_free(fds);
  if (rc != MAGPIE_OK) {
    close(sock); /* gives the exporter's hold back */
    meta_free(imp);
    return error_set(rc, "magpie_ipc_import: cannot map the block on device %d: %s", device, backend_error_detail());
  }
  *imp = (ipc_import){.ptr = base + (uintptr_t)(w.ptr - r.span_base),
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
