// The price scale against launches of every length (issue 35): a closed loop
// of bucket + controller on a modelled device, in simulated time (1 ms ticks),
// with the launch path's order of things — a launch spends its price, waits
// while the bucket is in debt, then runs — and a measurement either exact
// every 50 ms (the ideal profile) or NVML's whole percents of a 166 ms sample
// (the realistic one). Process A runs long launches, then a new owner's
// process B (a fresh controller, the region's scale and balance) runs short
// kernels or the same long launches: B must get its share at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <memory>

#include "limiter/compute.h"
#include "limiter/compute_control.h"

using namespace gpuslice;
using namespace gpuslice::limiter;

namespace {

constexpr std::uint64_t kMs = 1'000'000;

struct Load {
  std::uint64_t nominal_ns;  // the launch's nominal price (waves x 20 us, summed over a graph)
  std::uint64_t true_ns;     // its device time
  unsigned inflight;         // launches the process keeps queued
};

struct Device {
  std::unique_ptr<DeviceState> d = std::make_unique<DeviceState>();
  bool sampled = false;  // NVML of whole percents every 166 ms, else exact every 50 ms
  std::uint64_t now = 1'000'000'000;
  std::uint64_t busy_until = 0;
  std::deque<std::pair<std::uint64_t, std::uint64_t>> kernels;  // (start, end), for the measurement
  std::uint64_t window_start = 0;

  Device(std::uint32_t pct, bool nvml_sampled) : sampled(nvml_sampled) {
    d->sm_limit_pct.store(pct);
    d->cost_scale_ppm.store(1'000'000);
  }
  std::uint64_t busy_in(std::uint64_t t0, std::uint64_t t1) const {
    std::uint64_t busy = 0;
    for (const auto& [a, b] : kernels) {
      const std::uint64_t lo = std::max(a, t0), hi = std::min(b, t1);
      if (hi > lo) busy += hi - lo;
    }
    return busy;
  }
  double scale() const { return static_cast<double>(d->cost_scale_ppm.load()) * 1e-6; }
};

// Runs one process of `load` for `seconds` with its own controller (a new
// feedback owner: control_begin on the region as the previous process left
// it). Returns the process's share (percent) of its last `measured` seconds.
double run_process(Device& dev, const Load& load, double seconds, double measured) {
  DeviceState& d = *dev.d;
  ControlState control;
  control_begin(d, control);
  dev.window_start = dev.now;
  const std::uint64_t period = dev.sampled ? 166 * kMs : 50 * kMs;
  std::uint64_t next_step = dev.now + period;
  const std::uint64_t start = dev.now, end = start + static_cast<std::uint64_t>(seconds * 1e9);
  const std::uint64_t measure_from = end - static_cast<std::uint64_t>(measured * 1e9);
  bool waiting = false;  // spent, waiting for the balance to be >= 0
  // This process's queued launches (end, price): the launch path's queue
  // bound keeps at most kQueueCostNs (20 ms) of priced work in flight.
  std::deque<std::pair<std::uint64_t, std::int64_t>> mine;
  std::int64_t priced_inflight = 0;
  std::uint64_t busy = 0;
  std::int64_t price = 0;
  for (; dev.now < end; dev.now += kMs) {
    refill(d, dev.now);
    while (!mine.empty() && mine.front().first <= dev.now) {
      priced_inflight -= mine.front().second;
      mine.pop_front();
    }
    // As many launches as the process gets through in a tick.
    for (int i = 0; i < 1000; ++i) {
      bool go = false;
      if (!waiting && mine.size() < load.inflight &&
          (mine.empty() || priced_inflight < static_cast<std::int64_t>(20 * kMs))) {
        price = price_ns(load.nominal_ns, d.cost_scale_ppm.load());
        go = spend(d, price);
        waiting = !go;
      } else if (waiting && d.tokens_ns.load() >= 0) {
        go = true;
        waiting = false;
      }
      if (!go) break;
      const std::uint64_t s = std::max(dev.now, dev.busy_until);
      dev.busy_until = s + load.true_ns;
      dev.kernels.emplace_back(s, dev.busy_until);
      mine.emplace_back(dev.busy_until, price);
      priced_inflight += price;
      if (dev.busy_until > measure_from && s < end) busy += std::min(dev.busy_until, end) - std::max(s, measure_from);
    }
    if (dev.now >= next_step) {
      const std::uint64_t window = dev.now - dev.window_start;
      std::uint64_t b = dev.busy_in(dev.window_start, dev.now);
      Measurement m{window, b, 0, 0};
      if (dev.sampled) {
        m.busy_ns = (b * 100 + window / 2) / window * window / 100;  // whole percent, rounded
        m.resolution_ns = window / 200;
        // A 0% process has no sample: with nobody else on the device, NVML
        // answers NOT_FOUND, and a window closes (as idle) only after 1 s.
        if (m.busy_ns == 0 && window < 1000 * kMs) {
          next_step = dev.now + period;
          continue;
        }
        if (m.busy_ns == 0) m = Measurement{window, 0, 0, window / 200};
      }
      control_step(d, control, m, dev.now);
      dev.window_start = dev.now;
      next_step = dev.now + period;
      while (!dev.kernels.empty() && dev.kernels.front().second < dev.window_start) dev.kernels.pop_front();
    }
  }
  // What is still queued at exit runs on (and is measured by the next owner).
  return 100.0 * static_cast<double>(busy) / (measured * 1e9);
}

// 10^5 kernels of 5 us in one graph: 0.5 s, nominal 2 s (true scale 0.25).
constexpr Load kGraph{100'000 * 20'000ull, 500 * kMs, 2};
// Kernels of 500 ms, 2 s and 50 ms (one wave: nominal 20 us).
constexpr Load kHalfSecond{20'000, 500 * kMs, 2};
constexpr Load kTwoSeconds{20'000, 2000 * kMs, 1};
constexpr Load kFiftyMs{20'000, 50 * kMs, 2};
// 100 us kernels, 200 of them queued (20 ms), true scale 5.
constexpr Load kShort{20'000, 100'000, 200};

class LongLaunches : public ::testing::TestWithParam<bool> {};

INSTANTIATE_TEST_SUITE_P(Nvml, LongLaunches, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "sampled" : "exact"; });

void expect_scale_near(const Device& dev, double truth) {
  EXPECT_GE(dev.scale(), truth / 2) << "truth " << truth;
  EXPECT_LE(dev.scale(), truth * 2) << "truth " << truth;
}

TEST_P(LongLaunches, ScaleOfGraphsOfHalfASecondIsTheirs) {
  Device dev(50, GetParam());
  const double a = run_process(dev, kGraph, 8.0, 6.0);
  std::printf("graph: A %.1f%%, scale %.3f (truth 0.25)\n", a, dev.scale());
  EXPECT_NEAR(a, 50.0, 9.0);
  expect_scale_near(dev, 0.25);
}

TEST_P(LongLaunches, ScaleOfKernelsOfFiftyMillisecondsIsTheirs) {
  Device dev(50, GetParam());
  const double a = run_process(dev, kFiftyMs, 4.0, 3.0);
  std::printf("50 ms: A %.1f%%, scale %.1f (truth 2500)\n", a, dev.scale());
  EXPECT_NEAR(a, 50.0, 5.0);
  expect_scale_near(dev, 2500);
}

TEST_P(LongLaunches, ShortKernelsAfterGraphsGetTheirShare) {
  Device dev(50, GetParam());
  run_process(dev, kGraph, 5.0, 1.0);
  const double scale_a = dev.scale();
  const double b = run_process(dev, kShort, 6.0, 2.0);
  std::printf("graph then short: scale after A %.3f, B %.1f%%, scale %.2f (truth 5)\n", scale_a, b, dev.scale());
  EXPECT_NEAR(b, 50.0, 5.0) << "scale after A " << scale_a;
}

TEST_P(LongLaunches, ShortKernelsAfterKernelsOfHalfASecondGetTheirShare) {
  Device dev(50, GetParam());
  run_process(dev, kHalfSecond, 5.0, 1.0);
  const double scale_a = dev.scale();
  const double b = run_process(dev, kShort, 6.0, 2.0);
  std::printf("500 ms then short: scale after A %.1f (truth 25000), B %.1f%%, scale %.2f\n", scale_a, b, dev.scale());
  EXPECT_NEAR(b, 50.0, 5.0) << "scale after A " << scale_a;
}

TEST_P(LongLaunches, ShortKernelsAfterKernelsOfTwoSecondsGetTheirShare) {
  Device dev(50, GetParam());
  run_process(dev, kTwoSeconds, 9.0, 1.0);
  const double scale_a = dev.scale();
  // A leaves its last kernel running (up to 2 s of the container's device
  // time, repaid in B's first 4 s): B's share of its 6th and 7th seconds.
  const double b = run_process(dev, kShort, 7.0, 2.0);
  std::printf("2 s then short: scale after A %.1f (truth 1e5), B %.1f%%, scale %.2f\n", scale_a, b, dev.scale());
  EXPECT_NEAR(b, 50.0, 5.0) << "scale after A " << scale_a;
}

TEST_P(LongLaunches, TheNextGraphIsNotHeldForMinutes) {
  Device dev(50, GetParam());
  run_process(dev, kGraph, 5.0, 1.0);
  const double scale_a = dev.scale();
  // B: the same graph. Its share of its first 3 s: its first launch goes
  // within a couple of seconds, not after a debt of minutes.
  const double b = run_process(dev, kGraph, 3.0, 3.0);
  std::printf("graph then graph: scale after A %.3f, B %.1f%% of its first 3 s\n", scale_a, b);
  EXPECT_GE(b, 25.0) << "scale after A " << scale_a;
}

// The bound alone: a scale of 2500 x nominal (a 500 ms kernel's) on 100 us
// kernels of a container that measurably uses nothing at that price, one
// launch a window (the bucket's pace at that price). The new baseline settles
// at once (the device is idle); the bound leaves 4 queues' worth (80 ms at
// the price: 1.6 launches) as possibly not run yet, so the third window
// refutes the scale: to what 7 us nominal and the 200 us signal floor support.
TEST(ComputeControl, AScaleTheMeasurementRefutesIsLowered) {
  Device dev(50, false);
  DeviceState& d = *dev.d;
  d.cost_scale_ppm.store(2'500'000'000);
  scale_updated_ns(d).store(1);
  ControlState s;
  control_begin(d, s);
  for (int i = 0; i < 3; ++i) {
    spend(d, price_ns(20'000, d.cost_scale_ppm.load()));
    control_step(d, s, Measurement{50 * kMs, 0, 0, 0}, 2 + i);
  }
  EXPECT_LE(d.cost_scale_ppm.load(), 30'000'000u);
  EXPECT_GE(d.cost_scale_ppm.load(), 20'000'000u);
}

// ... but a weak signal that agrees with the scale leaves it alone: 100 us
// kernels priced at their 5 x, one per window, measured exactly.
TEST(ComputeControl, AWeakSignalThatAgreesKeepsTheScale) {
  Device dev(50, false);
  DeviceState& d = *dev.d;
  d.cost_scale_ppm.store(5'000'000);
  scale_updated_ns(d).store(1);
  ControlState s;
  control_begin(d, s);
  for (int i = 0; i < 20; ++i) {
    spend(d, price_ns(20'000, d.cost_scale_ppm.load()));
    control_step(d, s, Measurement{50 * kMs, 100'000, 0, 0}, 2 + i);
    EXPECT_NEAR(static_cast<double>(d.cost_scale_ppm.load()), 5e6, 5e5) << "step " << i;
  }
}

// A new owner finds a departed process's kernel still running (the device
// full of the container's time, with next to nothing admitted): that time is
// charged (the true-up) but not priced against the new admissions, until the
// device has been idle once.
TEST(ComputeControl, WorkQueuedBeforeTheBaselineIsNotPriced) {
  Device dev(50, false);
  DeviceState& d = *dev.d;
  d.cost_scale_ppm.store(250'000);
  scale_updated_ns(d).store(1);
  ControlState s;
  control_begin(d, s);
  for (int i = 0; i < 10; ++i) {
    spend(d, price_ns(20'000, d.cost_scale_ppm.load()));
    const StepResult r = control_step(d, s, Measurement{50 * kMs, 50 * kMs, 0, 0}, 2 + i);
    EXPECT_EQ(r.adjust_ns, price_ns(20'000, 250'000) - static_cast<std::int64_t>(50 * kMs));  // charged
    EXPECT_EQ(d.cost_scale_ppm.load(), 250'000u) << "step " << i;                             // not priced
  }
  EXPECT_FALSE(s.settled);
  control_step(d, s, Measurement{50 * kMs, 10 * kMs, 0, 0}, 20);  // the device idled: drained
  EXPECT_TRUE(s.settled);
  EXPECT_EQ(d.cost_scale_ppm.load(), 250'000u);  // that window may hold the old work still
  for (int i = 0; i < 10; ++i) {
    spend(d, price_ns(2'000'000, d.cost_scale_ppm.load()));            // 2 ms nominal ...
    control_step(d, s, Measurement{50 * kMs, 1 * kMs, 0, 0}, 30 + i);  // ... that took 1 ms
  }
  EXPECT_NEAR(static_cast<double>(d.cost_scale_ppm.load()), 500'000.0, 50'000.0);
}

TEST(ComputeControl, ANewOwnerInheritsABoundedDebt) {
  Device dev(50, false);
  DeviceState& d = *dev.d;
  d.tokens_ns.store(-1'000'000 * static_cast<std::int64_t>(kMs));  // 1000 s: a price at a poisoned scale
  ControlState s;
  control_begin(d, s);
  EXPECT_EQ(d.tokens_ns.load(), -kInheritedDebtCapacities * capacity_ns(500));
  EXPECT_EQ(s.spent_mark, spent_total(d));                  // the baseline is after the bound
  d.tokens_ns.store(-10 * static_cast<std::int64_t>(kMs));  // an ordinary debt stands
  control_begin(d, s);
  EXPECT_EQ(d.tokens_ns.load(), -10 * static_cast<std::int64_t>(kMs));
}

}  // namespace
