// Every limit reached, and answered clearly (issue 35): never a silent
// miscount, never a quota lost. Each test drives a program of the container
// (programs/limits_probe.cc) to the limit and checks the error, the count
// and what the region shows the agent. docs/scale.md lists the limits.
#include <gtest/gtest.h>

#include <string>

#include "gpuslice/region.h"
#include "harness.h"
#include "shm/region_file.h"

using namespace gpuslice;
using namespace gpuslice::test;

namespace {

// What the agent reads of the region: the sum over published devices of a field.
template <class F>
unsigned long long region_sum(const std::string& path, F&& field) {
  shm::Error err{};
  Region* r = shm::attach_existing(path.c_str(), false, &err);
  if (r == nullptr) return ~0ull;
  unsigned long long sum = 0;
  for (const DeviceState& d : r->devices) {
    if (d.uuid_state.load() == shm::kDevicePublished) sum += field(d);
  }
  shm::detach(r);
  return sum;
}

// The process's pointer table (include/platform/pointer_table.h) cannot grow
// once its address space is exhausted (RLIMIT_AS here, with the driver's own
// bookkeeping served from heap it already has): allocations are then refused
// (CUDA_ERROR_OUT_OF_MEMORY, a warning naming the cause) before the driver
// makes them, never admitted unrecorded — a record is what lets a free
// release its bytes. Once the records have room again, allocations resume.
TEST(Limits, PointerTableThatCannotGrowRefusesInsteadOfLosingQuota) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's allocator maps memory of its own: under RLIMIT_AS the driver's heap fails first";
#endif
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "60Gi"}, {"FAKECUDA_MEMORY", "64Gi"}});
  Result r = run({bin("limits_probe"), "table", "1024", "4096", "600000"}, env, 240000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "table", "rc"), "2") << "refused with CUDA_ERROR_OUT_OF_MEMORY\n" << r.describe();
  EXPECT_GT(number(r, "table", "admitted"), 1000) << r.describe();
  EXPECT_EQ(value(r, "table", "free_after"), value(r, "table", "free_before"))
      << "every admitted allocation was freed: the container's count is back where it was\n"
      << r.describe();
  EXPECT_NE(r.err.find("allocation records cannot grow"), std::string::npos) << r.describe();
  EXPECT_EQ(value(r, "again", "rc"), "0") << r.describe();
  EXPECT_GE(region_sum(box.path("container.region"), [](const DeviceState& d) { return d.record_refusals.load(); }),
            1ull)
      << "the refusal is counted where the agent reads it";
}

// 1,024 processes per container (kMaxSlots): the next one, with every slot
// held by a live process, fails cuInit with CUDA_ERROR_NOT_INITIALIZED and
// says why; the region shows the agent 1,024 live processes. The slots are
// planted here under this test's own identity (alive) to keep it cheap.
TEST(Limits, ProcessPastTheSlotsOfItsContainerFailsClosedSayingWhy) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}});
  Result first = run({bin("limits_probe"), "init"}, env);  // creates the region
  ASSERT_EQ(value(first, "init", "rc"), "0") << first.describe();
  shm::ProcessIdentity self{};
  ASSERT_TRUE(shm::read_identity(0, &self));
  shm::Error err{};
  Region* region = shm::attach_existing(box.path("container.region").c_str(), true, &err);
  ASSERT_NE(region, nullptr) << err.message;
  int planted = 0;
  while (shm::claim_slot(region, self) >= 0) ++planted;
  EXPECT_EQ(planted, static_cast<int>(kMaxSlots));
  Result r = run({bin("limits_probe"), "init"}, env);
  const unsigned live = region->header.live_slots.load();
  shm::detach(region);
  EXPECT_EQ(value(r, "init", "rc"), "3") << "CUDA_ERROR_NOT_INITIALIZED\n" << r.describe();
  EXPECT_NE(r.err.find("all 1024 process slots are held by live processes"), std::string::npos) << r.describe();
  EXPECT_EQ(live, kMaxSlots) << "gpuslice_container_processes shows the container full";
}

// 16 devices per container (kMaxDevices, one entry per GPU UUID, kept for the
// region's life): a process on a 17th device is refused its allocations
// (CUDA_ERROR_OUT_OF_MEMORY) with a warning naming the limit, never admitted
// uncounted. Each simulated machine (state file) has GPUs of its own UUIDs.
TEST(Limits, SeventeenthDeviceOfAContainerIsRefusedSayingWhy) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}});
  for (unsigned i = 0; i < kMaxDevices; ++i) {
    Result r = run({bin("limits_probe"), "alloc", "1048576"},
                   merge(env, {{"FAKECUDA_STATE", box.path("machine" + std::to_string(i))}}));
    ASSERT_EQ(value(r, "alloc", "rc"), "0") << "device " << i << "\n" << r.describe();
  }
  Result r = run({bin("limits_probe"), "alloc", "1048576"}, merge(env, {{"FAKECUDA_STATE", box.path("machine16")}}));
  EXPECT_EQ(value(r, "alloc", "rc"), "2") << r.describe();
  EXPECT_NE(r.err.find("all 16 device entries are taken"), std::string::npos) << r.describe();
  EXPECT_EQ(region_sum(box.path("container.region"), [](const DeviceState&) { return 1ull; }), kMaxDevices);
}

// 4,096 graph executables priced per process (limiter::GraphCostTable): one
// instantiated past it runs, priced as one kernel's prior (the controller's
// true-up charges what it measures), and the process says so once.
TEST(Limits, GraphExecutablesPastThePriceTableAreSaidOnce) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_SM_LIMIT", "50"}});
  Result few = run({bin("limits_probe"), "graphs", "1000"}, env);
  Result many = run({bin("limits_probe"), "graphs", "4200"}, env);
  EXPECT_EQ(value(few, "graphs", "made"), "1000") << few.describe();
  EXPECT_EQ(few.err.find("graph price table is full"), std::string::npos) << few.describe();
  EXPECT_EQ(value(many, "graphs", "made"), "4200") << many.describe();
  EXPECT_EQ(value(many, "graphs", "launch_rc"), "0") << many.describe();
  const std::string::size_type at = many.err.find("graph price table is full (4096 executables)");
  EXPECT_NE(at, std::string::npos) << many.describe();
  EXPECT_EQ(many.err.find("graph price table is full", at + 1), std::string::npos) << "said once\n" << many.describe();
}

}  // namespace
