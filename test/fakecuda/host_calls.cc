// Host work in streams (cuLaunchHostFunc, cuStreamAddCallback), stream-capture
// queries (cuStreamGetCaptureInfo*), prefetching managed memory and the
// profiler switches.
//
// Host functions run in the calling thread, once the work submitted to the
// stream before them has completed, and before the call returns: a valid
// order (later work on the stream starts after the function), though the
// real driver runs them on a driver thread and returns at once.
#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

CUresult host_stream(CUstream hStream, bool ptsz, CUstream_st** out) {
  if (!initialized()) return uninitialized_error();
  if (CUresult rc = resolve_stream(hStream, ptsz, out); rc != CUDA_SUCCESS) return rc;
  // Host nodes in captured graphs are not modelled (README "Not modelled").
  if ((*out)->capture.load(std::memory_order_acquire) != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  stream_wait_idle(*out);
  return CUDA_SUCCESS;
}

CUresult launch_host_func(CUstream hStream, CUhostFn fn, void* userData, bool ptsz) {
  if (fn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUstream_st* stream = nullptr;
  if (CUresult rc = host_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  fn(userData);
  return CUDA_SUCCESS;
}

CUresult add_callback(CUstream hStream, CUstreamCallback callback, void* userData, unsigned flags, bool ptsz) {
  if (callback == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;  // flags: "reserved, must be 0"
  CUstream_st* stream = nullptr;
  if (CUresult rc = host_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  callback(hStream, CUDA_SUCCESS, userData);
  return CUDA_SUCCESS;
}

// Dependencies are not modelled (graphs run their nodes in insertion order):
// a capturing stream reports none.
CUresult capture_info(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                      const CUgraphNode** deps, const CUgraphEdgeData** edges, size_t* num_deps, bool ptsz) {
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUgraph_st* capturing = stream->capture.load(std::memory_order_acquire);
  *status = capturing != nullptr ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  if (capturing != nullptr) {
    if (id != nullptr) *id = stream->capture_id;
    if (graph != nullptr) *graph = capturing;
    if (deps != nullptr) *deps = nullptr;
    if (edges != nullptr) *edges = nullptr;
    if (num_deps != nullptr) *num_deps = 0;
  }
  return CUDA_SUCCESS;
}

// Managed memory is host memory here: prefetching moves nothing, but the
// range and the stream are checked as the driver does.
CUresult prefetch(CUdeviceptr ptr, size_t count, CUstream hStream, bool ptsz) {
  if (count == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  CUdeviceptr base = 0;
  const Allocation* a = find_allocation_locked(ptr, &base);
  if (a == nullptr || a->kind != AllocKind::managed || count > a->size - (ptr - base)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

bool valid_location(const CUmemLocation& location) {
  if (location.type == CU_MEM_LOCATION_TYPE_DEVICE) return valid_device(location.id);
  return location.type == CU_MEM_LOCATION_TYPE_HOST || location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
         location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT;
}

}  // namespace

extern "C" CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void* userData) {
  return launch_host_func(hStream, fn, userData, false);
}
extern "C" CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void* userData) {
  return launch_host_func(hStream, fn, userData, true);
}
extern "C" CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void* userData,
                                        unsigned int flags) {
  return add_callback(hStream, callback, userData, flags, false);
}
extern "C" CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void* userData,
                                             unsigned int flags) {
  return add_callback(hStream, callback, userData, flags, true);
}

extern "C" CUresult cuStreamGetCaptureInfo(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id) {
  return capture_info(hStream, status, id, nullptr, nullptr, nullptr, nullptr, false);
}
extern "C" CUresult cuStreamGetCaptureInfo_ptsz(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id) {
  return capture_info(hStream, status, id, nullptr, nullptr, nullptr, nullptr, true);
}
extern "C" CUresult cuStreamGetCaptureInfo_v2(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                              CUgraph* graph, const CUgraphNode** deps, size_t* num) {
  return capture_info(hStream, status, id, graph, deps, nullptr, num, false);
}
extern "C" CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                                   CUgraph* graph, const CUgraphNode** deps, size_t* num) {
  return capture_info(hStream, status, id, graph, deps, nullptr, num, true);
}
extern "C" CUresult cuStreamGetCaptureInfo_v3(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                              CUgraph* graph, const CUgraphNode** deps, const CUgraphEdgeData** edges,
                                              size_t* num) {
  return capture_info(hStream, status, id, graph, deps, edges, num, false);
}
extern "C" CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream hStream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                                   CUgraph* graph, const CUgraphNode** deps,
                                                   const CUgraphEdgeData** edges, size_t* num) {
  return capture_info(hStream, status, id, graph, deps, edges, num, true);
}

extern "C" CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
  if (dstDevice != CU_DEVICE_CPU && (!initialized() || !valid_device(dstDevice))) return CUDA_ERROR_INVALID_DEVICE;
  return prefetch(devPtr, count, hStream, false);
}
extern "C" CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
  if (dstDevice != CU_DEVICE_CPU && (!initialized() || !valid_device(dstDevice))) return CUDA_ERROR_INVALID_DEVICE;
  return prefetch(devPtr, count, hStream, true);
}
extern "C" CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                          CUstream hStream) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (initialized() && !valid_location(location)) return CUDA_ERROR_INVALID_DEVICE;
  return prefetch(devPtr, count, hStream, false);
}
extern "C" CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                               unsigned int flags, CUstream hStream) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (initialized() && !valid_location(location)) return CUDA_ERROR_INVALID_DEVICE;
  return prefetch(devPtr, count, hStream, true);
}

// No profiler is attached to the simulator: starting and stopping collection
// succeed with a current context (cuda.h: INVALID_CONTEXT without one).
extern "C" CUresult cuProfilerStart(void) {
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  return current_context(&ctx);
}
extern "C" CUresult cuProfilerStop(void) { return cuProfilerStart(); }
