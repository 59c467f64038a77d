/* Sharing blocks with other processes (magpie.h, "IPC"): what the export
 * server (ipc_server.c) and the public entry points (ipc.c) share: the
 * handles' layouts (the 128-byte handle and the 64-byte compact one), the
 * socket's name and the messages on it (ipc_wire.c).
 *
 * The exporting process serves imports from one thread, on a SOCK_SEQPACKET
 * Unix socket in the abstract namespace named by its pid and a random
 * nonce. An importer connects, sends one request (the export's block
 * address, id and secret); the server answers with the span to map, the
 * device's UUID and one file descriptor per granule (SCM_RIGHTS), and
 * keeps the connection: it is the import's hold on the block (pool/record.h,
 * exports), released when the importer closes it, by magpie_ipc_close or by
 * exiting.
 *
 * Lock order: ipc_st.lock is a leaf (ipc.c and ipc_server.c hold it
 * for list and state changes only, never across a driver call, a socket
 * call that can block, or another lock). */
#ifndef MAGPIE_IPC_H
#define MAGPIE_IPC_H

#include <stddef.h>
#include <stdint.h>

#include <pthread.h>

#include "magpie.h"
#include "pool/record.h"

#define IPC_MAGIC 0x4d504948u /* "MPIH" */
/* The protocol's version, in both handles and in the request. 2: the reply
 * carries the device's UUID (the compact handle has no room for it). */
#define IPC_VERSION 2u

/* The handle's bytes (magpie_ipc_handle), host order: both processes are
 * on one machine. */
typedef struct ipc_wire_handle {
  uint32_t magic;
  uint16_t version;
  uint16_t pad0;
  uint32_t pid;           /* the exporting process */
  int32_t device;         /* its device ordinal (for messages) */
  uint64_t nonce;         /* names its server's socket, with pid */
  unsigned char uuid[16]; /* its device (the importer maps on the reply's, the same) */
  uint64_t export_id;
  unsigned char secret[RECORD_SECRET_LEN];
  uint64_t ptr;  /* the block's address in the exporting process */
  uint64_t size; /* its usable size (the importer reports the reply's, the same) */
} ipc_wire_handle;
_Static_assert(sizeof(ipc_wire_handle) <= MAGPIE_IPC_HANDLE_SIZE, "the handle's layout fits its bytes");

/* The compact handle's bytes (magpie_ipc_compact: the 64 bytes of a
 * cudaIpcMemHandle_t), host order. The same export as the long handle,
 * with what the importer cannot do without: the server's socket (pid,
 * nonce), the export (ptr, export_id) and the 128-bit secret that proves
 * the importer was given the handle. The long handle's device UUID and size
 * are left out: the server's reply carries both. The tag and the check
 * tell it from a CUDA handle, whose 64 bytes are the driver's own: a CUDA
 * handle would have to carry the 7 tag bytes and the 32-bit check of its
 * other bytes by chance. */
#define IPC_COMPACT_TAG "\xd7magpie" /* 7 bytes, no terminating zero in the handle */
#define IPC_COMPACT_TAG_LEN 7
typedef struct ipc_compact_wire {
  unsigned char tag[IPC_COMPACT_TAG_LEN];
  uint8_t version; /* IPC_VERSION */
  uint32_t pid;    /* the exporting process */
  uint32_t check;  /* ipc_compact_check of the other 60 bytes */
  uint64_t nonce;  /* names its server's socket, with pid */
  uint64_t export_id;
  uint64_t ptr; /* the block's address in the exporting process */
  unsigned char secret[RECORD_SECRET_LEN];
  int32_t device; /* its device ordinal there (for messages) */
  uint32_t zero;  /* 0: room for a later version */
} ipc_compact_wire;
_Static_assert(sizeof(ipc_compact_wire) == MAGPIE_IPC_COMPACT_SIZE && offsetof(ipc_compact_wire, zero) == 60,
               "the compact handle fills its 64 bytes, with no padding");

/* FNV-1a (32 bits) of the compact handle's bytes, its check field taken as
 * zero (ipc_wire.c). */
uint32_t ipc_compact_check(const ipc_compact_wire *w);

/* importer -> server, once per connection. */
typedef struct ipc_request {
  uint32_t magic;
  uint32_t version;
  uint64_t ptr;
  uint64_t export_id;
  unsigned char secret[RECORD_SECRET_LEN];
} ipc_request;

/* server -> importer: the first message; nfds descriptors follow in it and
 * in later messages of at most IPC_FDS_PER_MSG each (SCM_MAX_FD is 253). */
#define IPC_FDS_PER_MSG 200
typedef struct ipc_reply {
  uint32_t magic;
  int32_t status; /* RECORD_IMPORT_*, or IPC_REPLY_FAILED with message */
  uint64_t span_base;
  uint64_t span_size;
  uint64_t gran;
  uint64_t bytes;
  uint64_t nfds;
  unsigned char uuid[16]; /* the block's device: the importer maps it on its device of that UUID */
  char message[200];
} ipc_reply;
#define IPC_REPLY_FAILED 100

/* The abstract socket's name for (pid, nonce): fills addr, returns its
 * length for bind/connect. */
struct sockaddr_un;
unsigned ipc_socket_name(uint32_t pid, uint64_t nonce, struct sockaddr_un *addr);
/* Sends len bytes of msg with fds[0..nfds) attached (nfds <= IPC_FDS_PER_MSG)
 * without blocking; 0 or an errno. */
int ipc_send(int sock, const void *msg, size_t len, const int *fds, size_t nfds);
/* Receives one message into msg (at most len bytes; *got set) and up to
 * maxfds descriptors (*nfds set; close-on-exec); 0 or an errno (EPROTO for
 * a truncated message). */
int ipc_recv(int sock, void *msg, size_t len, size_t *got, int *fds, size_t maxfds, size_t *nfds);

/* Starts this process's export server if it is not running; its nonce in
 * *nonce. MAGPIE_OK, or MAGPIE_ERR_IPC with the error set. (A forked
 * child serves nothing, its parent's server being the parent's: the
 * layer's fork handler closes the inherited socket.) */
int ipc_server_ensure(uint64_t *nonce);

/* The layer's process-wide state (defined in ipc_server.c), all under
 * lock (a leaf: no other lock and no driver call under it): the export
 * server's (started once its socket is bound and its thread runs; the
 * thread reads listen_fd, written before pthread_create, which orders it;
 * atfork: the fork handler is registered, at load), the nonce naming its socket,
 * and this process's imports. next_id: export ids (fetch_add, relaxed:
 * only uniqueness matters). */
struct ipc_import;
typedef struct ipc_state {
  pthread_mutex_t lock;
  int started;
  int atfork;
  int listen_fd;
  uint64_t nonce;
  struct ipc_import *imports;
  _Atomic uint64_t next_id;
} ipc_state;

extern ipc_state ipc_st;

#endif /* MAGPIE_IPC_H */
