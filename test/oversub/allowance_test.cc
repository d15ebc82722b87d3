// The device-resident allowance (GPUSLICE_MEMORY_RESIDENT) inside one
// container, against the holes issue 20 found: arrays ignored it, a process
// without the options counted its spare quota lease as resident, a dead
// holder's memory kept it full until the agent ran, cuMemRelease woke no
// waiter, and a process killed while waiting stayed counted as waiting.
// Programs are cuprobe under the preload library; the region is read directly.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "gpuslice/region.h"
#include "harness.h"
#include "region_view.h"
#include "limiter/agent_extra.h"
#include "limiter/memory_accounting.h"
#include "platform/clock.h"
#include "shm/region_file.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

template <class Pred>
bool await_region(const std::string& path, Pred pred, int ms = 20000) {
  for (int i = 0; i < ms / 2; ++i) {
    if (access(path.c_str(), F_OK) == 0) {
      RegionView v(path);
      if (v.region != nullptr && pred(v.dev())) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

Env allowance_env(const Sandbox& box, const std::string& policy, const std::string& allowance) {
  Env env =
      merge(box.env(),
            {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"GPUSLICE_MEMORY_RESIDENT", allowance}, {"FAKECUDA_MEMORY", "4Gi"}});
  if (!policy.empty()) env["GPUSLICE_OVERSUBSCRIBE"] = policy;
  return env;
}

// Sixteen 16 MiB arrays against a 64 MiB allowance: four fit. Before, all
// sixteen succeeded under every policy.
std::vector<std::string> sixteen_arrays() {
  std::vector<std::string> argv{bin("cuprobe"), "init", "ctx", "0"};
  for (int i = 0; i < 16; ++i) {
    argv.push_back("array");
    argv.push_back("4096");
    argv.push_back("4096");
  }
  argv.push_back("freeall");
  return argv;
}

TEST(Allowance, ArraysAreRefusedBeyondItUnderFailAndSpill) {
  for (const char* policy : {"fail", "spill"}) {
    Sandbox box;
    Result r = run(sixteen_arrays(), allowance_env(box, policy, "64Mi"));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    const std::vector<std::string> got = values(r, "array", "rc");
    ASSERT_EQ(got.size(), 16u) << r.describe();
    int ok = 0;
    for (const std::string& rc : got) ok += rc == "0";
    EXPECT_EQ(ok, 4) << policy << ": " << r.describe();
    EXPECT_EQ(got[4], "2") << policy;  // CUDA_ERROR_OUT_OF_MEMORY
    RegionView v(box.path("container.region"));
    ASSERT_NE(v.region, nullptr);
    EXPECT_EQ(v.dev().used_bytes.load(), 0u);
  }
}

TEST(Allowance, ArraysWaitForItUnderWait) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait", "64Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "200ms"}});
  std::vector<std::string> argv{bin("cuprobe"), "init", "ctx", "0"};
  for (int i = 0; i < 5; ++i) argv.insert(argv.end(), {"array", "4096", "4096"});
  const auto t0 = std::chrono::steady_clock::now();
  Result r = run(argv, env);
  const auto took = std::chrono::steady_clock::now() - t0;
  const std::vector<std::string> got = values(r, "array", "rc");
  ASSERT_EQ(got.size(), 5u) << r.describe();
  EXPECT_EQ(got[3], "0");
  EXPECT_EQ(got[4], "2") << r.describe();
  EXPECT_GE(took, std::chrono::milliseconds(200)) << "the fifth array did not wait";
  RegionView v(env["GPUSLICE_REGION"]);
  ASSERT_NE(v.region, nullptr);
  EXPECT_EQ(v.dev().oversub_waits.load(), 1u);
  EXPECT_EQ(v.dev().oversub_timeouts.load(), 1u);
}

// A process started without the options took a quota lease (32 MiB spare)
// before the allowance was published; its spare then counted as resident, and
// a 224 MiB allocation under a 256 MiB allowance waited out its timeout with
// 1 MiB in use.
TEST(Allowance, SpareLeaseOfAProcessWithoutTheOptionsIsNotResident) {
  Sandbox box;
  Env plain = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_MEMORY", "4Gi"}});
  const pid_t holder = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(1), "touch", box.path("holding"),
                              "waitfile", box.path("release"), "freeall"},
                             plain, box.path("plain.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("holding"), 20000));
  {
    RegionView v(plain["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    ASSERT_GT(v.dev().used_bytes.load(), 1 * kMi) << "the plain process took no lease: nothing to test";
  }
  Env waiter = merge(allowance_env(box, "wait", "256Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "2s"}});
  Result r = run({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(224), "freeall"}, waiter);
  EXPECT_EQ(values(r, "alloc", "rc"), std::vector<std::string>{"0"}) << r.describe();
  RegionView v(plain["GPUSLICE_REGION"]);
  EXPECT_EQ(v.dev().oversub_timeouts.load(), 0u);
  run({"/usr/bin/touch", box.path("release")}, {});
  EXPECT_EQ(wait(holder, box.path("plain.out")).exit_code, 0);
}

// A holder killed with SIGKILL: the next allocation that finds the allowance
// full reaps it first (the quota path always did), instead of refusing.
TEST(Allowance, ADeadHoldersMemoryIsReapedBeforeARefusal) {
  Sandbox box;
  Env env = allowance_env(box, "fail", "64Mi");
  // The second process starts (and reaps at start-up) before the first dies.
  const pid_t second = spawn({bin("cuprobe"), "init", "ctx", "0", "touch", box.path("ready"), "waitfile",
                              box.path("go"), "alloc", mib(32), "freeall"},
                             env, box.path("second.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("ready"), 20000));
  const pid_t holder = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(48), "touch", box.path("holding"),
                              "waitfile", box.path("never")},
                             env, box.path("holder.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("holding"), 20000));
  kill(holder, SIGKILL);
  wait(holder, box.path("holder.out"));
  run({"/usr/bin/touch", box.path("go")}, {});
  Result r = wait(second, box.path("second.out"));
  EXPECT_EQ(values(r, "alloc", "rc"), std::vector<std::string>{"0"}) << r.describe();
}

// The same under `wait`: the waiter reaps while it waits, instead of waiting
// out its timeout for memory nobody will free.
TEST(Allowance, ADeadHoldersMemoryIsReapedWhileWaiting) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait", "64Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "20s"}});
  const pid_t holder = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(48), "touch", box.path("holding"),
                              "waitfile", box.path("never")},
                             env, box.path("holder.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("holding"), 20000));
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t waiter =
      spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(32), "freeall"}, env, box.path("waiter.out"));
  ASSERT_TRUE(await_region(env["GPUSLICE_REGION"], [](DeviceState& d) { return d.oversub_waiting.load() == 1; }));
  kill(holder, SIGKILL);
  wait(holder, box.path("holder.out"));
  Result r = wait(waiter, box.path("waiter.out"));
  EXPECT_EQ(values(r, "alloc", "rc"), std::vector<std::string>{"0"}) << r.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << "waited out the timeout";
}

// cuMemRelease of the last reference frees device memory like any free: it
// wakes the container's waiters (bumps the futex word) instead of leaving
// them to the 20 ms retry.
TEST(Allowance, CuMemReleaseWakesTheContainersWaiters) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait", "64Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "20s"}});
  const pid_t holder =
      spawn({bin("cuprobe"), "init", "ctx", "0", "vmm", mib(48), "0", "touch", box.path("holding"), "waitfile",
             box.path("release"), "free", "touch", box.path("released"), "waitfile", box.path("exit")},
            env, box.path("holder.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("holding"), 20000));
  const pid_t waiter =
      spawn({bin("cuprobe"), "init", "ctx", "0", "vmm", mib(32), "0", "freeall"}, env, box.path("waiter.out"));
  ASSERT_TRUE(await_region(env["GPUSLICE_REGION"], [](DeviceState& d) { return d.oversub_waiting.load() == 1; }))
      << "the second allocation never waited";
  std::uint32_t before = 0;
  {
    RegionView v(env["GPUSLICE_REGION"]);
    before = v.dev().free_generation.load();
  }
  run({"/usr/bin/touch", box.path("release")}, {});
  ASSERT_TRUE(gpuslice::test::await_file(box.path("released"), 20000));
  {
    RegionView v(env["GPUSLICE_REGION"]);
    EXPECT_NE(v.dev().free_generation.load(), before) << "cuMemRelease woke nobody";
  }
  Result r = wait(waiter, box.path("waiter.out"));
  EXPECT_EQ(values(r, "vmm", "rc"), std::vector<std::string>{"0"}) << r.describe();
  run({"/usr/bin/touch", box.path("exit")}, {});
  EXPECT_EQ(wait(holder, box.path("holder.out")).exit_code, 0);
}

// A process SIGKILLed inside its wait: once reaped, it is no longer counted
// as waiting (smi, metrics, and a futex wake on every later free).
TEST(Allowance, AProcessKilledWhileWaitingIsNoLongerCountedOnceReaped) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait", "64Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "60s"}});
  const pid_t holder = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(48), "touch", box.path("holding"),
                              "waitfile", box.path("exit"), "freeall"},
                             env, box.path("holder.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("holding"), 20000));
  const pid_t waiter = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(32)}, env, box.path("waiter.out"));
  ASSERT_TRUE(await_region(env["GPUSLICE_REGION"], [](DeviceState& d) { return d.oversub_waiting.load() == 1; }));
  kill(waiter, SIGKILL);
  wait(waiter, box.path("waiter.out"));
  RegionView v(env["GPUSLICE_REGION"]);
  ASSERT_NE(v.region, nullptr);
  shm::ProcessIdentity self{};
  ASSERT_TRUE(shm::read_identity(0, &self));
  EXPECT_EQ(limiter::reap_dead(v.region, self), 1);
  EXPECT_EQ(v.dev().oversub_waiting.load(), 0u);
  EXPECT_EQ(v.dev().used_bytes.load(), 48 * kMi);
  run({"/usr/bin/touch", box.path("exit")}, {});
  EXPECT_EQ(wait(holder, box.path("holder.out")).exit_code, 0);
}

// A wait may outlast a change of the quota. 8 MiB reserved under a 1 GiB
// quota waits for the 16 MiB allowance another process holds; the quota
// falls to 4 MiB meanwhile, then the holder frees. The waiter's reservation
// is on no device yet: it must not reach the driver while the container
// stands above the quota (seed 352's shape under `wait`: 10 seeds of 300 at
// a 10 ms lag). Before, it was granted at the holder's free: the device held
// 8 MiB on a 4 MiB quota. Once the quota is back, it is granted.
TEST(Allowance, AWaiterReservedBeforeTheQuotaFellWaitsUntilItFits) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait", "16Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "20s"}});
  const pid_t holder = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(16), "touch", box.path("holding"),
                              "waitfile", box.path("release"), "freeall"},
                             env, box.path("holder.out"));
  ASSERT_TRUE(await_file(box.path("holding"), 20000));
  const pid_t waiter =
      spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(8), "freeall"}, env, box.path("waiter.out"));
  const bool waiting = await_region(env["GPUSLICE_REGION"], [](DeviceState& d) {
    return d.used_bytes.load() >= 24 * kMi && d.oversub_waiting.load() == 1;
  });
  {
    RegionView v(env["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    v.dev().quota_bytes.store(4 * kMi);
  }
  run({"/usr/bin/touch", box.path("release")}, {});
  EXPECT_EQ(wait(holder, box.path("holder.out")).exit_code, 0);
  // The holder's free woke the waiter; its allocation must not have landed.
  const bool landed = await_region(
      env["GPUSLICE_REGION"],
      [&](DeviceState&) { return lines_with(read_text(box.path("waiter.out")), "alloc ").size() != 0; }, 400);
  {
    RegionView v(env["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    v.dev().quota_bytes.store(1024 * kMi);
  }
  Result r = wait(waiter, box.path("waiter.out"));
  ASSERT_TRUE(waiting) << r.describe();
  EXPECT_FALSE(landed) << "granted while the container stood above its 4 MiB quota: " << r.describe();
  EXPECT_EQ(values(r, "alloc", "rc"), std::vector<std::string>{"0"}) << r.describe();
}

// The agent's extra (agent_extra_bytes: memory NVML shows on the device
// beyond the container's count) is resident memory: it counts against the
// allowance as it counts against the quota, while the agent that wrote it
// beats (limiter/agent_extra.h). 48 MiB under a 64 MiB allowance with 32 MiB
// of fresh extra: 80 MiB would be resident. Before, it was granted on the
// device under every policy; a stale heartbeat's extra does not count.
struct ExtraRun {
  Result result;
  std::uint64_t spilled = 0;
  std::uint64_t timeouts = 0;
};

ExtraRun alloc_beside_extra(const std::string& policy, bool fresh) {
  Sandbox box;
  Env env = merge(allowance_env(box, policy, "64Mi"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "100ms"}});
  const pid_t p = spawn({bin("cuprobe"), "init", "ctx", "0", "touch", box.path("ready"), "waitfile", box.path("go"),
                         "alloc", mib(48), "touch", box.path("done"), "waitfile", box.path("exit"), "freeall"},
                        env, box.path("p.out"));
  ExtraRun out;
  EXPECT_TRUE(await_file(box.path("ready"), 20000));
  {
    RegionView v(env["GPUSLICE_REGION"]);
    EXPECT_NE(v.region, nullptr);
    if (v.region != nullptr) {
      v.dev().agent_extra_bytes.store(32 * kMi);
      const std::uint64_t now = platform::monotonic_ns();
      v.region->header.agent_heartbeat_ns.store(fresh ? now : now - limiter::kAgentExtraHoldNs - 1'000'000'000);
    }
  }
  run({"/usr/bin/touch", box.path("go")}, {});
  EXPECT_TRUE(await_file(box.path("done"), 20000));
  {
    RegionView v(env["GPUSLICE_REGION"]);
    if (v.region != nullptr) {
      out.spilled = v.dev().spilled_bytes.load();
      out.timeouts = v.dev().oversub_timeouts.load();
    }
  }
  run({"/usr/bin/touch", box.path("exit")}, {});
  out.result = wait(p, box.path("p.out"));
  return out;
}

TEST(Allowance, TheAgentsFreshExtraCountsAgainstIt) {
  ExtraRun fail = alloc_beside_extra("fail", true);
  EXPECT_EQ(values(fail.result, "alloc", "rc"), std::vector<std::string>{"2"}) << fail.result.describe();
  ExtraRun wait_run = alloc_beside_extra("wait", true);
  EXPECT_EQ(values(wait_run.result, "alloc", "rc"), std::vector<std::string>{"2"}) << wait_run.result.describe();
  EXPECT_EQ(wait_run.timeouts, 1u);
  ExtraRun spill = alloc_beside_extra("spill", true);
  EXPECT_EQ(values(spill.result, "alloc", "rc"), std::vector<std::string>{"0"}) << spill.result.describe();
  EXPECT_EQ(spill.spilled, 48 * kMi) << "served on the device above the allowance";
}

TEST(Allowance, AStaleExtraDoesNotCountAgainstIt) {
  for (const char* policy : {"fail", "wait", "spill"}) {
    ExtraRun r = alloc_beside_extra(policy, false);
    EXPECT_EQ(values(r.result, "alloc", "rc"), std::vector<std::string>{"0"}) << policy << ": " << r.result.describe();
    EXPECT_EQ(r.spilled, 0u) << policy;
    EXPECT_EQ(r.timeouts, 0u) << policy;
  }
}

}  // namespace
}  // namespace gpuslice::test
