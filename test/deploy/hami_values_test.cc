// HAMi's values reach the library as HAMi's components write and accept
// them: a pod that says CUDA_DISABLE_CONTROL=0, CUDA_TASK_PRIORITY=2 or
// LIBCUDA_LOG_LEVEL=5 runs limited (before: every CUDA call of the container
// failed, the values being unknown to gpuslice); a value HAMi gives no meaning
// that gpuslice keeps, for something that does not limit, is one warning.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness.h"

namespace {

using gpuslice::test::field;
using gpuslice::test::Result;
using gpuslice::test::Sandbox;

constexpr unsigned long long kMi = 1024ull * 1024;

// probe(box, env): 300 MiB then 100 MiB, in `box` with `env` over its environment.
const gpuslice::test::Probe probe{
    {"cuprobe", "init", "ctx", "0", "alloc", std::to_string(300 * kMi), "alloc", std::to_string(100 * kMi)}};

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(HamiValues, ThePodsValuesRunLimited) {
  Sandbox box;
  const Result r = probe(box, {{"CUDA_DEVICE_MEMORY_LIMIT_0", "256m"},
                               {"CUDA_DISABLE_CONTROL", "0"},
                               {"CUDA_TASK_PRIORITY", "2"},
                               {"LIBCUDA_LOG_LEVEL", "5"}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(field(gpuslice::test::lines_with(r.out, "init ").at(0), "rc"), "0") << r.describe();
  const auto allocs = gpuslice::test::lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), "2") << r.describe();
  EXPECT_EQ(field(allocs[1], "rc"), "0") << r.describe();
  // LIBCUDA_LOG_LEVEL=5 is HAMi-core's debug: the listing is printed.
  EXPECT_NE(r.err.find("GPUSLICE_PRIORITY=low (CUDA_TASK_PRIORITY, environment)"), std::string::npos) << r.describe();
}

// (The harness cannot pass an empty value; the parser's test covers it.)
TEST(HamiValues, AnUnknownCorePolicyWarnsOnce) {
  Sandbox box;
  const Result r = probe(box, {{"CUDA_DEVICE_MEMORY_LIMIT", "256m"}, {"GPU_CORE_UTILIZATION_POLICY", "sometimes"}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(field(gpuslice::test::lines_with(r.out, "alloc ").at(0), "rc"), "2") << r.describe();
  EXPECT_EQ(count(r.err,
                  "gpuslice: warning: GPU_CORE_UTILIZATION_POLICY='sometimes': unknown value (HAMi knows "
                  "default, force, disable), taken as GPUSLICE_SM_POLICY=elastic"),
            1u)
      << r.describe();
}

}  // namespace
