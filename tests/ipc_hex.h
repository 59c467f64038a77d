/* magpie_ipc_handle and magpie_ipc_compact as a line of hex, for the IPC
 * tests' processes to pass through pipes (tests/ipc_test.c,
 * tests/gpu/gpu_ipc_test.c). */
#ifndef MAGPIE_TESTS_IPC_HEX_H
#define MAGPIE_TESTS_IPC_HEX_H

#include <stdio.h>
#include <string.h>

#include "magpie.h"

/* Characters of a handle's hex, its terminating zero included. */
#define IPC_HEX_LEN (2 * MAGPIE_IPC_HANDLE_SIZE + 1)

static inline void to_hex(const magpie_ipc_handle *h, char *out) {
  for (int i = 0; i < MAGPIE_IPC_HANDLE_SIZE; i++) sprintf(out + 2 * i, "%02x", h->bytes[i]);
}

/* 0, or -1 if s does not start with a handle's hex. */
static inline int from_hex(const char *s, magpie_ipc_handle *h) {
  if (strlen(s) < 2 * MAGPIE_IPC_HANDLE_SIZE) return -1;
  for (int i = 0; i < MAGPIE_IPC_HANDLE_SIZE; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    h->bytes[i] = (unsigned char)v;
  }
  return 0;
}

/* The same for the compact handle (magpie_ipc_compact, 64 bytes). */
#define IPC_COMPACT_HEX_LEN (2 * MAGPIE_IPC_COMPACT_SIZE + 1)

static inline void compact_to_hex(const magpie_ipc_compact *h, char *out) {
  for (int i = 0; i < MAGPIE_IPC_COMPACT_SIZE; i++) sprintf(out + 2 * i, "%02x", h->bytes[i]);
}

static inline int compact_from_hex(const char *s, magpie_ipc_compact *h) {
  if (strlen(s) < 2 * MAGPIE_IPC_COMPACT_SIZE) return -1;
  for (int i = 0; i < MAGPIE_IPC_COMPACT_SIZE; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    h->bytes[i] = (unsigned char)v;
  }
  return 0;
}

#endif /* MAGPIE_TESTS_IPC_HEX_H */
