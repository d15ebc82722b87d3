// Issue 36, green contexts (CUDA 12.4+, 13): a green context retains its
// device's primary context inside the driver (cuda.h, cuGreenCtxCreate), so
// the context memory that creates must be counted; memory allocated while its
// CUcontext is current is counted on its device; a lookup through
// cuGetProcAddress gets the same wrappers (programs/green_probe.cc).
#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

Env green_env(const Sandbox& box, const char* quota, const Env& extra = {}) {
  return merge(box.env(), merge({{"GPUSLICE_MEMORY_LIMIT", quota},
                                 {"FAKECUDA_DEVICES", "2"},
                                 {"FAKECUDA_MEMORY", "16Gi"},
                                 {"FAKECUDA_CONTEXT_MEMORY", "256Mi"}},
                                extra));
}

Result green(const Env& env, const std::vector<std::string>& args) {
  std::vector<std::string> argv{bin("green_probe")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv, env, 120000);
}

void expect_counted_once(const Result& r) {
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_EQ(number(r, "green", "rc"), CUDA_SUCCESS) << r.out;
  EXPECT_EQ(unsigned_number(r, "created", "held"), 256 * kMi) << "the primary context the driver retained" << r.out;
  EXPECT_EQ(unsigned_number(r, "created", "counted"), 256 * kMi) << r.out;
  EXPECT_EQ(number(r, "alloc", "succeeded"), 12) << "(1 GiB - 256 MiB) / 64 MiB" << r.out;
  EXPECT_EQ(number(r, "alloc", "last_rc"), CUDA_ERROR_OUT_OF_MEMORY) << r.out;
  EXPECT_EQ(unsigned_number(r, "alloc", "held"), 1024 * kMi) << "the device holds no more than the quota" << r.out;
  EXPECT_EQ(unsigned_number(r, "alloc", "counted"), 1024 * kMi) << r.out;
  EXPECT_EQ(number(r, "after-destroy", "rc"), CUDA_SUCCESS) << r.out;
  EXPECT_EQ(unsigned_number(r, "after-destroy", "held"), 256 * kMi) << r.out;
  EXPECT_EQ(unsigned_number(r, "after-destroy", "counted"), 256 * kMi) << "the primary context, once" << r.out;
  EXPECT_EQ(unsigned_number(r, "released", "held"), 0u) << r.out;
}

// On device 1, with no primary context active before: the primary context
// the green context retains is counted, and the quota holds in it.
TEST(GreenContext, ItsPrimaryContextAndAllocationsAreCounted) {
  Sandbox box;
  expect_counted_once(green(green_env(box, "1Gi"), {"memory", "1", "64"}));
}

TEST(GreenContext, ThroughCuGetProcAddressToo) {
  Sandbox box;
  expect_counted_once(green(green_env(box, "1Gi", {{"GREEN_VIA_PROCADDR", "1"}}), {"memory", "1", "64"}));
}

// A quota smaller than the context it would retain: refused, nothing held.
TEST(GreenContext, RefusedWhenItsPrimaryContextDoesNotFit) {
  Sandbox box;
  Result r = green(green_env(box, "128Mi"), {"memory", "1", "64"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "green", "rc"), CUDA_ERROR_OUT_OF_MEMORY) << r.out;
  EXPECT_EQ(unsigned_number(r, "refused", "held"), 0u) << r.out;
}

}  // namespace
}  // namespace gpuslice::test
