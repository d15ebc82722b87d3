// The queue bound (docs/limiter.md "queue bound"): how much admitted work this
// process has not seen complete, measured by event markers recorded behind
// the launches. A launching thread checks it every few launches and sleeps
// while it is over the bound.
#include <cuda.h>

#include "hook/launch.h"
#include "limiter/compute.h"

namespace gpuslice::hook::launch {
namespace {

constexpr std::uint64_t kQueueCostNs = 20'000'000;     // priced device time in flight
constexpr std::uint64_t kQueueLatencyNs = 50'000'000;  // age of the oldest unfinished marker
constexpr std::uint64_t kQueueLaunches = 1024;         // launches in flight, once calibrated
// While the price is still the prior, one launch in flight: nothing is known
// of the kernels' length yet, and a process must not be able to queue more
// unmeasured work than one kernel before it waits (and so lives) long enough
// for the feedback to measure it (issue 9: short-lived processes).
constexpr std::uint64_t kQueueLaunchesPrior = 1;
constexpr std::uint64_t kMarkerEveryNs = 1'000'000;
constexpr std::uint64_t kQueuePollNs = 200'000;

// The stream a launch really went to: the per-thread default stream for a
// _ptsz launch on the null stream.
CUstream target_stream(CUstream s, bool ptsz) noexcept { return ptsz && s == nullptr ? CU_STREAM_PER_THREAD : s; }

bool try_lock(LaunchDevice& d) noexcept {
  std::uint32_t expected = 0;
  return d.ring_lock.compare_exchange_strong(expected, 1, std::memory_order_acquire);
}
void unlock(LaunchDevice& d) noexcept { d.ring_lock.store(0, std::memory_order_release); }

void max_store(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
  std::uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// Retires completed markers (oldest first). A marker whose event the driver
// no longer knows (its context was destroyed) counts as complete: the work
// behind it can no longer run.
void poll_markers(LaunchDevice& d) noexcept {
  if (!try_lock(d)) return;
  while (d.head != d.tail) {
    Marker& m = d.ring[d.head % kMarkers];
    const CUresult rc = g_marker_api.event_query(m.event);
    if (rc == CUDA_ERROR_NOT_READY) break;
    if (rc != CUDA_SUCCESS) m.event = nullptr;
    max_store(d.completed_count, m.count);
    max_store(d.completed_cost, m.cost);
    ++d.head;
  }
  d.oldest_pending_ns.store(d.head != d.tail ? d.ring[d.head % kMarkers].recorded_ns : 0, std::memory_order_relaxed);
  unlock(d);
}

bool over_queue_bound(LaunchDevice& d, std::uint64_t now) noexcept {
  const std::uint64_t count = d.submitted_count.load(std::memory_order_relaxed) -
                              d.completed_count.load(std::memory_order_relaxed);
  const std::uint64_t cost = d.submitted_cost.load(std::memory_order_relaxed) -
                             d.completed_cost.load(std::memory_order_relaxed);
  const std::uint64_t oldest = d.oldest_pending_ns.load(std::memory_order_relaxed);
  const bool calibrated = d.calibrated.load(std::memory_order_relaxed) != 0;
  return static_cast<std::int64_t>(cost) > static_cast<std::int64_t>(kQueueCostNs) ||
         static_cast<std::int64_t>(count) > static_cast<std::int64_t>(calibrated ? kQueueLaunches : kQueueLaunchesPrior) ||
         (oldest != 0 && now > oldest && now - oldest > kQueueLatencyNs);
}

}  // namespace

MarkerApi g_marker_api;

bool capturing(CUstream s, bool ptsz) noexcept {
  if (g_marker_api.stream_is_capturing == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return g_marker_api.stream_is_capturing(target_stream(s, ptsz), &status) == CUDA_SUCCESS &&
         status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void forget_queue(LaunchDevice& d) noexcept {
  max_store(d.completed_count, d.submitted_count.load(std::memory_order_relaxed));
  max_store(d.completed_cost, d.submitted_cost.load(std::memory_order_relaxed));
}

void reset_queue_after_fork(LaunchDevice& d) noexcept {
  d.head = d.tail = 0;
  for (Marker& m : d.ring) m = Marker{};
  d.oldest_pending_ns.store(0, std::memory_order_relaxed);
  forget_queue(d);
}

void record_marker(LaunchDevice& d, CUstream s, bool ptsz) noexcept {
  if (!try_lock(d)) return;  // another thread is at it; the next check retries
  const std::uint64_t now = mono_ns();
  d.last_marker_ns.store(now, std::memory_order_relaxed);
  if (d.tail - d.head < kMarkers && !capturing(s, ptsz)) {
    Marker& m = d.ring[d.tail % kMarkers];
    if (m.event == nullptr && g_marker_api.event_create(&m.event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
      m.event = nullptr;
    CUresult rc =
        m.event != nullptr ? g_marker_api.event_record(m.event, target_stream(s, ptsz)) : CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS) {
      m.recorded_ns = now;
      m.count = d.submitted_count.load(std::memory_order_relaxed);
      m.cost = d.submitted_cost.load(std::memory_order_relaxed);
      if (d.head == d.tail) d.oldest_pending_ns.store(now, std::memory_order_relaxed);
      ++d.tail;
    }
    if (rc != CUDA_SUCCESS) {
      // The event belongs to another context than the stream (a stream of
      // another context, or of another device, than the current one): make
      // one in the stream's context and record that.
      if (m.event != nullptr) g_marker_api.event_destroy(m.event);
      m.event = nullptr;
      if (create_event_for_stream(target_stream(s, ptsz), &m.event) == CUDA_SUCCESS) {
        rc = g_marker_api.event_record(m.event, target_stream(s, ptsz));
        if (rc != CUDA_SUCCESS) {
          g_marker_api.event_destroy(m.event);
          m.event = nullptr;
        }
      } else {
        m.event = nullptr;
      }
      if (rc == CUDA_SUCCESS) {
        m.recorded_ns = now;
        m.count = d.submitted_count.load(std::memory_order_relaxed);
        m.cost = d.submitted_cost.load(std::memory_order_relaxed);
        if (d.head == d.tail) d.oldest_pending_ns.store(now, std::memory_order_relaxed);
        ++d.tail;
      } else if (d.head == d.tail) {
        forget_queue(d);  // no marker possible: nothing tells when the work completes
      }
    }
  }
  unlock(d);
}

void wait_while_uncalibrated(LaunchDevice& d) noexcept {
  std::uint64_t now = mono_ns();
  const std::uint64_t start = now;
  while (d.calibrated.load(std::memory_order_relaxed) == 0) {
    if (limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) != 0) {
      d.calibrated.store(1, std::memory_order_relaxed);
      break;
    }
    poll_markers(d);
    // Nothing in flight, or no marker could be recorded (a capturing stream,
    // a stream of another context): nothing to wait on.
    if (d.oldest_pending_ns.load(std::memory_order_relaxed) == 0) break;
    sleep_ns(kQueuePollNs);
    now = mono_ns();
  }
  if (now != start) d.state->throttled_ns.fetch_add(now - start, std::memory_order_relaxed);
}

bool check_queue(LaunchDevice& d, ThreadCounts& tc, CUstream s, bool ptsz) noexcept {
  d.submitted_count.fetch_add(tc.launches, std::memory_order_relaxed);
  d.submitted_cost.fetch_add(tc.cost, std::memory_order_relaxed);
  d.state->launches.fetch_add(tc.launches, std::memory_order_relaxed);
  tc = ThreadCounts{};
  if (d.calibrated.load(std::memory_order_relaxed) == 0 &&
      limiter::scale_updated_ns(*d.state).load(std::memory_order_relaxed) != 0)
    d.calibrated.store(1, std::memory_order_relaxed);
  std::uint64_t now = mono_ns();
  poll_markers(d);
  std::uint64_t slept = 0;
  bool checked_capture = false;
  while (over_queue_bound(d, now)) {
    if (d.oldest_pending_ns.load(std::memory_order_relaxed) == 0) break;  // nothing to wait on: mark first
    if (!checked_capture) {
      checked_capture = true;
      if (capturing(s, ptsz)) break;
    }
    sleep_ns(kQueuePollNs);
    const std::uint64_t after = mono_ns();
    slept += after - now;
    now = after;
    poll_markers(d);
  }
  if (slept != 0) d.state->throttled_ns.fetch_add(slept, std::memory_order_relaxed);
  return d.calibrated.load(std::memory_order_relaxed) == 0 ||
         now - d.last_marker_ns.load(std::memory_order_relaxed) >= kMarkerEveryNs;
}

}  // namespace gpuslice::hook::launch
