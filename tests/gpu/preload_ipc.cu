// preload_ipc: legacy CUDA IPC and the revocation of peer access in an
// ordinary CUDA program, run as is and under LD_PRELOAD=libmagpie_preload.so
// (tests/gpu/README.md). The importing process is this program again,
// started with posix_spawn (an exec: CUDA state is never inherited through
// fork), the handle passed as hex on its command line.
//   1. IPC: the parent cudaMalloc's a block on device 0, fills it with a
//      kernel and cudaIpcGetMemHandle's it; the child opens it twice
//      (cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess: one
//      address, two opens), checks every word with a kernel and writes its
//      own, closes twice; the parent checks the child's words on the host.
//   2. A CUDA handle: the same with a cudaMallocPitch block, which the
//      preload library never serves: the handle is CUDA's in both
//      processes.
//   3. Two GPUs: the child opens device 0's block with device 1 current
//      (lazy peer access) and a device-1 kernel checks and writes it.
//   4. Two GPUs, peer access taken back: device 1 granted device 0's memory
//      by cudaDeviceEnablePeerAccess and by cudaMemPoolSetAccess on device
//      0's default pool; the first disabled (the pool's grant still
//      stands), then the pool's access set to none (cudaMemPoolGetAccess
//      answers none), then enabled again: a device-1 kernel reads device
//      0's blocks, the one allocated while access was off included. A
//      faulting access would kill the context, so what is asked while
//      access is off is the mapping's rights (cuMemGetAccess), which only
//      magpie's blocks have (VMM mappings): under PRELOAD_EXPECT=1 they
//      must be read-write for device 1 while a grant stands and none after.
// With PRELOAD_EXPECT=1 it also requires that magpie served the blocks
// (magpie_usable_size in the process answers their size), that their
// handles are magpie's compact handles and the pitched block's is not
// (magpie_ipc_is_compact), and (5) magpie's guarantee, undefined under
// CUDA: a block the parent frees while the child has it open is not handed
// out again (8 cudaMalloc's of its size meanwhile) and the child still
// reads the parent's words; cudaMemPoolExportPointer of a magpie block
// answers cudaErrorNotSupported. With one GPU, 3 and 4 say so and pass.
//
// Built with nvcc -cudart shared (a statically linked runtime cannot be
// interposed).
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_check.h"
#include "preload_kernels.cuh"

extern char **environ;

static const size_t N = (size_t)1 << 20; // words per block (4 MiB)

// Counts the words of p that are not seed's pattern into *bad; with reply
// nonzero, then writes reply's pattern.
__global__ void check_write(unsigned *p, size_t n, unsigned seed, unsigned reply, unsigned long long *bad) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    mine += p[i] != mix(seed, i);
    if (reply) p[i] = mix(reply, i);
  }
  if (mine) atomicAdd(bad, mine);
}

// Words of p (on the device) that are not seed's pattern, counted by a
// kernel of the current device; with reply nonzero, reply's pattern is
// written.
static unsigned long long device_check(unsigned *p, size_t n, unsigned seed, unsigned reply) {
  unsigned long long *bad = NULL, h = 0;
  CHECK(cudaMalloc(&bad, sizeof *bad));
  CHECK(cudaMemset(bad, 0, sizeof *bad));
  check_write<<<256, 256>>>(p, n, seed, reply, bad);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(bad));
  return h;
}

// Words of p that are not seed's pattern, read on the host.
static size_t host_wrong(const unsigned *p, size_t n, unsigned seed) {
  unsigned *h = (unsigned *)malloc(n * sizeof *h);
  CHECK(cudaMemcpy(h, p, n * sizeof *h, cudaMemcpyDefault));
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += h[i] != mix(seed, i);
  free(h);
  return bad;
}

// magpie's functions, when this process runs it (NULL otherwise).
static void *magpie_fn(const char *name) { return dlsym(RTLD_DEFAULT, name); }

static size_t magpie_size(const void *p) {
  size_t (*f)(const void *) = (size_t(*)(const void *))magpie_fn("magpie_usable_size");
  return f != NULL ? f(p) : 0;
}

static int magpie_compact(const cudaIpcMemHandle_t *h) {
  int (*f)(const void *) = (int (*)(const void *))magpie_fn("magpie_ipc_is_compact");
  return f != NULL ? f(h) : -1;
}

static void to_hex(const cudaIpcMemHandle_t *h, char *out) {
  const unsigned char *b = (const unsigned char *)h;
  for (size_t i = 0; i < sizeof *h; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static int from_hex(const char *s, cudaIpcMemHandle_t *h) {
  unsigned char *b = (unsigned char *)h;
  if (strlen(s) != 2 * sizeof *h) return -1;
  for (size_t i = 0; i < sizeof *h; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    b[i] = (unsigned char)v;
  }
  return 0;
}

static int expect = 0; // PRELOAD_EXPECT=1: magpie must serve
static int failed = 0;

static void verdict(int ok, const char *what) {
  printf("%s %s\n", ok ? "PASS" : "FAIL", what);
  fflush(stdout);
  failed |= !ok;
}

// ---- the child ----

// --child check HEX DEVICE SEED REPLY: opens the handle twice on DEVICE,
//   checks SEED's pattern with a kernel, writes REPLY's, closes twice.
// --child hold HEX DEVICE SEED: opens, says "opened", waits for a line on
//   stdin, then checks SEED's pattern and closes.
static int child_main(int argc, char **argv) {
  cudaIpcMemHandle_t h;
  if (argc < 6 || from_hex(argv[3], &h) != 0) return 90;
  int dev = atoi(argv[4]);
  unsigned seed = (unsigned)strtoul(argv[5], NULL, 0);
  CHECK(cudaSetDevice(dev));
  CHECK(cudaFree(0));                              // the context, before the open
  if (expect && magpie_compact(&h) < 0) return 91; // magpie is not in this process
  unsigned *p = NULL, *q = NULL;
  CHECK(cudaIpcOpenMemHandle((void **)&p, h, cudaIpcMemLazyEnablePeerAccess));
  if (strcmp(argv[2], "check") == 0 && argc == 7) {
    unsigned reply = (unsigned)strtoul(argv[6], NULL, 0);
    CHECK(cudaIpcOpenMemHandle((void **)&q, h, cudaIpcMemLazyEnablePeerAccess));
    if (q != p) {
      fprintf(stderr, "child: the second open gave %p, the first %p\n", (void *)q, (void *)p);
      return 92;
    }
    unsigned long long bad = device_check(p, N, seed, reply);
    CHECK(cudaIpcCloseMemHandle(q));
    CHECK(cudaIpcCloseMemHandle(p));
    if (bad != 0) {
      fprintf(stderr, "child: %llu wrong words on device %d\n", bad, dev);
      return 93;
    }
    return 0;
  }
  if (strcmp(argv[2], "hold") == 0 && argc == 6) {
    printf("opened\n");
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) return 94;
    unsigned long long bad = device_check(p, N, seed, 0);
    CHECK(cudaIpcCloseMemHandle(p));
    if (bad != 0) {
      fprintf(stderr, "child: %llu wrong words in the block its exporter freed\n", bad);
      return 95;
    }
    return 0;
  }
  return 96;
}

// ---- the parent ----

typedef struct child {
  pid_t pid;
  FILE *in, *out; // its stdin and stdout (NULL: inherited)
} child;

static child spawn_child(const char *mode, const cudaIpcMemHandle_t *h, int dev, unsigned seed, unsigned reply,
                         int pipes) {
  char hex[2 * sizeof(cudaIpcMemHandle_t) + 1], d[16], s[16], r[16];
  to_hex(h, hex);
  snprintf(d, sizeof d, "%d", dev);
  snprintf(s, sizeof s, "%u", seed);
  snprintf(r, sizeof r, "%u", reply);
  char *argv[] = {(char *)"/proc/self/exe", (char *)"--child", (char *)mode, hex, d, s, reply ? r : NULL, NULL};
  int pin[2] = {-1, -1}, pout[2] = {-1, -1};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (pipes) {
    if (pipe2(pin, O_CLOEXEC) != 0 || pipe2(pout, O_CLOEXEC) != 0) exit(3);
    posix_spawn_file_actions_adddup2(&fa, pin[0], 0);
    posix_spawn_file_actions_adddup2(&fa, pout[1], 1);
  }
  child c = {0, NULL, NULL};
  if (posix_spawn(&c.pid, "/proc/self/exe", &fa, NULL, argv, environ) != 0) {
    perror("posix_spawn");
    exit(3);
  }
  posix_spawn_file_actions_destroy(&fa);
  if (pipes) {
    close(pin[0]);
    close(pout[1]);
    c.in = fdopen(pin[1], "w");
    c.out = fdopen(pout[0], "r");
  }
  return c;
}

static int child_wait(child *c) {
  if (c->in != NULL) fclose(c->in);
  if (c->out != NULL) fclose(c->out);
  int st = 0;
  if (waitpid(c->pid, &st, 0) != c->pid) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// 1-3: the block at p (N words on device 0, filled with seed) is shared
// with a child that opens it on dev and writes reply; the parent checks.
static void round_trip(unsigned *p, unsigned seed, unsigned reply, int dev, int magpies, const char *what) {
  cudaIpcMemHandle_t h;
  CHECK(cudaIpcGetMemHandle(&h, p));
  if (expect) {
    char line[200];
    snprintf(line, sizeof line, "%s: the handle is %s (magpie_ipc_is_compact %d)", what,
             magpies ? "magpie's compact handle" : "CUDA's", magpie_compact(&h));
    verdict(magpie_compact(&h) == magpies, line);
  }
  child c = spawn_child("check", &h, dev, seed, reply, 0);
  int rc = child_wait(&c);
  CHECK(cudaSetDevice(0));
  size_t bad = rc == 0 ? host_wrong(p, N, reply) : N;
  char line[200];
  snprintf(line, sizeof line, "%s: the child (device %d) opened it twice, checked and rewrote it (exit %d, %zu wrong)",
           what, dev, rc, bad);
  verdict(rc == 0 && bad == 0, line);
}

// cuMemGetAccess of p for device dev: the flags, or -1 if the driver
// cannot say (not a VMM mapping: CUDA's own cudaMalloc memory).
static long long access_of(const void *p, int dev) {
  CUmemLocation loc = {};
  loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
  loc.id = dev;
  unsigned long long flags = 0;
  if (cuMemGetAccess(&flags, &loc, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS) return -1;
  return (long long)flags;
}

// Under PRELOAD_EXPECT, the rights of device 1 on p must be want.
static void expect_access(const void *p, long long want, const char *what) {
  long long got = access_of(p, 1);
  char line[200];
  snprintf(line, sizeof line, "%s: device 1's access to %p is %lld (%s)", what, p, got,
           want == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? "read-write wanted" : "none wanted");
  if (expect) verdict(got == want, line);
  else printf("info %s\n", line);
}

static void pool_access(cudaMemPool_t pool, int dev, cudaMemAccessFlags flags) {
  cudaMemAccessDesc d = {};
  d.location.type = cudaMemLocationTypeDevice;
  d.location.id = dev;
  d.flags = flags;
  CHECK(cudaMemPoolSetAccess(pool, &d, 1));
}

// 4: peer access of device 1 to device 0's memory, granted two ways and
// taken back.
static void peer_revocation(void) {
  const long long RW = CU_MEM_ACCESS_FLAGS_PROT_READWRITE, NONE = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  unsigned *a0 = NULL, *a2 = NULL;
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&a0, N * sizeof *a0));
  fill<<<256, 256>>>(a0, N, 0xC0u);
  CHECK(cudaDeviceSynchronize());
  cudaMemPool_t pool0;
  CHECK(cudaDeviceGetDefaultMemPool(&pool0, 0));

  CHECK(cudaSetDevice(1));
  CHECK(cudaDeviceEnablePeerAccess(0, 0));
  expect_access(a0, RW, "after cudaDeviceEnablePeerAccess");
  unsigned long long bad = device_check(a0, N, 0xC0u, 0);
  printf("%s peer access: device 1's kernel read device 0's block (%llu wrong)\n", bad ? "FAIL" : "PASS", bad);
  failed |= bad != 0;
  pool_access(pool0, 1, cudaMemAccessFlagsProtReadWrite);
  CHECK(cudaDeviceDisablePeerAccess(0));
  expect_access(a0, RW, "after cudaDeviceDisablePeerAccess, the pool's grant standing");
  pool_access(pool0, 1, cudaMemAccessFlagsProtNone);
  cudaMemLocation loc = {};
  loc.type = cudaMemLocationTypeDevice;
  loc.id = 1;
  cudaMemAccessFlags flags = cudaMemAccessFlagsProtReadWrite;
  CHECK(cudaMemPoolGetAccess(&flags, pool0, &loc));
  char line[200];
  snprintf(line, sizeof line, "pool access set to none: cudaMemPoolGetAccess answers %d", (int)flags);
  verdict(flags == cudaMemAccessFlagsProtNone, line);
  expect_access(a0, NONE, "after both grants were taken back");
  // A block mapped while access is off (64 MiB: new mappings) gets none.
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&a2, 16 * N * sizeof *a2));
  fill<<<256, 256>>>(a2, 16 * N, 0xC2u);
  CHECK(cudaDeviceSynchronize());
  expect_access(a2, NONE, "a block mapped while access is off");

  CHECK(cudaSetDevice(1));
  CHECK(cudaDeviceEnablePeerAccess(0, 0));
  expect_access(a0, RW, "enabled again");
  expect_access(a2, RW, "enabled again, the block mapped while off");
  bad = device_check(a0, N, 0xC0u, 0) + device_check(a2, 16 * N, 0xC2u, 0);
  printf("%s peer access again: device 1's kernels read both blocks (%llu wrong)\n", bad ? "FAIL" : "PASS", bad);
  failed |= bad != 0;
  CHECK(cudaDeviceDisablePeerAccess(0));
  expect_access(a0, NONE, "disabled again");
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(a2));
  CHECK(cudaFree(a0));
}

// 5 (PRELOAD_EXPECT only): the block stays out of reuse while imported.
static void free_while_open(void) {
  unsigned *p = NULL, *v[8];
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&p, N * sizeof *p));
  fill<<<256, 256>>>(p, N, 0xD0u);
  CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  CHECK(cudaIpcGetMemHandle(&h, p));
  child c = spawn_child("hold", &h, 0, 0xD0u, 0, 1);
  char line[200];
  if (fgets(line, sizeof line, c.out) == NULL || strcmp(line, "opened\n") != 0) {
    verdict(0, "free while open: the child did not open the block");
    child_wait(&c);
    return;
  }
  CHECK(cudaFree(p));
  int reused = 0;
  for (int i = 0; i < 8; i++) {
    CHECK(cudaMalloc(&v[i], N * sizeof *v[i]));
    reused |= v[i] == p;
    fill<<<256, 256>>>(v[i], N, 0xE0u + i); // would overwrite the child's words if it were the block
  }
  CHECK(cudaDeviceSynchronize());
  fprintf(c.in, "go\n");
  fflush(c.in);
  int rc = child_wait(&c);
  snprintf(line, sizeof line,
           "free while open: 8 cudaMalloc's never returned the freed block (%s), the child read its words (exit %d)",
           reused ? "one did" : "none did", rc);
  verdict(!reused && rc == 0, line);
  for (int i = 0; i < 8; i++) CHECK(cudaFree(v[i]));

  // A pool's exported pointer: refused for magpie's block.
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *q = NULL;
  CHECK(cudaMallocAsync(&q, 4096, s));
  cudaMemPoolPtrExportData data;
  cudaError_t e = cudaMemPoolExportPointer(&data, q);
  snprintf(line, sizeof line, "cudaMemPoolExportPointer of a magpie block: %s (%d)", cudaGetErrorName(e), (int)e);
  verdict(e == cudaErrorNotSupported, line);
  CHECK(cudaFreeAsync(q, s));
  CHECK(cudaStreamSynchronize(s));
  CHECK(cudaStreamDestroy(s));
}

int main(int argc, char **argv) {
  expect = getenv("PRELOAD_EXPECT") != NULL && strcmp(getenv("PRELOAD_EXPECT"), "0") != 0;
  if (argc > 1 && strcmp(argv[1], "--child") == 0) return child_main(argc, argv);
  int n = 0;
  CHECK(cudaGetDeviceCount(&n));
  int peer = 0;
  if (n >= 2) {
    int can10 = 0, can01 = 0;
    CHECK(cudaDeviceCanAccessPeer(&can10, 1, 0));
    CHECK(cudaDeviceCanAccessPeer(&can01, 0, 1));
    peer = can10 && can01;
  }

  // 1 and 3: a cudaMalloc block.
  unsigned *a = NULL;
  CHECK(cudaSetDevice(0));
  CHECK(cudaMalloc(&a, N * sizeof *a));
  if (expect) {
    char line[200];
    snprintf(line, sizeof line, "magpie served the cudaMalloc block (usable size %zu)", magpie_size(a));
    verdict(magpie_size(a) >= N * sizeof *a, line);
  }
  fill<<<256, 256>>>(a, N, 0xA0u);
  CHECK(cudaDeviceSynchronize());
  round_trip(a, 0xA0u, 0xA1u, 0, 1, "IPC, cudaMalloc block, device 0");
  if (peer) {
    fill<<<256, 256>>>(a, N, 0xA2u);
    CHECK(cudaDeviceSynchronize());
    round_trip(a, 0xA2u, 0xA3u, 1, 1, "IPC, cudaMalloc block of device 0 opened on device 1 (lazy peer access)");
  } else {
    printf("skipped: opening on device 1 (%d GPU(s), peer access %d)\n", n, peer);
  }
  CHECK(cudaFree(a));

  // 2: a pitched block, CUDA's own.
  unsigned *b = NULL;
  size_t pitch = 0;
  CHECK(cudaMallocPitch((void **)&b, &pitch, 4096, N * sizeof *b / 4096));
  if (expect) verdict(magpie_size(b) == 0, "the cudaMallocPitch block is CUDA's");
  fill<<<256, 256>>>(b, N, 0xB0u);
  CHECK(cudaDeviceSynchronize());
  round_trip(b, 0xB0u, 0xB1u, 0, 0, "IPC, cudaMallocPitch block (CUDA's handle)");
  CHECK(cudaFree(b));

  // 4: peer access taken back.
  if (peer) peer_revocation();
  else printf("skipped: peer revocation (%d GPU(s), peer access %d)\n", n, peer);

  // 5: magpie's guarantees.
  if (expect) free_while_open();

  printf("preload_ipc: %s\n", failed ? "FAILED" : "passed");
  return failed ? 1 : 0;
}
