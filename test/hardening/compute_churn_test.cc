// Issue 9, "short-lived processes": processes that launch a few long kernels
// and exit without synchronising must not push their container far past its
// share. Their work keeps running after they are gone; the limiter must have
// measured it (a process waits for its first kernels while their price is
// unknown, and the feedback keeps attributing an exited process's device time
// to its container) so that the container's next launches pay for it.
//
// Three spawners start such processes back to back for 3 s (each launches 1
// or 3 kernels of 100 ms) under a 10 % limit. Everything they queued, read from
// the simulated device's timeline, must stay under 10 % of the churn's wall
// time plus 2.5 s of slack (the first processes' unmeasured kernels and the
// controller's lag). Without the fix they queue a hundred seconds and more.
// Labelled `timing` (wall-clock shares).
#include <gtest/gtest.h>
#include <time.h>

#include <algorithm>
#include <string>
#include <cstdio>
#include <atomic>
#include <thread>
#include <vector>

#include "compute_support.h"

using namespace gpuslice::test;
using namespace gpuslice::test::hardening;

namespace {

std::uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

class ShortLivedProcesses : public ::testing::TestWithParam<int> {};

TEST_P(ShortLivedProcesses, CannotQueueFarBeyondTheContainersShare) {
  const std::string kernels = std::to_string(GetParam());
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_SM_LIMIT", "10"}});
  constexpr std::uint64_t kChurnNs = 3'000'000'000;
  const std::uint64_t start = mono_ns();
  const std::uint64_t deadline = start + kChurnNs;
  std::atomic<int> processes{0}, finished{0};
  std::vector<std::thread> spawners;
  for (int t = 0; t < 3; ++t) {
    spawners.emplace_back([&] {
      while (mono_ns() < deadline) {
        const pid_t pid = spawn({bin("gpuslice-probe"), "compute", "churn", "100000", kernels}, env);
        ++processes;
        const std::uint64_t now = mono_ns();
        // Still waiting for credit at the end of the churn: killed (what it
        // was admitted for is on the timeline already).
        const int left_ms = now < deadline ? static_cast<int>((deadline - now) / 1'000'000) + 1 : 1;
        Result r = wait(pid, "", left_ms);
        if (r.exit_code == 0) ++finished;
      }
    });
  }
  for (auto& t : spawners) t.join();
  const std::uint64_t wall = mono_ns() - start;
  const std::uint64_t busy = device_busy_ns(box, 0, 0);
  const double bound = 0.10 * static_cast<double>(wall) + 2.5e9;
  EXPECT_GE(processes.load(), 3);
  std::printf("churn: %d processes queued %.2f s of device time in %.2f s\n", processes.load(), busy / 1e9, wall / 1e9);
  EXPECT_GT(busy, 0u);
  EXPECT_LE(static_cast<double>(busy), bound)
      << processes.load() << " processes (" << finished.load() << " exited by themselves) queued " << busy / 1e9
      << " s of device time in " << wall / 1e9 << " s under a 10% limit";
}

INSTANTIATE_TEST_SUITE_P(KernelsPerProcess, ShortLivedProcesses, ::testing::Values(1, 3),
                         [](const auto& info) { return std::to_string(info.param) + "Kernels"; });

}  // namespace
