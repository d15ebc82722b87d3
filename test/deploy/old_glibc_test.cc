// The preload library under an older glibc than the build machine's: Debian
// bullseye's 2.31 (the glibc of Ubuntu 20.04-era CUDA images), in a root made
// by bullseye_rootfs.sh and entered by in_root.sh (chroot in an overlay: the
// cached root is never written). The probe is the root's own python3 (built
// against 2.31) driving the simulated driver through ctypes.
//
// Before the glibc floor (docs/deploy.md), nothing here started: the library
// needed GLIBC_2.35 and libstdc++, and ld.so refused every program it was
// preloaded into ("version `GLIBC_2.35' not found").
//
// Exits 77 (skipped) where the root cannot be made or entered: not root, no
// debootstrap, no network, no overlayfs; it says which.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "harness.h"

namespace {

using gpuslice::test::field;
using gpuslice::test::Result;
using gpuslice::test::Sandbox;

std::string g_root;

constexpr unsigned long long kMi = 1024ull * 1024;
const std::string kOver = std::to_string(300 * kMi);   // above the 256 MiB quota
const std::string kUnder = std::to_string(100 * kMi);  // within it

std::string script(const std::string& name) { return std::string(GPUSLICE_DEPLOY_TEST_DIR) + "/" + name; }

// Runs `command` in the root in `mode` (none | ld_preload | ld_so_preload)
// with the given extra variables; a fresh simulated machine and region each time.
// `conf`: a file to install as the root's /etc/gpuslice/gpuslice.conf; with
// `bare`, the command gets no variable at all (the driver is where a real one
// is, the region and the simulated machine at their defaults).
Result in_root(const Sandbox& box, const std::string& mode, std::vector<std::string> vars,
               const std::vector<std::string>& command, const std::string& conf = "", bool bare = false) {
  std::vector<std::string> argv = {script("in_root.sh"), g_root, box.path("scratch-" + mode),
                                   gpuslice::test::build_dir(), mode};
  if (!bare) {
    vars.push_back("FAKECUDA_STATE=/tmp/fakecuda.state");
    vars.push_back("GPUSLICE_REGION=/tmp/gpuslice.region");
    vars.push_back("GPUSLICE_PRIORITY_BOARD=/tmp/priority-board");
  }
  argv.insert(argv.end(), vars.begin(), vars.end());
  argv.push_back("--");
  argv.insert(argv.end(), command.begin(), command.end());
  return gpuslice::test::run(argv, {{"IN_ROOT_CONF", conf}, {"IN_ROOT_BARE", bare ? "1" : "0"}}, 120000);
}

// The value of `key` in the probe's key=value output, or "" if absent.
std::string value(const Result& r, const std::string& key) {
  for (const auto& line : gpuslice::test::lines_with(r.out, key + "=")) return field(line, key);
  return "";
}

std::vector<std::string> probe() { return {"/usr/bin/python3", "/opt/gpuslice/quota_probe.py", kOver, kUnder}; }

void expect_enforced(const Result& r) {
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "glibc"), "2.31") << r.describe();
  EXPECT_EQ(value(r, "preloaded"), "1") << r.describe();
  EXPECT_EQ(value(r, "cuInit"), "0") << r.describe();
  EXPECT_EQ(value(r, "cuCtxCreate"), "0") << r.describe();
  // The quota is what the program sees as the device's memory.
  EXPECT_EQ(value(r, "total"), std::to_string(256 * kMi)) << r.describe();
  EXPECT_EQ(value(r, "alloc_" + kOver), "2") << "over the quota: CUDA_ERROR_OUT_OF_MEMORY\n" << r.describe();
  EXPECT_EQ(value(r, "alloc_" + kUnder), "0") << "within the quota: admitted\n" << r.describe();
}

TEST(OldGlibc, LdPreloadLoadsAndEnforcesTheQuota) {
  Sandbox box;
  expect_enforced(in_root(box, "ld_preload", {"GPUSLICE_MEMORY_LIMIT=256Mi"}, probe()));
}

TEST(OldGlibc, LdSoPreloadLoadsIntoEveryProgramAndEnforces) {
  Sandbox box;
  // A program that has nothing to do with CUDA starts as usual...
  const Result shell = in_root(box, "ld_so_preload", {}, {"/bin/sh", "-c", "echo started"});
  EXPECT_EQ(shell.exit_code, 0) << shell.describe();
  EXPECT_EQ(shell.out, "started\n") << shell.describe();
  EXPECT_EQ(shell.err.find("not found"), std::string::npos) << shell.describe();
  // ...and a CUDA program is limited.
  expect_enforced(in_root(box, "ld_so_preload", {"GPUSLICE_MEMORY_LIMIT=256Mi"}, probe()));
}

// The real case of a process that clears its environment: /etc/ld.so.preload
// injects the library, no variable at all is set, and the library reads the
// container's limits from its default configuration file.
TEST(OldGlibc, TheDefaultConfigurationFileLimitsAProcessWithNoVariableAtAll) {
  Sandbox box;
  const std::string conf = box.path("gpuslice.conf");
  {
    std::FILE* f = std::fopen(conf.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("# the container's limits, as gpuslice-cdi mounts them\nGPUSLICE_MEMORY_LIMIT=256Mi\n", f);
    std::fclose(f);
  }
  expect_enforced(in_root(box, "ld_so_preload", {}, probe(), conf, true));
  // Without the file the same process runs unlimited.
  Sandbox other;
  const Result r = in_root(other, "ld_so_preload", {}, probe(), "", true);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "preloaded"), "1") << r.describe();
  EXPECT_EQ(value(r, "alloc_" + kOver), "0") << r.describe();
}

// The refusal above is the library's: without it the simulated device admits
// the same allocation.
TEST(OldGlibc, WithoutTheLibraryTheDeviceAdmitsIt) {
  Sandbox box;
  const Result r = in_root(box, "none", {"GPUSLICE_MEMORY_LIMIT=256Mi"}, probe());
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "preloaded"), "0") << r.describe();
  EXPECT_EQ(value(r, "alloc_" + kOver), "0") << r.describe();
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const Result made = gpuslice::test::run({script("bullseye_rootfs.sh"), GPUSLICE_BULLSEYE_ROOT}, {}, 900000);
  if (made.exit_code == 77 || made.timed_out) {
    std::fprintf(stderr, "SKIPPED: no bullseye root (glibc 2.31) to run in:\n%s", made.err.c_str());
    return 77;
  }
  if (made.exit_code != 0) {
    std::fprintf(stderr, "bullseye_rootfs.sh failed:\n%s\n", made.describe().c_str());
    return 1;
  }
  g_root = GPUSLICE_BULLSEYE_ROOT;
  // Where the root exists but cannot be entered (no mount namespace or
  // overlayfs here), in_root.sh exits 77: skip the whole test, saying so.
  {
    Sandbox box;
    const Result probe_entry = in_root(box, "none", {}, {"/bin/true"});
    if (probe_entry.exit_code == 77) {
      std::fprintf(stderr, "SKIPPED: the bullseye root cannot be entered:\n%s", probe_entry.err.c_str());
      return 77;
    }
  }
  return RUN_ALL_TESTS();
}
