// Managed memory (cuMemAllocManaged) under the device-resident allowance
// (GPUSLICE_MEMORY_RESIDENT), under each policy: the part the device may
// hold stays within the allowance; beyond it the policy applies as to
// cuMemAlloc (docs/memory.md, "Oversubscription"). Before, managed memory was
// reserved against the quota only: every allocation below succeeded at once
// and the device held it all (the chaos suite's managed,resident-wait
// schedules, issue 20). Programs are cuprobe under the preload library; the
// region and the simulated device are read directly.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "gpuslice/region.h"
#include "harness.h"
#include "probe.h"
#include "region_view.h"

namespace gpuslice::test {
namespace {

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

Env allowance_env(const Sandbox& box, const std::string& policy) {
  return merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"},
                           {"GPUSLICE_MEMORY_RESIDENT", "64Mi"},
                           {"GPUSLICE_OVERSUBSCRIBE", policy},
                           {"FAKECUDA_MEMORY", "4Gi"}});
}

// `count` managed allocations of 16 MiB, then (with `hold`) a file saying so
// and a wait for the release file, then free everything.
std::vector<std::string> managed_program(int count, const Sandbox* hold = nullptr) {
  std::vector<std::string> argv{bin("cuprobe"), "init", "ctx", "0"};
  for (int i = 0; i < count; ++i) argv.insert(argv.end(), {"managed", mib(16)});
  if (hold != nullptr) argv.insert(argv.end(), {"touch", hold->path("holding"), "waitfile", hold->path("release")});
  argv.push_back("freeall");
  return argv;
}

// By direct symbol and through cuGetProcAddress (cuprobe_dl).
TEST(ManagedAllowance, IsRefusedBeyondItUnderFail) {
  for (Path path : {Path::direct, Path::get_proc_address}) {
    Sandbox box;
    Env env = allowance_env(box, "fail");
    std::vector<std::string> argv = managed_program(8);
    argv.erase(argv.begin());
    Result r = probe(path, env, argv);
    ASSERT_EQ(r.exit_code, 0) << path_name(path) << ": " << r.describe();
    const std::vector<std::string> got = values(r, "managed", "rc");
    EXPECT_EQ(got, (std::vector<std::string>{"0", "0", "0", "0", "2", "2", "2", "2"}))  // CUDA_ERROR_OUT_OF_MEMORY
        << path_name(path) << ": " << r.describe();
    RegionView v(env["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    EXPECT_EQ(v.dev().used_bytes.load(), 0u) << path_name(path);
  }
}

// Beyond the allowance managed memory is served advised to the host, as a
// spilled cuMemAlloc is: the device holds the allowance, the rest is counted
// (in the quota) as spilled.
TEST(ManagedAllowance, SpillsBeyondItUnderSpill) {
  Sandbox box;
  Env env = allowance_env(box, "spill");
  const pid_t pid = spawn(managed_program(8, &box), env, box.path("out"));
  ASSERT_TRUE(await_file(box.path("holding"), 20000));
  EXPECT_EQ(device_used(box), 64 * kMi) << "the device holds managed memory beyond the allowance";
  {
    RegionView v(env["GPUSLICE_REGION"]);
    ASSERT_NE(v.region, nullptr);
    EXPECT_EQ(v.dev().used_bytes.load(), 128 * kMi);
    EXPECT_EQ(v.dev().spilled_bytes.load(), 64 * kMi);
  }
  run({"/usr/bin/touch", box.path("release")}, {});
  Result r = wait(pid, box.path("out"));
  EXPECT_EQ(values(r, "managed", "rc"), std::vector<std::string>(8, "0")) << r.describe();
  EXPECT_EQ(values(r, "freeall", "rc"), std::vector<std::string>{"0"}) << r.describe();
  RegionView v(env["GPUSLICE_REGION"]);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);
  EXPECT_EQ(v.dev().spilled_bytes.load(), 0u);
  EXPECT_EQ(device_used(box), 0u);
}

TEST(ManagedAllowance, WaitsForItUnderWait) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "200ms"}});
  const auto t0 = std::chrono::steady_clock::now();
  Result r = run(managed_program(5), env);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(values(r, "managed", "rc"), (std::vector<std::string>{"0", "0", "0", "0", "2"})) << r.describe();
  EXPECT_GE(took, std::chrono::milliseconds(200)) << "the fifth allocation did not wait";
  RegionView v(env["GPUSLICE_REGION"]);
  ASSERT_NE(v.region, nullptr);
  EXPECT_EQ(v.dev().oversub_waits.load(), 1u);
  EXPECT_EQ(v.dev().oversub_timeouts.load(), 1u);
  EXPECT_EQ(v.dev().used_bytes.load(), 0u);
}

// A waiting managed allocation gets the allowance when another process of
// the container frees its managed memory, and the device never holds more.
TEST(ManagedAllowance, AWaiterGetsItWhenTheContainerFrees) {
  Sandbox box;
  Env env = merge(allowance_env(box, "wait"), {{"GPUSLICE_OVERSUBSCRIBE_WAIT", "20s"}});
  struct LetGo {  // a failed assertion must not leave the programs waiting
    const Sandbox& box;
    ~LetGo() {
      for (const char* f : {"release", "exit"}) run({"/usr/bin/touch", box.path(f)}, {});
    }
  } let_go{box};
  const pid_t holder = spawn(managed_program(3, &box), env, box.path("holder.out"));
  ASSERT_TRUE(await_file(box.path("holding"), 20000));
  const pid_t waiter = spawn({bin("cuprobe"), "init", "ctx", "0", "managed", mib(32), "touch", box.path("got"),
                              "waitfile", box.path("exit"), "freeall"},
                             env, box.path("waiter.out"));
  bool waiting = false;
  for (int i = 0; i < 10000 && !waiting; ++i) {
    RegionView v(env["GPUSLICE_REGION"]);
    waiting = v.region != nullptr && v.dev().oversub_waiting.load() == 1;
    if (!waiting) usleep(2000);
  }
  ASSERT_TRUE(waiting) << "the managed allocation over the allowance did not wait";
  EXPECT_EQ(device_used(box), 48 * kMi);
  run({"/usr/bin/touch", box.path("release")}, {});
  ASSERT_TRUE(await_file(box.path("got"), 20000));
  EXPECT_EQ(device_used(box), 32 * kMi);
  run({"/usr/bin/touch", box.path("exit")}, {});
  Result r = wait(waiter, box.path("waiter.out"));
  EXPECT_EQ(values(r, "managed", "rc"), std::vector<std::string>{"0"}) << r.describe();
  EXPECT_EQ(wait(holder, box.path("holder.out")).exit_code, 0);
}

}  // namespace
}  // namespace gpuslice::test
