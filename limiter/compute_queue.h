// The queue bound's arithmetic (docs/limiter.md "queue bound"): how much
// admitted work a process has not yet seen complete, and when a launching
// thread must wait for it. Pure logic: the launch path (hook/launch_queue.cc)
// records event markers behind the launches and tells this class what they
// stand behind and which completed; the clock, the sleep and the marker polls
// are injected, so the waits are unit-tested without a driver or wall clock
// (test/limiter/compute_queue_test.cc).
//
// Everything in flight is counted twice, as launches and as priced device
// time (ns): launching threads add what they admitted in batches (submit),
// and a completed marker retires everything submitted before it was recorded
// (retire). The counters only grow; in flight = submitted - completed.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpuslice::limiter {

// --- the bound (docs/limiter.md explains each choice) ---
inline constexpr std::uint64_t kQueueCostNs = 20'000'000;     // priced device time in flight
inline constexpr std::uint64_t kQueueLatencyNs = 50'000'000;  // age of the oldest unfinished marker
inline constexpr std::uint64_t kQueueLaunches = 1024;         // launches in flight, once calibrated
// While the price is still the prior, one launch in flight: nothing is known
// of the kernels' length yet, and a process must not be able to queue more
// unmeasured work than one kernel before it waits (and so lives) long enough
// for the feedback to measure it (issue 9: short-lived processes).
inline constexpr std::uint64_t kQueueLaunchesPrior = 1;
inline constexpr std::uint64_t kMarkerEveryNs = 1'000'000;  // a marker at least this often, once calibrated
inline constexpr std::uint64_t kQueuePollNs = 200'000;      // sleep between two looks at the markers

struct InFlight {
  std::int64_t launches = 0;  // signed: a refund racing a flush may leave completed ahead for a moment
  std::int64_t cost_ns = 0;
};

// The counters of one device of one process. Lock-free: any launching thread
// submits, whichever thread polls the markers retires.
class QueueBound {
 public:
  // A launching thread's batch of admitted launches and their priced time.
  void submit(std::uint64_t launches, std::uint64_t cost_ns) noexcept {
    submitted_count_.fetch_add(launches, std::memory_order_relaxed);
    submitted_cost_.fetch_add(cost_ns, std::memory_order_relaxed);
  }
  // What a marker recorded now stands behind (its retire() arguments).
  std::uint64_t submitted_count() const noexcept { return submitted_count_.load(std::memory_order_relaxed); }
  std::uint64_t submitted_cost() const noexcept { return submitted_cost_.load(std::memory_order_relaxed); }

  // A marker was recorded at `now_ns`; `first` when no other was outstanding
  // (it is then the oldest).
  void marked(std::uint64_t now_ns, bool first) noexcept;
  // A marker was tried at `now_ns` (recorded or not): the next one is due
  // kMarkerEveryNs later.
  void marker_tried(std::uint64_t now_ns) noexcept { last_marker_ns_.store(now_ns, std::memory_order_relaxed); }
  // A marker completed: everything submitted before it was recorded is done.
  // Markers may be retired out of order between threads: counters only grow.
  void retire(std::uint64_t count, std::uint64_t cost_ns) noexcept;
  // After retiring: the recording time of the oldest outstanding marker, 0
  // when none is.
  void set_oldest_pending(std::uint64_t recorded_ns) noexcept {
    oldest_pending_ns_.store(recorded_ns, std::memory_order_relaxed);
  }
  // Without a marker nothing tells when the work completes: all of it counts
  // as done.
  void forget() noexcept { retire(submitted_count(), submitted_cost()); }
  // In a forked child: no marker outstanding (the parent's events are gone).
  void reset() noexcept;

  InFlight in_flight() const noexcept;
  // 0: no marker outstanding, nothing to wait on.
  std::uint64_t oldest_pending_ns() const noexcept { return oldest_pending_ns_.load(std::memory_order_relaxed); }
  // Over the bound at `now_ns`: too much priced time, too many launches
  // (one while uncalibrated), or the oldest marker too old.
  bool over(std::uint64_t now_ns, bool calibrated) const noexcept;
  // A marker is due behind the current launch: every check while
  // uncalibrated (each launch must be waited for), else every kMarkerEveryNs.
  bool marker_due(std::uint64_t now_ns, bool calibrated) const noexcept;

 private:
  std::atomic<std::uint64_t> submitted_count_{0};
  std::atomic<std::uint64_t> submitted_cost_{0};
  std::atomic<std::uint64_t> completed_count_{0};
  std::atomic<std::uint64_t> completed_cost_{0};
  std::atomic<std::uint64_t> oldest_pending_ns_{0};
  std::atomic<std::uint64_t> last_marker_ns_{0};
};

// The waits, on an injected environment `env` providing
//   std::uint64_t now() noexcept           monotonic ns
//   void sleep(std::uint64_t ns) noexcept
//   void poll() noexcept                   retires completed markers (may do nothing: another thread polls)
//   bool capturing() noexcept              the launch's stream is being captured (nothing runs)
//   bool calibrated() noexcept             the device's price is measured (may become true meanwhile)

// A check: while over the bound, sleep kQueuePollNs and poll again. Stops
// when nothing is outstanding to wait on (a marker is recorded first) or the
// stream is capturing (asked once, only when over). Returns the time slept
// (the caller's throttled_ns) and sets *now_ns to the last clock reading.
template <class Env>
std::uint64_t wait_under_bound(QueueBound& q, Env& env, std::uint64_t* now_ns) noexcept {
  std::uint64_t now = env.now();
  env.poll();
  std::uint64_t slept = 0;
  bool checked_capture = false;
  while (q.over(now, env.calibrated())) {
    if (q.oldest_pending_ns() == 0) break;  // nothing to wait on: mark first
    if (!checked_capture) {
      checked_capture = true;
      if (env.capturing()) break;
    }
    env.sleep(kQueuePollNs);
    const std::uint64_t after = env.now();
    slept += after - now;
    now = after;
    env.poll();
  }
  *now_ns = now;
  return slept;
}

// While the price is still the prior, a launch returns only once its work
// completed (or the price got measured meanwhile). Stops at once when no
// marker is outstanding (none could be recorded: nothing to wait on).
// Returns the time waited.
template <class Env>
std::uint64_t wait_while_uncalibrated(QueueBound& q, Env& env) noexcept {
  std::uint64_t now = env.now();
  const std::uint64_t start = now;
  while (!env.calibrated()) {
    env.poll();
    if (q.oldest_pending_ns() == 0) break;
    env.sleep(kQueuePollNs);
    now = env.now();
  }
  return now - start;
}

}  // namespace gpuslice::limiter
