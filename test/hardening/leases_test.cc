// Quota leases across processes, end to end (issue 20): a quota lowered at
// run time with gpuslice-smi set holds at the next allocation of every
// process, spare leases included; and a process started after another was
// SIGKILLed sees the truth in its first cuMemGetInfo (start-up reap); what a
// thread frees is spent again only under the limits in force and is the
// container's once the thread exited (once a per-thread reserve kept it;
// now it goes to the slot at the free: reserve_test.cc).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

// Eight processes each hold 1 MiB and a 32 MiB spare lease under a 1 GiB
// quota; `gpuslice-smi set --memory 128Mi`; then each allocates 4 x 8 MiB.
// Before: all 32 allocations succeeded from the leases (264 MiB held under a
// 128 MiB quota). Now what is held never exceeds the new quota.
TEST(Leases, SmiLoweringTheQuotaHoldsForSpareLeasesOfEveryProcess) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_MEMORY", "4Gi"}});
  std::vector<pid_t> pids;
  for (int i = 0; i < 8; ++i) {
    const std::string n = std::to_string(i);
    pids.push_back(spawn({bin("cuprobe"), "init",           "ctx",    "0",
                          "alloc",        mib(1),           "touch",  box.path("ready" + n),
                          "waitfile",     box.path("go"),   "alloc",  mib(8),
                          "alloc",        mib(8),           "alloc",  mib(8),
                          "alloc",        mib(8),           "touch",  box.path("done" + n),
                          "waitfile",     box.path("exit"), "freeall"},
                         env, box.path("out" + n)));
  }
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(gpuslice::test::await_file(box.path("ready" + std::to_string(i)), 30000));
  Result smi = run(
      {bin("gpuslice-smi"), "set", "--region", env.at("GPUSLICE_REGION"), "--device", "0", "--memory", "128Mi"}, {});
  ASSERT_EQ(smi.exit_code, 0) << smi.describe();
  run({"/usr/bin/touch", box.path("go")}, {});
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(gpuslice::test::await_file(box.path("done" + std::to_string(i)), 30000));
  run({"/usr/bin/touch", box.path("exit")}, {});
  unsigned long long held = 0;
  for (int i = 0; i < 8; ++i) {
    Result r = wait(pids[static_cast<std::size_t>(i)], box.path("out" + std::to_string(i)));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    const std::vector<std::string> allocs = lines_with(r.out, "alloc ");
    ASSERT_EQ(allocs.size(), 5u) << r.describe();
    for (std::size_t k = 0; k < allocs.size(); ++k)
      if (field(allocs[k], "rc") == "0") held += k == 0 ? 1 * kMi : 8 * kMi;
  }
  EXPECT_LE(held, 128 * kMi) << "the container held " << held / kMi << " MiB under a 128 MiB quota";
  EXPECT_GT(held, 128 * kMi - 8 * kMi) << "refused below the quota";
}

// Frameworks size themselves from cuMemGetInfo at start-up: a process of a
// container whose previous process was SIGKILLed holding 300 MiB must not
// see those 300 MiB in its first query (without any agent).
TEST(Leases, FirstMemGetInfoAfterAKilledProcessIsTrue) {
  const Env limits{{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_MEMORY", "4Gi"}};
  std::string fresh_free;
  {
    Sandbox fresh;
    Result r = run({bin("cuprobe"), "init", "ctx", "0", "meminfo"}, merge(fresh.env(), limits));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    fresh_free = field(lines_with(r.out, "meminfo ").at(0), "free");
  }
  Sandbox box;
  const Env env = merge(box.env(), limits);
  const pid_t victim = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(300), "touch", box.path("holding"),
                              "waitfile", box.path("never")},
                             env, box.path("victim.out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("holding"), 30000));
  kill(victim, SIGKILL);
  wait(victim, box.path("victim.out"));
  Result r = run({bin("cuprobe"), "init", "ctx", "0", "meminfo"}, env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(field(lines_with(r.out, "meminfo ").at(0), "free"), fresh_free) << r.describe();
}

// Sixteen threads each allocate and free 2 MiB, keeping it for themselves,
// and exit; then one allocation asks for the whole 64 MiB quota. The threads'
// reserves went back at their exit: nothing is left counted. (Without the
// exit-time give-back, up to 32 MiB stayed counted as in use and the
// allocation was refused.)
TEST(ThreadReserve, GoesBackToTheContainerWhenItsThreadExits) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  Result r = run({bin("gpuslice-probe"), "reserve", "thread-exit", "16", "2", "64"}, env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::string line = lines_with(r.out, "thread-exit ").at(0);
  EXPECT_EQ(field(line, "freed"), "16") << r.describe();
  EXPECT_EQ(field(line, "big_rc"), "0") << "the exited threads' reserves stayed counted\n" << r.describe();
}

// A process holds 100 MiB and keeps 1 MiB it freed in its thread's reserve;
// gpuslice-smi lowers the quota to 64 MiB; its next 1 MiB allocation must be
// refused: the reserve was admitted under the old quota and its lease word
// is STALE now. (Spending it regardless admitted 1 MiB over the new quota.)
TEST(ThreadReserve, IsNotSpentPastAQuotaLoweredAtRunTime) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_MEMORY", "4Gi"}});
  const pid_t pid = spawn({bin("cuprobe"), "init", "ctx", "0", "alloc", mib(100), "alloc", mib(1), "free", "alloc",
                           mib(1), "free", "touch", box.path("ready"), "waitfile", box.path("go"), "alloc", mib(1)},
                          env, box.path("out"));
  ASSERT_TRUE(gpuslice::test::await_file(box.path("ready"), 30000));
  Result smi =
      run({bin("gpuslice-smi"), "set", "--region", env.at("GPUSLICE_REGION"), "--device", "0", "--memory", "64Mi"}, {});
  ASSERT_EQ(smi.exit_code, 0) << smi.describe();
  run({"/usr/bin/touch", box.path("go")}, {});
  Result r = wait(pid, box.path("out"));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::vector<std::string> allocs = lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 4u) << r.describe();
  EXPECT_EQ(field(allocs[2], "rc"), "0") << "the second 1 MiB, from the reserve, before the change\n" << r.describe();
  EXPECT_EQ(field(allocs[3], "rc"), "2") << "admitted over the lowered quota\n" << r.describe();
}

}  // namespace
}  // namespace gpuslice::test
