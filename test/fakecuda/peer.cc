// Peer access between devices (cuda.h: cuDeviceCanAccessPeer,
// cuCtxEnablePeerAccess, cuCtxDisablePeerAccess). The simulated devices are
// one model (unified addressing, the same compute capability) on one fabric,
// so every device can access every other; enabling access is recorded per
// pair of contexts and is unidirectional, as documented. It holds no device
// memory and no peer limit is modelled (CUDA_ERROR_TOO_MANY_PEERS is never
// returned); peer copies work with or without it (bytes.cc).
#include <algorithm>

#include "driver.h"

using namespace gpuslice::fakecuda;

extern "C" CUresult cuDeviceCanAccessPeer(int* canAccessPeer, CUdevice dev, CUdevice peerDev) {
  if (!initialized()) return uninitialized_error();
  if (canAccessPeer == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(dev) || !valid_device(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
  // A device is not its own peer (the real driver answers 0 for dev == peerDev).
  *canAccessPeer = dev != peerDev ? 1 : 0;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (current_context(&ctx) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  if (!alive(peerContext) || !peerContext->active.load(std::memory_order_acquire) || peerContext == ctx)
    return CUDA_ERROR_INVALID_CONTEXT;
  if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (peerContext->device == ctx->device) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;  // cuDeviceCanAccessPeer: 0
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  if (std::find(ctx->peers.begin(), ctx->peers.end(), peerContext->id) != ctx->peers.end())
    return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
  ctx->peers.push_back(peerContext->id);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (current_context(&ctx) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  if (!alive(peerContext) || !peerContext->active.load(std::memory_order_acquire)) return CUDA_ERROR_INVALID_CONTEXT;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  auto it = std::find(ctx->peers.begin(), ctx->peers.end(), peerContext->id);
  if (it == ctx->peers.end()) return CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
  ctx->peers.erase(it);
  return CUDA_SUCCESS;
}
