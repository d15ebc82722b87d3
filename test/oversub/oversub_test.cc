// Memory oversubscription (issue 12), end to end: one container fills the
// simulated device, a second (its own region) allocates within its quota
// under each policy; and the device-resident allowance inside one container.
// Programs are cuprobe under the preload library; the region is read directly.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "gpuslice/region.h"
#include "harness.h"
#include "region_view.h"
#include "probe.h"
#include "limiter/memory_accounting.h"
#include "shm/region_file.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

// Two containers on one 2 GiB simulated device: A holds 1800 MiB until
// `release` exists; B (its own region, 1 GiB quota) comes second.
struct TwoContainers {
  Sandbox box;
  Env a, b;
  std::string release = box.path("release");
  TwoContainers() {
    const Env device{{"FAKECUDA_MEMORY", "2Gi"}};
    a = merge(box.env(), device);
    a["GPUSLICE_REGION"] = box.path("a.region");
    b = merge(box.env(), device);
    b["GPUSLICE_REGION"] = box.path("b.region");
    b["GPUSLICE_MEMORY_LIMIT"] = "1Gi";
  }
  pid_t start_holder() {
    const pid_t pid = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(1800), "touch", box.path("holding"),
                             "waitfile", release, "freeall"},
                            a, box.path("a.out"));
    for (int i = 0; i < 10000 && access(box.path("holding").c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_EQ(access(box.path("holding").c_str(), F_OK), 0) << "container A never held its memory";
    return pid;
  }
  Result finish_holder(pid_t pid) {
    run({"/usr/bin/touch", release}, {});
    return wait(pid, box.path("a.out"));
  }
};

TEST(Oversubscribe, FailIsOutOfMemoryAsWithoutTheOption) {
  TwoContainers t;
  const pid_t holder = t.start_holder();
  Result r = run({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(512)}, t.b);
  EXPECT_EQ(value(r, "alloc", "rc"), "2") << r.describe();  // CUDA_ERROR_OUT_OF_MEMORY
  EXPECT_EQ(t.finish_holder(holder).exit_code, 0);
}

// spill: the allocation is served as managed memory preferring the host; the
// device holds no more than before, the container counts it as spilled.
TEST(Oversubscribe, SpillServesAFullDeviceFromHostMemory) {
  TwoContainers t;
  const pid_t holder = t.start_holder();
  const unsigned long long before = device_used(t.box);
  Env b = merge(t.b, {{"GPUSLICE_OVERSUBSCRIBE", "spill"}});
  const std::string done = t.box.path("b-allocated");
  const pid_t pid = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(512), "touch", done, "waitfile",
                           t.box.path("b-release"), "freeall"},
                          b, t.box.path("b.out"));
  for (int i = 0; i < 10000 && access(done.c_str(), F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(device_used(t.box), before) << "spilled memory must not be held by the device";
  {
    RegionView v(b["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    EXPECT_EQ(v.dev().spilled_bytes.load(), 512 * kMi);
    EXPECT_EQ(v.dev().used_bytes.load(), 512 * kMi);  // still within (and counted against) the quota
  }
  run({"/usr/bin/touch", t.box.path("b-release")}, {});
  Result r = wait(pid, t.box.path("b.out"));
  EXPECT_EQ(value(r, "alloc", "rc"), "0") << r.describe();
  EXPECT_EQ(value(r, "freeall", "rc"), "0") << r.describe();
  RegionView v(b["GPUSLICE_REGION"]);
  EXPECT_EQ(v.dev().spilled_bytes.load(), 0u);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);
  EXPECT_EQ(t.finish_holder(holder).exit_code, 0);
}

TEST(Oversubscribe, WaitTimesOutWithOutOfMemory) {
  TwoContainers t;
  const pid_t holder = t.start_holder();
  Env b = merge(t.b, {{"GPUSLICE_OVERSUBSCRIBE", "wait"}, {"GPUSLICE_OVERSUBSCRIBE_WAIT", "300ms"}});
  const auto t0 = std::chrono::steady_clock::now();
  Result r = run({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(512)}, b);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(value(r, "alloc", "rc"), "2") << r.describe();
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  RegionView v(b["GPUSLICE_REGION"]);
  ASSERT_NE(v.region, nullptr);
  EXPECT_EQ(v.dev().oversub_waits.load(), 1u);
  EXPECT_EQ(v.dev().oversub_timeouts.load(), 1u);
  EXPECT_EQ(v.dev().oversub_waiting.load(), 0u);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);  // the reservation went back
  EXPECT_EQ(t.finish_holder(holder).exit_code, 0);
}

TEST(Oversubscribe, WaitSucceedsWhenTheOtherContainerFrees) {
  TwoContainers t;
  const pid_t holder = t.start_holder();
  Env b = merge(t.b, {{"GPUSLICE_OVERSUBSCRIBE", "wait"}, {"GPUSLICE_OVERSUBSCRIBE_WAIT", "60s"}});
  const pid_t waiter =
      spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(512), "freeall"}, b, t.box.path("b.out"));
  // Once B is waiting (its region says so), A frees.
  bool waiting = false;
  for (int i = 0; i < 10000 && !waiting; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (access(b["GPUSLICE_REGION"].c_str(), F_OK) != 0) continue;
    RegionView v(b["GPUSLICE_REGION"]);
    waiting = v.region != nullptr && v.dev().oversub_waiting.load() == 1;
  }
  ASSERT_TRUE(waiting) << "container B never started waiting";
  EXPECT_EQ(t.finish_holder(holder).exit_code, 0);
  Result r = wait(waiter, t.box.path("b.out"));
  EXPECT_EQ(value(r, "alloc", "rc"), "0") << r.describe();
  RegionView v(b["GPUSLICE_REGION"]);
  EXPECT_EQ(v.dev().oversub_waits.load(), 1u);
  EXPECT_EQ(v.dev().oversub_timeouts.load(), 0u);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);
}

// Inside one container: a 256 MiB device-resident allowance under a 1 GiB
// quota. Beyond the allowance plain allocations spill; the quota still holds;
// resident + spilled = allocated, exactly, and both return to zero.
TEST(Oversubscribe, SpillBeyondTheResidentAllowanceWithinTheQuota) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"},
                              {"GPUSLICE_MEMORY_RESIDENT", "256Mi"},
                              {"GPUSLICE_OVERSUBSCRIBE", "spill"},
                              {"FAKECUDA_MEMORY", "4Gi"}});
  const std::string hold = box.path("hold");
  const pid_t pid = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(200), "alloc", mib(300), "alloc", mib(400),
                           "alloc", mib(200), "touch", box.path("allocated"), "waitfile", hold, "freeall"},
                          env, box.path("out"));
  for (int i = 0; i < 10000 && access(box.path("allocated").c_str(), F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  {
    RegionView v(env["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    EXPECT_EQ(v.dev().used_bytes.load(), 900 * kMi);
    EXPECT_EQ(v.dev().spilled_bytes.load(), 700 * kMi);
    EXPECT_EQ(v.dev().spills.load(), 2u);
    EXPECT_EQ(v.dev().resident_limit_bytes.load(), 256 * kMi);
  }
  // Visible to operators: gpuslice-smi's JSON.
  Result smi = run({bin("gpuslice-smi"), "--region", env["GPUSLICE_REGION"], "--json"}, {});
  ASSERT_EQ(smi.exit_code, 0) << smi.describe();
  EXPECT_NE(smi.out.find("\"spilled_bytes\":" + std::to_string(700 * kMi)), std::string::npos) << smi.out;
  EXPECT_NE(smi.out.find("\"oversubscribe\":\"spill\""), std::string::npos) << smi.out;
  // And to the node agent's scrape (one cycle, no NVML).
  Result agent = run(
      {bin("gpuslice-agent"), "--region-dir", box.dir(), "--no-nvml", "--once", "--listen", "off", "--grace", "0"}, {});
  ASSERT_EQ(agent.exit_code, 0) << agent.describe();
  EXPECT_NE(agent.out.find("gpuslice_memory_spilled_bytes{"), std::string::npos) << agent.out;
  EXPECT_NE(agent.out.find("} " + std::to_string(700 * kMi)), std::string::npos) << agent.out;
  EXPECT_NE(agent.out.find("gpuslice_memory_resident_limit_bytes{"), std::string::npos) << agent.out;
  run({"/usr/bin/touch", hold}, {});
  Result r = wait(pid, box.path("out"));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "alloc", "rc", 0), "0");
  EXPECT_EQ(value(r, "alloc", "rc", 1), "0");
  EXPECT_EQ(value(r, "alloc", "rc", 2), "0");
  EXPECT_EQ(value(r, "alloc", "rc", 3), "2") << "the quota holds under spill";
  EXPECT_EQ(value(r, "freeall", "rc"), "0");
  RegionView v(env["GPUSLICE_REGION"]);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);
  EXPECT_EQ(v.dev().spilled_bytes.load(), 0u);
}

// A context destroyed with spilled allocations live: the driver frees them
// with it, and they stop counting as spilled too.
TEST(Oversubscribe, SpilledMemoryOfADestroyedContextStopsCounting) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"},
                              {"GPUSLICE_MEMORY_RESIDENT", "128Mi"},
                              {"GPUSLICE_OVERSUBSCRIBE", "spill"},
                              {"FAKECUDA_MEMORY", "4Gi"}});
  const pid_t pid = spawn(
      {bin("cuprobe"), "init", "ctxcreate", "0", "alloc", mib(100), "alloc", mib(300), "touch", box.path("allocated"),
       "waitfile", box.path("destroy"), "ctxdestroy", "touch", box.path("destroyed"), "waitfile", box.path("exit")},
      env, box.path("out"));
  auto await = [&](const std::string& f) {
    for (int i = 0; i < 10000 && access(f.c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  await(box.path("allocated"));
  {
    RegionView v(env["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    EXPECT_EQ(v.dev().spilled_bytes.load(), 300 * kMi);
  }
  run({"/usr/bin/touch", box.path("destroy")}, {});
  await(box.path("destroyed"));
  {
    RegionView v(env["GPUSLICE_REGION"]);
    EXPECT_EQ(v.dev().used_bytes.load(), 0u);
    EXPECT_EQ(v.dev().spilled_bytes.load(), 0u);
  }
  run({"/usr/bin/touch", box.path("exit")}, {});
  Result r = wait(pid, box.path("out"));
  EXPECT_EQ(value(r, "ctxdestroy", "rc"), "0") << r.describe();
}

// A process killed while it holds spilled memory: the reaper recovers its
// share, spilled bytes included, exactly.
TEST(Oversubscribe, KilledWhileHoldingSpilledMemoryLeavesExactCounts) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"},
                              {"GPUSLICE_MEMORY_RESIDENT", "128Mi"},
                              {"GPUSLICE_OVERSUBSCRIBE", "spill"},
                              {"FAKECUDA_MEMORY", "4Gi"}});
  const pid_t pid = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(100), "alloc", mib(300), "touch",
                           box.path("allocated"), "waitfile", box.path("never")},
                          env, box.path("out"));
  for (int i = 0; i < 10000 && access(box.path("allocated").c_str(), F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  RegionView v(env["GPUSLICE_REGION"]);
  ASSERT_NE(v.region, nullptr);
  EXPECT_EQ(v.dev().spilled_bytes.load(), 300 * kMi);
  kill(pid, SIGKILL);
  wait(pid, box.path("out"));
  shm::ProcessIdentity self{};
  ASSERT_TRUE(shm::read_identity(0, &self));
  EXPECT_GE(limiter::reap_dead(v.region, self), 1);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);
  EXPECT_EQ(v.dev().spilled_bytes.load(), 0u);
}

}  // namespace
}  // namespace gpuslice::test
