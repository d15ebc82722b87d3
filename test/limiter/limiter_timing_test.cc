// The compute limiter on the simulated driver, end to end: spinload processes
// under libgpuslice.so, shares read from the simulated device timeline. Short
// windows and tolerances wide enough for a loaded 2-core machine; the full
// 5-second sweep with +-2 points is gpuslice-limiter-sweep (docs/limiter.md).
// Labelled `timing`: skipped under sanitizers.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "scenarios.h"

using namespace gpuslice::test;
using namespace gpuslice::test::limiter;

namespace {

constexpr double kWindow = 2.0;  // seconds measured, from the first launch
constexpr std::uint64_t kSecond = 1'000'000'000ull;
// The load keeps 30 ms of its work queued (the sweep: 20 ms), so that a load
// process starved of CPU for a while on a busy machine does not leave the
// device idle: what is measured is the limiter, not the scheduler.
constexpr double kInflightMs = 30.0;

std::vector<std::string> load(const std::string& path, unsigned kernel_us, double seconds,
                              const std::string& via = "symbol") {
  return spin(path, kernel_us, seconds, via, kInflightMs);
}

// Above the target is the limiter's failure; below it can also be a loaded
// machine not running the load often enough, hence the wider lower margin.
#define EXPECT_SHARE(achieved, target, over, under) \
  do {                                              \
    const double a_ = (achieved), t_ = (target);    \
    EXPECT_LE(a_, t_ + (over)) << "target " << t_;  \
    EXPECT_GE(a_, t_ - (under)) << "target " << t_; \
  } while (0)

std::uint64_t after(std::uint64_t t, double seconds) { return t + static_cast<std::uint64_t>(seconds * 1e9); }

void expect_ran(const std::vector<ContainerResult>& results) {
  for (const auto& c : results)
    for (const auto& p : c.procs) ASSERT_TRUE(p.result.exit_code == 0 && p.start_ns != 0) << c.describe();
}

// One container of `procs` processes running `args`; its share of the window.
double one_container(const std::string& limit, const std::vector<std::string>& args, unsigned procs = 1,
                     const std::string& policy = "") {
  Machine m;
  Container c{"c", limit, policy, {}, {}};
  for (unsigned i = 0; i < procs; ++i) c.procs.push_back(Proc{args});
  auto results = m.run({c});
  expect_ran(results);
  const std::uint64_t t0 = results[0].first_start();
  return m.share(results[0], t0, after(t0, kWindow));
}

}  // namespace

class HardLimit : public ::testing::TestWithParam<unsigned> {};
TEST_P(HardLimit, OneProcessOfMillisecondKernels) {
  const unsigned pct = GetParam();
  EXPECT_SHARE(one_container(std::to_string(pct), load("kernel", 1000, kWindow + 0.2)), pct, 3.0, 6.0);
}
INSTANTIATE_TEST_SUITE_P(Limits, HardLimit, ::testing::Values(25u, 75u));

TEST(LimiterTiming, SmallKernelsAreLimitable) {
  EXPECT_SHARE(one_container("50", load("kernel", 20, kWindow + 0.2)), 50.0, 3.0, 6.0);
}

class LaunchPath : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};
TEST_P(LaunchPath, IsThrottled) {
  const auto [path, via] = GetParam();
  const unsigned kernel_us = std::string(path).rfind("graph", 0) == 0 ? 100 : 1000;
  Machine m;
  Container c{"c", "40", "", {Proc{load(path, kernel_us, 1.7, via)}}, {}};
  auto results = m.run({c});
  expect_ran(results);
  const std::uint64_t t0 = results[0].first_start();
  SCOPED_TRACE(std::string(path) + " via " + via);
  EXPECT_SHARE(m.share(results[0], t0, after(t0, 1.5)), 40.0, 3.5, 6.0);
}
INSTANTIATE_TEST_SUITE_P(Paths, LaunchPath,
                         ::testing::Values(std::make_pair("ex", "symbol"), std::make_pair("kernel_ptsz", "procaddr"),
                                           std::make_pair("coop_ptsz", "procaddr"), std::make_pair("graph", "symbol"),
                                           std::make_pair("graph_ptsz", "procaddr")));

TEST(LimiterTiming, FourProcessesShareOneBucket) {
  EXPECT_SHARE(one_container("40", load("kernel", 1000, kWindow + 0.2), 4), 40.0, 3.0, 6.0);
}

TEST(LimiterTiming, ThreadsShareOneBucket) {
  auto args = load("kernel", 200, kWindow + 0.2);
  args.insert(args.end(), {"--threads", "3"});
  EXPECT_SHARE(one_container("40", args), 40.0, 3.0, 6.0);
}

TEST(LimiterTiming, UnlimitedRunsFree) { EXPECT_GT(one_container("", load("kernel", 1000, kWindow + 0.2)), 90.0); }

TEST(LimiterTiming, TwoContainersGetTheirShares) {
  Machine m;
  Container a{"a", "30", "", {Proc{load("kernel", 1000, kWindow + 0.2)}}, {}};
  Container b{"b", "70", "", {Proc{load("kernel", 1000, kWindow + 0.2)}}, {}};
  auto r = m.run({a, b});
  expect_ran(r);
  const std::uint64_t t0 = std::max(r[0].first_start(), r[1].first_start());
  EXPECT_SHARE(m.share(r[0], t0, after(t0, kWindow)), 30.0, 4.0, 6.0);
  EXPECT_SHARE(m.share(r[1], t0, after(t0, kWindow)), 70.0, 4.0, 8.0);
}

TEST(LimiterTiming, LimitedNextToUnlimitedKeepsItsShareAndLeavesTheRest) {
  Machine m;
  Container a{"a", "30", "", {Proc{load("kernel", 1000, kWindow + 0.2)}}, {}};
  Container b{"b", "", "", {Proc{load("kernel", 1000, kWindow + 0.2)}}, {}};
  auto r = m.run({a, b});
  expect_ran(r);
  const std::uint64_t t0 = std::max(r[0].first_start(), r[1].first_start());
  const double sa = m.share(r[0], t0, after(t0, kWindow)), sb = m.share(r[1], t0, after(t0, kWindow));
  EXPECT_SHARE(sa, 30.0, 4.0, 6.0);
  EXPECT_GT(sa + sb, 90.0);  // the unlimited one takes the rest
}

TEST(LimiterTiming, ElasticUsesIdleCapacityAndGivesItBack) {
  Machine m;
  Container a{"a", "30", "elastic", {Proc{load("kernel", 1000, 4.2)}}, {}};
  Container b{"b", "", "", {Proc{load("kernel", 1000, 2.2), 2.0}}, {}};
  auto r = m.run({a, b});
  expect_ran(r);
  const std::uint64_t ta = r[0].first_start(), tb = r[1].first_start();
  EXPECT_GT(m.share(r[0], after(ta, 0.8), tb), 80.0);
  EXPECT_LE(m.share(r[0], after(tb, 1.0), after(tb, 2.0)), 35.0);
}

TEST(LimiterTiming, DeepQueueCannotEscapeTheLimit) {
  Machine m;
  Container c{"c", "30", "", {Proc{spin("kernel", 1000, kWindow + 0.2, "symbol", 0)}}, {}};
  auto r = m.run({c});
  expect_ran(r);
  const std::uint64_t t0 = r[0].first_start();
  EXPECT_SHARE(m.share(r[0], t0, after(t0, kWindow)), 30.0, 3.0, 6.0);
  // What it left queued when it stopped launching.
  const std::uint64_t end = r[0].procs[0].end_ns;
  EXPECT_LT(m.busy_ns(end, end + 10 * kSecond), 150'000'000u);
}

TEST(LimiterTiming, RuntimeLimitChangeTakesEffectWithinASecond) {
  Machine m;
  Container c{"c", "80", "", {Proc{load("kernel", 1000, 3.2)}}, {}};
  std::thread changer([&] {
    usleep(1'000'000);
    EXPECT_TRUE(m.set_region_limit("c", 20));  // lowered, as the agent or gpuslice-smi would
  });
  auto r = m.run({c});
  changer.join();
  expect_ran(r);
  const std::uint64_t t0 = r[0].first_start();
  EXPECT_SHARE(m.share(r[0], after(t0, 2.0), after(t0, 3.0)), 20.0, 4.0, 6.0);
}

TEST(LimiterTiming, UnlimitedContainerPicksUpALimitSetAtRunTime) {
  Machine m;
  Container u{"u", "", "", {Proc{load("kernel", 1000, 3.2)}}, {}};
  std::thread changer([&] {
    usleep(1'000'000);
    EXPECT_TRUE(m.set_region_limit("u", 30));
  });
  auto r = m.run({u});
  changer.join();
  expect_ran(r);
  const std::uint64_t t0 = r[0].first_start();
  EXPECT_GT(m.share(r[0], t0, after(t0, 0.9)), 90.0);
  EXPECT_SHARE(m.share(r[0], after(t0, 2.0), after(t0, 3.0)), 30.0, 4.0, 6.0);
}

TEST(LimiterTiming, KilledProcessLeavesTheBucketUsable) {
  Machine m;
  Container c{"c", "40", "", {}, {}};
  c.procs.push_back(Proc{load("kernel", 1000, 3.2), 0, 0.7});  // first started: likely the feedback owner
  c.procs.push_back(Proc{load("kernel", 1000, 3.2), 0.05});
  c.procs.push_back(Proc{load("kernel", 1000, 3.2), 0.05});
  auto r = m.run({c});
  EXPECT_EQ(r[0].procs[0].result.signal, SIGKILL);
  const std::uint64_t t0 = r[0].first_start();
  // The survivors keep the container at its share, feedback owner or not.
  EXPECT_SHARE(m.share(r[0], after(t0, 1.5), after(t0, 3.0)), 40.0, 4.0, 6.0);
}
