// Issue 36, many GPUs in one process: 8 simulated devices, a context on
// each, peer access enabled between every pair, memory allocated round-robin
// on each (programs/multi_gpu_probe.cc). Each device's quota is different, so
// a count landing on another device shows: every device stops exactly at its
// own quota, and what gpuslice counts there is what the device holds.
#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr unsigned long long kMi = 1ull << 20;

Result probe(const Env& env) { return run({bin("multi_gpu_probe"), "8", "8"}, env, 120000); }

TEST(MultiGpu, EightDevicesWithPeerAccessEachKeepItsOwnQuota) {
  Sandbox box;
  // Device d: (64 + 8 d) MiB.
  std::string limits;
  for (int d = 0; d < 8; ++d) limits += (d ? "," : "") + std::to_string(d) + "=" + std::to_string(64 + 8 * d) + "Mi";
  Env env =
      merge(box.env(), {{"FAKECUDA_DEVICES", "8"}, {"FAKECUDA_MEMORY", "1Gi"}, {"GPUSLICE_MEMORY_LIMIT", limits}});
  Result r = probe(env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "peers", "can"), 56) << r.out;
  EXPECT_EQ(number(r, "peers", "enabled"), 56) << r.out;
  for (int d = 0; d < 8; ++d) {
    const unsigned long long quota = (64 + 8 * d) * kMi;
    const std::string line = "dev d=" + std::to_string(d) + " ";
    const size_t at = r.out.find(line);
    ASSERT_NE(at, std::string::npos) << r.out;
    const std::string rest = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_NE(rest.find(" succeeded=" + std::to_string(quota / (8 * kMi)) + " "), std::string::npos) << rest;
    EXPECT_NE(rest.find(" counted=" + std::to_string(quota) + " "), std::string::npos) << rest;
    EXPECT_NE(rest.find(" total=" + std::to_string(quota) + " "), std::string::npos) << rest;
    EXPECT_NE(rest.find(" held=" + std::to_string(quota)), std::string::npos) << rest;
  }
  EXPECT_EQ(number(r, "peer-copy", "rc"), CUDA_SUCCESS) << r.out;
  EXPECT_EQ(unsigned_number(r, "freed", "held"), 0u) << r.out;
}

// The same program on the simulator alone: the same peers, every device
// filled to its 1 GiB.
TEST(MultiGpu, WithoutGpusliceTheDevicesFillUp) {
  Sandbox box;
  Env env = merge(box.env(false), {{"FAKECUDA_DEVICES", "8"}, {"FAKECUDA_MEMORY", "128Mi"}});
  Result r = probe(env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(number(r, "peers", "enabled"), 56) << r.out;
  EXPECT_NE(r.out.find("dev d=7 succeeded=16 "), std::string::npos) << r.out;
  EXPECT_EQ(unsigned_number(r, "freed", "held"), 0u) << r.out;
}

}  // namespace
}  // namespace gpuslice::test
