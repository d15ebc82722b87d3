// Issue 36, the NCCL/vLLM set-up: one process per device (4 ranks on 4
// simulated GPUs), each exporting VMM memory with a POSIX-fd handle over a
// Unix socket to its neighbour, which imports and maps it with access for its
// own device (programs/nccl_rank.cc), under a quota AND a compute limit on
// every device. What must hold: no rank crashes or hangs (every wait in the
// ranks and here is bounded); each rank's shared 64 MiB is counted once, on
// its own device (the import of a neighbour's memory charges nothing more), so
// each fills exactly quota - 64 MiB; and each device's kernels are throttled
// there. Shares of the simulated timeline: labelled `timing`.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compute_support.h"

using namespace gpuslice::test;
using namespace gpuslice::test::hardening;

namespace {

constexpr unsigned long long kMi = 1ull << 20;

TEST(NcclShaped, FourRanksOnePerDeviceUnderAQuotaAndAComputeLimit) {
  Sandbox box;
  Env env = merge(box.env(), {{"FAKECUDA_DEVICES", "4"},
                              {"FAKECUDA_MEMORY", "1Gi"},
                              {"GPUSLICE_MEMORY_LIMIT", "256Mi"},
                              {"GPUSLICE_SM_LIMIT", "10"}});
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 4; ++rank)
    pids.push_back(spawn({bin("nccl_rank"), std::to_string(rank), "4", box.dir(), "64", "100", "1.5"}, env,
                         box.path("rank" + std::to_string(rank) + ".out")));
  std::vector<Result> results;
  for (int rank = 0; rank < 4; ++rank)
    results.push_back(wait(pids[rank], box.path("rank" + std::to_string(rank) + ".out"), 90000));
  for (int rank = 0; rank < 4; ++rank) {
    const Result& r = results[rank];
    SCOPED_TRACE("rank " + std::to_string(rank));
    ASSERT_FALSE(r.timed_out) << r.describe();
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(number(r, "import", "rc"), 0) << r.out;
    EXPECT_EQ(unsigned_number(r, "fill", "bytes"), 192 * kMi)
        << "the shared 64 MiB counted once, on its device" << r.out;
    const long pid = static_cast<long>(unsigned_number(r, "launches", "pid", 0));
    ASSERT_GT(unsigned_number(r, "launches", "n", 0), 0u) << r.out;
    const std::uint64_t busy = device_busy_ns(box, rank, pid);
    EXPECT_GT(busy, 0u) << r.out;
    EXPECT_LE(busy, 1'000'000'000u) << "device " << rank << " ran " << busy / 1e6 << " ms under a 10% limit";
    for (int other = 0; other < 4; ++other) {
      if (other != rank) {
        EXPECT_EQ(device_busy_ns(box, other, pid), 0u) << "rank " << rank << " ran on " << other;
      }
    }
  }
}

}  // namespace
