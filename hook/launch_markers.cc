// The launch side's driver layer (hook/launch_markers.h): stream, capture and
// event-marker calls, through hook/real.h only.
#include "hook/launch_markers.h"

#include "hook/real.h"

namespace gpuslice::hook {

bool capturing(CUstream s, bool ptsz) noexcept {
  if (real_cuStreamIsCapturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return real_cuStreamIsCapturing(target_stream(s, ptsz), &status) == CUDA_SUCCESS &&
         status != CU_STREAM_CAPTURE_STATUS_NONE;
}

bool markers_available() noexcept {
  return real_cuEventCreate != nullptr && real_cuEventRecord != nullptr && real_cuEventQuery != nullptr &&
         real_cuEventDestroy_v2 != nullptr;
}

bool marker_waits_available() noexcept { return markers_available() && real_cuEventSynchronize != nullptr; }

namespace {
MarkerState state_of(CUresult rc) noexcept {
  if (rc == CUDA_SUCCESS) return MarkerState::done;
  return rc == CUDA_ERROR_NOT_READY ? MarkerState::pending : MarkerState::gone;
}
}  // namespace

MarkerState query_marker(CUevent event) noexcept { return state_of(real_cuEventQuery(event)); }

MarkerState wait_marker(CUevent event) noexcept { return state_of(real_cuEventSynchronize(event)); }

bool ensure_marker_event(CUevent* event, unsigned flags) noexcept {
  if (*event == nullptr && real_cuEventCreate(event, flags) != CUDA_SUCCESS) *event = nullptr;
  return *event != nullptr;
}

CUresult record_marker_event(CUevent* event, CUstream target) noexcept {
  const CUresult rc = real_cuEventRecord(*event, target);
  if (rc != CUDA_SUCCESS) drop_marker_event(event);
  return rc;
}

void drop_marker_event(CUevent* event) noexcept {
  if (*event != nullptr) real_cuEventDestroy_v2(*event);
  *event = nullptr;
}

bool marker_elapsed_ns(CUevent from, CUevent to, std::uint64_t* ns) noexcept {
  float ms = 0;
  if (real_cuEventElapsedTime == nullptr || from == nullptr || real_cuEventElapsedTime(&ms, from, to) != CUDA_SUCCESS ||
      !(ms > 0))
    return false;
  *ns = static_cast<std::uint64_t>(static_cast<double>(ms) * 1e6);
  return true;
}

}  // namespace gpuslice::hook
