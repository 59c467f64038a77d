/* The CUDA backend's shared helpers: backend_cuda.c (init, contexts,
 * events, streams) and backend_cuda_vmm.c (mappings, peer access, export
 * and import) are one table split in two files. Nothing outside them
 * includes this.
 *
 * Lock order: as backend_cuda.c (cuda_lock only, below every magpie lock). */
#ifndef MAGPIE_BACKEND_CUDA_H
#define MAGPIE_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "device/backend.h"
#include "device/cuda_driver.h"

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
int cuda_peer_enable(int device, int peer);
int cuda_device_uuid(int device, unsigned char uuid[16]);
int cuda_export_fds(int device, uintptr_t addr, size_t size, int *fds);
int cuda_import_map(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers);

#endif /* MAGPIE_BACKEND_CUDA_H */
