/* The simulated device's peer access and inter-process sharing, through its
 * device table (magpie_sim_device_table) and the public access checks:
 * exportable (memfd-backed) granules, export_fds and import_map within the
 * process and into a second process (this program run again with
 * --ipc-child, the descriptors passed over a Unix socket), the refusals,
 * the descriptor limit, access rights per granule and per device, and the
 * capture rule of the new memory calls. Two devices (MAGPIE_SIM_DEVICES,
 * set in main). */
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>

#include "tests/sim_test_util.h"

#define GRAN (2 * MiB) /* the simulated granularity */
#define IPC_GRANULES 2

static const backend_ops *table(void) {
  const backend_ops *ops = magpie_sim_device_table(BACKEND_ABI);
  assert_non_null(ops);
  assert_int_equal(ops->init(), MAGPIE_OK);
  return ops;
}

/* ---------------------------------------------------------------- helpers */

/* A pattern that differs with seed and with every word's place (a hash:
 * meant to wrap). */
static SIM_WRAPS uint64_t pattern_word(uint64_t seed, size_t i) { return seed * 0x9e3779b97f4a7c15ull + i; }

static void stamp(uintptr_t p, size_t n, uint64_t seed) {
  volatile uint64_t *w = (volatile uint64_t *)p;
  for (size_t i = 0; i < n / sizeof *w; i++) w[i] = pattern_word(seed, i);
}

/* 1 if [p, p+n) holds seed's pattern. */
static int stamped(uintptr_t p, size_t n, uint64_t seed) {
  const volatile uint64_t *w = (const volatile uint64_t *)p;
  for (size_t i = 0; i < n / sizeof *w; i++)
    if (w[i] != pattern_word(seed, i)) return 0;
  return 1;
}

static size_t free_bytes(const backend_ops *ops, int device) {
  size_t f = 0, t = 0;
  assert_int_equal(ops->mem_info(device, &f, &t), MAGPIE_OK);
  return f;
}

/* Descriptors open in this process (a leak check). */
static int open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  assert_non_null(d);
  int n = 0;
  while (readdir(d) != NULL) n++;
  closedir(d);
  return n;
}

static void detail_says(const char *what) {
  if (strstr(backend_error_detail(), what) == NULL)
    fail_msg("the reason \"%s\" does not say \"%s\"", backend_error_detail(), what);
}

/* ---------------------------------------------------------------- in one process */

static void test_table_version(void **state) {
  (void)state;
  assert_non_null(magpie_sim_device_table(BACKEND_ABI));
  /* A table of the previous layout is refused, not misread. */
  assert_null(magpie_sim_device_table(((BACKEND_ABI_VERSION - 1) << 16) | (unsigned)sizeof(backend_ops)));
  const backend_ops *ops = table();
  assert_non_null(ops->can_access_peer);
  assert_non_null(ops->set_access);
  assert_non_null(ops->revoke_access);
  assert_non_null(ops->peer_enable);
  assert_non_null(ops->peer_disable);
  assert_non_null(ops->device_uuid);
  assert_non_null(ops->export_fds);
  assert_non_null(ops->import_map);
}

/* Every exportable granule keeps a descriptor: the simulator raised the
 * soft limit to the hard one at start. */
static void test_fd_limit_raised(void **state) {
  (void)state;
  table();
  struct rlimit l;
  assert_int_equal(getrlimit(RLIMIT_NOFILE, &l), 0);
  /* An infinite hard limit cannot be the soft one (the kernel caps it). */
  if (l.rlim_max != RLIM_INFINITY) assert_true(l.rlim_cur == l.rlim_max);
}

static void test_export_import_in_process(void **state) {
  (void)state;
  const backend_ops *ops = table();
  size_t gran = 0;
  assert_int_equal(ops->granularity(0, &gran), MAGPIE_OK);
  assert_true(gran == GRAN);
  int fds0 = open_fds();
  size_t free0 = free_bytes(ops, 0), free1 = free_bytes(ops, 1);
  uintptr_t a, b;
  assert_int_equal(ops->reserve(0, 4 * GRAN, &a), MAGPIE_OK);
  assert_int_equal(ops->map(0, a, 2 * GRAN, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  /* Capacity as for any map; one descriptor per granule. */
  assert_true(free_bytes(ops, 0) == free0 - 2 * GRAN);
  assert_int_equal(open_fds(), fds0 + 2);
  stamp(a, 2 * GRAN, 1);
  int fds[2] = {-1, -1};
  assert_int_equal(ops->export_fds(0, a, 2 * GRAN, fds), MAGPIE_OK);
  for (int i = 0; i < 2; i++) {
    assert_true(fds[i] >= 0);
    assert_true(fcntl(fds[i], F_GETFD) & FD_CLOEXEC);
  }
  assert_int_equal(open_fds(), fds0 + 4);
  /* Imported on the other device: same memory, none of its capacity. */
  assert_int_equal(ops->reserve(1, 2 * GRAN, &b), MAGPIE_OK);
  assert_int_equal(ops->import_map(1, b, 2 * GRAN, fds, 0), MAGPIE_OK);
  assert_true(free_bytes(ops, 1) == free1);
  /* The descriptors stay the caller's: closing them leaves the import. */
  for (int i = 0; i < 2; i++) close(fds[i]);
  assert_int_equal(open_fds(), fds0 + 2);
  assert_true(stamped(b, 2 * GRAN, 1));
  stamp(b, 2 * GRAN, 2);
  assert_true(stamped(a, 2 * GRAN, 2));
  stamp(a + GRAN, GRAN, 3);
  assert_true(stamped(b + GRAN, GRAN, 3));
  assert_int_equal(magpie_sim_access_check(1, (void *)b, 2 * GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(0, (void *)a, 2 * GRAN), MAGPIE_OK);
  /* The exporter unmaps: its capacity comes back, the import lives on. */
  assert_int_equal(ops->unmap(0, a, 2 * GRAN), MAGPIE_OK);
  assert_true(free_bytes(ops, 0) == free0);
  assert_int_equal(open_fds(), fds0);
  assert_int_equal(magpie_sim_access_check(0, (void *)a, 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_true(stamped(b, GRAN, 2));
  assert_true(stamped(b + GRAN, GRAN, 3));
  stamp(b, 2 * GRAN, 4);
  assert_true(stamped(b, 2 * GRAN, 4));
  /* The importer's unmap gives back nothing: it took nothing. */
  assert_int_equal(ops->unmap(1, b, 2 * GRAN), MAGPIE_OK);
  assert_true(free_bytes(ops, 1) == free1);
  assert_int_equal(magpie_sim_access_check(1, (void *)b, 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->unmap(1, b, GRAN), MAGPIE_ERR_INVALID_ARGUMENT);
  /* Mapped again, plainly this time: fresh zeroed memory. */
  assert_int_equal(ops->map(0, a, GRAN, 0, 0), MAGPIE_OK);
  for (size_t i = 0; i < GRAN / sizeof(uint64_t); i += 4096) assert_true(((volatile uint64_t *)a)[i] == 0);
  assert_int_equal(ops->map(0, a + GRAN, GRAN, 2, 0), MAGPIE_ERR_INVALID_ARGUMENT); /* an unknown flag */
  detail_says("flags");
  /* One unmap over plain and exportable granules together. */
  assert_int_equal(ops->map(0, a + GRAN, 2 * GRAN, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  assert_true(free_bytes(ops, 0) == free0 - 3 * GRAN);
  assert_int_equal(ops->unmap(0, a, 3 * GRAN), MAGPIE_OK);
  assert_true(free_bytes(ops, 0) == free0);
  assert_int_equal(open_fds(), fds0);
  assert_int_equal(ops->unreserve(0, a, 4 * GRAN), MAGPIE_OK);
  assert_int_equal(ops->unreserve(1, b, 2 * GRAN), MAGPIE_OK);
}

static void test_export_import_refusals(void **state) {
  (void)state;
  const backend_ops *ops = table();
  int fds0 = open_fds();
  size_t free0 = free_bytes(ops, 0);
  uintptr_t a;
  assert_int_equal(ops->reserve(0, 6 * GRAN, &a), MAGPIE_OK);
  assert_int_equal(ops->map(0, a, GRAN, 0, 0), MAGPIE_OK);
  assert_int_equal(ops->map(0, a + GRAN, GRAN, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  int fd[2] = {-7, -7};
  /* Not exportable, not mapped, partly either: refused, nothing opened. */
  assert_int_equal(ops->export_fds(0, a, GRAN, fd), MAGPIE_ERR_INVALID_ARGUMENT);
  detail_says("not mapped exportable");
  assert_int_equal(ops->export_fds(0, a, 2 * GRAN, fd), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->export_fds(0, a + 2 * GRAN, GRAN, fd), MAGPIE_ERR_INVALID_ARGUMENT);
  detail_says("not mapped");
  assert_int_equal(ops->export_fds(0, a + GRAN, 2 * GRAN, fd), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->export_fds(1, a + GRAN, GRAN, fd), MAGPIE_ERR_INVALID_ARGUMENT); /* not device 1's */
  assert_int_equal(fd[0], -7);
  assert_int_equal(open_fds(), fds0 + 1);
  int good;
  assert_int_equal(ops->export_fds(0, a + GRAN, GRAN, &good), MAGPIE_OK);
  /* Importing over mapped granules. */
  assert_int_equal(ops->import_map(0, a, GRAN, &good, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->import_map(0, a + GRAN, GRAN, &good, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->import_map(0, a + GRAN, 2 * GRAN, (int[]){good, good}, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  /* Descriptors that are not one exported granule: a pipe, a memfd of
   * another size, a closed descriptor, a read-only one. */
  int p[2];
  assert_int_equal(pipe(p), 0);
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, GRAN, &p[0], 0), MAGPIE_ERR_INVALID_ARGUMENT);
  detail_says("not exported simulated device memory");
  int small = memfd_create("small", MFD_CLOEXEC);
  assert_true(small >= 0);
  assert_int_equal(ftruncate(small, GRAN / 2), 0);
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, GRAN, &small, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ftruncate(small, 2 * GRAN), 0);
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, GRAN, &small, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  int closed = -1;
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, GRAN, &closed, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", good);
  int readonly = open(path, O_RDONLY | O_CLOEXEC);
  assert_true(readonly >= 0);
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, GRAN, &readonly, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  detail_says("reading and writing");
  /* A failure at the second granule undoes the first: the read-only one
   * passes the checks made before mapping and fails when mapped. */
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, 2 * GRAN, (int[]){good, readonly}, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_access_check(0, (void *)(a + 2 * GRAN), 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->unmap(0, a + 2 * GRAN, GRAN), MAGPIE_ERR_INVALID_ARGUMENT);
  /* A bad descriptor at the second granule: nothing mapped at all. */
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, 2 * GRAN, (int[]){good, p[1]}, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_access_check(0, (void *)(a + 2 * GRAN), 1), MAGPIE_ERR_INVALID_ARGUMENT);
  /* The range is still usable: the same granule imported twice. */
  assert_int_equal(ops->import_map(0, a + 2 * GRAN, 2 * GRAN, (int[]){good, good}, 0), MAGPIE_OK);
  ((volatile char *)(a + GRAN))[5] = 42;
  assert_int_equal(((volatile char *)(a + 2 * GRAN))[5], 42);
  assert_int_equal(((volatile char *)(a + 3 * GRAN))[5], 42);
  /* An import is not exported again: its exporter does that. */
  assert_int_equal(ops->export_fds(0, a + 2 * GRAN, GRAN, fd), MAGPIE_ERR_INVALID_ARGUMENT);
  detail_says("imported");
  /* An unmap of the import does not count capacity. */
  assert_true(free_bytes(ops, 0) == free0 - 2 * GRAN);
  assert_int_equal(ops->unmap(0, a, 4 * GRAN), MAGPIE_OK);
  assert_true(free_bytes(ops, 0) == free0);
  assert_int_equal(ops->unreserve(0, a, 6 * GRAN), MAGPIE_OK);
  close(p[0]);
  close(p[1]);
  close(small);
  close(readonly);
  close(good);
  assert_int_equal(open_fds(), fds0);
}

/* Out of descriptors: the map fails whole, saying what to do. */
static void test_out_of_descriptors(void **state) {
  (void)state;
  const backend_ops *ops = table();
  size_t free0 = free_bytes(ops, 0);
  int fds0 = open_fds();
  uintptr_t a;
  assert_int_equal(ops->reserve(0, 4 * GRAN, &a), MAGPIE_OK);
  struct rlimit saved, l;
  assert_int_equal(getrlimit(RLIMIT_NOFILE, &saved), 0);
  int lowest = open("/dev/null", O_RDONLY | O_CLOEXEC); /* the lowest free descriptor */
  assert_true(lowest >= 0);
  close(lowest);
  l = saved;
  l.rlim_cur = (rlim_t)lowest + 2; /* room for two more */
  assert_int_equal(setrlimit(RLIMIT_NOFILE, &l), 0);
  int rc = ops->map(0, a, 4 * GRAN, BACKEND_MAP_EXPORTABLE, 0);
  char detail[BACKEND_DETAIL_LEN];
  snprintf(detail, sizeof detail, "%s", backend_error_detail());
  assert_int_equal(setrlimit(RLIMIT_NOFILE, &saved), 0);
  assert_int_equal(rc, MAGPIE_ERR_OUT_OF_MEMORY);
  if (strstr(detail, "file descriptors") == NULL || strstr(detail, "RLIMIT_NOFILE") == NULL ||
      strstr(detail, "MAGPIE_CONF=ipc=0") == NULL)
    fail_msg("unexpected reason: %s", detail);
  /* Nothing left behind: capacity, descriptors, the range unmapped. */
  assert_true(free_bytes(ops, 0) == free0);
  assert_int_equal(open_fds(), fds0);
  assert_int_equal(magpie_sim_access_check(0, (void *)a, 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->map(0, a, 4 * GRAN, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  assert_int_equal(ops->unmap(0, a, 4 * GRAN), MAGPIE_OK);
  assert_int_equal(ops->unreserve(0, a, 4 * GRAN), MAGPIE_OK);
}

/* ---------------------------------------------------------------- another process */

/* What the parent sends the child with the descriptors. */
struct ipc_hello {
  uint64_t seed;
  uint32_t granules;
  unsigned char uuid[16]; /* the exporting device's */
};

static int send_with_fds(int sock, const void *data, size_t len, const int *fds, int n) {
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int) * IPC_GRANULES)];
  } u;
  memset(&u, 0, sizeof u);
  struct iovec iov = {(void *)data, len};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
  if (n > 0) {
    m.msg_control = u.buf;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n);
  }
  return sendmsg(sock, &m, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -1;
}

/* Receives len bytes and exactly n descriptors (n may be 0). */
static int recv_with_fds(int sock, void *data, size_t len, int *fds, int n) {
  union {
    struct cmsghdr h;
    char buf[CMSG_SPACE(sizeof(int) * IPC_GRANULES)];
  } u;
  memset(&u, 0, sizeof u);
  struct iovec iov = {data, len};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  if (recvmsg(sock, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL) != (ssize_t)len) return -1;
  int got = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c != NULL; c = CMSG_NXTHDR(&m, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      got = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      if (got > n) return -1;
      memcpy(fds, CMSG_DATA(c), sizeof(int) * (size_t)got);
    }
  return got == n ? 0 : -1;
}

/* The child: a process of its own using the simulated device, which
 * imports what the parent exported. Each failure exits with its own code. */
static int ipc_child(int sock) {
  struct timeval tv = {WAIT_MS / 1000, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct ipc_hello h;
  int fds[IPC_GRANULES];
  if (recv_with_fds(sock, &h, sizeof h, fds, IPC_GRANULES) != 0 || h.granules != IPC_GRANULES) return 10;
  const backend_ops *ops = magpie_sim_device_table(BACKEND_ABI);
  if (ops == NULL || ops->init() != MAGPIE_OK) return 11;
  unsigned char uuid[16];
  if (ops->device_uuid(0, uuid) != MAGPIE_OK || memcmp(uuid, h.uuid, sizeof uuid) != 0) return 12;
  size_t size = (size_t)h.granules * GRAN, f0, f, t;
  uintptr_t base;
  if (ops->reserve(0, size, &base) != MAGPIE_OK || ops->mem_info(0, &f0, &t) != MAGPIE_OK) return 13;
  if (ops->import_map(0, base, size, fds, 0) != MAGPIE_OK) return 14;
  for (int i = 0; i < IPC_GRANULES; i++) close(fds[i]);
  if (ops->mem_info(0, &f, &t) != MAGPIE_OK || f != f0) return 15;
  if (!stamped(base, size, h.seed)) return 16;
  if (magpie_sim_access_check(0, (void *)base, size) != MAGPIE_OK) return 17;
  stamp(base, size, h.seed + 1);
  char c = 'w';
  if (send_with_fds(sock, &c, 1, NULL, 0) != 0) return 18;
  /* The parent checks our writes and unmaps its own mapping. */
  if (recv_with_fds(sock, &c, 1, NULL, 0) != 0 || c != 'u') return 19;
  if (!stamped(base, size, h.seed + 1)) return 20;
  if (ops->unmap(0, base, size) != MAGPIE_OK || ops->unreserve(0, base, size) != MAGPIE_OK) return 21;
  if (ops->mem_info(0, &f, &t) != MAGPIE_OK || f != f0) return 22;
  return 0;
}

extern char **environ;

static void test_import_in_another_process(void **state) {
  (void)state;
  const backend_ops *ops = table();
  int fds0 = open_fds();
  size_t size = IPC_GRANULES * GRAN, free0 = free_bytes(ops, 0);
  uintptr_t a;
  assert_int_equal(ops->reserve(0, size, &a), MAGPIE_OK);
  assert_int_equal(ops->map(0, a, size, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  struct ipc_hello h = {.seed = 0x5eed, .granules = IPC_GRANULES};
  stamp(a, size, h.seed);
  assert_int_equal(ops->device_uuid(0, h.uuid), MAGPIE_OK);
  int fds[IPC_GRANULES];
  assert_int_equal(ops->export_fds(0, a, size, fds), MAGPIE_OK);
  /* The child's end is inherited across exec (not close-on-exec); the
   * exported descriptors are not: they reach the child only through the
   * socket. The simulator's threads do not survive a fork, so the child is
   * a fresh run of this program. */
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  assert_int_equal(fcntl(sv[0], F_SETFD, FD_CLOEXEC), 0);
  char fdarg[16];
  snprintf(fdarg, sizeof fdarg, "%d", sv[1]);
  char *argv[] = {"sim_ipc_test", "--ipc-child", fdarg, NULL};
  pid_t pid;
  assert_int_equal(posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ), 0);
  close(sv[1]);
  struct timeval tv = {WAIT_MS / 1000, 0};
  setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  assert_int_equal(send_with_fds(sv[0], &h, sizeof h, fds, IPC_GRANULES), 0);
  for (int i = 0; i < IPC_GRANULES; i++) close(fds[i]);
  char c = 0;
  int got = recv_with_fds(sv[0], &c, 1, NULL, 0);
  int written = got == 0 && c == 'w' && stamped(a, size, h.seed + 1);
  /* The exporter unmaps before the importer is done: its mapping lives. */
  assert_int_equal(ops->unmap(0, a, size), MAGPIE_OK);
  assert_true(free_bytes(ops, 0) == free0);
  c = 'u';
  send_with_fds(sv[0], &c, 1, NULL, 0);
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  close(sv[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail_msg("the importing process failed: %s %d", WIFEXITED(status) ? "exit" : "signal",
             WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
  assert_true(written); /* the child's writes reached the exporter's mapping */
  assert_int_equal(ops->unreserve(0, a, size), MAGPIE_OK);
  assert_int_equal(open_fds(), fds0);
}

/* ---------------------------------------------------------------- access rights */

static void test_peer_queries_and_uuid(void **state) {
  (void)state;
  const backend_ops *ops = table();
  int can = -1;
  assert_int_equal(ops->can_access_peer(0, 1, &can), MAGPIE_OK);
  assert_int_equal(can, 1);
  can = -1;
  assert_int_equal(ops->can_access_peer(1, 0, &can), MAGPIE_OK);
  assert_int_equal(can, 1);
  assert_int_equal(ops->can_access_peer(0, 0, &can), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->can_access_peer(0, 2, &can), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->can_access_peer(-1, 0, &can), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_set_peer_capable(1, 1, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_set_peer_capable(0, 2, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_INVALID_ARGUMENT);
  /* Directional: 0's memory closed to 1, 1's still open to 0. */
  assert_int_equal(magpie_sim_set_peer_capable(0, 1, 0), MAGPIE_OK);
  assert_int_equal(ops->can_access_peer(0, 1, &can), MAGPIE_OK);
  assert_int_equal(can, 0);
  assert_int_equal(ops->can_access_peer(1, 0, &can), MAGPIE_OK);
  assert_int_equal(can, 1);
  assert_int_equal(magpie_sim_set_peer_capable(0, 1, 1), MAGPIE_OK);
  assert_int_equal(ops->can_access_peer(0, 1, &can), MAGPIE_OK);
  assert_int_equal(can, 1);

  unsigned char u0[16], u1[16], again[16];
  static const unsigned char want0[16] = {'m', 'a', 'g', 'p', 'i', 'e', '-', 's', 'i', 'm', '-', 'd', 'e', 'v', 0, 0};
  assert_int_equal(ops->device_uuid(0, u0), MAGPIE_OK);
  assert_int_equal(ops->device_uuid(1, u1), MAGPIE_OK);
  assert_int_equal(ops->device_uuid(0, again), MAGPIE_OK);
  assert_memory_equal(u0, want0, 16);
  assert_memory_equal(u0, again, 16);
  assert_memory_not_equal(u0, u1, 16);
  assert_int_equal(u1[15], 1);
  assert_int_equal(ops->device_uuid(2, u0), MAGPIE_ERR_INVALID_ARGUMENT);
}

static void set_flag_atomic(void *arg) { atomic_store((atomic_int *)arg, 1); }

static void test_access_rights_vmm(void **state) {
  (void)state;
  const backend_ops *ops = table();
  uintptr_t a;
  assert_int_equal(ops->reserve(0, 4 * GRAN, &a), MAGPIE_OK);
  assert_int_equal(ops->map(0, a, GRAN, 0, 0), MAGPIE_OK);
  void *p = (void *)a;
  assert_int_equal(magpie_sim_access_check(0, p, GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(0, p, 0), MAGPIE_OK); /* nothing touched */
  assert_int_equal(magpie_sim_access_check(1, p, GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_last_error(), MAGPIE_ERR_NO_PEER_ACCESS);
  const char *msg = magpie_sim_last_error_message();
  if (strstr(msg, "device 0's memory") == NULL || strstr(msg, "not accessible from device 1") == NULL ||
      strstr(msg, "magpie_device_enable_peer_access(0, 1)") == NULL)
    fail_msg("unexpected message: %s", msg);
  /* Past the mapped granule, and memory no device has. */
  assert_int_equal(magpie_sim_access_check(0, p, GRAN + 1), MAGPIE_ERR_INVALID_ARGUMENT);
  static int host_word;
  assert_int_equal(magpie_sim_access_check(0, &host_word, sizeof host_word), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_access_check(2, p, 1), MAGPIE_ERR_INVALID_ARGUMENT);

  /* A kernel of device 1 touching it is refused at enqueue; device 0's runs. */
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t s1 = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  cudaStream_t s0 = magpie_sim_stream_create();
  assert_non_null(s1);
  assert_non_null(s0);
  atomic_int ran = 0;
  assert_int_equal(magpie_sim_launch_access(s1, set_flag_atomic, &ran, p, 64), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_non_null(strstr(magpie_sim_last_error_message(), "magpie_sim_launch_access"));
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(atomic_load(&ran), 0);
  assert_int_equal(magpie_sim_launch_access(s0, set_flag_atomic, &ran, p, 64), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s0), MAGPIE_OK);
  assert_int_equal(atomic_load(&ran), 1);
  assert_int_equal(magpie_sim_launch_access(s0, NULL, NULL, p, 64), MAGPIE_ERR_INVALID_ARGUMENT);

  /* Granted: accessible from device 1, the kernel runs. */
  assert_int_equal(ops->set_access(0, a, GRAN, 1u << 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, GRAN), MAGPIE_OK);
  atomic_store(&ran, 0);
  assert_int_equal(magpie_sim_launch_access(s1, set_flag_atomic, &ran, p, GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(atomic_load(&ran), 1);
  /* set_access needs every granule mapped, and real devices. */
  assert_int_equal(ops->set_access(0, a, 2 * GRAN, 1u << 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->set_access(0, a, GRAN, 1u << 5), MAGPIE_ERR_INVALID_ARGUMENT);
  /* Mapped with the peer: accessible at once; a range over both granules. */
  assert_int_equal(ops->map(0, a + GRAN, GRAN, 0, 1u << 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, 2 * GRAN), MAGPIE_OK);
  assert_int_equal(ops->map(0, a + 2 * GRAN, GRAN, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, 3 * GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(0, p, 3 * GRAN), MAGPIE_OK);

  /* A machine where 0's memory cannot reach 1: grants refused, naming
   * both; rights already given stay. */
  size_t f0 = free_bytes(ops, 0);
  assert_int_equal(magpie_sim_set_peer_capable(0, 1, 0), MAGPIE_OK);
  assert_int_equal(ops->set_access(0, a + 2 * GRAN, GRAN, 1u << 1), MAGPIE_ERR_NO_PEER_ACCESS);
  detail_says("device 0's memory cannot be made accessible from device 1");
  assert_int_equal(ops->map(0, a + 3 * GRAN, GRAN, 0, 1u << 1), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_true(free_bytes(ops, 0) == f0);
  assert_int_equal(magpie_sim_access_check(0, (void *)(a + 3 * GRAN), 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->peer_enable(0, 1), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, p, 2 * GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)(a + 2 * GRAN), GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  /* The other direction is unaffected. */
  uintptr_t b;
  assert_int_equal(ops->reserve(1, GRAN, &b), MAGPIE_OK);
  assert_int_equal(ops->map(1, b, GRAN, 0, 1u << 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(0, (void *)b, GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_set_peer_capable(0, 1, 1), MAGPIE_OK);
  assert_int_equal(ops->set_access(0, a + 2 * GRAN, GRAN, 1u << 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, 3 * GRAN), MAGPIE_OK);

  /* Taken back from one granule: refused there only, and a kernel of
   * device 1 over it is refused at enqueue, as a GPU faults. */
  assert_int_equal(ops->revoke_access(0, a + GRAN, GRAN, 1u << 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)(a + GRAN), GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, (void *)(a + 2 * GRAN), GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(0, p, 3 * GRAN), MAGPIE_OK);
  atomic_store(&ran, 0);
  assert_int_equal(magpie_sim_launch_access(s1, set_flag_atomic, &ran, p, 3 * GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(atomic_load(&ran), 0);
  /* Over all three; again is no change. Its own device's access cannot be
   * taken; the range must be mapped; the devices must exist. */
  assert_int_equal(ops->revoke_access(0, a, 3 * GRAN, 1u << 1), MAGPIE_OK);
  assert_int_equal(ops->revoke_access(0, a, 3 * GRAN, 1u << 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)(a + 2 * GRAN), GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(ops->revoke_access(0, a, GRAN, 1u << 0), MAGPIE_ERR_INVALID_ARGUMENT);
  detail_says("its own memory cannot be revoked");
  assert_int_equal(magpie_sim_access_check(0, p, 3 * GRAN), MAGPIE_OK);
  assert_int_equal(ops->revoke_access(0, a, 4 * GRAN, 1u << 1), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->revoke_access(0, a, GRAN, 1u << 5), MAGPIE_ERR_INVALID_ARGUMENT);
  /* Granted again. */
  assert_int_equal(ops->set_access(0, a, 3 * GRAN, 1u << 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, 3 * GRAN), MAGPIE_OK);

  assert_int_equal(ops->unmap(1, b, GRAN), MAGPIE_OK);
  assert_int_equal(ops->unreserve(1, b, GRAN), MAGPIE_OK);
  assert_int_equal(ops->unmap(0, a, 3 * GRAN), MAGPIE_OK);
  /* Rights go with the mapping: mapped again, only device 0's. */
  assert_int_equal(ops->map(0, a, GRAN, 0, 0), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, p, 1), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(ops->unmap(0, a, GRAN), MAGPIE_OK);
  assert_int_equal(ops->unreserve(0, a, 4 * GRAN), MAGPIE_OK);
  magpie_sim_stream_destroy(s0);
  magpie_sim_stream_destroy(s1);
}

/* Without VMM: plain allocations, opened to a peer per device, present and
 * future, and closed again. Leaves device 0's allocations open to device 1;
 * runs before the capture rule's test, which opens device 1's to device 0
 * and closes them again. */
static void test_access_rights_fallback(void **state) {
  (void)state;
  const backend_ops *ops = table();
  sim_memory_set_vmm(0);
  int vmm = -1;
  assert_int_equal(ops->vmm_supported(0, &vmm), MAGPIE_OK);
  assert_int_equal(vmm, 0);
  assert_int_equal(ops->set_access(0, 0, GRAN, 2), MAGPIE_ERR_BACKEND);
  int fd = -1;
  assert_int_equal(ops->export_fds(0, 0, GRAN, &fd), MAGPIE_ERR_BACKEND);
  assert_int_equal(ops->import_map(0, 0, GRAN, &fd, 0), MAGPIE_ERR_BACKEND);
  uintptr_t before, after, other;
  assert_int_equal(ops->mem_alloc(0, GRAN, &before), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(0, (void *)before, GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)before, GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(ops->mem_alloc(1, GRAN, &other), MAGPIE_OK);
  /* Not capable: refused. */
  assert_int_equal(magpie_sim_set_peer_capable(0, 1, 0), MAGPIE_OK);
  assert_int_equal(ops->peer_enable(0, 1), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, (void *)before, GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_set_peer_capable(0, 1, 1), MAGPIE_OK);
  assert_int_equal(ops->peer_enable(0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->peer_enable(0, 2), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(ops->peer_enable(0, 1), MAGPIE_OK);
  assert_int_equal(ops->peer_enable(0, 1), MAGPIE_OK); /* already: fine */
  assert_int_equal(magpie_sim_access_check(1, (void *)before, GRAN), MAGPIE_OK);
  assert_int_equal(ops->mem_alloc(0, 3 * GRAN, &after), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)after, 3 * GRAN), MAGPIE_OK);
  /* One direction only. */
  assert_int_equal(magpie_sim_access_check(0, (void *)other, GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_set_device(1), MAGPIE_OK);
  cudaStream_t s1 = magpie_sim_stream_create();
  assert_int_equal(magpie_sim_set_device(0), MAGPIE_OK);
  atomic_int ran = 0;
  assert_int_equal(magpie_sim_launch_access(s1, set_flag_atomic, &ran, (void *)after, 3 * GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_stream_synchronize(s1), MAGPIE_OK);
  assert_int_equal(atomic_load(&ran), 1);
  /* Disabled: every allocation of device 0, present and future, is closed
   * to device 1 again; disabling twice is no change. */
  assert_int_equal(ops->peer_disable(0, 1), MAGPIE_OK);
  assert_int_equal(ops->peer_disable(0, 1), MAGPIE_OK);
  assert_int_equal(ops->peer_disable(0, 0), MAGPIE_ERR_INVALID_ARGUMENT);
  assert_int_equal(magpie_sim_access_check(1, (void *)before, GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(magpie_sim_access_check(1, (void *)after, 3 * GRAN), MAGPIE_ERR_NO_PEER_ACCESS);
  atomic_store(&ran, 0);
  assert_int_equal(magpie_sim_launch_access(s1, set_flag_atomic, &ran, (void *)after, 3 * GRAN),
                   MAGPIE_ERR_NO_PEER_ACCESS);
  assert_int_equal(ops->peer_enable(0, 1), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)after, 3 * GRAN), MAGPIE_OK);
  magpie_sim_stream_destroy(s1);
  assert_int_equal(ops->mem_free(0, before, GRAN), MAGPIE_OK);
  assert_int_equal(ops->mem_free(0, after, 3 * GRAN), MAGPIE_OK);
  assert_int_equal(ops->mem_free(1, other, GRAN), MAGPIE_OK);
  assert_int_equal(magpie_sim_access_check(1, (void *)before, 1), MAGPIE_ERR_INVALID_ARGUMENT);
  sim_memory_set_vmm(1);
}

/* ---------------------------------------------------------------- capture rule */

struct beginner {
  cudaStream_t s;
  int rc;
};

static void *beginner_main(void *arg) {
  struct beginner *b = arg;
  b->rc = magpie_sim_stream_begin_capture(b->s, MAGPIE_SIM_CAPTURE_GLOBAL);
  return NULL;
}

enum new_op {
  NEW_MAP_EXPORTABLE,
  NEW_SET_ACCESS,
  NEW_REVOKE_ACCESS,
  NEW_PEER_ENABLE,
  NEW_PEER_DISABLE,
  NEW_EXPORT,
  NEW_IMPORT,
  NEW_COUNT
};

static const char *const new_op_says[NEW_COUNT] = {
    [NEW_MAP_EXPORTABLE] = "mapping device memory",
    [NEW_SET_ACCESS] = "changing access to device memory",
    [NEW_REVOKE_ACCESS] = "taking access to device memory back",
    [NEW_PEER_ENABLE] = "enabling peer access",
    [NEW_PEER_DISABLE] = "disabling peer access",
    [NEW_EXPORT] = "exporting device memory",
    [NEW_IMPORT] = "importing device memory",
};

/* a: a reservation of 3 granules, the first mapped exportable, the others
 * not mapped. Each call, when permitted, is undone. */
static int new_call(enum new_op op, uintptr_t a, int through_table) {
  const backend_ops *ops = table();
  int fd = -1, rc = -1;
  switch (op) {
  case NEW_MAP_EXPORTABLE:
    rc = through_table ? ops->map(0, a + GRAN, GRAN, BACKEND_MAP_EXPORTABLE, 0)
                       : sim_memory_map(0, a + GRAN, GRAN, BACKEND_MAP_EXPORTABLE, 0);
    if (rc == MAGPIE_OK) assert_int_equal(ops->unmap(0, a + GRAN, GRAN), MAGPIE_OK);
    break;
  case NEW_SET_ACCESS:
    rc = through_table ? ops->set_access(0, a, GRAN, 0) : sim_memory_set_access(0, a, GRAN, 0);
    break;
  case NEW_REVOKE_ACCESS:
    rc = through_table ? ops->revoke_access(0, a, GRAN, 1u << 1) : sim_memory_revoke_access(0, a, GRAN, 1u << 1);
    break;
  case NEW_PEER_ENABLE: rc = through_table ? ops->peer_enable(1, 0) : sim_memory_peer_enable(1, 0); break;
  case NEW_PEER_DISABLE: rc = through_table ? ops->peer_disable(1, 0) : sim_memory_peer_disable(1, 0); break;
  case NEW_EXPORT:
    rc = through_table ? ops->export_fds(0, a, GRAN, &fd) : sim_memory_export_fds(0, a, GRAN, &fd);
    if (rc == MAGPIE_OK) close(fd);
    break;
  case NEW_IMPORT:
    assert_int_equal(ops->export_fds(0, a, GRAN, &fd), MAGPIE_OK);
    rc = through_table ? ops->import_map(0, a + 2 * GRAN, GRAN, &fd, 0)
                       : sim_memory_import_map(0, a + 2 * GRAN, GRAN, &fd, 0);
    if (rc == MAGPIE_OK) assert_int_equal(ops->unmap(0, a + 2 * GRAN, GRAN), MAGPIE_OK);
    close(fd);
    break;
  case NEW_COUNT: break;
  }
  return rc;
}

/* Refused to a thread in the global mode while another thread's global
 * capture runs (and that capture invalidated); the device table runs them
 * relaxed, so through it they pass. */
static void test_new_calls_follow_the_capture_rule(void **state) {
  (void)state;
  const backend_ops *ops = table();
  uintptr_t a;
  assert_int_equal(ops->reserve(0, 3 * GRAN, &a), MAGPIE_OK);
  assert_int_equal(ops->map(0, a, GRAN, BACKEND_MAP_EXPORTABLE, 0), MAGPIE_OK);
  size_t f0 = free_bytes(ops, 0);
  int fds0 = open_fds();
  cudaStream_t s = magpie_sim_stream_create();
  assert_non_null(s);
  for (int op = 0; op < NEW_COUNT; op++) {
    struct beginner b = {s, -1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, beginner_main, &b), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(b.rc, MAGPIE_OK);
    uint64_t v0 = magpie_sim_capture_violations();
    int rc = new_call(op, a, 0);
    if (rc != MAGPIE_ERR_CAPTURE) fail_msg("op %d: rc %d, not refused", op, rc);
    detail_says(new_op_says[op]);
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    assert_int_equal(new_call(op, a, 1), MAGPIE_OK);
    assert_true(magpie_sim_capture_violations() == v0 + 1);
    magpie_sim_graph g = (magpie_sim_graph)(uintptr_t)1;
    assert_int_equal(magpie_sim_stream_end_capture(s, &g), MAGPIE_ERR_CAPTURE);
    assert_null(g);
  }
  /* Outside a capture, the plain calls pass. */
  for (int op = 0; op < NEW_COUNT; op++) assert_int_equal(new_call(op, a, 0), MAGPIE_OK);
  assert_true(free_bytes(ops, 0) == f0);
  assert_int_equal(open_fds(), fds0);
  assert_int_equal(ops->unmap(0, a, GRAN), MAGPIE_OK);
  assert_int_equal(ops->unreserve(0, a, 3 * GRAN), MAGPIE_OK);
  magpie_sim_stream_destroy(s);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--ipc-child") == 0) return ipc_child(atoi(argv[2]));
  /* Before the simulator's first use: it reads the environment once (the
   * child inherits it). */
  setenv("MAGPIE_SIM_DEVICES", "2", 1);
  unsetenv("MAGPIE_SIM_MEMORY");
  unsetenv("MAGPIE_SIM_VMM");
  /* The usual soft limit of descriptors, whatever this process was given,
   * so that test_fd_limit_raised sees the simulator raise it. */
  struct rlimit l;
  if (getrlimit(RLIMIT_NOFILE, &l) == 0 && l.rlim_max > 1024) {
    l.rlim_cur = 1024;
    setrlimit(RLIMIT_NOFILE, &l);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table_version),
      cmocka_unit_test(test_fd_limit_raised),
      cmocka_unit_test(test_export_import_in_process),
      cmocka_unit_test(test_export_import_refusals),
      cmocka_unit_test(test_out_of_descriptors),
      cmocka_unit_test(test_import_in_another_process),
      cmocka_unit_test(test_peer_queries_and_uuid),
      cmocka_unit_test(test_access_rights_vmm),
      cmocka_unit_test(test_access_rights_fallback),
      cmocka_unit_test(test_new_calls_follow_the_capture_rule),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
