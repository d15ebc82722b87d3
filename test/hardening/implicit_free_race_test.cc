// A free racing the driver's implicit free (issue 32's refusal direction,
// found by the chaos suite's `primary` and `array` classes): one thread frees
// an allocation while another resets the primary context, which frees
// everything the context owned. The free took its record out of the table
// before its driver call, so the sweep after the reset could not see it; the
// driver then refused the free (the memory was gone) and the record went
// back into the table: counted with nothing on the device, until the
// process ended (the container refused allocations while it had room).
// programs/implicit_free_race.cc; the simulator's chaos mode sleeps at the
// free's entry so that the reset lands inside it (a seeded sleep of up to
// 100 ms per round: most rounds are hits).
#include <gtest/gtest.h>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr long long kMi = 1ll << 20;

const Probe race{{"implicit_free_race"}, 120000};

Env race_env(const char* call) {
  return {{"GPUSLICE_MEMORY_LIMIT", "64Mi"},    {"FAKECUDA_CONTEXT_MEMORY", "0"},  {"FAKECUDA_CHAOS_SEED", "32"},
          {"FAKECUDA_CHAOS_CALLS", call},       {"FAKECUDA_CHAOS_YIELD_PCT", "0"}, {"FAKECUDA_CHAOS_SLEEP_PCT", "100"},
          {"FAKECUDA_CHAOS_SLEEP_US", "100000"}};
}

// 10 rounds of 40 MiB under a 64 MiB quota, then 40 MiB more: it fits (the
// device holds nothing). Before: each hit left 40 MiB counted, the last
// allocation was refused and cuMemGetInfo showed them as used.
void expect_nothing_left(const Result& r) {
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_GT(number(r, "race", "hits"), 0) << "no free was refused by the driver: the race was not exercised\n" << r.out;
  EXPECT_EQ(number(r, "after", "big_rc"), 0) << "refused with the device empty\n" << r.out;
  EXPECT_LT(number(r, "after", "used"), 40 * kMi) << "freed memory shown as used\n" << r.out;
}

TEST(ImplicitFreeRace, AFreeTheDriverRefusedAfterAResetLeavesNothingCounted) {
  Sandbox box;
  expect_nothing_left(race(box, race_env("free_common"), {"pointer", "10", "40"}));
}

TEST(ImplicitFreeRace, AnArrayDestroyTheDriverRefusedAfterAResetLeavesNothingCounted) {
  Sandbox box;
  expect_nothing_left(race(box, race_env("cuArrayDestroy"), {"array", "10", "40"}));
}

// A mipmapped array freed by the reset alone (no free racing it): the sweep
// after the reset asks the driver whether each counted mipmapped array is
// still there (cuMipmappedArrayGetLevel). Before: the simulator did not
// model that call (CUDA_ERROR_NOT_SUPPORTED, so never "gone"), and every
// mipmapped array a context took with it stayed counted (the chaos suite's
// 4-5.5 MiB refusals with room). The simulator now answers as the driver does.
TEST(ImplicitFreeRace, AMipmappedArrayAResetFreedIsNoLongerCounted) {
  Sandbox box;
  Result r = race(box, race_env("none"), {"mipmap", "3", "40", "keep"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "after", "big_rc"), 0) << "refused with the device empty\n" << r.out;
  EXPECT_LT(number(r, "after", "used"), 40 * kMi) << "freed memory shown as used\n" << r.out;
}

TEST(ImplicitFreeRace, AMipmappedArrayDestroyTheDriverRefusedAfterAResetLeavesNothingCounted) {
  Sandbox box;
  expect_nothing_left(race(box, race_env("cuMipmappedArrayDestroy"), {"mipmap", "10", "40"}));
}

// A module loaded in the primary context, unloaded by the reset with it
// (no unload call). Before: modules were never swept (the records of
// cuModuleLoad* were released only by cuModuleUnload, which the driver
// refuses once the context took the module with it): counted until the
// process ended (the chaos suite's `module` + `primary` refusals with room).
TEST(ImplicitFreeRace, AModuleAResetUnloadedIsNoLongerCounted) {
  Sandbox box;
  Result r = race(box, merge(race_env("none"), {{"FAKECUDA_MODULE_MEMORY", "1"}}), {"module", "3", "40", "keep"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "after", "big_rc"), 0) << "refused with the device empty\n" << r.out;
  EXPECT_LT(number(r, "after", "used"), 40 * kMi) << "unloaded module shown as used\n" << r.out;
}

// An array made while the primary context is reset (issue 32's chaos
// classes `array` + `primary`, seed 2,001,044: a 16 MiB array counted with
// nothing on the device): the driver made it, and the reset freed it before
// its creation returned and the library recorded its handle, so the sweep
// after the reset did not see it. Before: 40 MiB counted until the process
// ended (a 40 MiB allocation refused with the device empty).
void expect_array_released(const Result& r) {
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::size_t at = r.out.find("round 0 create_rc=0 gone=1 ");
  ASSERT_NE(at, std::string::npos) << "the array was not made, or not freed by the reset: the race was not exercised\n"
                                   << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_NE(line.find("probe_rc=0 "), std::string::npos) << "refused with the device empty\n" << r.out;
  EXPECT_NE(line.find("used=0"), std::string::npos) << "freed memory shown as used\n" << r.out;
}
Env create_env() {
  return {{"GPUSLICE_MEMORY_LIMIT", "64Mi"},
          {"FAKECUDA_CONTEXT_MEMORY", "0"},
          {"FAKECUDA_ARRAY_RETURN_DELAY_US", "400000"}};
}

TEST(ImplicitFreeRace, AnArrayAResetFreedBeforeItsCreationReturnedIsNotCounted) {
  Sandbox box;
  expect_array_released(race(box, create_env(), {"create", "1", "40"}));
}

TEST(ImplicitFreeRace, AMipmappedArrayAResetFreedBeforeItsCreationReturnedIsNotCounted) {
  Sandbox box;
  expect_array_released(race(box, create_env(), {"create", "1", "40", "mipmap"}));
}

// The array form of the stale free below: an array handle a reset freed is
// destroyed by the program while another thread's array, which the driver
// gave that handle, has yet to return from its creation. The driver destroys
// the new array; the library had no record of the handle (the sweep after
// the reset released it), and the new array's record, made after, counted
// 40 MiB with nothing on the device.
TEST(ImplicitFreeRace, AStaleArrayDestroyOfAHandleGivenAgainLeavesNothingCounted) {
  Sandbox box;
  Result r = race(box, create_env(), {"stale-array", "1", "40"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::size_t at = r.out.find("round 0 reused=1 create_rc=0 stale_destroy_rc=0 gone=1 ");
  ASSERT_NE(at, std::string::npos) << "the handle did not come back, or the stale destroy failed: the race was not "
                                      "exercised\n"
                                   << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_NE(line.find("probe_rc=0 "), std::string::npos) << "refused with the device empty\n" << r.out;
  EXPECT_NE(line.find("used=0"), std::string::npos) << "freed memory shown as used\n" << r.out;
}

// A use after a reset (issue 32's `alloc,fill,primary` chaos class): a
// pointer the reset freed is freed again by the program while another
// thread's cuMemAlloc, which got the same address from the driver, has yet
// to record it. The driver frees the other thread's allocation; its record,
// made after, counted 40 MiB with nothing on the device until its owner
// freed it (refusals with room meanwhile). Freeing a freed pointer is the
// program's bug, but the count must stay what the device holds.
TEST(ImplicitFreeRace, AStaleFreeOfAnAddressAllocatedAgainLeavesNothingCounted) {
  Sandbox box;
  Result r = race(box,
                  {{"GPUSLICE_MEMORY_LIMIT", "64Mi"},
                   {"FAKECUDA_CONTEXT_MEMORY", "0"},
                   {"FAKECUDA_ALLOC_RETURN_DELAY_US", "400000"}},
                  {"reuse", "1", "40"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  {
    const std::string line = r.out.substr(r.out.find("round 0 reused="));
    ASSERT_NE(line.find("reused=1 q_rc=0 stale_free_rc=0"), std::string::npos)
        << "the address did not come back, or the stale free failed: the race was not exercised\n"
        << r.out;
    EXPECT_EQ(line.find("probe_rc=0"), line.find("probe_rc=")) << "refused with the device empty\n" << r.out;
    EXPECT_NE(line.find("used=0\n"), std::string::npos) << "freed memory shown as used\n" << r.out;
  }
}

// The same use after a reset, the stale free begun before it: its record
// was taken before the reset (so no sweep saw it), its driver call came
// after the reset ended and the driver gave the address to a new
// allocation, not yet recorded, which it freed. Before: that allocation's
// record counted 40 MiB with nothing on the device.
TEST(ImplicitFreeRace, AStaleFreeBegunBeforeTheResetLeavesNothingCounted) {
  Sandbox box;
  // 100 MiB: the new allocation is admitted while the stale free's 40 MiB are still counted.
  Result r = race(box,
                  merge(race_env("free_common"),
                        {{"GPUSLICE_MEMORY_LIMIT", "100Mi"}, {"FAKECUDA_ALLOC_RETURN_DELAY_US", "150000"}}),
                  {"span", "4", "40"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_GT(number(r, "span", "hits"), 0) << "no stale free freed a new allocation: the race was not exercised\n"
                                          << r.out;
  for (std::size_t at = r.out.find("hit=1"); at != std::string::npos; at = r.out.find("hit=1", at + 1)) {
    const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_NE(line.find("probe_rc=0 "), std::string::npos) << "refused with the device empty\n" << r.out;
    EXPECT_NE(line.find("used=0"), std::string::npos) << "freed memory shown as used\n" << r.out;
  }
}

// A context's allocation at X, freed with the context, while another thread
// allocates from a pool and the driver hands it X again before the sweep
// after the destroy asks about X (programs/pool_address_race.cc). The
// destroyed context's record of X was then kept (X known to the driver
// again), and the program's cuMemFree of its pool allocation at X found that
// record first: it released the stale record and left the pool allocation's
// bytes outstanding, counted above the pool's reserve until the process ended
// (the chaos suite's `pool` + `context` refusals with room: 8-12 MiB beyond
// the slack). A record of one table at an address another table's newer
// allocation holds is stale, as within one table (platform::record).
TEST(ImplicitFreeRace, AContextsRecordAtAnAddressAPoolAllocationTookIsNotCountedTwice) {
  Sandbox box;
  const Probe pool_race{{"pool_address_race"}, 120000};
  Result r = pool_race(
      box,
      merge(race_env("cuMemGetAddressRange_v2"), {{"FAKECUDA_CHAOS_SLEEP_US", "20000"}, {"FAKECUDA_CHAOS_SEED", "7"}}),
      {"8", "10"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_GT(number(r, "race", "hits"), 0) << "no pool allocation got the context's address: not exercised\n" << r.out;
  EXPECT_EQ(number(r, "after", "used"), 0) << "freed memory shown as used\n" << r.out;
  EXPECT_EQ(number(r, "after", "big_rc"), 0) << "refused with the device empty\n" << r.out;
}

// The same with a buffer mapped onto imported graphics memory
// (cuExternalMemoryGetMappedBuffer: an address the driver hands out, no memory
// of its own, which gpuslice records nowhere) taking X. Before: the stale
// record of X stayed counted for as long as the buffer was held (till its
// cuMemFree found it), MIB MiB shown as used that the device did not hold.
TEST(ImplicitFreeRace, AContextsRecordAtAnAddressAMappedBufferTookIsReleased) {
  Sandbox box;
  const Probe pool_race{{"pool_address_race"}, 120000};
  Result r = pool_race(
      box,
      merge(race_env("cuMemGetAddressRange_v2"), {{"FAKECUDA_CHAOS_SLEEP_US", "20000"}, {"FAKECUDA_CHAOS_SEED", "7"}}),
      {"8", "10", "mapped"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_GT(number(r, "race", "hits"), 0) << "no mapped buffer got the context's address: not exercised\n" << r.out;
  for (const std::string& over : values(r, "round", "over")) EXPECT_EQ(over, "0") << r.out;
  EXPECT_EQ(number(r, "after", "used"), 0) << "freed memory shown as used\n" << r.out;
}

}  // namespace
}  // namespace gpuslice::test
