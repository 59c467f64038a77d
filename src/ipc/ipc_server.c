/* The export server (ipc.h): one thread per exporting process, started at
 * the first export, serving imports on an abstract Unix socket. Each
 * accepted connection carries one request; a granted one stays open as the
 * import's hold on the block until the importer closes it or exits.
 *
 * The thread is the only one touching its connections (no lock); the
 * server's start is under ipc_st.lock (a leaf). It stays for the
 * process's life (the library is never unloaded: -z nodelete); a child of
 * fork() has none and closes the inherited sockets.
 *
 * Lock order: ipc_st.lock, a leaf; the thread takes the record table's
 * lock (a leaf, pool/record.h) with no lock of its own held, and calls the
 * device table outside every lock. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/error.h"
#include "base/meta.h"
#include "base/pagemap.h"
#include "heap/heap.h"
#include "ipc/ipc.h"

ipc_state ipc_st = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .listen_fd = -1,
};

static void ipc_after_fork_child(void);

/* The layer's fork handler, registered when the library is loaded: a
 * parent thread may hold the lock at the fork, whether or not the server
 * runs. */
__attribute__((constructor)) static void ipc_register_fork(void) {
  ipc_st.atfork = pthread_atfork(NULL, NULL, ipc_after_fork_child) == 0;
}

/* One connection. INVARIANT: held != 0 iff the request was granted: the
 * connection then holds one import of export (h, ptr, id). */
typedef struct ipc_conn {
  int fd;
  int held;
  heap *h;
  uintptr_t ptr;
  uint64_t id;
} ipc_conn;

/* The server thread's connections (its own; no lock). */
typedef struct ipc_conns {
  ipc_conn *v;
  size_t n, cap;
} ipc_conns;

/* A refusal: status and message in reply. */
static void ipc_refuse(ipc_reply *r, int status, const char *fmt, const char *detail) {
  r->status = status;
  snprintf(r->message, sizeof r->message, fmt, detail);
}

/* Sends the reply and the granule descriptors; 0 or an errno. */
static int ipc_send_reply(int sock, const ipc_reply *r, const int *fds) {
  size_t first = r->nfds < IPC_FDS_PER_MSG ? r->nfds : IPC_FDS_PER_MSG;
  int e = ipc_send(sock, r, sizeof *r, fds, first);
  for (size_t off = first; e == 0 && off < r->nfds; off += IPC_FDS_PER_MSG) {
    size_t k = r->nfds - off < IPC_FDS_PER_MSG ? r->nfds - off : IPC_FDS_PER_MSG;
    uint32_t magic = IPC_MAGIC;
    e = ipc_send(sock, &magic, sizeof magic, fds + off, k);
  }
  return e;
}

/* One request on c: a hold and the descriptors, or a refusal. */
static void ipc_serve(ipc_conn *c) {
  ipc_request q;
  size_t got = 0, nf = 0;
  int junk[1];
  int e = ipc_recv(c->fd, &q, sizeof q, &got, junk, 0, &nf);
  ipc_reply r;
  memset(&r, 0, sizeof r);
  r.magic = IPC_MAGIC;
  if (e != 0 || got != sizeof q || q.magic != IPC_MAGIC || q.version != IPC_VERSION) {
    ipc_refuse(&r, IPC_REPLY_FAILED, "%s", "malformed request (a different magpie version?)");
    ipc_send_reply(c->fd, &r, NULL);
    return;
  }
  slab *sl = pagemap_lookup((uintptr_t)q.ptr);
  size_t bytes = 0;
  int st = sl == NULL ? RECORD_IMPORT_UNKNOWN
                      : record_import_hold(&sl->heap->records, (uintptr_t)q.ptr, q.export_id, q.secret, &bytes);
  if (st != RECORD_IMPORT_OK) {
    const char *why = st == RECORD_IMPORT_FREED     ? "the exporting process freed the block before this import"
                      : st == RECORD_IMPORT_REVOKED ? "the exporting process revoked the handle"
                                                    : "no such export: the handle is corrupted, or the exporting "
                                                      "process freed the block (it may have been reused since)";
    ipc_refuse(&r, st, "%s", why);
    ipc_send_reply(c->fd, &r, NULL);
    return;
  }
  heap *h = sl->heap;
  size_t g = h->region.gran;
  uintptr_t base = (uintptr_t)q.ptr & ~(uintptr_t)(g - 1);
  size_t span = (((uintptr_t)q.ptr + bytes + g - 1) & ~(uintptr_t)(g - 1)) - base;
  size_t n = span / g;
  int *fds = meta_alloc(n * sizeof *fds);
  int rc = fds == NULL ? MAGPIE_ERR_OUT_OF_MEMORY : h->ops->device_uuid(h->device, r.uuid);
  if (rc == MAGPIE_OK) rc = h->ops->export_fds(h->device, base, span, fds);
  if (rc != MAGPIE_OK) {
    record_import_release(&h->records, (uintptr_t)q.ptr, q.export_id);
    ipc_refuse(&r, IPC_REPLY_FAILED, "the exporting process cannot export the memory: %s",
               fds == NULL ? "out of host memory" : backend_error_detail());
    ipc_send_reply(c->fd, &r, NULL);
    meta_free(fds);
    return;
  }
  r.status = RECORD_IMPORT_OK;
  r.span_base = base;
  r.span_size = span;
  r.gran = g;
  r.bytes = bytes;
  r.nfds = n;
  e = ipc_send_reply(c->fd, &r, fds);
  for (size_t i = 0; i < n; i++) close(fds[i]);
  meta_free(fds);
  if (e != 0) { /* the importer is gone already: no hold */
    record_import_release(&h->records, (uintptr_t)q.ptr, q.export_id);
    return;
  }
  c->held = 1;
  c->h = h;
  c->ptr = (uintptr_t)q.ptr;
  c->id = q.export_id;
}

static void ipc_conn_close(ipc_conns *cs, size_t i) {
  ipc_conn *c = &cs->v[i];
  if (c->held) record_import_release(&c->h->records, c->ptr, c->id);
  close(c->fd);
  cs->v[i] = cs->v[--cs->n];
}

static void ipc_accept(ipc_conns *cs, int lfd) {
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;
  if (cs->n == cs->cap) {
    size_t cap = cs->cap ? 2 * cs->cap : 16;
    ipc_conn *v = meta_alloc(cap * sizeof *v);
    if (v == NULL) { /* out of host memory: refuse this one */
      close(fd);
      return;
    }
    if (cs->n) memcpy(v, cs->v, cs->n * sizeof *v);
    meta_free(cs->v);
    cs->v = v;
    cs->cap = cap;
  }
  cs->v[cs->n++] = (ipc_conn){.fd = fd};
}

static void *ipc_server_main(void *arg) {
  (void)arg;
  int lfd = ipc_st.listen_fd; /* written before pthread_create */
  ipc_conns cs = {0};
  struct pollfd *pf = NULL;
  size_t pcap = 0;
  for (;;) {
    if (pcap < cs.n + 1) {
      size_t cap = 2 * (cs.n + 1);
      struct pollfd *np = meta_alloc(cap * sizeof *np);
      if (np == NULL) {
        sleep(1); /* out of host memory: try again later */
        continue;
      }
      meta_free(pf);
      pf = np;
      pcap = cap;
    }
    pf[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
    for (size_t i = 0; i < cs.n; i++) pf[i + 1] = (struct pollfd){.fd = cs.v[i].fd, .events = POLLIN};
    size_t npf = cs.n + 1;
    if (poll(pf, npf, -1) < 0) continue; /* EINTR */
    /* Connections first, from the last (closing one moves the last into
     * its place), then new ones. */
    for (size_t i = npf - 1; i >= 1; i--) {
      if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ipc_conn *c = &cs.v[i - 1];
      if (!c->held) {
        ipc_serve(c);
        if (!c->held) ipc_conn_close(&cs, i - 1); /* refused: done */
        continue;
      }
      /* A granted connection carries nothing more: readable means the
       * importer closed it (or sent what it must not). */
      ipc_conn_close(&cs, i - 1);
    }
    if (pf[0].revents & POLLIN) ipc_accept(&cs, lfd);
  }
  return NULL;
}

int ipc_server_ensure(uint64_t *nonce) {
  pthread_mutex_lock(&ipc_st.lock);
  int rc = MAGPIE_OK;
  if (!ipc_st.started) {
    uint64_t n = 0;
    if (getrandom(&n, sizeof n, 0) != (ssize_t)sizeof n) n = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull ^ (uint64_t)&n;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    unsigned len = ipc_socket_name((uint32_t)getpid(), n, &a);
    const char *step = fd < 0 ? "socket" : NULL;
    if (step == NULL && bind(fd, (struct sockaddr *)&a, len) != 0) step = "bind";
    if (step == NULL && listen(fd, 128) != 0) step = "listen";
    pthread_t t;
    pthread_attr_t attr;
    if (step == NULL) {
      ipc_st.listen_fd = fd;
      pthread_attr_init(&attr);
      pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
      if (pthread_create(&t, &attr, ipc_server_main, NULL) != 0) step = "pthread_create";
      pthread_attr_destroy(&attr);
    }
    if (step != NULL) {
      int e = errno;
      if (fd >= 0) close(fd);
      ipc_st.listen_fd = -1;
      rc = error_set(MAGPIE_ERR_IPC, "magpie_ipc_export: cannot start the export server (%s: %s)", step, strerror(e));
    } else {
      ipc_st.nonce = n;
      ipc_st.started = 1;
    }
  }
  *nonce = ipc_st.nonce;
  pthread_mutex_unlock(&ipc_st.lock);
  return rc;
}

static void ipc_after_fork_child(void) {
  /* The child's only thread: the parent's server thread is not here. Its
   * listening socket is the parent's to serve; the child's copy goes. The
   * connections' copies close with the child's exit (magpie is unusable
   * in it: init.c). */
  pthread_mutex_init(&ipc_st.lock, NULL);
  if (ipc_st.listen_fd >= 0) close(ipc_st.listen_fd);
  ipc_st.listen_fd = -1;
  ipc_st.started = 0;
}
