// The feedback loop (limiter/compute_feedback.h) driven by a scripted NVML
// and scripted clocks on a region in memory: election, NVML windows, the
// agent's samples, the pid-namespace guard and the limit refresh.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "limiter/compute.h"
#include "limiter/compute_feedback.h"

using namespace gpuslice;
using namespace gpuslice::limiter;

namespace {

struct Script {
  std::uint64_t mono = 1'000'000'000;
  std::uint64_t real_us = 1'700'000'000'000'000ull;
  std::uint32_t ours_pct = 0, others_pct = 0;
  std::uint32_t our_pid = 0, other_pid = 0;
  bool running_has_ours = true;
  std::string last_uuid;
  std::vector<unsigned long long> last_seen;
  std::vector<std::string> warnings;
  int refreshes = 0;
  std::uint32_t entries = 1;
  // Non-zero: a sampling NVML with one sample stamped here, published once the
  // clock reaches it (else the samples are stamped "now", exact windows).
  std::uint64_t sample_stamp_us = 0;
};
Script* g = nullptr;
nvmlDevice_t kDevice = reinterpret_cast<nvmlDevice_t>(0x1234);

nvmlReturn_t fake_init() { return NVML_SUCCESS; }
nvmlReturn_t fake_by_uuid(const char* uuid, nvmlDevice_t* dev) {
  g->last_uuid = uuid;
  *dev = kDevice;
  return NVML_SUCCESS;
}
nvmlReturn_t fake_util(nvmlDevice_t, nvmlProcessUtilizationSample_t* s, unsigned int* n, unsigned long long last) {
  g->last_seen.push_back(last);
  unsigned count = 0;
  const std::uint64_t stamp = g->sample_stamp_us != 0 ? g->sample_stamp_us : g->real_us;
  if (stamp > g->real_us || stamp <= last) return NVML_ERROR_NOT_FOUND;
  if (g->ours_pct) s[count++] = nvmlProcessUtilizationSample_t{g->our_pid, stamp, g->ours_pct, 0, 0, 0};
  if (g->others_pct) s[count++] = nvmlProcessUtilizationSample_t{g->other_pid, stamp, g->others_pct, 0, 0, 0};
  if (count == 0) return NVML_ERROR_NOT_FOUND;
  *n = count;
  return NVML_SUCCESS;
}
nvmlReturn_t fake_running(nvmlDevice_t, unsigned int* n, nvmlProcessInfo_t* infos) {
  infos[0] = nvmlProcessInfo_t{g->running_has_ours ? g->our_pid : 99999, 0, 0, 0};
  *n = 1;
  return NVML_SUCCESS;
}
bool fake_load(NvmlApi* api) noexcept {
  api->init = fake_init;
  api->handle_by_uuid = fake_by_uuid;
  api->process_utilization = fake_util;
  api->running_processes = fake_running;
  return true;
}
void fake_refresh() noexcept { ++g->refreshes; }
std::uint32_t fake_entries() noexcept { return g->entries; }
void fake_warn(const char* m) noexcept { g->warnings.emplace_back(m); }
std::uint64_t fake_mono() noexcept { return g->mono; }
std::uint64_t fake_real() noexcept { return g->real_us; }

struct Fixture : ::testing::Test {
  std::unique_ptr<Region> region = std::make_unique<Region>();
  Script script;
  FeedbackHost host;
  void SetUp() override {
    g = &script;
    script.our_pid = static_cast<std::uint32_t>(getpid());
    script.other_pid = script.our_pid + 1;
    DeviceState& d = region->devices[0];
    d.sm_limit_pct.store(40);
    d.cost_scale_ppm.store(1'000'000);
    for (int i = 0; i < 16; ++i) d.uuid[i] = static_cast<std::uint8_t>(i);
    region->slots[3].state.store(kSlotLive);
    region->slots[3].pid.store(script.our_pid);
    host.region = region.get();
    host.load_nvml = fake_load;
    host.refresh = fake_refresh;
    host.entries = fake_entries;
    host.warn = fake_warn;
    host.mono_ns = fake_mono;
    host.real_us = fake_real;
  }
  void TearDown() override { g = nullptr; }
  // Advances both clocks and ticks.
  void step(FeedbackLoop& loop, std::uint64_t ns) {
    script.mono += ns;
    script.real_us += ns / 1000;
    loop.tick();
  }
};

}  // namespace

TEST_F(Fixture, ElectedOwnerMeasuresNvmlWindowsAndPublishesUtilisation) {
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();  // elected; baseline
  DeviceState& d = region->devices[0];
  EXPECT_EQ(d.feedback_owner_pid.load(), script.our_pid);
  EXPECT_EQ(script.last_uuid, "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
  EXPECT_TRUE(loop.entry(0).control.primed);
  script.ours_pct = 40;
  script.others_pct = 35;
  spend(d, 10'000'000);          // 10 ms admitted at the prior price ...
  step(loop, kControlPeriodNs);  // ... 20 ms measured (40% of 50 ms)
  ASSERT_EQ(script.last_seen.size(), 1u);
  EXPECT_EQ(d.util_permille.load(), 400u);
  EXPECT_EQ(d.device_util_permille.load(), 750u);
  EXPECT_EQ(d.util_updated_ns.load(), script.mono);
  EXPECT_EQ(d.tokens_ns.load(), -20'000'000);  // trued up to the measured 20 ms
  EXPECT_GT(d.cost_scale_ppm.load(), 1'000'000u);
  // Windows are contiguous: the next query starts where this one ended.
  step(loop, kControlPeriodNs);
  ASSERT_EQ(script.last_seen.size(), 2u);
  EXPECT_EQ(script.last_seen[1] - script.last_seen[0], kControlPeriodNs / 1000);
  EXPECT_TRUE(script.warnings.empty());
}

TEST_F(Fixture, OnlyOneProcessOwnsTheFeedback) {
  FeedbackLoop mine(host, script.our_pid), other(host, script.our_pid + 7);
  mine.tick();
  other.tick();
  EXPECT_TRUE(mine.entry(0).owner);
  EXPECT_FALSE(other.entry(0).owner);
  // The owner dies (stops ticking): the other takes over after the timeout.
  script.mono += kOwnerTimeoutNs + 1;
  other.tick();
  EXPECT_TRUE(other.entry(0).owner);
  EXPECT_EQ(region->devices[0].feedback_owner_pid.load(), script.our_pid + 7);
}

TEST_F(Fixture, UnlimitedOrUnusedDevicesAreLeftAlone) {
  region->devices[0].sm_limit_pct.store(100);
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();
  EXPECT_EQ(region->devices[0].feedback_owner_pid.load(), 0u);
  region->devices[0].sm_limit_pct.store(40);
  script.entries = 0;  // this process does not launch there
  loop.tick();
  EXPECT_EQ(region->devices[0].feedback_owner_pid.load(), 0u);
  script.entries = 1;
  loop.tick();
  EXPECT_EQ(region->devices[0].feedback_owner_pid.load(), script.our_pid);
  region->devices[0].sm_limit_pct.store(0);  // limit removed at run time: role given back
  loop.tick();
  EXPECT_EQ(region->devices[0].feedback_owner_pid.load(), 0u);
}

TEST_F(Fixture, RefreshesTheLaunchCachesPeriodically) {
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();
  EXPECT_EQ(script.refreshes, 1);
  step(loop, kRefreshNs / 2);
  EXPECT_EQ(script.refreshes, 1);
  step(loop, kRefreshNs / 2);
  EXPECT_EQ(script.refreshes, 2);
}

TEST_F(Fixture, ForeignPidsAreNotTrusted) {
  script.running_has_ours = false;
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();
  script.ours_pct = 0;
  script.others_pct = 90;  // the container's own work, seen under host pids
  DeviceState& d = region->devices[0];
  spend(d, 10'000'000);
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.tokens_ns.load(), -10'000'000);  // no refund from a measurement we cannot attribute
  ASSERT_FALSE(script.warnings.empty());
  EXPECT_NE(script.warnings[0].find("pid namespace"), std::string::npos);
}

TEST_F(Fixture, UsesTheAgentsSamplesWhileItIsAlive) {
  DeviceState& d = region->devices[0];
  region->header.agent_heartbeat_ns.store(script.mono);
  d.util_updated_ns.store(script.mono - 1'000'000);
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();  // baseline at the agent's last sample
  spend(d, 1'000'000);
  // The agent publishes a 100 ms window: the container at 30%, the device at 70%.
  d.util_permille.store(300);
  d.device_util_permille.store(700);
  d.util_updated_ns.store(script.mono + 99'000'000);
  region->header.agent_heartbeat_ns.store(script.mono + 99'000'000);
  step(loop, 100'000'000);
  EXPECT_TRUE(script.last_seen.empty());  // NVML never asked
  EXPECT_EQ(d.tokens_ns.load(), -30'000'000);
  // No new agent sample: no step.
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.tokens_ns.load(), -30'000'000);
}

// Issue 9, short-lived processes: a process of the container that exited
// (Region::departed) still has kernels running; their device time is the
// container's, not "others'", for kDepartedKeepNs after it left.
TEST_F(Fixture, RecentlyDepartedProcessesStillCountAsTheContainers) {
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();  // elected; baseline
  DeviceState& d = region->devices[0];
  script.ours_pct = 0;
  script.others_pct = 60;  // other_pid: not a live slot ...
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.util_permille.load(), 0u);
  EXPECT_EQ(d.device_util_permille.load(), 600u);
  // ... until it is recorded as a departed process of the container.
  record_departure(region.get(), script.other_pid, script.other_pid, script.mono);
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.util_permille.load(), 600u);
  EXPECT_EQ(d.tokens_ns.load(), -30'000'000);  // charged the 30 ms it ran
  // Long gone: somebody else's again.
  script.mono += kDepartedKeepNs + 1;
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.util_permille.load(), 0u);
}

// A departing owner hands the feedback role over at once.
TEST_F(Fixture, DepartureDropsTheFeedbackRole) {
  FeedbackLoop mine(host, script.our_pid), other(host, script.our_pid + 7);
  mine.tick();
  EXPECT_TRUE(mine.entry(0).owner);
  record_departure(region.get(), script.our_pid, script.our_pid, script.mono);
  EXPECT_EQ(region->devices[0].feedback_owner_pid.load(), 0u);
  other.tick();
  EXPECT_TRUE(other.entry(0).owner);
  EXPECT_EQ(region->header.departed_next.load(), 1u);
  EXPECT_EQ(region->departed[0].pid.load(), script.our_pid);
}

TEST_F(Fixture, SamplingNvmlNotFoundBetweenSamplesRefundsNothing) {
  // A real NVML samples on its own period (~166 ms) and answers NOT_FOUND until
  // the next sample exists. That is no idle window: measuring it as one gave
  // back every provisional price of the window, and the limit did not hold.
  FeedbackLoop loop(host, script.our_pid);
  loop.tick();  // baseline
  const std::uint64_t base_us = script.real_us;
  DeviceState& d = region->devices[0];
  script.ours_pct = 40;
  script.sample_stamp_us = base_us + 120'000;  // this period ends 120 ms after the baseline
  spend(d, 10'000'000);
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.tokens_ns.load(), -10'000'000);  // no window yet: nothing given back
  step(loop, kControlPeriodNs);
  EXPECT_EQ(d.tokens_ns.load(), -10'000'000);
  // The sample comes: the owner, asking every tick meanwhile, closes the
  // window at its stamp within a tick: 40% of the 120 ms it covers.
  step(loop, 20'000'000 + kFeedbackTickNs);
  EXPECT_EQ(d.tokens_ns.load(), -48'000'000);
  EXPECT_EQ(d.util_permille.load(), 400u);
  step(loop, kControlPeriodNs);
  EXPECT_EQ(script.last_seen.back(), base_us + 120'000);  // next query from the stamp, not "now"
  EXPECT_EQ(d.tokens_ns.load(), -48'000'000);             // NOT_FOUND again: still no window
}
