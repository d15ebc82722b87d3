// Issue 9: launch entry points that escaped the limiter, and launch wrappers
// that crashed on a NULL configuration.
//   - cuLaunch, cuLaunchGrid, cuLaunchGridAsync,
//     cuLaunchCooperativeKernelMultiDevice (deprecated, still exported) and
//     cuGraphExecKernelNodeSetParams / cuGraphExecNodeSetParams (they change
//     an instantiated graph's price) must resolve to gpuslice's wrappers
//     through cuGetProcAddress and dlsym.
//   - cuLaunchKernelEx(NULL, ...) returns CUDA_ERROR_INVALID_VALUE (what the
//     driver documents) as a first call, limited or not, and after a
//     fail-closed bootstrap, instead of calling a pointer never loaded.
#include <gtest/gtest.h>

#include "compute_support.h"

using namespace gpuslice::test;
using namespace gpuslice::test::hardening;

namespace {

TEST(LaunchEntryPoints, ResolveToTheWrappers) {
  Sandbox box;
  Result r = run({bin("gpuslice-probe"), "compute", "entry-points"}, merge(box.env(), {{"GPUSLICE_SM_LIMIT", "10"}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const auto lines = lines_with(r.out, "entry ");
  ASSERT_EQ(lines.size(), 14u) << r.describe();
  for (const std::string& line : lines) EXPECT_EQ(field(line, "in"), "libgpuslice.so") << line;
}

class NullLaunchConfig : public ::testing::TestWithParam<const char*> {};

TEST_P(NullLaunchConfig, IsInvalidValueNotACrash) {
  Sandbox box;
  Env env = box.env();
  const std::string setting = GetParam();
  if (setting == "fail-closed")
    env["GPUSLICE_SM_LIMIT"] = "lots";  // a malformed option: bootstrap fails closed
  else if (setting == "limited")
    env["GPUSLICE_SM_LIMIT"] = "10";
  Result r = run({bin("gpuslice-probe"), "compute", "null-config"}, env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const int invalid = 1;  // CUDA_ERROR_INVALID_VALUE
  for (const char* how : {"direct", "direct_ptsz", "multi_device"}) {
    bool seen = false;
    for (const std::string& line : lines_with(r.out, std::string("null ") + how + " ")) {
      seen = true;
      EXPECT_EQ(std::atoi(field(line, "rc").c_str()), invalid) << line;
    }
    EXPECT_TRUE(seen) << how << ": " << r.describe();
  }
  if (setting != "fail-closed") {
    const auto lines = lines_with(r.out, "null procaddr ");
    ASSERT_EQ(lines.size(), 1u) << r.describe();
    EXPECT_EQ(std::atoi(field(lines.front(), "rc").c_str()), invalid) << r.describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Settings, NullLaunchConfig, ::testing::Values("unlimited", "limited", "fail-closed"),
                         [](const auto& info) {
                           const std::string s = info.param;
                           return s == "fail-closed" ? std::string("FailClosedBootstrap")
                                  : s == "limited"   ? std::string("Limited")
                                                     : std::string("Unlimited");
                         });

// The deprecated launches are admitted like cuLaunchKernel, and so are the
// four whose fast path is assembly on x86-64 (launch_fast_x86_64.S): 300
// kernels of 1 ms at 10 % cannot all run in the fraction of a second they
// take to submit.
class LegacyLaunch : public ::testing::TestWithParam<const char*> {};

TEST_P(LegacyLaunch, IsThrottled) {
  Sandbox box;
  Result r = run({bin("gpuslice-probe"), "compute", "legacy-launch", GetParam(), "1000", "300"},
                 merge(box.env(), {{"GPUSLICE_SM_LIMIT", "10"}}), 90000);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  if (unsigned_number(r, "probe", "first_rc", 0) == 801)  // CUDA_ERROR_NOT_SUPPORTED
    GTEST_SKIP() << "the simulated driver does not implement " << GetParam()
                 << " (its weak stub returns CUDA_ERROR_NOT_SUPPORTED); only its interception is checked";
  ASSERT_GT(unsigned_number(r, "probe", "launches", 0), 0u) << r.describe();
  const std::uint64_t wall = unsigned_number(r, "probe", "end_ns", 0) - unsigned_number(r, "probe", "start_ns", 0);
  const std::uint64_t busy = device_busy_ns(box, 0, static_cast<long>(unsigned_number(r, "probe", "pid", 0)));
  EXPECT_LE(static_cast<double>(busy), 0.35 * static_cast<double>(wall) + 100e6) << r.describe();
}

INSTANTIATE_TEST_SUITE_P(EntryPoints, LegacyLaunch,
                         ::testing::Values("cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync",
                                           "cuLaunchCooperativeKernelMultiDevice", "cuLaunchKernel",
                                           "cuLaunchKernel_ptsz", "cuLaunchCooperativeKernel",
                                           "cuLaunchCooperativeKernel_ptsz"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
