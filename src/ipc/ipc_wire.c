/* The export server's socket: its name and the messages on it, and the
 * compact handle's check (ipc.h). Takes no lock. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/atomic.h"
#include "ipc/ipc.h"

unsigned ipc_socket_name(uint32_t pid, uint64_t nonce, struct sockaddr_un *addr) {
  memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  /* Abstract namespace: sun_path starts with a zero byte, and the name is
   * the bytes after it (no file, gone with the socket). */
  int n = snprintf(addr->sun_path + 1, sizeof addr->sun_path - 1, "magpie-ipc-%u-%016llx", (unsigned)pid,
                   (unsigned long long)nonce);
  return (unsigned)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

int ipc_send(int sock, const void *msg, size_t len, const int *fds, size_t nfds) {
  struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
  union {
    char buf[CMSG_SPACE(sizeof(int) * IPC_FDS_PER_MSG)];
    struct cmsghdr align;
  } ctl;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds > 0) {
    memset(&ctl, 0, sizeof ctl);
    mh.msg_control = ctl.buf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  ssize_t n;
  do n = sendmsg(sock, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  if (n < 0) return errno;
  return (size_t)n == len ? 0 : EPROTO;
}

int ipc_recv(int sock, void *msg, size_t len, size_t *got, int *fds, size_t maxfds, size_t *nfds) {
  struct iovec iov = {.iov_base = msg, .iov_len = len};
  union {
    char buf[CMSG_SPACE(sizeof(int) * IPC_FDS_PER_MSG)];
    struct cmsghdr align;
  } ctl;
  struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
  *nfds = 0;
  ssize_t n;
  do n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n < 0) return errno;
  *got = (size_t)n;
  /* Every descriptor that arrived is taken (and closed if unwanted), so
   * none leaks into this process. */
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (*nfds < maxfds) fds[(*nfds)++] = fd;
      else close(fd);
    }
  }
  if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    for (size_t i = 0; i < *nfds; i++) close(fds[i]);
    *nfds = 0;
    return EPROTO;
  }
  return 0;
}

MAGPIE_WRAPS uint32_t ipc_compact_check(const ipc_compact_wire *w) {
  ipc_compact_wire c = *w;
  c.check = 0;
  const unsigned char *b = (const unsigned char *)&c;
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < sizeof c; i++) h = (h ^ b[i]) * 16777619u;
  return h;
}
