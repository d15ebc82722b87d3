// The queue bound's driver side (docs/limiter.md "queue bound"): event
// markers recorded behind the launches and polled for completion. What is in
// flight and when a launching thread waits is limiter/compute_queue.h's
// arithmetic (unit-tested on an injected clock); this file makes the driver
// calls it needs.
#include <cuda.h>

#include "hook/launch.h"
#include "hook/real.h"
#include "limiter/compute.h"
#include "limiter/compute_queue.h"

namespace gpuslice::hook::launch {
namespace {

// The stream a launch really went to: the per-thread default stream for a
// _ptsz launch on the null stream.
CUstream target_stream(CUstream s, bool ptsz) noexcept { return ptsz && s == nullptr ? CU_STREAM_PER_THREAD : s; }

bool try_lock(LaunchDevice& d) noexcept {
  std::uint32_t expected = 0;
  return d.ring_lock.compare_exchange_strong(expected, 1, std::memory_order_acquire);
}
void unlock(LaunchDevice& d) noexcept { d.ring_lock.store(0, std::memory_order_release); }

// Retires completed markers (oldest first). A marker whose event the driver
// no longer knows (its context was destroyed) counts as complete: the work
// behind it can no longer run.
void poll_markers(LaunchDevice& d) noexcept {
  if (!try_lock(d)) return;
  while (d.head != d.tail) {
    Marker& m = d.ring[d.head % kMarkers];
    const CUresult rc = real_cuEventQuery(m.event);
    if (rc == CUDA_ERROR_NOT_READY) break;
    if (rc != CUDA_SUCCESS) m.event = nullptr;
    d.queue.retire(m.count, m.cost);
    ++d.head;
  }
  d.queue.set_oldest_pending(d.head != d.tail ? d.ring[d.head % kMarkers].recorded_ns : 0);
  unlock(d);
}

// Records `m.event` (created in the current context when it has none yet)
// behind the launch, else one made in the stream's own context: the event
// belongs to another context than the stream (a stream of another context,
// or of another device, than the current one).
CUresult record(Marker& m, CUstream target) noexcept {
  if (m.event == nullptr && real_cuEventCreate(&m.event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
    m.event = nullptr;
  CUresult rc = m.event != nullptr ? real_cuEventRecord(m.event, target) : CUDA_ERROR_INVALID_HANDLE;
  if (rc == CUDA_SUCCESS) return rc;
  if (m.event != nullptr) real_cuEventDestroy_v2(m.event);
  m.event = nullptr;
  if (create_event_for_stream(target, &m.event) != CUDA_SUCCESS) {
    m.event = nullptr;
    return CUDA_ERROR_INVALID_HANDLE;
  }
  rc = real_cuEventRecord(m.event, target);
  if (rc != CUDA_SUCCESS) {
    real_cuEventDestroy_v2(m.event);
    m.event = nullptr;
  }
  return rc;
}

// The waits' environment (limiter/compute_queue.h): the real clock, the
// markers of one device, the launch's stream.
struct DriverEnv {
  LaunchDevice& d;
  CUstream s;
  bool ptsz;
  bool measure_price;  // calibrated() also looks whether the price got measured meanwhile

  std::uint64_t now() noexcept { return mono_ns(); }
  void sleep(std::uint64_t ns) noexcept { sleep_ns(ns); }
  void poll() noexcept { poll_markers(d); }
  bool capturing() noexcept { return launch::capturing(s, ptsz); }
  bool calibrated() noexcept {
    if (d.calibrated.load(std::memory_order_relaxed) != 0) return true;
    if (!measure_price || limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) == 0) return false;
    d.calibrated.store(1, std::memory_order_relaxed);
    return true;
  }
};

}  // namespace

bool markers_available() noexcept {
  return real_cuEventCreate != nullptr && real_cuEventRecord != nullptr && real_cuEventQuery != nullptr &&
         real_cuEventDestroy_v2 != nullptr;
}

bool capturing(CUstream s, bool ptsz) noexcept {
  if (real_cuStreamIsCapturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return real_cuStreamIsCapturing(target_stream(s, ptsz), &status) == CUDA_SUCCESS &&
         status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void forget_queue(LaunchDevice& d) noexcept { d.queue.forget(); }

void reset_queue_after_fork(LaunchDevice& d) noexcept {
  d.head = d.tail = 0;
  for (Marker& m : d.ring) m = Marker{};
  d.queue.reset();
}

void record_marker(LaunchDevice& d, CUstream s, bool ptsz) noexcept {
  if (!markers_available()) {
    d.queue.forget();  // no marker possible: nothing tells when the work completes
    return;
  }
  if (!try_lock(d)) return;  // another thread is at it; the next check retries
  const std::uint64_t now = mono_ns();
  d.queue.marker_tried(now);
  if (d.tail - d.head < kMarkers && !capturing(s, ptsz)) {
    Marker& m = d.ring[d.tail % kMarkers];
    if (record(m, target_stream(s, ptsz)) == CUDA_SUCCESS) {
      m.recorded_ns = now;
      m.count = d.queue.submitted_count();
      m.cost = d.queue.submitted_cost();
      d.queue.marked(now, d.head == d.tail);
      ++d.tail;
    } else if (d.head == d.tail) {
      forget_queue(d);  // no marker possible: nothing tells when the work completes
    }
  }
  unlock(d);
}

void wait_while_uncalibrated(LaunchDevice& d) noexcept {
  DriverEnv env{d, nullptr, false, true};
  const std::uint64_t waited = limiter::wait_while_uncalibrated(d.queue, env);
  if (waited != 0) d.state->throttled_ns.fetch_add(waited, std::memory_order_relaxed);
}

bool check_queue(LaunchDevice& d, ThreadCounts& tc, CUstream s, bool ptsz) noexcept {
  d.queue.submit(tc.launches, tc.cost);
  d.state->launches.fetch_add(tc.launches, std::memory_order_relaxed);
  tc = ThreadCounts{};
  DriverEnv env{d, s, ptsz, false};
  if (d.calibrated.load(std::memory_order_relaxed) == 0 &&
      limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) != 0)
    d.calibrated.store(1, std::memory_order_relaxed);
  std::uint64_t now = 0;
  const std::uint64_t slept = limiter::wait_under_bound(d.queue, env, &now);
  if (slept != 0) d.state->throttled_ns.fetch_add(slept, std::memory_order_relaxed);
  return d.queue.marker_due(now, d.calibrated.load(std::memory_order_relaxed) != 0);
}

}  // namespace gpuslice::hook::launch
