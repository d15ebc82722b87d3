// The queue bound's arithmetic. See compute_queue.h.
#include "limiter/compute_queue.h"

namespace gpuslice::limiter {
namespace {

void max_store(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
  std::uint64_t cur = a.load(std::memory_order_relaxed);
  while (cur < v && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {}
}

}  // namespace

void QueueBound::marked(std::uint64_t now_ns, bool first) noexcept {
  if (first) oldest_pending_ns_.store(now_ns, std::memory_order_relaxed);
}

void QueueBound::retire(std::uint64_t count, std::uint64_t cost_ns) noexcept {
  max_store(completed_count_, count);
  max_store(completed_cost_, cost_ns);
}

void QueueBound::reset() noexcept {
  oldest_pending_ns_.store(0, std::memory_order_relaxed);
  forget();
}

InFlight QueueBound::in_flight() const noexcept {
  const std::uint64_t count =
      submitted_count_.load(std::memory_order_relaxed) - completed_count_.load(std::memory_order_relaxed);
  const std::uint64_t cost =
      submitted_cost_.load(std::memory_order_relaxed) - completed_cost_.load(std::memory_order_relaxed);
  return InFlight{static_cast<std::int64_t>(count), static_cast<std::int64_t>(cost)};
}

bool QueueBound::over(std::uint64_t now_ns, bool calibrated) const noexcept {
  const InFlight f = in_flight();
  const std::uint64_t oldest = oldest_pending_ns();
  const auto launches = static_cast<std::int64_t>(calibrated ? kQueueLaunches : kQueueLaunchesPrior);
  return f.cost_ns > static_cast<std::int64_t>(kQueueCostNs) || f.launches > launches ||
         (oldest != 0 && now_ns > oldest && now_ns - oldest > kQueueLatencyNs);
}

bool QueueBound::marker_due(std::uint64_t now_ns, bool calibrated) const noexcept {
  return !calibrated || now_ns - last_marker_ns_.load(std::memory_order_relaxed) >= kMarkerEveryNs;
}

}  // namespace gpuslice::limiter
