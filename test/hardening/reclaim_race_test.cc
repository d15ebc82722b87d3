// Two threads of one process in the refusal path at once (the chaos suite's
// `fill` + `pool` refusals with room, issue 32): before refusing, gpuslice
// trims the process's idle pool reserves and lowers their count (the pool
// reclaim, hook/pool_state.cc). A reclaim skips a pool another thread is
// busy with (try-lock: reclaims run inside pool growth, which holds its
// pool's mutex); when that other thread was itself reclaiming it (the device
// already trimmed, the count not lowered yet), the second thread was refused
// while the memory it needed was on its way back.
// programs/reclaim_race.cc; the simulator's reserve query sleeps 300 ms
// (FAKECUDA_POOL_QUERY_DELAY_US), so the second request lands inside the
// first's reclaim.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "harness.h"

namespace gpuslice::test {
namespace {

const Probe race{{"reclaim_race"}, 120000};

// 64 MiB quota; the default pool keeps 48 MiB reserved, idle. A asks for
// 32 MiB (reclaims the pool), B for 24 MiB during A's reclaim: 56 MiB fit.
// Before: B was refused (CUDA_ERROR_OUT_OF_MEMORY) with the pool already
// trimmed.
TEST(ReclaimRace, ASecondRequestDuringAnotherThreadsPoolReclaimIsNotRefused) {
  Sandbox box;
  Result r =
      race(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}, {"FAKECUDA_POOL_QUERY_DELAY_US", "300000"}}, {"48", "32", "24"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "race", "a_rc"), 0) << r.out;
  EXPECT_EQ(number(r, "race", "b_rc"), 0) << "refused during another thread's pool reclaim\n" << r.out;
}

// A trim that could not lower the count (another thread was reconciling the
// pool: busy), then a request the device has room for: the refusal's
// reclaim skipped the busy pool too (try-lock) and refused, with the pool's
// reserve already back on the device (the chaos suite's `pool` + `fill`
// refusals with room: a pool held by a growth or a reconciliation while a
// synchronisation trimmed it). 64 MiB quota, 48 MiB of idle reserve trimmed,
// then 48 MiB asked. It waits for the pool's mutex now (bounded).
TEST(ReclaimRace, ARequestAfterATrimOfABusyPoolIsNotRefused) {
  Sandbox box;
  Result r = race(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}, {"FAKECUDA_POOL_QUERY_DELAY_US", "300000"}},
                  {"48", "48", "0", "busy"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "race", "b_rc"), 0) << r.out;
  EXPECT_EQ(number(r, "race", "a_rc"), 0) << "refused after the pool's reserve went back to the device\n" << r.out;
}

// The same trim, and the request from another process of the container
// (which has no pool of its own to reclaim): the trim itself must lower the
// count once the other thread's reconciliation lets go of the pool. Before:
// it skipped the busy pool (try-lock), and the container was refused with
// the reserve back on the device until the pool's next synchronisation.
TEST(ReclaimRace, ATrimOfABusyPoolLowersTheCountForOtherProcesses) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}, {"FAKECUDA_POOL_QUERY_DELAY_US", "500000"}});
  const std::string out = box.path("race.out");
  const pid_t racer = spawn({bin("reclaim_race"), "48", "0", "0", "busy-trim"}, env, out);
  bool trimmed = false;
  for (int i = 0; i < 2000 && !trimmed; ++i) {
    usleep(5000);
    std::ifstream in(out);
    std::stringstream text;
    text << in.rdbuf();
    trimmed = text.str().find("trimmed") != std::string::npos;
  }
  const Result other = run({bin("cuprobe"), "init", "ctx", "0", "alloc", std::to_string(48ull << 20)}, env);
  const Result r = wait(racer, out);
  ASSERT_TRUE(trimmed) << r.describe();
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(other.out.find("alloc rc=0"), std::string::npos)
      << "refused after the pool's reserve went back to the device\n"
      << other.describe();
}

}  // namespace
}  // namespace gpuslice::test
