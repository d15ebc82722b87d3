// Issue 35, item 1: no launch length may poison a container's compute limiter.
// Process A of a container runs long launches (kernels of 50 ms, 500 ms or
// 2 s, graphs of 10^5 kernels of 5 us: 0.5 s a launch) under a 50% limit and
// exits; then process B of the same container (same region: the learnt price
// scale and the bucket are the container's) runs. B must get its share — not
// be paced at 500x its kernels' device time — and its first launch must not
// sleep for minutes on a debt A's launches left. Shares are read from the
// simulated device timeline (fakecuda-ctl), never from the limiter's own
// bookkeeping. Registered on both simulated profiles
// (test/limiter/CMakeLists.txt). Labelled `timing`: wall-clock shares,
// skipped under sanitizers.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gpuslice/region.h"
#include "scenarios.h"
#include "shm/region_file.h"

using namespace gpuslice;
using namespace gpuslice::test;
using namespace gpuslice::test::limiter;

namespace {

constexpr double kSecond = 1e9;
// Every process must end well before this: a launch sleeping on a debt of
// minutes fails the test here instead of hanging it.
constexpr int kTimeoutMs = 20000;

// The container's learnt price scale (device time per nominal ns), for the
// failure messages: the issue saw 399-662 where the truth was 0.25.
double region_scale(const Machine& m, const std::string& container) {
  shm::Error err{};
  Region* r = shm::attach_existing(m.region_path(container).c_str(), true, &err);
  if (r == nullptr) return -1;
  double scale = -1;
  for (DeviceState& d : r->devices)
    if (d.uuid_state.load() == shm::kDevicePublished) scale = static_cast<double>(d.cost_scale_ppm.load()) * 1e-6;
  shm::detach(r);
  return scale;
}

std::vector<std::string> graph_load(double seconds) {
  std::vector<std::string> args = spin("graph", 5, seconds);
  args.insert(args.end(), {"--graph-kernels", "100000"});
  return args;
}

ProcResult run_one(Machine& m, const std::vector<std::string>& args) {
  Container c{"c", "50", "", {Proc{args}}, {}};
  auto results = m.run({c}, kTimeoutMs);
  EXPECT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].procs.size(), 1u);
  const ProcResult p = results[0].procs[0];
  EXPECT_TRUE(!p.result.timed_out && p.result.exit_code == 0 && p.start_ns != 0) << results[0].describe();
  return p;
}

// Long launches of process A, then short kernels of process B (6 s):
//   - the container (A's kernels still running, and B) is not starved over
//     B's life: at least 30% of it at a 50% limit (the start-up below costs
//     B about a second, 38-42% was typical, 33% the least seen after a 6 s
//     A; a poisoned scale left 0-8%);
//   - B's share of its last 1.5 s is its 50% (40-55, the timing tests'
//     tolerances). Before that B may repay what the container used while A's
//     last kernel ran on (up to 2 s of device time: 4 s at 50%), a debt of
//     at most kInheritedDebtCapacities bucket capacities (one second) that
//     A's prices left, and, until its kernels are measured, their price at
//     A's scale (0.5 s a 100 us kernel; on the realistic profile, where
//     nothing of B's reaches NVML's whole percents, refuted after ~1 s).
// `truth`: A's launches' true scale (device time per nominal ns), which the
// container's learnt scale must be within 4x of after A (0: not checked).
void long_then_short(const std::vector<std::string>& long_args, double truth) {
  Machine m;
  const ProcResult a = run_one(m, long_args);
  const double scale_a = region_scale(m, "c");
  if (truth > 0) {
    EXPECT_GE(scale_a, truth / 4) << "the scale A's launches left";
    EXPECT_LE(scale_a, truth * 4) << "the scale A's launches left";
  }
  const ProcResult b = run_one(m, spin("kernel", 100, 6.0));
  ASSERT_GT(b.end_ns, b.start_ns + static_cast<std::uint64_t>(5.5 * kSecond)) << b.result.describe();
  const std::uint64_t t0 = b.end_ns - static_cast<std::uint64_t>(1.5 * kSecond);
  ContainerResult only_b, both;
  only_b.procs.push_back(b);
  both.procs = {a, b};
  const double share = m.share(only_b, t0, b.end_ns);
  const double container = m.share(both, b.start_ns, b.end_ns);
  std::printf(
      "A ran %.2f s (%llu kernels), scale after A %.2f; over B's life the container %.1f%%, B's last 1.5 s "
      "%.1f%%, scale after B %.2f\n",
      static_cast<double>(a.end_ns - a.start_ns) / kSecond, static_cast<unsigned long long>(a.launches), scale_a,
      container, share, region_scale(m, "c"));
  std::printf("B by half second:");
  for (std::uint64_t t = b.start_ns; t + kSecond / 2 <= b.end_ns; t += static_cast<std::uint64_t>(kSecond / 2))
    std::printf(" %.1f%%", m.share(only_b, t, t + static_cast<std::uint64_t>(kSecond / 2)));
  std::printf("\n");
  EXPECT_GE(container, 30.0) << "the container starved: scale after A " << scale_a;
  EXPECT_GE(share, 40.0) << "B starved: scale after A " << scale_a;
  EXPECT_LE(share, 55.0);
}

// Long launches of A, then B's first launch of a 10^5-node graph: it is
// priced at what A's launches measured and goes within a few seconds, not
// after the debt of minutes a poisoned scale leaves.
void long_then_graph(const std::vector<std::string>& long_args, double truth) {
  Machine m;
  run_one(m, long_args);
  const double scale_a = region_scale(m, "c");
  EXPECT_GE(scale_a, truth / 4) << "the scale A's launches left";
  EXPECT_LE(scale_a, truth * 4) << "the scale A's launches left";
  const ProcResult b = run_one(m, graph_load(0.5));
  std::printf("scale after A %.2f; B launched %llu kernels in %.2f s\n", scale_a,
              static_cast<unsigned long long>(b.launches), static_cast<double>(b.end_ns - b.start_ns) / kSecond);
  EXPECT_GE(b.launches, 100000u) << "scale after A " << scale_a;
  // Its first graph: 0.5 s of device time, at most a few seconds at 50%
  // (the new process may pay A's last launch once), never minutes.
  EXPECT_LT(static_cast<double>(b.end_ns - b.start_ns) / kSecond, 6.0) << "scale after A " << scale_a;
}

}  // namespace

// True scales: a kernel of one wave is 20 us nominal; the graph's 5 us
// kernels are 0.25 of theirs.
TEST(LongLaunches, KernelsOfHalfASecondLeaveTheNextProcessItsShare) {
  long_then_short(spin("kernel", 500'000, 1.5), 25'000);
}

// The first kernel runs before the scale is measured (the launch waits for
// it); the second is priced. (Their true scale, 10^5, is kMaxScalePpm.)
TEST(LongLaunches, KernelsOfTwoSecondsLeaveTheNextProcessItsShare) {
  long_then_short(spin("kernel", 2'000'000, 2.5), 0);
}

TEST(LongLaunches, GraphsOfAHundredThousandKernelsLeaveTheNextProcessItsShare) {
  long_then_short(graph_load(1.5), 0.25);
}

TEST(LongLaunches, GraphsOfAHundredThousandKernelsLeaveTheNextGraphNoDebtOfMinutes) {
  long_then_graph(graph_load(1.5), 0.25);
}

TEST(LongLaunches, KernelsOfFiftyMillisecondsLeaveTheNextGraphNoDebtOfMinutes) {
  long_then_graph(spin("kernel", 50'000, 1.0), 2'500);
}
