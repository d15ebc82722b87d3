// Per-process visible devices (issue 36). A container with two simulated GPUs
// and GPUSLICE_MEMORY_LIMIT=0=32Mi,1=16Mi: the ordinals are the container's
// (as its runtime exposed the GPUs, before a process's own
// CUDA_VISIBLE_DEVICES), so physical GPU 1 has 16 MiB in every process, under
// whatever ordinal a worker sees it, and its count is its own.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>

#include "harness.h"

using namespace gpuslice::test;

namespace {

constexpr unsigned long long kMi = 1ull << 20;

// visible_probe ORDINAL HOLD in `box`, its CUDA_VISIBLE_DEVICES `visible`
// ("" = unset), the container's limits per container ordinal.
Result worker(const Sandbox& box, const std::string& visible, int ordinal, unsigned long long hold,
              bool preload = true) {
  Env env = merge(
      box.env(preload),
      {{"FAKECUDA_DEVICES", "2"}, {"GPUSLICE_MEMORY_LIMIT", "0=32Mi,1=16Mi"}, {"GPUSLICE_SM_LIMIT", "0=30,1=50"}});
  if (!visible.empty()) env["CUDA_VISIBLE_DEVICES"] = visible;
  return run({bin("visible_probe"), std::to_string(ordinal), std::to_string(hold)}, env);
}

// NVML's line for physical GPU `index` (NVML ignores CUDA_VISIBLE_DEVICES).
std::string nvml(const Result& r, unsigned index, const std::string& key) { return value(r, "nvml", key, index); }

// The region's entry of GPU `uuid` as gpuslice-smi --json shows it (null if none).
nlohmann::json region_device(const Sandbox& box, const std::string& uuid) {
  Result smi = run({bin("gpuslice-smi"), "--region", box.env().at("GPUSLICE_REGION"), "--json"}, {});
  EXPECT_EQ(smi.exit_code, 0) << smi.describe();
  nlohmann::json doc = nlohmann::json::parse(smi.out, nullptr, false);
  if (doc.is_discarded() || !doc.contains("regions") || doc["regions"].empty()) return nullptr;
  for (const auto& d : doc["regions"][0]["devices"])
    if (d.value("uuid", "") == uuid) return d;
  return nullptr;
}

}  // namespace

// The simulator alone: CUDA_VISIBLE_DEVICES as the driver parses it at cuInit.
TEST(VisibleDevices, SimulatorEnumeratesAsDocumented) {
  Sandbox box;
  Result all = worker(box, "", 0, 0, false);
  ASSERT_EQ(all.exit_code, 0) << all.describe();
  ASSERT_EQ(value(all, "count", "n"), "2") << all.describe();
  const std::string gpu0 = value(all, "uuid", "uuid", 0), gpu1 = value(all, "uuid", "uuid", 1);
  ASSERT_NE(gpu0, gpu1);
  struct Case {
    std::string visible;
    std::string count;
    std::string first;  // ordinal 0's UUID
  } cases[] = {
      {"1", "1", gpu1},      {"1,0", "2", gpu1},
      {gpu1, "1", gpu1},     {gpu1.substr(0, 12), "1", gpu1},         // a unique prefix
      {"0,7,1", "1", gpu0},                                           // the first invalid entry ends the list
      {"0,-1,1", "1", gpu0}, {"1,MIG-" + gpu1.substr(4), "1", gpu1},  // no MIG instance is modelled
  };
  for (const Case& c : cases) {
    Result r = worker(box, c.visible, 0, 0, false);
    EXPECT_EQ(value(r, "count", "n"), c.count) << c.visible << "\n" << r.describe();
    EXPECT_EQ(value(r, "uuid", "uuid"), c.first) << c.visible << "\n" << r.describe();
  }
  Result none = worker(box, "7", 0, 0, false);
  EXPECT_EQ(value(none, "init", "rc"), "100") << "CUDA_ERROR_NO_DEVICE\n" << none.describe();
}

// B sees only physical GPU 1 (as its ordinal 0) and runs first; then A sees
// both. B is held to GPU 1's 16 MiB; its 8 MiB land on GPU 1; A finds
// GPU 1's limit, not GPU 0's.
TEST(VisibleDevices, IndexFormGetsThePhysicalGpusLimitAndCount) {
  Sandbox box;
  Result b = worker(box, "1", 0, 8 * kMi);
  ASSERT_EQ(b.exit_code, 0) << b.describe();
  EXPECT_EQ(value(b, "hold", "rc"), "0") << b.describe();
  EXPECT_EQ(value(b, "fill", "bytes"), std::to_string(8 * kMi)) << "held to GPU 1's 16 MiB\n" << b.describe();
  EXPECT_EQ(nvml(b, 1, "total"), std::to_string(16 * kMi)) << b.describe();
  EXPECT_EQ(nvml(b, 1, "used"), std::to_string(8 * kMi)) << b.describe();
  EXPECT_EQ(nvml(b, 0, "total"), std::to_string(32 * kMi)) << "GPU 0 keeps its own quota\n" << b.describe();
  EXPECT_EQ(nvml(b, 0, "used"), "0") << b.describe();
  Result a1 = worker(box, "", 1, 0);
  EXPECT_EQ(value(a1, "fill", "bytes"), std::to_string(16 * kMi)) << a1.describe();
  Result a0 = worker(box, "", 0, 0);
  EXPECT_EQ(value(a0, "fill", "bytes"), std::to_string(32 * kMi)) << a0.describe();
  EXPECT_EQ(nvml(a0, 1, "total"), std::to_string(16 * kMi)) << a0.describe();
  EXPECT_EQ(nvml(a0, 0, "total"), std::to_string(32 * kMi)) << a0.describe();
}

// Reordered ("1,0": ordinal 0 is GPU 1, ordinal 1 is GPU 0) and the UUID form.
TEST(VisibleDevices, ReorderedAndUuidFormsGetThePhysicalGpusLimit) {
  Sandbox box;
  Result a = worker(box, "", 0, 0, false);
  const std::string gpu1 = value(a, "uuid", "uuid", 1);
  ASSERT_FALSE(gpu1.empty()) << a.describe();
  Result swapped0 = worker(box, "1,0", 0, 0);
  EXPECT_EQ(value(swapped0, "fill", "bytes"), std::to_string(16 * kMi)) << swapped0.describe();
  Result swapped1 = worker(box, "1,0", 1, 0);
  EXPECT_EQ(value(swapped1, "fill", "bytes"), std::to_string(32 * kMi)) << swapped1.describe();
  Result c = worker(box, gpu1, 0, 4 * kMi);
  EXPECT_EQ(value(c, "fill", "bytes"), std::to_string(12 * kMi)) << c.describe();
  EXPECT_EQ(nvml(c, 1, "used"), std::to_string(4 * kMi)) << c.describe();
  EXPECT_EQ(nvml(c, 1, "total"), std::to_string(16 * kMi)) << c.describe();
  Result prefix = worker(box, gpu1.substr(0, 12), 0, 0);
  EXPECT_EQ(value(prefix, "fill", "bytes"), std::to_string(16 * kMi)) << prefix.describe();
}

// The region (gpuslice-smi) after a worker that sees only GPU 1: GPU 1's entry
// has GPU 1's quota and SM limit and took the worker's bytes (its peak);
// GPU 0's entry (claimed by the worker's NVML query) has GPU 0's and none.
TEST(VisibleDevices, RegionGivesEachGpuItsOwnLimitsAndCount) {
  Sandbox box;
  Result a = worker(box, "", 0, 0, false);
  const std::string gpu0 = value(a, "uuid", "uuid", 0), gpu1 = value(a, "uuid", "uuid", 1);
  Result b = worker(box, "1", 0, 8 * kMi);
  ASSERT_EQ(b.exit_code, 0) << b.describe();
  nlohmann::json d1 = region_device(box, gpu1), d0 = region_device(box, gpu0);
  ASSERT_TRUE(d1.is_object()) << b.describe();
  EXPECT_EQ(d1["memory"]["quota_bytes"], 16 * kMi) << d1.dump();
  EXPECT_EQ(d1["compute"]["sm_limit_pct"], 50) << d1.dump();
  EXPECT_EQ(d1["memory"]["peak_bytes"], 16 * kMi) << d1.dump();
  ASSERT_TRUE(d0.is_object()) << b.describe();
  EXPECT_EQ(d0["memory"]["quota_bytes"], 32 * kMi) << d0.dump();
  EXPECT_EQ(d0["compute"]["sm_limit_pct"], 30) << d0.dump();
  EXPECT_EQ(d0["memory"]["peak_bytes"], 0) << d0.dump();
}
