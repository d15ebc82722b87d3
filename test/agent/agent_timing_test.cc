// Utilisation feedback against the simulated device timeline: what the agent
// writes into the region, window by window, is what the timeline says the
// container's kernels occupied. Timing-sensitive: labelled "timing" (skipped
// under sanitizers).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "agent.h"
#include "agent_test_util.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

using BusyFn = std::uint64_t (*)(int, int, std::uint64_t, std::uint64_t);

TEST(AgentUtilisation, WrittenUtilisationMatchesTheSimulatedTimeline) {
  Sandbox box;
  const std::string region = region_dir(box) + "/pod/c.region";
  test::Env env = test::merge(box.env(), {{"GPUSLICE_REGION", region}, {"GPUSLICE_CONTAINER_NAME", "util"}});
  // ~40% duty: 40 ms kernels, 60 ms idle, for ~3 s.
  std::vector<std::string> argv{test::bin("cuprobe"), "init",         "ctx",   "0",
                                "function",           "spin_40000us", "touch", box.path("ready")};
  for (int i = 0; i < 30; ++i) {
    for (const char* op : {"launch", "1", "sync", "sleep", "60"}) argv.push_back(op);
  }
  const pid_t probe = test::spawn(argv, env, box.path("probe.out"));
  ASSERT_TRUE(eventually([&] { return file_exists(box.path("ready")); }, 20000));

  agent::Agent a(config_for(box));
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  void* cuda = dlopen((test::fakecuda_dir() + "/libcuda.so.1").c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(cuda, nullptr) << dlerror();
  auto busy_ns = reinterpret_cast<BusyFn>(dlsym(cuda, "fakecuda_busy_ns"));
  ASSERT_NE(busy_ns, nullptr);

  a.cycle();  // first sample: NVML's default window
  Region* r = attach(region);
  ASSERT_NE(r, nullptr);
  int dev = -1;
  for (std::uint32_t i = 0; i < kMaxDevices && dev < 0; ++i) {
    if (r->devices[i].uuid_state.load() == 2) dev = static_cast<int>(i);
  }
  ASSERT_GE(dev, 0);
  std::uint64_t prev = r->devices[dev].util_updated_ns.load();
  ASSERT_NE(prev, 0u);
  int windows = 0;
  double sum_measured = 0, sum_expected = 0, worst = 0;
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    a.cycle();
    const std::uint64_t at = r->devices[dev].util_updated_ns.load();
    const double measured = static_cast<double>(r->devices[dev].util_permille.load());
    const double device = static_cast<double>(r->devices[dev].device_util_permille.load());
    const double expected = 1000.0 * static_cast<double>(busy_ns(0, 0, prev, at)) / static_cast<double>(at - prev);
    prev = at;
    ++windows;
    sum_measured += measured;
    sum_expected += expected;
    worst = std::max(worst, std::abs(measured - expected));
    EXPECT_NEAR(measured, expected, 25.0) << "window " << i;
    EXPECT_EQ(measured, device) << "one process: the container is the whole device";
  }
  EXPECT_NEAR(sum_measured / windows, sum_expected / windows, 10.0);
  EXPECT_NEAR(sum_measured / windows, 400.0, 80.0) << "the workload's duty cycle";
  std::printf("[ utilisation ] %d windows, mean measured %.1f permille, mean timeline %.1f, worst window off by %.1f\n",
              windows, sum_measured / windows, sum_expected / windows, worst);
  test::Result res = test::wait(probe, box.path("probe.out"));
  EXPECT_EQ(res.exit_code, 0) << res.describe();
  shm::detach(r);
}

}  // namespace
