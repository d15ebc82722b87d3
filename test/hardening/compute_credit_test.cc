// Prices a thread takes ahead (limiter::spend_ahead, hook/launch.cc): a
// launch of a small price also takes its thread's next launches' prices from
// the container's bucket, and the thread spends them from its own credit.
// What it has not spent when it ends goes back to the bucket, whether the
// thread is joined or is the main thread returning from main, and only once:
// a child forked by fork() that exits gives back none of the credit its
// parent took. The bucket's spent total (limiter::spent_total: credited_ns -
// tokens_ns, which refills and true-ups leave alone) then grows by the prices
// of the launches that ran, nothing more.
#include <gtest/gtest.h>

#include <string>

#include "compute_support.h"
#include "limiter/compute.h"
#include "shm/region_file.h"

namespace gpuslice::test::hardening {
namespace {

constexpr std::uint64_t kScalePpm = 5'000;  // a one-block kernel is priced 100 ns
constexpr long kLaunches = 20;              // past one check of the queue (every 16 launches) and one take ahead

class ThreadCredit : public ::testing::TestWithParam<const char*> {};

TEST_P(ThreadCredit, GoesBackToTheBucketWhenItsThreadEnds) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_SM_LIMIT", "50"}});
  // A first process names the device: its entry in the region exists from here.
  Result first = run({bin("gpuslice-probe"), "compute", "launch-then-exit", "main", "1"}, env);
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  shm::Error err{};
  Region* region = shm::attach_existing(box.path("container.region").c_str(), true, &err);
  ASSERT_NE(region, nullptr) << err.message;
  DeviceState& d = region->devices[0];
  ASSERT_EQ(d.sm_limit_pct.load(), 50u);
  // A measured, small price (the controller's work, done here so that the
  // probe's launches are priced alike) and a full bucket: every launch goes
  // at once and the first takes the next ones' prices ahead.
  d.cost_scale_ppm.store(kScalePpm);
  limiter::scale_updated_ns(d).store(1);
  d.tokens_ns.store(1'000'000'000);
  const std::int64_t price = limiter::price_ns(limiter::kNominalWaveNs, kScalePpm);
  ASSERT_GT(limiter::ahead_for(price), 0) << "the price is not small enough to be taken ahead";
  const std::int64_t before = limiter::spent_total(d);

  Result r = run({bin("gpuslice-probe"), "compute", "launch-then-exit", GetParam(), std::to_string(kLaunches)}, env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_EQ(unsigned_number(r, "probe", "launched", 0), static_cast<std::uint64_t>(kLaunches)) << r.describe();
  ASSERT_EQ(unsigned_number(r, "probe", "child_status", 0), 0u) << r.describe();
  ASSERT_EQ(d.cost_scale_ppm.load(), kScalePpm) << "the price changed during the run";
  EXPECT_EQ(limiter::spent_total(d) - before, kLaunches * price)
      << "the bucket kept " << limiter::spent_total(d) - before - kLaunches * price
      << " ns taken ahead and never spent";
}

INSTANTIATE_TEST_SUITE_P(Compute, ThreadCredit, ::testing::Values("thread", "main", "fork"),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

}  // namespace
}  // namespace gpuslice::test::hardening
