// Memory quotas through every allocation family and every way of reaching the
// driver: fill to the quota exactly, then CUDA_ERROR_OUT_OF_MEMORY; free and
// refill; the queries report the quota; the simulated device agrees.
#include <gtest/gtest.h>
#include <unistd.h>

#include "probe.h"

using namespace gpuslice::test;

namespace {

struct Family {
  const char* name;  // cuprobe op
  unsigned long long chunk;
};
// Chunks are whole pool/VMM granules (2 MiB) where the driver works in them.
const Family kFamilies[] = {{"alloc", kMi},         {"managed", kMi}, {"pitch", kMi}, {"async", 2 * kMi},
                            {"poolasync", 2 * kMi}, {"vmm", 2 * kMi}, {"array", kMi}};
void PrintTo(const Family& f, std::ostream* os) { *os << f.name; }  // not the struct's bytes
const Path kPaths[] = {Path::direct, Path::per_thread, Path::get_proc_address, Path::get_proc_address_ptsz};

class FamilyPath : public ::testing::TestWithParam<std::tuple<Family, Path>> {};

TEST_P(FamilyPath, FillsQuotaExactlyThenOutOfMemoryAndRefills) {
  const auto [family, path] = GetParam();
  Sandbox box;
  const unsigned long long quota = 64 * kMi;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  const std::string chunk = std::to_string(family.chunk);
  Result r = probe(path, env,
                   {"init", "ctx", "0", "fill", family.name, chunk, "meminfo", "freeall", "sync", "meminfo", "fill",
                    family.name, chunk});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto filled = values(r, "fill", "bytes");
  auto last_rc = values(r, "fill", "rc");
  ASSERT_EQ(filled.size(), 2u) << r.describe();
  EXPECT_EQ(std::stoull(filled[0]), quota) << r.describe();
  EXPECT_EQ(last_rc[0], "2") << "expected CUDA_ERROR_OUT_OF_MEMORY\n" << r.describe();
  EXPECT_EQ(std::stoull(filled[1]), quota) << "memory must come back after free\n" << r.describe();
  auto totals = values(r, "meminfo", "total");
  auto frees = values(r, "meminfo", "free");
  ASSERT_EQ(totals.size(), 2u);
  EXPECT_EQ(std::stoull(totals[0]), quota);
  EXPECT_EQ(std::stoull(frees[0]), 0u);
  EXPECT_EQ(std::stoull(frees[1]), quota);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, FamilyPath,
                         ::testing::Combine(::testing::ValuesIn(kFamilies), ::testing::ValuesIn(kPaths)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" + path_name(std::get<1>(info.param));
                         });

// The same on the realistic simulated device (FAKECUDA_PROFILE=realistic:
// every context holds 512 MiB, modules hold their globals and code): what a
// family can fill plus what the context took is the quota, to the byte, and
// the device never holds more than the quota for the process.
class RealisticFamily : public ::testing::TestWithParam<Family> {};

TEST_P(RealisticFamily, FillsTheQuotaLessTheContextExactly) {
  const Family family = GetParam();
  Sandbox box;
  const unsigned long long quota = 1024 * kMi, context = 512 * kMi;
  Env env = merge(box.env(),
                  {{"GPUSLICE_MEMORY_LIMIT", "1Gi"}, {"FAKECUDA_PROFILE", "realistic"}, {"FAKECUDA_MEMORY", "4Gi"}});
  const std::string chunk = std::to_string(family.chunk);
  Result r = probe(Path::direct, env,
                   {"init", "ctx", "0", "fill", family.name, chunk, "meminfo", "freeall", "sync", "meminfo"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(std::stoull(value(r, "fill", "bytes")), quota - context) << r.describe();
  EXPECT_EQ(value(r, "fill", "rc"), "2") << r.describe();
  auto frees = values(r, "meminfo", "free");
  ASSERT_EQ(frees.size(), 2u) << r.describe();
  EXPECT_EQ(std::stoull(frees[0]), 0u);
  EXPECT_EQ(std::stoull(frees[1]), quota - context) << "the context stays counted, the rest comes back";
}

INSTANTIATE_TEST_SUITE_P(Realistic, RealisticFamily, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(MemoryQuota, DeviceNeverHoldsMoreThanQuotaAsSimulatedDriverCounts) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "32Mi"}});
  const std::string held = box.path("held"), go = box.path("go");
  pid_t pid = spawn(
      {bin("cuprobe"), "init", "ctx", "0", "fill", "alloc", std::to_string(kMi), "touch", held, "waitfile", go}, env);
  for (int i = 0; i < 5000 && access(held.c_str(), F_OK) != 0; ++i) usleep(1000);
  EXPECT_EQ(device_used(box), 32 * kMi);
  run({"/usr/bin/touch", go}, {});
  Result r = wait(pid);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(device_used(box), 0u);
}

TEST(MemoryQuota, CuMemGetInfoAndTotalMemReportTheQuota) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "100Mi"}, {"FAKECUDA_MEMORY", "1Gi"}});
  Result r = probe(Path::get_proc_address, env,
                   {"init", "ctx", "0", "alloc", std::to_string(30 * kMi), "meminfo", "totalmem", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "meminfo", "total"), std::to_string(100 * kMi));
  EXPECT_EQ(value(r, "meminfo", "free"), std::to_string(70 * kMi));
  EXPECT_EQ(value(r, "totalmem", "bytes"), std::to_string(100 * kMi));
}

TEST(MemoryQuota, UnlimitedReportsTheRealCard) {
  Sandbox box;
  Env env = merge(box.env(), {{"FAKECUDA_MEMORY", "1Gi"}});
  Result r = probe(Path::direct, env, {"init", "ctx", "0", "meminfo", "totalmem", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "meminfo", "total"), std::to_string(1024 * kMi));
  EXPECT_EQ(value(r, "totalmem", "bytes"), std::to_string(1024 * kMi));
}

// GPUSLICE_PASSTHROUGH / HAMi's CUDA_DISABLE_CONTROL=true: loaded, limits
// ignored, the real card reported, and no region file created.
TEST(MemoryQuota, PassthroughForwardsEverythingAndSharesNothing) {
  Sandbox box;
  Env env = merge(box.env(),
                  {{"GPUSLICE_MEMORY_LIMIT", "100Mi"}, {"FAKECUDA_MEMORY", "1Gi"}, {"CUDA_DISABLE_CONTROL", "true"}});
  Result r = probe(Path::direct, env, {"init", "ctx", "0", "alloc", std::to_string(300 * kMi), "meminfo"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "alloc", "rc"), "0") << r.out;
  EXPECT_EQ(value(r, "meminfo", "total"), std::to_string(1024 * kMi));
  const std::string region = env.at("GPUSLICE_REGION");
  EXPECT_NE(access(region.c_str(), F_OK), 0) << "passthrough created the region file " << region;
}

TEST(MemoryQuota, NullArgumentsBehaveAsTheDriver) {
  Sandbox box;
  Result native = probe(Path::direct, box.env(false), {"init", "ctx", "0", "meminfo-null"});
  Result wrapped =
      probe(Path::direct, merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}), {"init", "ctx", "0", "meminfo-null"});
  EXPECT_EQ(value(native, "meminfo-null", "rc"), value(wrapped, "meminfo-null", "rc")) << wrapped.describe();
  EXPECT_NE(value(wrapped, "meminfo-null", "rc"), "0");
}

TEST(MemoryQuota, UsageAboveQuotaNeverMakesQueriesFail) {
  // Context memory is charged after the fact and may push usage past a tiny quota.
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "4Mi"}, {"FAKECUDA_CONTEXT_MEMORY", "3Mi"}});
  Result r = probe(Path::direct, env, {"init", "ctx", "0", "alloc", std::to_string(kMi), "meminfo"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "meminfo", "rc"), "0");
  EXPECT_EQ(value(r, "meminfo", "free"), "0");
}

TEST(MemoryQuota, ContextMemoryIsCounted) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}, {"FAKECUDA_CONTEXT_MEMORY", "8Mi"}});
  Result r = probe(Path::direct, env, {"init", "ctx", "0", "fill", "alloc", std::to_string(kMi), "ctxcreate", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "fill", "bytes"), std::to_string(56 * kMi)) << r.describe();
  EXPECT_EQ(value(r, "ctxcreate", "rc"), "2") << "a second context does not fit\n" << r.describe();
}

TEST(MemoryQuota, CreatedContextIsReturnedOnDestroy) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}, {"FAKECUDA_CONTEXT_MEMORY", "8Mi"}});
  Result r = probe(Path::get_proc_address, env,
                   {"init", "ctxcreate", "0", "ctxcreate", "0", "meminfo", "ctxdestroy", "meminfo"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto frees = values(r, "meminfo", "free");
  ASSERT_EQ(frees.size(), 2u) << r.describe();
  EXPECT_EQ(frees[0], std::to_string(48 * kMi));
  EXPECT_EQ(frees[1], std::to_string(56 * kMi));
}

TEST(MemoryQuota, PerDeviceQuotasOnAMultiGpuContainer) {
  Sandbox box;
  Env env = merge(box.env(), {{"FAKECUDA_DEVICES", "2"}, {"GPUSLICE_MEMORY_LIMIT", "0=32Mi,1=16Mi"}});
  Result r = probe(
      Path::direct, env,
      {"init", "ctx", "0", "fill", "alloc", std::to_string(kMi), "ctx", "1", "fill", "alloc", std::to_string(kMi)});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto filled = values(r, "fill", "bytes");
  ASSERT_EQ(filled.size(), 2u);
  EXPECT_EQ(filled[0], std::to_string(32 * kMi));
  EXPECT_EQ(filled[1], std::to_string(16 * kMi));
}

TEST(MemoryQuota, HamiAliasesAndPrecedence) {
  Sandbox box;
  Result alias = probe(Path::direct, merge(box.env(), {{"CUDA_DEVICE_MEMORY_LIMIT", "24m"}}),
                       {"init", "ctx", "0", "fill", "alloc", std::to_string(kMi)});
  EXPECT_EQ(value(alias, "fill", "bytes"), std::to_string(24 * kMi)) << alias.describe();
  Sandbox box2;
  Result both =
      probe(Path::direct, merge(box2.env(), {{"CUDA_DEVICE_MEMORY_LIMIT", "24m"}, {"GPUSLICE_MEMORY_LIMIT", "12Mi"}}),
            {"init", "ctx", "0", "fill", "alloc", std::to_string(kMi)});
  EXPECT_EQ(value(both, "fill", "bytes"), std::to_string(12 * kMi)) << both.describe();
}

TEST(MemoryQuota, MappedVmmMemoryStaysCountedAfterReleaseUntilUnmapped) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "16Mi"}});
  // "vmm N 1" maps the allocation and releases the handle at once (PyTorch/NCCL idiom).
  Result r = probe(Path::get_proc_address, env,
                   {"init", "ctx", "0", "vmm", std::to_string(8 * kMi), "1", "meminfo", "free", "meminfo"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto frees = values(r, "meminfo", "free");
  ASSERT_EQ(frees.size(), 2u);
  EXPECT_EQ(frees[0], std::to_string(8 * kMi)) << "released but still mapped: still held\n" << r.describe();
  EXPECT_EQ(frees[1], std::to_string(16 * kMi)) << r.describe();
}

TEST(MemoryQuota, PoolReserveIsCountedUntilTrimmedAtSync) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "16Mi"}});
  Result r = probe(Path::direct, env,
                   {"init", "ctx", "0", "async", std::to_string(8 * kMi), "free", "meminfo", "streamsync", "meminfo"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto frees = values(r, "meminfo", "free");
  ASSERT_EQ(frees.size(), 2u);
  EXPECT_EQ(frees[0], std::to_string(8 * kMi)) << "the pool keeps the freed memory until a sync\n" << r.describe();
  EXPECT_EQ(frees[1], std::to_string(16 * kMi)) << r.describe();
}

TEST(MemoryQuota, LegacyAbiIsRefusedNotBypassed) {
  for (Path p : {Path::direct, Path::get_proc_address}) {
    Sandbox box;
    Result r = probe(p, merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}),
                     {"init", "ctx", "0", "legacy-alloc", std::to_string(64 * kMi)});
    EXPECT_EQ(value(r, "legacy-alloc", "rc"), "801") << path_name(p) << "\n" << r.describe();
    EXPECT_EQ(device_used(box), 0u);
  }
}

TEST(MemoryQuota, FreeOfAnUncountedPointerIsForwarded) {
  Sandbox box;
  Result native = probe(Path::direct, box.env(false), {"init", "ctx", "0", "freeptr", "4096"});
  Result wrapped = probe(Path::direct, box.env(), {"init", "ctx", "0", "freeptr", "4096"});
  EXPECT_EQ(value(native, "freeptr", "rc"), value(wrapped, "freeptr", "rc")) << wrapped.describe();
}

// With one device the library caches its entry instead of asking the driver
// for the current context on every allocation: an allocation with no context
// is still refused by the driver itself (its own error), and the bytes the
// library reserved for it go back.
TEST(MemoryQuota, AllocationWithoutContextFailsInTheDriverAndHoldsNothing) {
  Sandbox box;
  const std::vector<std::string> script = {
      "init", "ctx", "0",    "alloc", std::to_string(kMi), "ctxnone", "alloc", std::to_string(kMi),
      "ctx",  "0",   "fill", "alloc", std::to_string(kMi)};
  Result native = probe(Path::direct, box.env(false), script);
  Result wrapped = probe(Path::direct, merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}}), script);
  ASSERT_EQ(wrapped.exit_code, 0) << wrapped.describe();
  const auto native_rcs = values(native, "alloc", "rc");
  const auto rcs = values(wrapped, "alloc", "rc");
  ASSERT_EQ(rcs.size(), 2u) << wrapped.describe();
  ASSERT_EQ(native_rcs.size(), 2u) << native.describe();
  EXPECT_EQ(rcs[0], "0") << wrapped.describe();
  EXPECT_NE(rcs[1], "0") << wrapped.describe();
  EXPECT_EQ(rcs[1], native_rcs[1]) << "the driver's own error\n" << wrapped.describe();
  EXPECT_EQ(value(wrapped, "fill", "bytes"), std::to_string(63 * kMi)) << "nothing held for the refused call\n"
                                                                       << wrapped.describe();
}

TEST(MemoryQuota, CleanExitReturnsMemoryAtOnce) {
  Sandbox box;
  Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "16Mi"}});
  Result first = probe(Path::direct, env, {"init", "ctx", "0", "alloc", std::to_string(10 * kMi)});
  ASSERT_EQ(first.exit_code, 0) << first.describe();
  Result second = probe(Path::direct, env, {"init", "ctx", "0", "meminfo"});
  EXPECT_EQ(value(second, "meminfo", "free"), std::to_string(16 * kMi)) << second.describe();
}

}  // namespace
