// Stream-ordered allocation: the count of each pool against what the
// simulated device holds, on the paths the lock-free fast path leaves to slow
// triggers (reconciliation before a refusal, at synchronisation and trim; a
// non-zero release threshold; cuDeviceSetMemPool; a driver refusal; many
// threads on two devices). Each scenario runs gpuslice-probe pool under the preload
// library (docs/memory.md, "Stream-ordered pools").
#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

const Probe probe{{"gpuslice-probe", "pool"}, 120000};

// A pool allocation freed without a synchronisation keeps its memory in the
// pool (counted: the device holds it). An allocation that needs that memory
// is not refused for it: before refusing, the library trims its own pools
// and counts what they still hold.
TEST(PoolAccounting, CachedPoolMemoryIsTrimmedBeforeARefusal) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "16Mi"}}, {"reclaim", "12", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "reclaim", "cached"), 12 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "reclaim", "cached_held"), 12 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "reclaim", "alloc_rc"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "reclaim", "counted"), 8 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "reclaim", "held"), 8 * kMi) << r.out;
}

// With a release threshold the pool keeps freed memory across a sync: it
// stays counted (the device holds it) until cuMemPoolTrimTo gives it back.
TEST(PoolAccounting, ReserveKeptByTheReleaseThresholdStaysCountedUntilTrimmed) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}}, {"threshold", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "threshold", "synced"), 8 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "threshold", "synced_held"), 8 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "threshold", "trimmed"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "threshold", "trimmed_held"), 0u) << r.out;
}

// The library caches each device's current pool; cuDeviceSetMemPool changes
// it, and the new pool's reserve is what the device then holds.
TEST(PoolAccounting, AllocAsyncAfterSetMemPoolCountsTheNewCurrentPool) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}}, {"set-mempool", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "set-mempool", "held"), 8 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "set-mempool", "counted"), 8 * kMi) << r.out;
}

// Within the quota but beyond the device: the driver's error, count unchanged.
TEST(PoolAccounting, DriverRefusalLeavesTheCountUnchanged) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_MEMORY", "64Mi"}}, {"driver-oom", "48", "32"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "driver-oom", "rc"), static_cast<unsigned long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_EQ(unsigned_number(r, "driver-oom", "before"), 48 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "driver-oom", "after"), 48 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "driver-oom", "held"), 48 * kMi) << r.out;
}

// 8 threads on two devices allocating, freeing and synchronising at once:
// afterwards every device's count equals what it holds, and 0 once freed.
TEST(PoolAccounting, ConcurrentAllocAndFreeOnTwoDevicesIsExact) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "4Gi"}, {"FAKECUDA_DEVICES", "2"}}, {"threads", "3000"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "threads live", "failures"), 0u) << r.out;
  EXPECT_GT(unsigned_number(r, "threads live", "held0"), 0u) << r.out;
  EXPECT_GT(unsigned_number(r, "threads live", "held1"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "threads live", "counted0"), unsigned_number(r, "threads live", "held0")) << r.out;
  EXPECT_EQ(unsigned_number(r, "threads live", "counted1"), unsigned_number(r, "threads live", "held1")) << r.out;
  EXPECT_EQ(unsigned_number(r, "threads freed", "counted0"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "threads freed", "held0"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "threads freed", "counted1"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "threads freed", "held1"), 0u) << r.out;
}

// An allocation above the quota, racing a synchronisation that reconciles
// the same pool, is refused every time: the reconciliation never charges
// (unchecked) for an allocation still on its way to its own reservation.
// Known open defects this race still shows now and then (docs/memory.md,
// "Limits"): the other thread's small allocations may be refused, and the
// pool may stay counted a chunk above what the device holds until its next
// synchronisation; the count is never below it.
TEST(PoolAccounting, OversizeAllocationRacingAReconciliationIsAlwaysRefused) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}}, {"oversize", "200000", "2048"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "oversize", "admitted"), 0u) << r.out;
  EXPECT_GE(unsigned_number(r, "oversize", "counted"), unsigned_number(r, "oversize", "held")) << r.out;
}

// The driver grows a pool by steps of its own choosing (here 32 MiB): a
// growth whose reserve passes the quota or the resident allowance is
// trimmed back, or refused, so the device never holds more than either
// once the call returned; what fits in a pool's reserve is still admitted.
void expect_coarse_growth_held(const Env& env) {
  Sandbox box;
  Env all = env;
  all["FAKECUDA_POOL_GROWTH_BYTES"] = std::to_string(32 * kMi);
  Result r = probe(box, all, {"coarse", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "coarse", "first_held"), 32 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "coarse", "second_rc"), static_cast<unsigned long long>(CUDA_ERROR_OUT_OF_MEMORY))
      << r.out;
  EXPECT_EQ(unsigned_number(r, "coarse", "second_held"), 32 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "coarse", "third_rc"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "coarse", "held"), 32 * kMi) << r.out;
  EXPECT_GE(unsigned_number(r, "coarse", "counted"), unsigned_number(r, "coarse", "held")) << r.out;
}

TEST(PoolAccounting, CoarseDriverGrowthPastTheQuotaIsRefused) {
  expect_coarse_growth_held({{"GPUSLICE_MEMORY_LIMIT", "48Mi"}});
}

TEST(PoolAccounting, CoarseDriverGrowthPastTheResidentAllowanceIsRefused) {
  for (const char* mode : {"fail", "spill", "wait"}) {
    SCOPED_TRACE(mode);
    expect_coarse_growth_held({{"GPUSLICE_MEMORY_LIMIT", "1Gi"},
                               {"GPUSLICE_MEMORY_RESIDENT", "48Mi"},
                               {"GPUSLICE_OVERSUBSCRIBE", mode},
                               {"GPUSLICE_OVERSUBSCRIBE_WAIT", "200ms"}});
  }
}

// The driver grows a pool's reserve for an allocation that fits in what
// gpuslice counts for the pool (its fast path): a pool that reuses freed
// memory only on the freeing stream, 4 MiB freed on stream A, 4 MiB asked on
// stream B (the device then holds 8 MiB). The growth is checked before the
// call returns. With A synchronised (its free observed) a trim of the pool
// gives A's 4 MiB back and the allocation is admitted; without, the trim
// keeps them (cuMemPoolTrimTo: such frees "can count as outstanding") and
// the allocation is freed and refused. Either way the device holds 4 MiB.
void expect_reuse_growth_held(const Env& env, bool sync_a) {
  Sandbox box;
  Result r = probe(box, env, {"reuse", "4", "4", sync_a ? "1" : "0"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "reuse", "freed_held"), 4 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "reuse", "rc"), sync_a ? 0u : static_cast<unsigned long long>(CUDA_ERROR_OUT_OF_MEMORY))
      << r.out;
  EXPECT_EQ(unsigned_number(r, "reuse", "held"), 4 * kMi) << r.out;
  EXPECT_GE(unsigned_number(r, "reuse", "counted"), unsigned_number(r, "reuse", "held")) << r.out;
}

const Env kAllowance = {
    {"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"GPUSLICE_MEMORY_RESIDENT", "6Mi"}, {"GPUSLICE_OVERSUBSCRIBE_WAIT", "200ms"}};

TEST(PoolAccounting, FastPathDriverGrowthPastTheQuotaIsTrimmedThenAdmitted) {
  expect_reuse_growth_held({{"GPUSLICE_MEMORY_LIMIT", "6Mi"}}, true);
}

TEST(PoolAccounting, FastPathDriverGrowthPastTheQuotaIsRefusedWhenATrimKeepsIt) {
  expect_reuse_growth_held({{"GPUSLICE_MEMORY_LIMIT", "6Mi"}}, false);
}

TEST(PoolAccounting, FastPathDriverGrowthPastTheResidentAllowanceIsTrimmedOrRefused) {
  for (const char* mode : {"fail", "spill", "wait"}) {
    for (const bool sync_a : {true, false}) {
      SCOPED_TRACE(std::string(mode) + (sync_a ? ", trimmed" : ", refused"));
      Env env = kAllowance;
      env["GPUSLICE_OVERSUBSCRIBE"] = mode;
      expect_reuse_growth_held(env, sync_a);
    }
  }
}

// The same on the growth path: 4 MiB freed on stream A (synchronised), 6 MiB
// asked on stream B (more than counted: the count grows to 6 MiB first), and
// the driver grows the reserve to 10 MiB. Over the 8 MiB quota, the trim
// gives back A's 4 MiB and the allocation is admitted.
TEST(PoolAccounting, GrowthPastTheQuotaTrimmedBackUnderItIsAdmitted) {
  Sandbox box;
  Result r = probe(box, {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}, {"reuse", "4", "6", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(unsigned_number(r, "reuse", "rc"), 0u) << r.out;
  EXPECT_EQ(unsigned_number(r, "reuse", "held"), 6 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "reuse", "counted"), 6 * kMi) << r.out;
}

}  // namespace
}  // namespace gpuslice::test
