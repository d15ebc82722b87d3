// The queue bound's driver side (docs/limiter.md "queue bound"): event
// markers recorded behind the launches and polled for completion, in a ring
// of the launch side's driver layer (launch_markers.h). What is in flight and
// when a launching thread waits is limiter/compute_queue.h's arithmetic
// (unit-tested on an injected clock); this file makes the driver calls it
// needs.
// gpuslice: hot path (no heap, no locks)
#include "hook/launch_queue.h"

#include <cuda.h>

#include "hook/launch_markers.h"
#include "limiter/compute.h"
#include "limiter/compute_queue.h"

namespace gpuslice::hook::launch {
namespace {

// Retires completed markers (oldest first). A marker whose event the driver
// no longer knows (its context was destroyed) counts as complete: the work
// behind it can no longer run.
void poll_markers(LaunchDevice& d) noexcept {
  if (!d.markers.lock.try_lock()) return;
  while (!d.markers.empty()) {
    Marker& m = d.markers.oldest();
    const MarkerState state = query_marker(m.event);
    if (state == MarkerState::pending) break;
    if (state == MarkerState::gone) m.event = nullptr;
    d.queue.retire(m.count, m.cost);
    d.markers.pop();
  }
  d.queue.set_oldest_pending(!d.markers.empty() ? d.markers.oldest().recorded_ns : 0);
  d.markers.lock.unlock();
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
  bool capturing() noexcept { return hook::capturing(s, ptsz); }
  bool calibrated() noexcept {
    if (d.calibrated.load(std::memory_order_relaxed) != 0) return true;
    if (!measure_price || limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) == 0) return false;
    d.calibrated.store(1, std::memory_order_relaxed);
    return true;
  }
};

}  // namespace

void forget_queue(LaunchDevice& d) noexcept { d.queue.forget(); }

void reset_queue_after_fork(LaunchDevice& d) noexcept {
  d.markers.lock.reset();  // its holder, if any, is a thread of the parent
  d.markers.clear();
  d.queue.reset();
}

void record_marker(LaunchDevice& d, CUstream s, bool ptsz) noexcept {
  if (!markers_available()) {
    d.queue.forget();  // no marker possible: nothing tells when the work completes
    return;
  }
  if (!d.markers.lock.try_lock()) return;  // another thread is at it; the next check retries
  const std::uint64_t now = mono_ns();
  d.queue.marker_tried(now);
  if (d.markers.pending() < kMarkers && !capturing(s, ptsz)) {
    Marker& m = d.markers.next();
    if (record_marker_on_stream(&m.event, CU_EVENT_DISABLE_TIMING, target_stream(s, ptsz)) == CUDA_SUCCESS) {
      m.recorded_ns = now;
      m.count = d.queue.submitted_count();
      m.cost = d.queue.submitted_cost();
      d.queue.marked(now, d.markers.empty());
      d.markers.push();
    } else if (d.markers.empty()) {
      forget_queue(d);  // no marker possible: nothing tells when the work completes
    }
  }
  d.markers.lock.unlock();
}

void wait_while_uncalibrated(LaunchDevice& d) noexcept {
  DriverEnv env{d, nullptr, false, true};
  const std::uint64_t waited = limiter::wait_while_uncalibrated(d.queue, env);
  if (waited != 0) d.state->throttled_ns.fetch_add(waited, std::memory_order_relaxed);
}

bool check_queue(LaunchDevice& d, ThreadCounts& tc, CUstream s, bool ptsz) noexcept {
  d.queue.submit(tc.launches, tc.cost);
  d.state->launches.fetch_add(tc.launches, std::memory_order_relaxed);
  tc.launches = 0;  // the credit stays: it is the bucket's, not statistics
  tc.since_check = 0;
  tc.cost = 0;
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
