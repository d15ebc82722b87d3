// Several processes on one simulated machine: the shared timeline, reclaiming
// the memory of killed processes, and fakecuda-ctl.
#include <sys/stat.h>

#include <random>
#include <sstream>
#include <thread>

#include "common.h"

using namespace fakecuda_test;

namespace {

std::string RunCtl(const std::string& args) {
  std::string command = std::string(FAKECUDA_CTL) + " " + args;
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  char buffer[4096];
  while (pipe != nullptr && std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  if (pipe != nullptr) pclose(pipe);
  return output;
}

TEST_F(FakeCuda, TwoProcessesShareTheDeviceTimeline) {
  uint64_t t0 = fakecuda_now_ns();
  // Each process launches 10 x 1 ms; together they need 20 ms of device time.
  Child a = Child::Spawn({"spin", "1000", "10"});
  Child b = Child::Spawn({"spin", "1000", "10"});
  std::istringstream line_a(a.ReadLine()), line_b(b.ReadLine());
  ASSERT_EQ(a.Wait(), 0);
  ASSERT_EQ(b.Wait(), 0);
  uint64_t t1 = fakecuda_now_ns();
  int pid_a = 0, pid_b = 0;
  uint64_t start_a = 0, end_a = 0, start_b = 0, end_b = 0;
  line_a >> pid_a >> start_a >> end_a;
  line_b >> pid_b >> start_b >> end_b;
  ASSERT_EQ(pid_a, a.pid);
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, t1), 20000000u);
  EXPECT_EQ(fakecuda_busy_ns(0, pid_a, t0, t1), 10000000u);
  EXPECT_EQ(fakecuda_busy_ns(0, pid_b, t0, t1), 10000000u);
  // Each waited at least for its own 10 ms, and the later one for both, if they overlapped.
  EXPECT_GE(end_a - start_a, 10000000u);
  EXPECT_GE(end_b - start_b, 10000000u);
  uint64_t first_start = std::min(start_a, start_b);
  uint64_t last_end = std::max(end_a, end_b);
  EXPECT_GE(last_end - first_start, 20000000u);
  std::string busy = RunCtl("busy 0 " + std::to_string(t0) + " " + std::to_string(t1));
  EXPECT_EQ(std::stoull(busy), 20000000u);
}

TEST_F(FakeCuda, KilledProcessMemoryIsReclaimed) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "4Mi", 1);
  Child child = Child::Spawn({"alloc", std::to_string(100 * kMiB), "3"});
  ASSERT_EQ(child.ReadLine(), "ready");
  EXPECT_EQ(fakecuda_device_used_bytes(0), 304 * kMiB);
  EXPECT_EQ(fakecuda_process_used_bytes(0, child.pid), 304 * kMiB);
  EXPECT_EQ(fakecuda_process_context_bytes(0, child.pid), 4 * kMiB);
  EXPECT_EQ(fakecuda_process_count(0), 1);
  std::string status = RunCtl("status");
  EXPECT_NE(status.find("\"pid\": " + std::to_string(child.pid)), std::string::npos) << status;
  EXPECT_NE(status.find("\"used\": " + std::to_string(304 * kMiB)), std::string::npos) << status;
  child.Kill();
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_EQ(fakecuda_process_count(0), 0);
}

TEST_F(FakeCuda, KilledMidAllocationLeavesNothingBehind) {
  setenv("FAKECUDA_MEMORY", "256Mi", 1);
  std::mt19937 rng(42);
  for (int round = 0; round < 6; ++round) {
    std::vector<Child> children;
    for (int i = 0; i < 3; ++i) {
      children.push_back(Child::Spawn({"allocloop", std::to_string(kMiB)}));
      ASSERT_EQ(children.back().ReadLine(), "ready");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    for (Child& child : children) child.Kill();  // at an arbitrary instruction, maybe holding the lock
    EXPECT_EQ(fakecuda_device_used_bytes(0), 0u) << "round " << round;
  }
  // The shared lock survived its owners: a new process allocates normally.
  Child last = Child::Spawn({"alloc", std::to_string(kMiB), "1"});
  ASSERT_EQ(last.ReadLine(), "ready");
  EXPECT_EQ(fakecuda_device_used_bytes(0), kMiB);
  last.Kill();
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

TEST_F(FakeCuda, ConcurrentFirstProcessesAgreeOnOneState) {
  // Whoever creates the state fixes the configuration; racing creators must agree.
  std::vector<Child> children;
  for (int i = 0; i < 6; ++i) children.push_back(Child::Spawn({"alloc", std::to_string(kMiB), "1"}));
  // EXPECT, not ASSERT: a child that failed must not leave the others running
  // (they would hold CTest's output pipe open until its timeout).
  for (Child& child : children) EXPECT_EQ(child.ReadLine(), "ready");
  if (!HasFailure()) {
    EXPECT_EQ(fakecuda_device_used_bytes(0), 6 * kMiB);
  }
  for (Child& child : children) child.Kill();
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

TEST_F(FakeCuda, CtlReportsAndResets) {
  ASSERT_CU(cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxRetain(&ctx, 1));
  ASSERT_CU(cuCtxSetCurrent(ctx));
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 3 * kMiB));
  std::string status = RunCtl("status");
  EXPECT_NE(status.find("\"devices\": [{\"index\": 0"), std::string::npos) << status;
  EXPECT_NE(status.find("\"pid\": " + std::to_string(getpid()) + ", \"host_pid\""), std::string::npos) << status;
  EXPECT_NE(status.find("\"device\": 1, \"used_bytes\": " + std::to_string(3 * kMiB)), std::string::npos) << status;
  EXPECT_EQ(RunCtl("bogus"), "");
  RunCtl("reset");
  struct stat st {};
  EXPECT_NE(stat(state_.c_str(), &st), 0);
}

TEST_F(FakeCuda, PidNamespaceReportsHostPid) {
  if (system("unshare --pid --fork true >/dev/null 2>&1") != 0) GTEST_SKIP() << "no pid namespaces here";
  Child child = Child::Spawn({"alloc", std::to_string(kMiB), "1"}, {"unshare", "--pid", "--fork", "--kill-child"});
  ASSERT_EQ(child.ReadLine(), "ready");
  ASSERT_CU(cuInit(0));  // not needed for queries; checks the state is shared with a namespaced process
  std::string status = RunCtl("status");
  // Inside its namespace the helper is pid 1; NVML-style reporting uses the outer pid.
  EXPECT_NE(status.find("\"pid\": 1, \"host_pid\": "), std::string::npos) << status;
  EXPECT_EQ(status.find("\"host_pid\": 1,"), std::string::npos) << status;
  EXPECT_EQ(fakecuda_process_used_bytes(0, 1), kMiB);
  child.Kill();
  // unshare's child (our helper) is killed by the kernel after unshare itself
  // dies and is not ours to wait for: poll until its lock is gone.
  for (int i = 0; i < 200 && fakecuda_device_used_bytes(0) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

}  // namespace
