// Memory the driver takes without an allocation call (contexts, modules,
// libraries placed lazily), measured from NVML: never counted short, whatever
// the process releases meanwhile; placed memory is counted where the driver
// places it (docs/memory.md, "Contexts, modules and libraries").
// Each scenario runs implicit_probe under the preload library.
#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gpuslice::test {
namespace {

constexpr long long kMi = 1ll << 20;

Result probe(const Sandbox& box, const Env& extra, std::vector<std::string> args) {
  args.insert(args.begin(), bin("implicit_probe"));
  return run(args, merge(box.env(), extra), 150000);
}

long long num(const Result& r, const std::string& op, const std::string& key) {
  auto lines = lines_with(r.out, op + " ");
  if (lines.empty()) return -1;
  const std::string v = field(lines.front(), key);
  return v.empty() ? -1 : std::stoll(v);
}

const Env kDevice = {{"GPUSLICE_MEMORY_LIMIT", "2Gi"},
                     {"FAKECUDA_MEMORY", "16Gi"},
                     {"FAKECUDA_CONTEXT_MEMORY", "256Mi"},
                     {"FAKECUDA_MODULE_MEMORY", "1"}};

// A context (or module) measured while another thread of the process releases
// device memory in a way that is not an allocation or a free: the release is
// a counting operation too, so no measurement overlaps it, and the count
// equals what the device holds after every creation. Before, the release
// made the new context look smaller (often 0): the device held up to its
// whole size beyond the count.
struct Case {
  const char* measured;
  const char* kind;
};
class MeasuredWhileReleasing : public ::testing::TestWithParam<Case> {};

TEST_P(MeasuredWhileReleasing, IsNeverCountedShort) {
  Sandbox box;
  Result r = probe(box, kDevice, {"measure-vs-release", GetParam().measured, GetParam().kind, "300"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(num(r, "measure-vs-release", "rounds"), 300) << r.out;
  EXPECT_EQ(num(r, "measure-vs-release", "refused"), 0) << r.out;
  EXPECT_EQ(num(r, "measure-vs-release", "shorts"), 0) << r.out;
  EXPECT_EQ(num(r, "measure-vs-release", "mismatches"), 0) << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Releases, MeasuredWhileReleasing,
    ::testing::Values(Case{"ctx", "ctx-destroy"}, Case{"ctx", "primary-release"}, Case{"ctx", "sync-trim"},
                      Case{"ctx", "pool-trim"}, Case{"ctx", "module-unload"}, Case{"ctx", "library-unload"},
                      Case{"module", "ctx-destroy"}, Case{"module", "sync-trim"}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string name = std::string(info.param.measured) + "_" + info.param.kind;
      for (char& c : name)
        if (c == '-') c = '_';
      return name;
    });

// A library loaded with no context current is placed at its first use: what
// the placement takes is counted then (and released at unload), and a
// placement beyond the quota is refused with CUDA_ERROR_OUT_OF_MEMORY,
// leaving nothing on the device. Before, it was never counted: a 1 GiB global
// left the device 1 GiB over the quota.
class LazyLibrary : public ::testing::TestWithParam<const char*> {};

TEST_P(LazyLibrary, PlacementIsCounted) {
  Sandbox box;
  Result r = probe(box, kDevice, {"lazy-library", "512", GetParam()});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(num(r, "lazy-library", "rc"), 0) << r.out;
  EXPECT_EQ(num(r, "lazy-library", "again_rc"), 0) << r.out;
  EXPECT_GE(num(r, "lazy-library", "placed_held") - num(r, "lazy-library", "loaded_held"), 512 * kMi) << r.out;
  EXPECT_EQ(num(r, "lazy-library", "placed"), num(r, "lazy-library", "placed_held")) << r.out;
  EXPECT_EQ(num(r, "lazy-library", "again"), num(r, "lazy-library", "again_held")) << r.out;
  EXPECT_EQ(num(r, "lazy-library", "unloaded"), num(r, "lazy-library", "unloaded_held")) << r.out;
}

TEST_P(LazyLibrary, PlacementBeyondTheQuotaIsRefused) {
  Sandbox box;
  Result r = probe(box, kDevice, {"lazy-library", "3072", GetParam()});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(num(r, "lazy-library", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_LE(num(r, "lazy-library", "placed_held"), 2048 * kMi) << r.out;
  EXPECT_EQ(num(r, "lazy-library", "placed"), num(r, "lazy-library", "placed_held")) << r.out;
  EXPECT_EQ(num(r, "lazy-library", "unloaded"), num(r, "lazy-library", "unloaded_held")) << r.out;
}

INSTANTIATE_TEST_SUITE_P(FirstUse, LazyLibrary, ::testing::Values("global", "kernel"));

// cuCtxSetLimit makes the driver reserve device memory (a 1 GiB malloc heap):
// counted from the call to the context's destruction; beyond the quota the
// call is refused and the previous limit kept. Before, nothing was counted:
// a 3 GiB heap left the device 1 GiB (and more) over a 2 GiB quota.
TEST(ResourceLimit, MallocHeapIsCountedUntilTheContextGoes) {
  Sandbox box;
  Result r = probe(box, kDevice, {"set-limit", "1024"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(num(r, "set-limit", "rc"), 0) << r.out;
  EXPECT_EQ(num(r, "set-limit", "limit"), 1024 * kMi) << r.out;
  EXPECT_GE(num(r, "set-limit", "set_held") - num(r, "set-limit", "before_held"), 1000 * kMi) << r.out;
  EXPECT_EQ(num(r, "set-limit", "set"), num(r, "set-limit", "set_held")) << r.out;
  EXPECT_EQ(num(r, "set-limit", "destroyed"), num(r, "set-limit", "destroyed_held")) << r.out;
}

TEST(ResourceLimit, MallocHeapBeyondTheQuotaIsRefused) {
  Sandbox box;
  Result r = probe(box, kDevice, {"set-limit", "3072"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(num(r, "set-limit", "rc"), static_cast<long long>(CUDA_ERROR_OUT_OF_MEMORY)) << r.out;
  EXPECT_EQ(num(r, "set-limit", "limit"), 8 * kMi) << r.out;  // the default, kept
  EXPECT_LE(num(r, "set-limit", "set_held"), 2048 * kMi) << r.out;
  EXPECT_EQ(num(r, "set-limit", "set"), num(r, "set-limit", "set_held")) << r.out;
}

}  // namespace
}  // namespace gpuslice::test
