// NVML utilisation answers -> measurement windows (limiter/compute_samples.h):
// an exact NVML (stamps "now"), and a sampling one like the real driver's
// (integer percents per period, stamped with the period's end, NOT_FOUND
// until the next period ends).
#include <gtest/gtest.h>

#include <vector>

#include "limiter/compute_samples.h"

using namespace gpuslice::limiter;

namespace {

constexpr std::uint32_t kOurs = 100, kOther = 200;
constexpr std::uint64_t kT0 = 1'700'000'000'000'000ull;  // CPU us
constexpr std::uint64_t kP = 166'000;                    // sample period, us

bool ours(const void*, std::uint32_t pid) noexcept { return pid == kOurs; }

nvmlProcessUtilizationSample_t sample(std::uint32_t pid, std::uint64_t stamp, unsigned pct) {
  return nvmlProcessUtilizationSample_t{pid, stamp, pct, 0, 0, 0};
}

struct Nvml {
  SampleClock clock;
  Measurement m;
  // One query at asked_us answering `s` (empty: NOT_FOUND).
  bool ask(std::uint64_t asked_us, std::vector<nvmlProcessUtilizationSample_t> s) {
    m = Measurement{};
    return samples_reduce(clock, s.empty() ? NVML_ERROR_NOT_FOUND : NVML_SUCCESS, s.data(),
                          static_cast<unsigned>(s.size()), asked_us, ours, nullptr, &m);
  }
};

}  // namespace

TEST(ComputeSamples, ExactNvmlMeasuresTheWindowUpToTheCall) {
  Nvml n;
  samples_begin(n.clock, kT0);
  ASSERT_TRUE(n.ask(kT0 + 50'000, {sample(kOurs, kT0 + 50'000, 40), sample(kOther, kT0 + 50'000, 35)}));
  EXPECT_EQ(n.m.window_ns, 50'000'000u);
  EXPECT_EQ(n.m.busy_ns, 20'000'000u);
  EXPECT_EQ(n.m.others_ns, 17'500'000u);
  EXPECT_TRUE(n.clock.exact);
  EXPECT_FALSE(n.clock.periodic);
  // Exact and nothing new: nobody ran, an idle window at once.
  ASSERT_TRUE(n.ask(kT0 + 100'000, {}));
  EXPECT_EQ(n.m.window_ns, 50'000'000u);
  EXPECT_EQ(n.m.busy_ns, 0u);
  EXPECT_EQ(n.clock.last_seen_us, kT0 + 100'000);
}

TEST(ComputeSamples, NotFoundBeforeTheNextSampleIsNoWindow) {
  // The bug this file fixes: NOT_FOUND between two samples was measured as an
  // idle window, which refunded everything admitted in it.
  Nvml n;
  samples_begin(n.clock, kT0);
  for (std::uint64_t t = 10'000; t < kP; t += 10'000) EXPECT_FALSE(n.ask(kT0 + t, {})) << t;
  EXPECT_EQ(n.clock.last_seen_us, kT0);
  // The period ends at kT0 + kP - 20 ms (the baseline was mid-period).
  const std::uint64_t s1 = kT0 + kP - 20'000;
  ASSERT_TRUE(n.ask(s1 + 3'000, {sample(kOurs, s1, 30)}));
  EXPECT_TRUE(n.clock.periodic);
  EXPECT_EQ(n.m.window_ns, (kP - 20'000) * 1000);
  EXPECT_EQ(n.m.busy_ns, (kP - 20'000) * 1000 * 30 / 100);
  for (std::uint64_t t = 10'000; t < kP; t += 10'000) EXPECT_FALSE(n.ask(s1 + t, {})) << t;
  ASSERT_TRUE(n.ask(s1 + kP + 1'000, {sample(kOurs, s1 + kP, 31), sample(kOther, s1 + kP, 60)}));
  EXPECT_EQ(n.clock.period_us, kP);
  EXPECT_EQ(n.m.window_ns, kP * 1000);
  EXPECT_EQ(n.m.busy_ns, kP * 1000 * 31 / 100);
  EXPECT_EQ(n.m.others_ns, kP * 1000 * 60 / 100);
}

TEST(ComputeSamples, EachSampleWeighsItsOwnPeriod) {
  Nvml n;
  n.clock = SampleClock{kT0, true, true, false, kP};
  // Three periods in one answer (the owner was late); the container ran in
  // the first and the last only: 0% in the middle one, not its average.
  ASSERT_TRUE(n.ask(kT0 + 3 * kP + 5'000, {sample(kOurs, kT0 + kP, 50), sample(kOther, kT0 + 2 * kP, 100),
                                           sample(kOurs, kT0 + 3 * kP, 50), sample(kOther, kT0 + kP, 50)}));
  EXPECT_EQ(n.m.window_ns, 3 * kP * 1000);
  EXPECT_EQ(n.m.busy_ns, kP * 1000);  // 50% + 0% + 50% of one period each
  EXPECT_EQ(n.m.others_ns, kP * 1000 * 3 / 2);
  EXPECT_EQ(n.clock.last_seen_us, kT0 + 3 * kP);
}

TEST(ComputeSamples, IdleDeviceClosesWindowsOnTheSampleGrid) {
  Nvml n;
  n.clock = SampleClock{kT0, true, true, false, kP};
  EXPECT_FALSE(n.ask(kT0 + 2 * kP + 10'000, {}));  // maybe only late
  ASSERT_TRUE(n.ask(kT0 + 3 * kP + 10'000, {}));   // three periods without any sample: idle
  EXPECT_EQ(n.m.busy_ns, 0u);
  EXPECT_EQ(n.clock.last_seen_us, kT0 + 2 * kP);  // the newest period may still be published
  // A sample two periods later weighs one period, not the gap.
  ASSERT_TRUE(n.ask(kT0 + 4 * kP + 1'000, {sample(kOurs, kT0 + 4 * kP, 20)}));
  EXPECT_EQ(n.m.window_ns, 2 * kP * 1000);
  EXPECT_EQ(n.m.busy_ns, kP * 1000 * 20 / 100);
}

TEST(ComputeSamples, UnknownNvmlWaitsBeforeCallingTheDeviceIdle) {
  Nvml n;
  samples_begin(n.clock, kT0);
  EXPECT_FALSE(n.ask(kT0 + kNoSampleIdleUs - 1, {}));
  ASSERT_TRUE(n.ask(kT0 + kNoSampleIdleUs, {}));
  EXPECT_EQ(n.m.window_ns, kNoSampleIdleUs * 1000);
  EXPECT_EQ(n.m.busy_ns, 0u);
}

TEST(ComputeSamples, StampsMicrosecondsApartAreOneInstant) {
  Nvml n;
  n.clock = SampleClock{kT0, true, true, false, 0};
  ASSERT_TRUE(n.ask(kT0 + kP + 2'000, {sample(kOurs, kT0 + kP, 40), sample(kOther, kT0 + kP + 3, 50)}));
  // One instant at the later stamp: the period is kP + 3 us, not 3 us.
  EXPECT_EQ(n.clock.period_us, kP + 3);
  EXPECT_EQ(n.m.busy_ns, (kP + 3) * 1000 * 40 / 100);
  EXPECT_EQ(n.m.others_ns, (kP + 3) * 1000 * 50 / 100);
}

TEST(ComputeSamples, ErrorsMeasureNothing) {
  Nvml n;
  samples_begin(n.clock, kT0);
  nvmlProcessUtilizationSample_t s = sample(kOurs, kT0 + 10, 10);
  EXPECT_FALSE(samples_reduce(n.clock, NVML_ERROR_UNKNOWN, &s, 1, kT0 + 5 * kNoSampleIdleUs, ours, nullptr, &n.m));
  EXPECT_EQ(n.clock.last_seen_us, kT0);
}

TEST(ComputeSamples, AGapFromAnIdleWindowTeachesNoPeriod) {
  // A sample that looked exact (stamped at the call), then NOT_FOUND closed an
  // idle window at "now": the gap from there to the next sample is not a
  // period (learning it as one capped every later sample at a few ms).
  Nvml n;
  samples_begin(n.clock, kT0);
  ASSERT_TRUE(n.ask(kT0 + 20'000, {sample(kOurs, kT0 + 20'000, 50)}));
  EXPECT_TRUE(n.clock.exact);
  ASSERT_TRUE(n.ask(kT0 + 30'000, {}));
  ASSERT_TRUE(n.ask(kT0 + 40'000, {sample(kOurs, kT0 + 38'000, 50)}));  // stamped before the call
  EXPECT_TRUE(n.clock.periodic);
  EXPECT_EQ(n.clock.period_us, 0u);
  ASSERT_TRUE(n.ask(kT0 + 38'000 + kP + 1, {sample(kOurs, kT0 + 38'000 + kP, 50)}));
  EXPECT_EQ(n.clock.period_us, kP);
}

// The one rounding rule of a published share: truncated permille, capped.
TEST(ComputeSamples, SharesArePublishedAsTruncatedPermille) {
  EXPECT_EQ(share_permille(0, 1'000), 0u);
  EXPECT_EQ(share_permille(1'000, 0), 0u);  // no window: nothing measured
  EXPECT_EQ(share_permille(333, 1'000), 333u);
  EXPECT_EQ(share_permille(9'999, 10'000'000), 0u);  // 0.9999 permille: truncated, never rounded up
  EXPECT_EQ(share_permille(2'999'999, 1'000'000'000), 2u);
  EXPECT_EQ(share_permille(5'000, 1'000), 1000u);  // capped
  // No overflow for long windows: a year of device time over a year.
  const std::uint64_t year_ns = 365ull * 24 * 3600 * 1'000'000'000;
  EXPECT_EQ(share_permille(year_ns / 2, year_ns), 500u);
}

namespace {

struct PerProcess {
  std::uint64_t busy[4] = {};  // by pid 1..3
  static void add(void* self, std::uint32_t pid, std::uint64_t busy_ns) noexcept {
    static_cast<PerProcess*>(self)->busy[pid < 4 ? pid : 0] += busy_ns;
  }
};

}  // namespace

// The agent's reduction (per process) and the library's (ours vs others) are
// the same one: per process, weighted by period, summed.
TEST(ComputeSamples, PerProcessWindowSumsEachProcessOverItsPeriods) {
  SampleClock c{kT0, true, true, false, kP};
  const std::vector<nvmlProcessUtilizationSample_t> s = {sample(1, kT0 + kP, 50), sample(2, kT0 + kP, 20),
                                                         sample(1, kT0 + 2 * kP, 10), sample(3, kT0 + 2 * kP, 7)};
  PerProcess p;
  std::uint64_t window_ns = 0;
  ASSERT_TRUE(samples_window(c, NVML_SUCCESS, s.data(), 4, kT0 + 2 * kP + 1'000, PerProcess::add, &p, &window_ns));
  EXPECT_EQ(window_ns, 2 * kP * 1000);
  EXPECT_EQ(p.busy[1], kP * 1000 * 60 / 100);
  EXPECT_EQ(p.busy[2], kP * 1000 * 20 / 100);
  EXPECT_EQ(p.busy[3], kP * 1000 * 7 / 100);
  EXPECT_EQ(c.last_seen_us, kT0 + 2 * kP);
  // The same answer split ours (pid 1) vs others gives the same times.
  SampleClock c2{kT0, true, true, false, kP};
  Measurement m;
  ASSERT_TRUE(samples_reduce(
      c2, NVML_SUCCESS, s.data(), 4, kT0 + 2 * kP + 1'000,
      [](const void*, std::uint32_t pid) noexcept { return pid == 1; }, nullptr, &m));
  EXPECT_EQ(m.window_ns, window_ns);
  EXPECT_EQ(m.busy_ns, p.busy[1]);
  EXPECT_EQ(m.others_ns, p.busy[2] + p.busy[3]);
  EXPECT_EQ(share_permille(m.busy_ns, m.window_ns), 300u);
}

TEST(ComputeSamples, PerProcessWindowWaitsForASampleLikeTheSplitOne) {
  SampleClock c{kT0, true, true, false, kP};
  PerProcess p;
  std::uint64_t window_ns = 0;
  EXPECT_FALSE(samples_window(c, NVML_ERROR_NOT_FOUND, nullptr, 0, kT0 + kP + 10'000, PerProcess::add, &p, &window_ns));
  EXPECT_EQ(c.last_seen_us, kT0);
  EXPECT_EQ(p.busy[1] + p.busy[2] + p.busy[3], 0u);
}
