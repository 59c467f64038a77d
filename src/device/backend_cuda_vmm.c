/* The CUDA backend's mappings (backend.h): map, peer access, export to and
 * import from other processes. One physical allocation per granule, so
 * that any granule-aligned part of a mapped range can be unmapped or
 * exported later (cuMemUnmap cannot split a mapping; an exported handle
 * names one allocation).
 *
 * Exportable memory is created with the POSIX file descriptor handle type
 * (cuMemCreate's requestedHandleTypes); export asks the driver for a
 * descriptor of each granule's allocation (cuMemRetainAllocationHandle,
 * cuMemExportToShareableHandle), and import turns descriptors back into
 * allocations and maps them (cuMemImportFromShareableHandle, cuMemMap).
 * An allocation lives until its last mapping, in any process, is unmapped
 * and its last handle released, so an importer's mapping outlives the
 * exporter's.
 *
 * Lock order: takes no lock but the driver's (cuda_push may take cuda_st.lock
 * once per device, below every magpie lock). */
#include <string.h>
#include <unistd.h>

#include "device/backend_cuda.h"

/* Access descriptors for device and every device in peers (at most
 * MAGPIE_MAX_DEVICES); returns their count. */
static size_t cuda_access_descs(uint64_t devices, unsigned flags, cudrv_mem_access_desc *d) {
  size_t n = 0;
  for (int i = 0; i < cuda_st.ndevices; i++) {
    if (!(devices >> i & 1)) continue;
    memset(&d[n], 0, sizeof d[n]);
    d[n].location.type = CUDRV_MEM_LOCATION_TYPE_DEVICE;
    d[n].location.id = cuda_st.devices[i];
    d[n].flags = flags;
    n++;
  }
  return n;
}

/* Maps allocation h (the caller's handle, released here) at addr and grants
 * access; on failure nothing stays mapped. */
static int cuda_map_handle(int device, uintptr_t addr, size_t g, cudrv_mem_handle h, uint64_t peers) {
  cudrv_deviceptr p = (cudrv_deviceptr)addr;
  int rc = MAGPIE_OK;
  cudrv_result r = cudrv.mem_map(p, g, 0, h, 0);
  if (r != CUDRV_SUCCESS) {
    rc = cuda_fail(cuda_code(r), r, "cuMemMap(0x%llx, %zu bytes)", p, g);
    cudrv.mem_release(h); /* nothing more to undo if this fails too */
    return rc;
  }
  cudrv_mem_access_desc access[MAGPIE_MAX_DEVICES];
  size_t n = cuda_access_descs(peers | (uint64_t)1 << device, CUDRV_MEM_ACCESS_FLAGS_PROT_READWRITE, access);
  r = cudrv.mem_set_access(p, g, access, n);
  if (r != CUDRV_SUCCESS) rc = cuda_fail(cuda_code(r), r, "cuMemSetAccess(0x%llx, %zu bytes, %zu devices)", p, g, n);
  cudrv_result rr = cudrv.mem_release(h);
  if (rr != CUDRV_SUCCESS && rc == MAGPIE_OK) rc = cuda_fail(MAGPIE_ERR_BACKEND, rr, "cuMemRelease(0x%llx)", h);
  if (rc != MAGPIE_OK) cudrv.mem_unmap(p, g); /* frees the memory once the handle is released */
  return rc;
}

/* Backs one granule at addr. The handle is released once mapped: the
 * mapping keeps the memory alive, and cuMemUnmap then frees it. */
static int cuda_map_granule(int device, uintptr_t addr, size_t g, unsigned flags, uint64_t peers) {
  cudrv_mem_alloc_prop prop;
  cuda_alloc_prop(device, &prop);
  if (flags & BACKEND_MAP_EXPORTABLE) prop.requested_handle_types = CUDRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  cudrv_mem_handle h = 0;
  cudrv_result r = cudrv.mem_create(&h, g, &prop, 0);
  if (r != CUDRV_SUCCESS)
    return cuda_fail(cuda_code(r), r, "cuMemCreate(%zu bytes%s)", g,
                     (flags & BACKEND_MAP_EXPORTABLE) ? ", exportable" : "");
  return cuda_map_handle(device, addr, g, h, peers);
}

/* A failure unmaps the granules already done. */
int cuda_map(int device, uintptr_t addr, size_t size, unsigned flags, uint64_t peers) {
  if (!cuda_ready()) return cuda_not_ready();
  size_t g;
  int rc = cuda_check_range(device, addr, size, &g, "map");
  if (rc == MAGPIE_OK) rc = cuda_push(device, "map");
  if (rc != MAGPIE_OK) return rc;
  size_t done = 0;
  while (done < size && (rc = cuda_map_granule(device, addr + done, g, flags, peers)) == MAGPIE_OK) done += g;
  if (rc != MAGPIE_OK)
    for (size_t off = 0; off < done; off += g) cudrv.mem_unmap((cudrv_deviceptr)(addr + off), g);
  return cuda_pop(rc, "map");
}

static int cuda_check_peer(int device, int peer) {
  int rc = cuda_check_device(device);
  if (rc == MAGPIE_OK) rc = cuda_check_device(peer);
  if (rc == MAGPIE_OK && device == peer) {
    backend_set_error_detail("device %d and peer %d are the same device", device, peer);
    rc = MAGPIE_ERR_INVALID_ARGUMENT;
  }
  return rc;
}

int cuda_can_access_peer(int device, int peer, int *can) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_peer(device, peer);
  if (rc != MAGPIE_OK) return rc;
  /* cuDeviceCanAccessPeer(can, dev, peerDev): whether dev can access
   * peerDev's memory; here peer accesses device's. */
  int v = 0;
  cudrv_result r = cudrv.device_can_access_peer(&v, cuda_st.devices[peer], cuda_st.devices[device]);
  if (r != CUDRV_SUCCESS) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuDeviceCanAccessPeer(%d, %d)", peer, device);
  *can = v != 0;
  return MAGPIE_OK;
}

/* devices' access (flags: read-write or none) to [addr, addr + size) of
 * device's mappings, granule by granule, as mapped: one cuMemSetAccess may
 * not span several allocations' mappings. Access to a device's own memory
 * is never taken away. */
static int cuda_access_range(int device, uintptr_t addr, size_t size, uint64_t devices, unsigned flags,
                             const char *what) {
  if (!cuda_ready()) return cuda_not_ready();
  size_t g;
  int rc = cuda_check_range(device, addr, size, &g, what);
  if (rc == MAGPIE_OK && flags == CUDRV_MEM_ACCESS_FLAGS_PROT_NONE && (devices >> device & 1)) {
    backend_set_error_detail("device %d's access to its own memory cannot be revoked", device);
    rc = MAGPIE_ERR_INVALID_ARGUMENT;
  }
  if (rc == MAGPIE_OK) rc = cuda_push(device, "cuMemSetAccess");
  if (rc != MAGPIE_OK) return rc;
  cudrv_mem_access_desc access[MAGPIE_MAX_DEVICES];
  size_t n = cuda_access_descs(devices, flags, access);
  const char *prot = flags == CUDRV_MEM_ACCESS_FLAGS_PROT_NONE ? ", PROT_NONE for " : ", ";
  for (size_t off = 0; n > 0 && off < size && rc == MAGPIE_OK; off += g) {
    cudrv_result r = cudrv.mem_set_access((cudrv_deviceptr)(addr + off), g, access, n);
    if (r != CUDRV_SUCCESS)
      rc = cuda_fail(r == CUDRV_ERROR_PEER_ACCESS_UNSUPPORTED ? MAGPIE_ERR_NO_PEER_ACCESS : cuda_code(r), r,
                     "cuMemSetAccess(0x%llx, %zu bytes%s%zu devices)", (unsigned long long)(addr + off), g, prot, n);
  }
  return cuda_pop(rc, "cuMemSetAccess");
}

int cuda_set_access(int device, uintptr_t addr, size_t size, uint64_t peers) {
  return cuda_access_range(device, addr, size, peers | (uint64_t)1 << device, CUDRV_MEM_ACCESS_FLAGS_PROT_READWRITE,
                           "set_access");
}

/* The same range, PROT_NONE for every device in peers (never device
 * itself). */
int cuda_revoke_access(int device, uintptr_t addr, size_t size, uint64_t peers) {
  return cuda_access_range(device, addr, size, peers, CUDRV_MEM_ACCESS_FLAGS_PROT_NONE, "revoke_access");
}

/* cuCtxEnablePeerAccess(ctx of device) with peer's context current: peer's
 * kernels may then access device's cuMemAlloc memory. */
int cuda_peer_enable(int device, int peer) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_peer(device, peer);
  cudrv_context ctx = NULL;
  if (rc == MAGPIE_OK) rc = cuda_device_ctx(device, &ctx);
  if (rc == MAGPIE_OK) rc = cuda_push(peer, "cuCtxEnablePeerAccess");
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.ctx_enable_peer_access(ctx, 0);
  if (r != CUDRV_SUCCESS && r != CUDRV_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    rc = cuda_fail(r == CUDRV_ERROR_PEER_ACCESS_UNSUPPORTED ? MAGPIE_ERR_NO_PEER_ACCESS : MAGPIE_ERR_BACKEND, r,
                   "cuCtxEnablePeerAccess(device %d's context, from device %d)", device, peer);
  return cuda_pop(rc, "cuCtxEnablePeerAccess");
}

/* cuCtxDisablePeerAccess(ctx of device) with peer's context current. */
int cuda_peer_disable(int device, int peer) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_peer(device, peer);
  cudrv_context ctx = NULL;
  if (rc == MAGPIE_OK) rc = cuda_device_ctx(device, &ctx);
  if (rc == MAGPIE_OK) rc = cuda_push(peer, "cuCtxDisablePeerAccess");
  if (rc != MAGPIE_OK) return rc;
  cudrv_result r = cudrv.ctx_disable_peer_access(ctx);
  if (r != CUDRV_SUCCESS && r != CUDRV_ERROR_PEER_ACCESS_NOT_ENABLED)
    rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuCtxDisablePeerAccess(device %d's context, from device %d)", device, peer);
  return cuda_pop(rc, "cuCtxDisablePeerAccess");
}

int cuda_device_uuid(int device, unsigned char uuid[16]) {
  if (!cuda_ready()) return cuda_not_ready();
  int rc = cuda_check_device(device);
  if (rc != MAGPIE_OK) return rc;
  cudrv_uuid u;
  cudrv_result r = cudrv.device_get_uuid(&u, cuda_st.devices[device]);
  if (r != CUDRV_SUCCESS) return cuda_fail(MAGPIE_ERR_BACKEND, r, "cuDeviceGetUuid(device %d)", device);
  memcpy(uuid, u.bytes, 16);
  return MAGPIE_OK;
}

static void cuda_close_fds(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++) close(fds[i]);
}

int cuda_export_fds(int device, uintptr_t addr, size_t size, int *fds) {
  if (!cuda_ready()) return cuda_not_ready();
  size_t g;
  int rc = cuda_check_range(device, addr, size, &g, "export");
  if (rc == MAGPIE_OK) rc = cuda_push(device, "export");
  if (rc != MAGPIE_OK) return rc;
  size_t n = 0;
  for (size_t off = 0; off < size && rc == MAGPIE_OK; off += g) {
    cudrv_mem_handle h = 0;
    void *p = (void *)(addr + off);
    cudrv_result r = cudrv.mem_retain_allocation_handle(&h, p);
    if (r != CUDRV_SUCCESS) {
      rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemRetainAllocationHandle(%p)", p);
      break;
    }
    int fd = -1;
    r = cudrv.mem_export_to_shareable_handle(&fd, h, CUDRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDRV_SUCCESS)
      rc = cuda_fail(MAGPIE_ERR_BACKEND, r,
                     "cuMemExportToShareableHandle(%p, POSIX file descriptor): was the memory mapped with ipc=0?", p);
    else fds[n++] = fd;
    cudrv.mem_release(h);
  }
  if (rc != MAGPIE_OK) cuda_close_fds(fds, n);
  return cuda_pop(rc, "export");
}

int cuda_import_map(int device, uintptr_t addr, size_t size, const int *fds, uint64_t peers) {
  if (!cuda_ready()) return cuda_not_ready();
  size_t g;
  int rc = cuda_check_range(device, addr, size, &g, "import");
  if (rc == MAGPIE_OK) rc = cuda_push(device, "import");
  if (rc != MAGPIE_OK) return rc;
  size_t done = 0;
  for (size_t i = 0; done < size; i++) {
    cudrv_mem_handle h = 0;
    /* The descriptor is passed by value in the pointer argument. */
    cudrv_result r = cudrv.mem_import_from_shareable_handle(&h, (void *)(intptr_t)fds[i],
                                                            CUDRV_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDRV_SUCCESS) {
      rc = cuda_fail(MAGPIE_ERR_BACKEND, r, "cuMemImportFromShareableHandle(descriptor %d)", fds[i]);
      break;
    }
    if ((rc = cuda_map_handle(device, addr + done, g, h, peers)) != MAGPIE_OK) break;
    done += g;
  }
  if (rc != MAGPIE_OK)
    for (size_t off = 0; off < done; off += g) cudrv.mem_unmap((cudrv_deviceptr)(addr + off), g);
  return cuda_pop(rc, "import");
}
