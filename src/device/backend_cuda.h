/* The CUDA backend's shared helpers: backend_cuda.c (init, contexts,
 * events, streams) and backend_cuda_vmm.c (mappings, peer access, export
 * and import) are one table split in two files. Nothing outside them
 * includes this.
 *
 * Lock order: as backend_cuda.c (cuda_st.lock only, below every magpie
 * lock). */
#ifndef MAGPIE_BACKEND_CUDA_H
#define MAGPIE_BACKEND_CUDA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "device/backend.h"
#include "device/cuda_driver.h"

/* The backend's process-wide state (defined in backend_cuda.c;
 * backend_cuda_vmm.c reads the devices). state: written by init under lock
 * (release store, after the fields below are set); read by every operation
 * (acquire load in cuda_ready, pairing with that store). */
typedef struct cuda_state {
  pthread_mutex_t lock;
  _Atomic int state;
  /* Set once by init before state is published; read-only afterwards. */
  int ndevices;
  int devices[MAGPIE_MAX_DEVICES];
  int vmm_off; /* MAGPIE_CUDA_VMM=0: report no VMM support */
  /* init's outcome, replayed by later calls; under lock. */
  int init_code;
  char init_detail[256];
  /* Each device's retained primary context, NULL until first used. Written
   * once by cuda_device_ctx under lock (release store after the retain);
   * read by any thread needing the context (acquire load). */
  _Atomic(cudrv_context) ctx[MAGPIE_MAX_DEVICES];
} cuda_state;

extern cuda_state cuda_st;

/* Sets the detail "<what> failed: CUDA_ERROR_X (n)" and returns code. */
int cuda_fail(int code, cudrv_result r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* MAGPIE_ERR_OUT_OF_MEMORY for the driver's out of memory, else BACKEND. */
int cuda_code(cudrv_result r);
/* init() succeeded (acquire: the driver table may be read). */
int cuda_ready(void);
/* The error for a table used before a successful init(). */
int cuda_not_ready(void);
int cuda_check_device(int device);
/* device's primary context, retained on first use. */
int cuda_device_ctx(int device, cudrv_context *out);
/* Makes device's primary context current, in the relaxed capture mode,
 * until cuda_pop, which passes rc through unless the pop itself fails. */
int cuda_push(int device, const char *op);
int cuda_pop(int rc, const char *op);
/* Pinned device memory on device with no export handle type. */
void cuda_alloc_prop(int device, cudrv_mem_alloc_prop *prop);
/* The device's granularity (the caller checked device). */
int cuda_granule(int device, size_t *bytes);
/* Checks device and that addr and size are nonzero granularity multiples. */
int cuda_check_range(int device, uintptr_t addr, size_t size, size_t *g, const char *op);

/* backend_cuda_vmm.c: the table's mapping, access and sharing operations
 * (backend.h). */
int cuda_map(int device, uintptr_t addr, size_t size, unsigned flags, uint64_t peers);
int cuda_can_access_peer(int device, int peer, int *can);
int cuda_set_access(int device, uintptr_t addr, size_t size, uint64_t peers);
int cuda_revoke_access(int device, uintptr_t addr, size_t size, uint64_t peers);
int cuda_peer_enable(int device, int peer);
int cuda_peer_disable(int device, int peer);
int cuda_device_uuid(int device, unsigned char uuid[16]);
int cuda_export_fds(int device, uintptr_t addr, size_t size, int *fds);
int cuda_import_map(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers);

#endif /* MAGPIE_BACKEND_CUDA_H */
