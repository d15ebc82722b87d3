// Stream-ordered allocation racing the library's slow paths, each window
// widened by a test knob of the simulated driver (gpuslice-probe pool-race): the
// container's count never falls below what the device holds, and the device
// never holds more than the quota (docs/memory.md, "Stream-ordered pools").
#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr long long kMi = 1ll << 20;

const Probe probe{{"gpuslice-probe", "pool-race"}, 60000};

// A reconciliation read the reserve, then `outstanding`; a fast-path
// allocation and its free between the two grew the reserve the first read
// missed, and the pool was counted below what the device held (0 counted,
// 64 MiB held before). Now the reconciliation sees the pool was used between
// its reads and lowers nothing.
TEST(PoolRace, ReconciliationRacedByAnAllocationAndFreeNeverCountsBelowTheDevice) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_POOL_QUERY_DELAY_US", "300000"}},
                   {"reconcile-order", "64"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "reconcile-order", "rc"), 0) << r.out;
  EXPECT_EQ(number(r, "reconcile-order", "held"), 64 * kMi) << r.out;
  EXPECT_GE(number(r, "reconcile-order", "counted"), number(r, "reconcile-order", "held")) << r.out;
}

// cuDeviceSetMemPool between cuMemAllocAsync's look at the cached current
// pool and the driver's: the driver grew the new pool while the old one was
// charged, and the device held 768 MiB with a 512 MiB quota. Now the change
// waits for allocations in flight (and they for it): the second allocation
// is refused, the device stays within the quota and the count covers it.
TEST(PoolRace, SetMemPoolDuringAnAllocationNeverLeavesTheDeviceAboveTheQuota) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "512Mi"}, {"FAKECUDA_ALLOC_ASYNC_DELAY_US", "300000"}},
                   {"set-mempool", "256"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_LE(number(r, "set-mempool", "held"), 512 * kMi) << r.out;
  EXPECT_GE(number(r, "set-mempool", "counted"), number(r, "set-mempool", "held")) << r.out;
  EXPECT_EQ(number(r, "set-mempool", "rc1"), 0) << r.out;
}

// A pool growth waiting for the resident allowance held the pool's mutex;
// the reconciliation after another thread freed that pool's memory and
// synchronised only try-locks it, skipped the pool, and the waiter timed out
// (CUDA_ERROR_OUT_OF_MEMORY after 3 s with the device empty). Now it waits
// without the mutex and goes on once the memory is given back.
TEST(PoolRace, PoolGrowthWaitingForTheAllowanceSeesTheSamePoolsFrees) {
  Sandbox box;
  Result r = probe(box,
                   {{"GPUSLICE_MEMORY_LIMIT", "256Mi"},
                    {"GPUSLICE_MEMORY_RESIDENT", "64Mi"},
                    {"GPUSLICE_OVERSUBSCRIBE", "wait"},
                    {"GPUSLICE_OVERSUBSCRIBE_WAIT", "3s"}},
                   {"allowance-wait", "48", "32"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "allowance-wait", "rc"), 0) << r.out;
  EXPECT_LT(number(r, "allowance-wait", "waited_ms"), 2500) << r.out;
}

}  // namespace
}  // namespace gpuslice::test
