// Containers of different priorities on one simulated device: the device time
// each got is read from the simulated timeline (fakecuda-ctl busy), never from
// gpuslice's own bookkeeping. Label `timing`: bounds are wide (a loaded 2-core
// machine may deschedule a launching process for milliseconds), what is
// checked is the direction and size of the effect, not its last percent.
#include <gtest/gtest.h>

#include <string>

#include "gpuslice/region.h"
#include "scenarios.h"
#include "shm/region_file.h"

namespace {

using namespace gpuslice::test;
using namespace gpuslice::test::limiter;

constexpr std::uint64_t kMs = 1'000'000;

// Low-priority "training": 1 ms kernels, 20 ms kept queued (deep, as a
// saturating job queues). High-priority: 200 us kernels, 2 ms queued.
Container tenant(const Machine& m, const std::string& name, const std::string& priority_var,
                 const std::string& priority, Proc proc) {
  Container c;
  c.name = name;
  c.procs = {proc};
  c.extra = {{"GPUSLICE_PRIORITY_BOARD", m.sandbox().path("board")}};
  if (!priority_var.empty()) c.extra[priority_var] = priority;
  return c;
}

Proc low_proc(double seconds, double delay = 0) {
  return Proc{spin("kernel", 1000, seconds, "symbol", 20.0), delay, 0};
}
Proc high_proc(double seconds, double delay = 0, double kill_after = 0) {
  return Proc{spin("kernel", 200, seconds, "symbol", 2.0), delay, kill_after};
}

std::uint64_t region_held_ns(const Machine& m, const std::string& name) {
  gpuslice::shm::Error err{};
  gpuslice::Region* r = gpuslice::shm::attach_existing(m.region_path(name).c_str(), false, &err);
  if (r == nullptr) return ~std::uint64_t{0};
  const std::uint64_t held = r->header.priority_held_ns.load();
  gpuslice::shm::detach(r);
  return held;
}

TEST(PriorityTenants, LowIsHeldWhileHighIsActiveAndReleasedAfter) {
  Machine m;
  const auto results = m.run({tenant(m, "low", "GPUSLICE_PRIORITY", "low", low_proc(2.6)),
                              tenant(m, "high", "GPUSLICE_PRIORITY", "high", high_proc(1.0, 0.6))});
  const ProcResult& low = results[0].procs[0];
  const ProcResult& high = results[1].procs[0];
  ASSERT_EQ(low.result.exit_code, 0) << low.result.describe();
  ASSERT_EQ(high.result.exit_code, 0) << high.result.describe();
  ASSERT_GT(high.end_ns, high.start_ns + 500 * kMs);
  // While the high one launches, the low one gets little (natively, on this
  // FIFO device, it would get about what it queues: most of it).
  const double low_during = m.share(results[0], high.start_ns + 100 * kMs, high.end_ns);
  const double high_during = m.share(results[1], high.start_ns + 100 * kMs, high.end_ns);
  EXPECT_LT(low_during, 20.0) << "high " << high_during;
  EXPECT_GT(high_during, 60.0) << "low " << low_during;
  EXPECT_GT(region_held_ns(m, "low"), 100 * kMs);
  EXPECT_EQ(region_held_ns(m, "high"), 0u);
  // Afterwards it has the device again.
  ASSERT_GT(low.end_ns, high.end_ns + 600 * kMs);
  EXPECT_GT(m.share(results[0], high.end_ns + 100 * kMs, high.end_ns + 600 * kMs), 80.0);
}

// A high-priority process SIGKILLed mid-run holds nobody: its published
// activity expires within milliseconds. (HAMi's CUDA_TASK_PRIORITY=0 makes it high.)
TEST(PriorityTenants, KilledHighPriorityProcessReleasesTheDevice) {
  Machine m;
  const std::uint64_t t0 = mono_now_ns();
  const auto results = m.run({tenant(m, "low", "GPUSLICE_PRIORITY", "low", low_proc(2.2)),
                              tenant(m, "high", "CUDA_TASK_PRIORITY", "0", high_proc(5.0, 0.3, 1.0))});
  const ProcResult& low = results[0].procs[0];
  ASSERT_EQ(low.result.exit_code, 0) << low.result.describe();
  ASSERT_EQ(results[1].procs[0].result.signal, SIGKILL);
  const std::uint64_t killed = t0 + 1000 * kMs;                  // the kill happens at or just after this
  EXPECT_LT(m.share(results[0], t0 + 500 * kMs, killed), 20.0);  // it was held
  EXPECT_GT(m.share(results[0], killed + 100 * kMs, killed + 600 * kMs), 80.0);
}

// Priority is relative: a normal container next to a low one is never held,
// and the low one is held by the normal one.
TEST(PriorityTenants, NormalIsNotHeldByLow) {
  Machine m;
  const auto results = m.run({tenant(m, "low", "GPUSLICE_PRIORITY", "low", low_proc(1.5)),
                              tenant(m, "normal", "", "", Proc{spin("kernel", 200, 1.0, "symbol", 2.0), 0.3, 0})});
  const ProcResult& normal = results[1].procs[0];
  ASSERT_EQ(normal.result.exit_code, 0) << normal.result.describe();
  EXPECT_EQ(region_held_ns(m, "normal"), 0u);
  // The normal container notices its low neighbour within a rescan (100 ms)
  // and from then on holds it.
  EXPECT_GT(m.share(results[1], normal.start_ns + 300 * kMs, normal.end_ns), 60.0);
  EXPECT_LT(m.share(results[0], normal.start_ns + 300 * kMs, normal.end_ns), 20.0);
}

// Priority composes with SM limits: a high container with a 40% hard limit
// gets at most 40%, and the low one gets the remainder (it is not held during
// the gaps its neighbour's own limit leaves).
TEST(PriorityTenants, HighWithAnSmLimitLeavesTheRestToLow) {
  Machine m;
  Container high = tenant(m, "high", "GPUSLICE_PRIORITY", "high", high_proc(2.0, 0.3));
  high.sm_limit = "40";
  const auto results = m.run({tenant(m, "low", "GPUSLICE_PRIORITY", "low", low_proc(2.6)), high});
  const ProcResult& h = results[1].procs[0];
  ASSERT_EQ(h.result.exit_code, 0) << h.result.describe();
  ASSERT_EQ(results[0].procs[0].result.exit_code, 0) << results[0].procs[0].result.describe();
  const std::uint64_t t0 = h.start_ns + 500 * kMs, t1 = h.end_ns;
  const double high_share = m.share(results[1], t0, t1);
  const double low_share = m.share(results[0], t0, t1);
  EXPECT_LT(high_share, 46.0) << "low " << low_share;
  EXPECT_GT(high_share, 30.0) << "low " << low_share;
  EXPECT_GT(low_share, 35.0) << "high " << high_share;
}

// Without a neighbour of another level, priority changes nothing: a low
// container alone has the whole device.
TEST(PriorityTenants, LowAloneHasTheDevice) {
  Machine m;
  const auto results = m.run({tenant(m, "low", "GPUSLICE_PRIORITY", "low", low_proc(1.0))});
  const ProcResult& low = results[0].procs[0];
  ASSERT_EQ(low.result.exit_code, 0) << low.result.describe();
  EXPECT_GT(m.share(results[0], low.start_ns + 100 * kMs, low.end_ns), 90.0);
  EXPECT_EQ(region_held_ns(m, "low"), 0u);
}

}  // namespace
