// The launch side's driver layer (hook/launch_markers.h): stream, context,
// capture and event-marker calls, through hook/real.h only.
// gpuslice: hot path (no heap, no locks)
#include "hook/launch_markers.h"

#include "hook/real.h"

namespace gpuslice::hook {

bool capturing(CUstream s, bool ptsz) noexcept {
  if (real_cuStreamIsCapturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return real_cuStreamIsCapturing(target_stream(s, ptsz), &status) == CUDA_SUCCESS &&
         status != CU_STREAM_CAPTURE_STATUS_NONE;
}

namespace {

// Stream `s`'s context made current for the scope: pushed, and popped again
// at its end, when it is not the current one. status(): CUDA_SUCCESS once it
// is current, CUDA_ERROR_INVALID_HANDLE when the driver cannot tell the
// stream's context, CUDA_ERROR_INVALID_CONTEXT when it cannot be pushed.
class StreamContext {
 public:
  explicit StreamContext(CUstream s) noexcept {
    auto get_ctx = real_cuStreamGetCtx;
    CUcontext ctx = nullptr, current = nullptr;
    if (get_ctx == nullptr || get_ctx(s, &ctx) != CUDA_SUCCESS || ctx == nullptr) {
      status_ = CUDA_ERROR_INVALID_HANDLE;
    } else if (real_cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == ctx) {
      status_ = CUDA_SUCCESS;
    } else if (real_cuCtxPushCurrent_v2 == nullptr || real_cuCtxPopCurrent_v2 == nullptr ||
               real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS) {
      status_ = CUDA_ERROR_INVALID_CONTEXT;
    } else {
      status_ = CUDA_SUCCESS;
      pushed_ = true;
    }
  }
  ~StreamContext() {
    CUcontext popped = nullptr;
    if (pushed_) real_cuCtxPopCurrent_v2(&popped);
  }
  StreamContext(const StreamContext&) = delete;
  StreamContext& operator=(const StreamContext&) = delete;
  CUresult status() const noexcept { return status_; }

 private:
  CUresult status_ = CUDA_ERROR_INVALID_HANDLE;
  bool pushed_ = false;
};

}  // namespace

int ask_stream_ordinal(CUstream s) noexcept {
  if (real_cuStreamGetDevice != nullptr) {
    CUdevice dev = 0;
    if (real_cuStreamGetDevice(s, &dev) == CUDA_SUCCESS) return static_cast<int>(dev);
  }
  const StreamContext in(s);
  return in.status() == CUDA_SUCCESS ? current_ordinal() : -1;
}

CUresult create_event_for_stream(CUstream s, unsigned flags, CUevent* out) noexcept {
  if (real_cuEventCreate == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (current_context_stream(s)) return real_cuEventCreate(out, flags);
  const StreamContext in(s);
  return in.status() == CUDA_SUCCESS ? real_cuEventCreate(out, flags) : in.status();
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

CUresult record_marker_on_stream(CUevent* event, unsigned flags, CUstream target) noexcept {
  if (ensure_marker_event(event, flags) && record_marker_event(event, target) == CUDA_SUCCESS) return CUDA_SUCCESS;
  if (create_event_for_stream(target, flags, event) != CUDA_SUCCESS) {
    *event = nullptr;
    return CUDA_ERROR_INVALID_HANDLE;
  }
  return record_marker_event(event, target);
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
