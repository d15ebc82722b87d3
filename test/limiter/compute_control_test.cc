// The feedback controller (limiter/compute_control.h): the true-up, the price
// scale, the elastic rule and owner election; and the closed loop of bucket +
// controller on a modelled device (one timeline, kernels of a fixed true
// duration the limiter does not know), in simulated time.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "limiter/compute.h"
#include "limiter/compute_control.h"

using namespace gpuslice;
using namespace gpuslice::limiter;

namespace {

std::unique_ptr<DeviceState> state(std::uint32_t pct, SmPolicy policy = SmPolicy::hard) {
  auto d = std::make_unique<DeviceState>();
  d->sm_limit_pct.store(pct);
  d->sm_policy.store(static_cast<std::uint32_t>(policy));
  d->cost_scale_ppm.store(1'000'000);
  return d;
}

}  // namespace

TEST(ComputeControl, TrueUpReplacesProvisionalPricesByMeasuredTime) {
  auto d = state(50);
  ControlState s;
  control_begin(*d, s);
  d->tokens_ns.store(0);
  credited_ns(*d).store(0);
  s.spent_mark = 0;
  spend(*d, 2'000'000);                                                          // provisional: 2 ms
  StepResult r = control_step(*d, s, Measurement{50'000'000, 5'000'000, 0}, 1);  // measured: 5 ms
  EXPECT_EQ(r.adjust_ns, -3'000'000);
  EXPECT_EQ(d->tokens_ns.load(), -5'000'000);  // charged exactly what ran
  // The next window starts from here: no double counting.
  r = control_step(*d, s, Measurement{50'000'000, 0, 0}, 2);
  EXPECT_EQ(r.adjust_ns, 0);
  EXPECT_EQ(d->tokens_ns.load(), -5'000'000);
}

TEST(ComputeControl, TrueUpRefundIsCappedAtTheBucket) {
  auto d = state(10);  // capacity 5 ms
  d->tokens_ns.store(capacity_ns(100));
  credited_ns(*d).store(static_cast<std::uint64_t>(capacity_ns(100)));
  ControlState s;
  control_begin(*d, s);
  spend(*d, 20'000'000);  // provisional 20 ms, nothing ran (e.g. captured launches)
  control_step(*d, s, Measurement{50'000'000, 0, 0}, 1);
  EXPECT_EQ(d->tokens_ns.load(), capacity_ns(100));
  spend(*d, 1'000'000);
  control_step(*d, s, Measurement{50'000'000, 0, 0}, 2);
  EXPECT_EQ(d->tokens_ns.load(), capacity_ns(100));  // unused share is not banked beyond the cap
}

TEST(ComputeControl, ScaleIsMeasuredTimePerNominalNanosecond) {
  auto d = state(50);
  ControlState s;
  control_begin(*d, s);
  EXPECT_EQ(scale_updated_ns(*d).load(), 0u);
  for (int i = 0; i < 20; ++i) {
    spend(*d, price_ns(1'000'000, d->cost_scale_ppm.load()));             // 1 ms nominal at the current price ...
    control_step(*d, s, Measurement{50'000'000, 7'000'000, 0}, 100 + i);  // ... that took 7 ms
  }
  EXPECT_NEAR(static_cast<double>(d->cost_scale_ppm.load()), 7e6, 7e4);
  EXPECT_NE(scale_updated_ns(*d).load(), 0u);
}

TEST(ComputeControl, ScaleIgnoresWindowsWithoutSignal) {
  auto d = state(50);
  ControlState s;
  control_begin(*d, s);
  control_step(*d, s, Measurement{50'000'000, 10'000, 0}, 1);  // 10 us of device time: noise
  EXPECT_EQ(d->cost_scale_ppm.load(), 1'000'000u);
  EXPECT_EQ(scale_updated_ns(*d).load(), 0u);
}

TEST(ComputeControl, KernelsFarCheaperThanThePriorStillCalibrate) {
  // Thousands of launches admitted at the nominal price, almost no device time
  // measured: the scale drops (clamped) instead of staying at the prior forever.
  auto d = state(90);
  ControlState s;
  control_begin(*d, s);
  for (int i = 0; i < 5; ++i) {
    spend(*d, price_ns(5'000'000, d->cost_scale_ppm.load()));        // 5 ms nominal per window
    control_step(*d, s, Measurement{50'000'000, 1'000, 0}, 10 + i);  // 1 us measured
  }
  EXPECT_NE(scale_updated_ns(*d).load(), 0u);
  EXPECT_LT(d->cost_scale_ppm.load(), 10'000u);
  EXPECT_GE(d->cost_scale_ppm.load(), kMinScalePpm);
}

TEST(ComputeControl, UnlimitedEntriesAreNotTrued) {
  auto d = state(100);
  ControlState s;
  control_begin(*d, s);
  spend(*d, 1'000'000);
  const StepResult r = control_step(*d, s, Measurement{50'000'000, 9'000'000, 0}, 1);
  EXPECT_EQ(r.adjust_ns, 0);
}

TEST(ComputeElastic, RampsUpIntoIdleCapacity) {
  std::uint32_t g = 300;
  g = elastic_grant(g, 300, 290, 0, 0);
  EXPECT_EQ(g, 400u);
  for (int i = 0; i < 10; ++i) g = elastic_grant(g, 300, g - 10, 0, 0);
  EXPECT_EQ(g, 1000u);
  g = elastic_grant(g, 300, 990, 0, 0);  // alone and using it all: keep it
  EXPECT_EQ(g, 1000u);
}

TEST(ComputeElastic, FallsBackToTheShareWhenOthersGrow) {
  EXPECT_EQ(elastic_grant(1000, 300, 950, 50, 0), 300u);
  EXPECT_EQ(elastic_grant(700, 300, 600, 400, 100), 300u);
}

TEST(ComputeElastic, LeavesHeadroomToSteadyNeighbours) {
  // Another tenant steadily at 50%: keep at most 45%, never less than the share.
  EXPECT_EQ(elastic_grant(800, 300, 480, 500, 500), 450u);
  EXPECT_EQ(elastic_grant(450, 300, 450, 500, 495), 450u);
  EXPECT_EQ(elastic_grant(450, 300, 250, 750, 750), 300u);
  // Below the share the grant is the share.
  EXPECT_EQ(elastic_grant(0, 300, 0, 0, 0), 400u);
}

TEST(ComputeElection, OneOwnerStaleTakeoverAndDrop) {
  auto d = state(50);
  EXPECT_TRUE(hold_feedback(*d, 100, 1'000'000'000));
  EXPECT_FALSE(hold_feedback(*d, 200, 1'100'000'000));  // fresh heartbeat
  EXPECT_TRUE(hold_feedback(*d, 100, 1'200'000'000));
  // 100 stops beating (killed): 200 takes over after the timeout.
  EXPECT_FALSE(hold_feedback(*d, 200, 1'200'000'000 + kOwnerTimeoutNs - 1));
  EXPECT_TRUE(hold_feedback(*d, 200, 1'200'000'000 + kOwnerTimeoutNs + 1));
  EXPECT_EQ(d->feedback_owner_pid.load(), 200u);
  EXPECT_FALSE(hold_feedback(*d, 100, 1'200'000'000 + kOwnerTimeoutNs + 2));  // the stalled one finds it gone
  drop_feedback(*d, 100);                                                     // not the owner: no effect
  EXPECT_EQ(d->feedback_owner_pid.load(), 200u);
  drop_feedback(*d, 200);
  EXPECT_EQ(d->feedback_owner_pid.load(), 0u);
  EXPECT_TRUE(hold_feedback(*d, 300, 1));
}

// --- closed loop on a modelled device -------------------------------------

namespace {

// One saturating container on a device it has to itself: kernels of
// `true_ns` run back to back on one timeline; the application keeps at most
// 10 ms of its own work queued; the controller measures the container's exact
// busy time every kControlPeriodNs (optionally rounded to whole percent, as
// NVML reports it).
struct Model {
  DeviceState* d = nullptr;
  ControlState control;
  std::uint64_t now = 1'000'000'000;
  std::uint64_t next_step = 0;
  std::uint64_t window_start = 0;
  std::uint64_t busy_until = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> kernels;
  bool round_percent = false;
  std::size_t cursor = 0;  // first kernel that may end after the current window's start

  std::uint64_t busy_in(std::uint64_t t0, std::uint64_t t1, std::size_t from = 0) const {
    std::uint64_t busy = 0;
    for (std::size_t i = from; i < kernels.size() && kernels[i].first < t1; ++i) {
      const std::uint64_t lo = std::max(kernels[i].first, t0), hi = std::min(kernels[i].second, t1);
      if (hi > lo) busy += hi - lo;
    }
    return busy;
  }
  void advance(std::uint64_t ns) {
    const std::uint64_t end = now + ns;
    while (next_step <= end) {
      now = next_step;
      while (cursor < kernels.size() && kernels[cursor].second <= window_start) ++cursor;
      std::uint64_t busy = busy_in(window_start, now, cursor);
      const std::uint64_t window = now - window_start;
      if (round_percent) busy = (busy * 100 + window / 2) / window * window / 100;
      control_step(*d, control, Measurement{window, busy, 0}, now);
      window_start = now;
      next_step = now + kControlPeriodNs;
    }
    now = end;
  }
};

Model* g_model = nullptr;
std::uint64_t model_clock() noexcept { return g_model->now; }
void model_sleep(std::uint64_t ns) noexcept { g_model->advance(ns); }

// Achieved share (percent) over `seconds` of a saturating container.
double run_model(std::uint32_t pct, std::uint64_t true_ns, double seconds, bool round_percent = false,
                 SmPolicy policy = SmPolicy::hard) {
  auto d = state(pct, policy);
  Model m;
  m.d = d.get();
  m.round_percent = round_percent;
  g_model = &m;
  control_begin(*d, m.control);
  m.window_start = m.now;
  m.next_step = m.now + kControlPeriodNs;
  const std::uint64_t t0 = m.now, t1 = t0 + static_cast<std::uint64_t>(seconds * 1e9);
  const std::uint64_t nominal = nominal_ns(1, sm_reciprocal(132));
  while (m.now < t1) {
    refill(*d, m.now);
    const std::int64_t cost = price_ns(nominal, d->cost_scale_ppm.load());
    if (!spend(*d, cost)) wait_for_credit(*d, model_clock, model_sleep);
    const std::uint64_t start = std::max(m.now, m.busy_until);
    m.busy_until = start + true_ns;
    m.kernels.emplace_back(start, m.busy_until);
    // The application's own pacing: at most 10 ms of its work queued.
    if (m.busy_until > m.now + 10'000'000)
      m.advance(m.busy_until - m.now - 5'000'000);
    else
      m.advance(1'000);  // launch overhead
  }
  g_model = nullptr;
  return 100.0 * static_cast<double>(m.busy_in(t0, t1)) / static_cast<double>(t1 - t0);
}

}  // namespace

class ClosedLoop : public ::testing::TestWithParam<std::tuple<std::uint32_t, std::uint64_t>> {};

TEST_P(ClosedLoop, AchievedShareConvergesOnTheTarget) {
  const auto [pct, true_ns] = GetParam();
  EXPECT_NEAR(run_model(pct, true_ns, 5.0), pct, 1.0) << "kernel " << true_ns << " ns";
  EXPECT_NEAR(run_model(pct, true_ns, 5.0, true), pct, 1.5) << "kernel " << true_ns << " ns, NVML rounding";
}

INSTANTIATE_TEST_SUITE_P(Kernels, ClosedLoop,
                         ::testing::Combine(::testing::Values(10u, 50u, 90u),
                                            ::testing::Values(2'000ull, 20'000ull, 1'000'000ull, 10'000'000ull)));

TEST(ClosedLoopElastic, AloneTakesTheIdleDevice) {
  EXPECT_GT(run_model(30, 1'000'000, 3.0, false, SmPolicy::elastic), 85.0);
}
