// tools/common/child_env: what a child started by a tool or a test inherits.
#include "child_env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>

using gpuslice::tools::child_environment;
using gpuslice::tools::ChildEnvRules;
using gpuslice::tools::envp_of;
using gpuslice::tools::inherited;

namespace {

bool has(const std::vector<std::string>& env, const std::string& entry) {
  return std::find(env.begin(), env.end(), entry) != env.end();
}
bool names(const std::vector<std::string>& env, const std::string& name) {
  return std::any_of(env.begin(), env.end(), [&](const std::string& e) { return e.rfind(name + "=", 0) == 0; });
}

class ChildEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& [k, v] : kVars) setenv(k, v, 1);
  }
  void TearDown() override {
    for (const auto& [k, v] : kVars) unsetenv(k);
  }
  static constexpr std::pair<const char*, const char*> kVars[] = {
      {"LD_PRELOAD", "/x/libgpuslice.so"},  {"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"GPUSLICE_LOG_LEVEL", "debug"},
      {"CUDA_DEVICE_MEMORY_LIMIT_0", "2g"}, {"CUDA_DEVICE_SM_LIMIT", "30"},   {"FAKECUDA_STATE", "/tmp/dev"},
      {"FAKECUDA_PROFILE", "realistic"},    {"LD_LIBRARY_PATH", "/opt/lib"},  {"CHILD_ENV_TEST_KEEP", "yes"},
  };
};

}  // namespace

TEST_F(ChildEnv, TestsGetNothingOfGpusliceOrTheSimulatedDriver) {
  const auto env = child_environment({}, ChildEnvRules{});
  for (const char* dropped : {"LD_PRELOAD", "GPUSLICE_MEMORY_LIMIT", "GPUSLICE_LOG_LEVEL", "CUDA_DEVICE_MEMORY_LIMIT_0",
                              "CUDA_DEVICE_SM_LIMIT", "FAKECUDA_STATE", "FAKECUDA_PROFILE"})
    EXPECT_FALSE(names(env, dropped)) << dropped;
  EXPECT_TRUE(has(env, "LD_LIBRARY_PATH=/opt/lib"));
  EXPECT_TRUE(has(env, "CHILD_ENV_TEST_KEEP=yes"));
  EXPECT_TRUE(std::is_sorted(env.begin(), env.end()));
}

TEST_F(ChildEnv, BenchmarksKeepTheLogLevelAndProfileButNotTheLibraryPath) {
  ChildEnvRules rules;
  rules.keep_log_level = true;
  rules.keep_library_path = false;
  rules.keep_fakecuda_profile = true;
  const auto env = child_environment({}, rules);
  EXPECT_TRUE(has(env, "GPUSLICE_LOG_LEVEL=debug"));
  EXPECT_TRUE(has(env, "FAKECUDA_PROFILE=realistic"));
  EXPECT_FALSE(names(env, "FAKECUDA_STATE")) << "each run has its own simulated device";
  EXPECT_FALSE(names(env, "GPUSLICE_MEMORY_LIMIT"));
  EXPECT_FALSE(names(env, "LD_LIBRARY_PATH"));
  EXPECT_FALSE(names(env, "LD_PRELOAD"));
}

TEST_F(ChildEnv, TheCallersVariablesWinAndAnEmptyValueUnsets) {
  const auto env = child_environment(
      {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}, {"LD_LIBRARY_PATH", "/fake"}, {"CHILD_ENV_TEST_KEEP", ""}}, ChildEnvRules{});
  EXPECT_TRUE(has(env, "GPUSLICE_MEMORY_LIMIT=64Mi"));
  EXPECT_TRUE(has(env, "LD_LIBRARY_PATH=/fake"));
  EXPECT_FALSE(has(env, "LD_LIBRARY_PATH=/opt/lib"));
  EXPECT_FALSE(names(env, "CHILD_ENV_TEST_KEEP"));
}

TEST(ChildEnvRules, Names) {
  const ChildEnvRules tests;
  EXPECT_FALSE(inherited("GPUSLICE_", tests));
  EXPECT_TRUE(inherited("GPUSLICEX", tests));  // a prefix, not a substring
  EXPECT_TRUE(inherited("PATH", tests));
  EXPECT_TRUE(inherited("CUDA_VISIBLE_DEVICES", tests));  // not a gpuslice or HAMi variable
}

TEST(ChildEnvRules, EnvpEndsWithNull) {
  std::vector<std::string> entries{"A=1", "B=2"};
  const auto envp = envp_of(entries);
  ASSERT_EQ(envp.size(), 3u);
  EXPECT_STREQ(envp[0], "A=1");
  EXPECT_EQ(envp[2], nullptr);
}
