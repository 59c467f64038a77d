/* Peer access: magpie_device_can_access_peer,
 * magpie_device_enable_peer_access and magpie_device_disable_peer_access
 * (magpie.h). The mappings themselves are pool/region.c's
 * (region_enable_peer, region_disable_peer). Takes no lock of its own. */
#include "base/error.h"
#include "front/global.h"
#include "heap/heap.h"

/* Both devices exist and differ; the device table can grant access. */
static int peer_check(int device, int peer, const char *fn) {
  int rc = global_device_check(device, fn);
  if (rc == MAGPIE_OK) rc = global_device_check(peer, fn);
  if (rc != MAGPIE_OK) return rc;
  if (device == peer)
    return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "%s(%d, %d): a device always accesses its own memory", fn, device,
                     peer);
  const backend_ops *ops = global_ops();
  if (ops->can_access_peer == NULL || ops->set_access == NULL || ops->revoke_access == NULL ||
      ops->peer_enable == NULL || ops->peer_disable == NULL)
    return error_set(MAGPIE_ERR_NO_PEER_ACCESS, "%s(%d, %d): the %s device has no peer access", fn, device, peer,
                     ops->name);
  return MAGPIE_OK;
}

MAGPIE_API int magpie_device_can_access_peer(int device, int peer, int *can) {
  if (can == NULL) return error_set(MAGPIE_ERR_INVALID_ARGUMENT, "magpie_device_can_access_peer: NULL answer");
  *can = 0;
  int rc = peer_check(device, peer, "magpie_device_can_access_peer");
  if (rc == MAGPIE_ERR_NO_PEER_ACCESS) return MAGPIE_OK; /* the answer is no */
  if (rc != MAGPIE_OK) return rc;
  rc = global_ops()->can_access_peer(device, peer, can);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_device_can_access_peer(%d, %d): %s", device, peer, backend_error_detail());
  return MAGPIE_OK;
}

MAGPIE_API int magpie_device_enable_peer_access(int device, int peer) {
  int rc = peer_check(device, peer, "magpie_device_enable_peer_access");
  if (rc != MAGPIE_OK) return rc;
  int can = 0;
  rc = global_ops()->can_access_peer(device, peer, &can);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_device_enable_peer_access(%d, %d): %s", device, peer, backend_error_detail());
  if (!can)
    return error_set(MAGPIE_ERR_NO_PEER_ACCESS,
                     "magpie_device_enable_peer_access(%d, %d): device %d owns the memory and device %d wants to "
                     "access it, but the driver reports no peer-to-peer path between them (see nvidia-smi topo -m); "
                     "copy between them instead (cudaMemcpyPeerAsync), which needs no peer access",
                     device, peer, device, peer);
  heap *h = heap_get(device);
  if (h == NULL) return magpie_last_error();
  rc = region_enable_peer(&h->region, peer);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_device_enable_peer_access(%d, %d): %s", device, peer, backend_error_detail());
  return MAGPIE_OK;
}

MAGPIE_API int magpie_device_disable_peer_access(int device, int peer) {
  int rc = peer_check(device, peer, "magpie_device_disable_peer_access");
  if (rc != MAGPIE_OK) return rc;
  /* A device magpie has no heap on has no mapping to take back, and none
   * is made for the question. */
  heap *h = heap_peek(device);
  if (h == NULL) return MAGPIE_OK;
  rc = region_disable_peer(&h->region, peer);
  if (rc != MAGPIE_OK)
    return error_set(rc, "magpie_device_disable_peer_access(%d, %d): %s", device, peer, backend_error_detail());
  return MAGPIE_OK;
}
