// The queue bound's arithmetic (limiter/compute_queue.h) on a scripted clock
// and scripted markers: what is in flight, when it is over the bound, and how
// long a launching thread waits. Deterministic (no sleeps): the launch path's
// wall-clock tests (label timing) are skipped under sanitizers, these are not.
#include <gtest/gtest.h>

#include <cstdint>
#include <deque>

#include "limiter/compute_queue.h"

using namespace gpuslice::limiter;

namespace {

constexpr std::uint64_t kT0 = 1'000'000'000;  // ns; the clock never starts at 0

// A device's markers and the clock, scripted: each marker completes at a set
// time, and is retired by the first poll at or after it.
struct ScriptedEnv {
  struct PendingMarker {
    std::uint64_t recorded_ns, done_ns, count, cost;
  };
  QueueBound& q;
  std::uint64_t t = kT0;
  std::deque<PendingMarker> markers;
  bool capture = false;
  int capture_asks = 0;
  int polls = 0;
  int sleeps = 0;
  std::uint64_t calibrated_at = 0;  // calibrated from this time on (~0: never)

  explicit ScriptedEnv(QueueBound& queue) : q(queue) {}

  // A marker behind everything submitted so far, completing `after_ns` from now.
  void mark(std::uint64_t after_ns) {
    q.marker_tried(t);
    q.marked(t, markers.empty());
    markers.push_back({t, t + after_ns, q.submitted_count(), q.submitted_cost()});
  }

  std::uint64_t now() noexcept { return t; }
  void sleep(std::uint64_t ns) noexcept {
    t += ns;
    ++sleeps;
  }
  void poll() noexcept {
    ++polls;
    while (!markers.empty() && markers.front().done_ns <= t) {
      q.retire(markers.front().count, markers.front().cost);
      markers.pop_front();
    }
    q.set_oldest_pending(markers.empty() ? 0 : markers.front().recorded_ns);
  }
  bool capturing() noexcept {
    ++capture_asks;
    return capture;
  }
  bool calibrated() noexcept { return t >= calibrated_at; }
};

}  // namespace

TEST(QueueBound, InFlightIsSubmittedLessRetired) {
  QueueBound q;
  q.submit(10, 5'000);
  q.submit(2, 1'000);
  EXPECT_EQ(q.in_flight().launches, 12);
  EXPECT_EQ(q.in_flight().cost_ns, 6'000);
  q.retire(10, 5'000);
  EXPECT_EQ(q.in_flight().launches, 2);
  EXPECT_EQ(q.in_flight().cost_ns, 1'000);
}

TEST(QueueBound, AnOlderMarkerRetiredLateDoesNotBringWorkBack) {
  QueueBound q;
  q.submit(8, 8'000);
  q.retire(8, 8'000);
  q.retire(3, 3'000);  // another thread's older marker, polled after
  EXPECT_EQ(q.in_flight().launches, 0);
  EXPECT_EQ(q.in_flight().cost_ns, 0);
}

TEST(QueueBound, ForgetCountsEverythingAsDone) {
  QueueBound q;
  q.submit(7, 70'000'000);
  EXPECT_TRUE(q.over(kT0, true));
  q.forget();
  EXPECT_EQ(q.in_flight().launches, 0);
  EXPECT_FALSE(q.over(kT0, true));
}

TEST(QueueBound, ResetAfterForkLeavesNothingOutstanding) {
  QueueBound q;
  q.submit(3, 3'000);
  q.marked(kT0, true);
  EXPECT_EQ(q.oldest_pending_ns(), kT0);
  q.reset();
  EXPECT_EQ(q.oldest_pending_ns(), 0u);
  EXPECT_EQ(q.in_flight().launches, 0);
  EXPECT_FALSE(q.over(kT0 + 10 * kQueueLatencyNs, false));
}

TEST(QueueBound, PricedTimeInFlightIsBoundedAtTwentyMilliseconds) {
  QueueBound q;
  q.submit(1, kQueueCostNs);
  EXPECT_FALSE(q.over(kT0, true));
  q.submit(0, 1);
  EXPECT_TRUE(q.over(kT0, true));
}

TEST(QueueBound, LaunchesInFlightAreBoundedByCalibration) {
  QueueBound q;
  q.submit(kQueueLaunchesPrior, 0);
  EXPECT_FALSE(q.over(kT0, false));
  q.submit(1, 0);
  EXPECT_TRUE(q.over(kT0, false));  // the prior: one launch of unknown length at a time
  EXPECT_FALSE(q.over(kT0, true));
  q.submit(kQueueLaunches - 2, 0);
  EXPECT_FALSE(q.over(kT0, true));
  q.submit(1, 0);
  EXPECT_TRUE(q.over(kT0, true));
}

TEST(QueueBound, TheOldestMarkerMayBeFiftyMillisecondsOld) {
  QueueBound q;
  EXPECT_FALSE(q.over(kT0 + 10 * kQueueLatencyNs, true));  // no marker: no age
  q.marked(kT0, true);
  q.marked(kT0 + 1'000, false);  // not the oldest
  EXPECT_EQ(q.oldest_pending_ns(), kT0);
  EXPECT_FALSE(q.over(kT0 + kQueueLatencyNs, true));
  EXPECT_TRUE(q.over(kT0 + kQueueLatencyNs + 1, true));
  EXPECT_FALSE(q.over(kT0 - 1, true));  // a clock reading older than the marker (another thread's)
}

TEST(QueueBound, MarkersAreDueEveryCheckUncalibratedElseEveryMillisecond) {
  QueueBound q;
  q.marker_tried(kT0);
  EXPECT_TRUE(q.marker_due(kT0, false));
  EXPECT_FALSE(q.marker_due(kT0 + kMarkerEveryNs - 1, true));
  EXPECT_TRUE(q.marker_due(kT0 + kMarkerEveryNs, true));
}

TEST(QueueBoundWait, UnderTheBoundNeitherSleepsNorAsksAboutCapture) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(10, 1'000'000);
  env.mark(5'000'000);
  std::uint64_t now = 0;
  EXPECT_EQ(wait_under_bound(q, env, &now), 0u);
  EXPECT_EQ(now, kT0);
  EXPECT_EQ(env.sleeps, 0);
  EXPECT_EQ(env.capture_asks, 0);
  EXPECT_EQ(env.polls, 1);  // every check retires what completed
}

TEST(QueueBoundWait, OverTheCostBoundSleepsUntilTheMarkerCompletes) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(100, 30'000'000);
  env.mark(3'000'000);  // the work completes 3 ms from now
  std::uint64_t now = 0;
  const std::uint64_t slept = wait_under_bound(q, env, &now);
  // Polled every kQueuePollNs: woken by the first poll at or after completion.
  EXPECT_EQ(slept, 3'000'000u);
  EXPECT_EQ(env.sleeps, 15);
  EXPECT_EQ(now, kT0 + 3'000'000);
  EXPECT_EQ(env.capture_asks, 1);
  EXPECT_EQ(q.in_flight().cost_ns, 0);
  EXPECT_EQ(q.oldest_pending_ns(), 0u);
}

TEST(QueueBoundWait, WaitsOnlyUntilBackUnderTheBoundNotUntilEmpty) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(1, 15'000'000);
  env.mark(1'000'000);
  q.submit(1, 15'000'000);
  env.mark(40'000'000);
  std::uint64_t now = 0;
  EXPECT_EQ(wait_under_bound(q, env, &now), 1'000'000u);  // 15 ms left in flight: under
  EXPECT_EQ(q.in_flight().cost_ns, 15'000'000);
  EXPECT_EQ(q.oldest_pending_ns(), kT0);  // the second marker, recorded at the same instant
}

TEST(QueueBoundWait, AnOldMarkerIsWaitedForEvenUnderTheCostBound) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(1, 1'000);
  env.mark(kQueueLatencyNs + 10'000'000);
  env.t += kQueueLatencyNs + 1;  // the marker is too old by now
  std::uint64_t now = 0;
  const std::uint64_t slept = wait_under_bound(q, env, &now);
  EXPECT_GE(now, kT0 + kQueueLatencyNs + 10'000'000);
  EXPECT_EQ(slept, now - (kT0 + kQueueLatencyNs + 1));
  EXPECT_LT(slept, 10'000'000u + kQueuePollNs);
}

TEST(QueueBoundWait, NothingOutstandingMeansNothingToWaitOn) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(5000, 90'000'000);  // far over, but no marker behind it yet
  std::uint64_t now = 0;
  EXPECT_EQ(wait_under_bound(q, env, &now), 0u);
  EXPECT_EQ(env.sleeps, 0);
  EXPECT_EQ(env.capture_asks, 0);
}

TEST(QueueBoundWait, ACapturingStreamIsNeverThrottledByTheQueue) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(100, 30'000'000);
  env.mark(50'000'000);
  env.capture = true;
  std::uint64_t now = 0;
  EXPECT_EQ(wait_under_bound(q, env, &now), 0u);
  EXPECT_EQ(env.capture_asks, 1);
  EXPECT_EQ(env.sleeps, 0);
}

TEST(QueueBoundWait, CalibrationMidWaitRaisesTheLaunchBound) {
  QueueBound q;
  ScriptedEnv env(q);
  env.calibrated_at = kT0 + 1'000'000;  // the feedback measures the price 1 ms in
  q.submit(2, 1'000);                   // over the prior's one launch
  env.mark(100'000'000);
  std::uint64_t now = 0;
  EXPECT_EQ(wait_under_bound(q, env, &now), 1'000'000u);
  EXPECT_EQ(q.in_flight().launches, 2);  // still in flight, but under the calibrated bound
}

TEST(QueueBoundWait, UncalibratedLaunchReturnsOnceItsWorkCompleted) {
  QueueBound q;
  ScriptedEnv env(q);
  env.calibrated_at = ~0ull;
  q.submit(1, 20'000);
  env.mark(1'100'000);
  EXPECT_EQ(wait_while_uncalibrated(q, env), 1'200'000u);  // six polls of 200 us
  EXPECT_EQ(q.in_flight().launches, 0);
}

TEST(QueueBoundWait, UncalibratedWaitEndsWhenThePriceIsMeasured) {
  QueueBound q;
  ScriptedEnv env(q);
  env.calibrated_at = kT0 + 400'000;
  q.submit(1, 20'000);
  env.mark(1'000'000'000);
  EXPECT_EQ(wait_while_uncalibrated(q, env), 400'000u);
  EXPECT_EQ(q.in_flight().launches, 1);
}

TEST(QueueBoundWait, UncalibratedWaitNeedsAMarker) {
  QueueBound q;
  ScriptedEnv env(q);
  env.calibrated_at = ~0ull;
  q.submit(1, 20'000);  // no marker could be recorded (a capturing stream)
  EXPECT_EQ(wait_while_uncalibrated(q, env), 0u);
  EXPECT_EQ(env.sleeps, 0);
}

TEST(QueueBoundWait, CalibratedLaunchDoesNotWaitForItsWork) {
  QueueBound q;
  ScriptedEnv env(q);
  q.submit(1, 20'000);
  env.mark(1'000'000);
  EXPECT_EQ(wait_while_uncalibrated(q, env), 0u);
  EXPECT_EQ(env.polls, 0);
}
