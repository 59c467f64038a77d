/* What magpie_preload.c and preload_ipc.c share besides magpie.h. Hidden,
 * as everything of the preload library but the interposed names and
 * magpie_* (preload.map). */
#ifndef MAGPIE_PRELOAD_IPC_H
#define MAGPIE_PRELOAD_IPC_H

/* magpie_preload.c: 1 once magpie runs on the CUDA backend and the driver's
 * helpers were found (the first call sets the library up). */
int preload_usable(void);
/* The next definition of a runtime (libcudart) or driver (libcuda)
 * function after this library, as the interposed functions reach the real
 * ones: the global scope, else the loaded library itself (a runtime loaded
 * into a local scope, as Python extension modules are). NULL if none. */
void *preload_runtime_sym(const char *name);
void *preload_driver_sym(const char *name);
/* Does p lie in magpie's memory (a block's start, or anywhere in a large
 * segment)? Sets its device (-1 if none). */
int preload_owned(const void *p, int *dev);
/* Waits for all work of device dev (its primary context); MAGPIE_OK, or
 * MAGPIE_ERR_BACKEND when it cannot (a context lost, no such device). */
int preload_sync_device(int dev);

/* preload_ipc.c: the sources of a grant of owner's memory to accessor
 * (magpie_device_enable_peer_access). The accessor's context enabled peer
 * access to the owner's (cudaDeviceEnablePeerAccess, cuCtxEnablePeerAccess:
 * the cudaMalloc blocks), or the owner's default pool was opened to the
 * accessor (cudaMemPoolSetAccess: the cudaMallocAsync blocks). */
enum { PRELOAD_GRANT_CTX = 1u, PRELOAD_GRANT_POOL = 2u };
/* After magpie granted owner's mappings to accessor for source. */
void preload_peer_granted(int owner, int accessor, unsigned source);
/* rc: the real disable's answer. Where it took source's access back, and
 * no other source of the grant stands, magpie's mappings of owner are taken
 * back from accessor too (magpie_device_disable_peer_access). Returns rc,
 * or cudaErrorUnknown (999) if magpie could not take them back. */
int preload_peer_revoke(int rc, int owner, int accessor, unsigned source);

#endif /* MAGPIE_PRELOAD_IPC_H */
