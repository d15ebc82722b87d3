// A process that clears its environment stays limited: the preload library
// reads the container's configuration file for every option the environment
// does not set (docs/deploy.md, "Configuration file"). Each process here
// starts through `env -i` with nothing but the preload, the simulated
// driver's location and state, and (where the test says) GPUSLICE_CONFIG_FILE;
// the default path /etc/gpuslice/gpuslice.conf with no variable at all is
// covered in the bullseye root (old_glibc_test.cc), where it can be written.
//
// Before the configuration file, such a process ran unlimited: 300 MiB
// admitted against a 256 MiB quota.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "harness.h"

namespace {

using gpuslice::test::field;
using gpuslice::test::Result;
using gpuslice::test::Sandbox;
using gpuslice::test::value;

constexpr unsigned long long kMi = 1024ull * 1024;

// `cuprobe args...` started by `env -i` with only the variables named here.
Result cleared(const Sandbox& box, const std::vector<std::string>& vars, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/usr/bin/env", "-i", "LD_PRELOAD=" + gpuslice::test::preload_library(),
                                   "LD_LIBRARY_PATH=" + gpuslice::test::fakecuda_dir(),
                                   "FAKECUDA_STATE=" + box.path("fakecuda.state")};
  argv.insert(argv.end(), vars.begin(), vars.end());
  argv.push_back(gpuslice::test::bin("cuprobe"));
  argv.insert(argv.end(), args.begin(), args.end());
  return gpuslice::test::run(argv, {});
}

std::string write(const Sandbox& box, const std::string& name, const std::string& text) {
  const std::string path = box.path(name);
  std::ofstream(path) << text;
  return path;
}

const std::vector<std::string> kProbe = {
    "init", "ctx", "0", "meminfo", "alloc", std::to_string(300 * kMi), "alloc", std::to_string(100 * kMi)};

std::string limits(const Sandbox& box) {
  return "# the container's limits\n"
         "GPUSLICE_MEMORY_LIMIT=256Mi\n"
         "GPUSLICE_REGION=" +
         box.path("container.region") +
         "\n"
         "GPUSLICE_PRIORITY_BOARD=" +
         box.path("board") + "\n";
}

TEST(ConfigFile, AProcessWithAClearedEnvironmentIsLimited) {
  Sandbox box;
  const std::string conf = write(box, "gpuslice.conf", limits(box));
  const Result r = cleared(box, {"GPUSLICE_CONFIG_FILE=" + conf}, kProbe);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "meminfo", "total"), std::to_string(256 * kMi)) << r.describe();
  // The first "alloc" line is the 300 MiB one.
  const auto allocs = gpuslice::test::lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), "2") << "300 MiB over a 256 MiB quota: CUDA_ERROR_OUT_OF_MEMORY\n" << r.describe();
  EXPECT_EQ(field(allocs[1], "rc"), "0") << r.describe();
}

// The environment wins option by option: a process that keeps its own
// variables gets them, and the file fills in the rest.
TEST(ConfigFile, TheEnvironmentWinsOptionByOption) {
  Sandbox box;
  const std::string conf = write(box, "gpuslice.conf", limits(box));
  const Result r = cleared(box, {"GPUSLICE_CONFIG_FILE=" + conf, "GPUSLICE_MEMORY_LIMIT=512Mi"}, kProbe);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "meminfo", "total"), std::to_string(512 * kMi)) << r.describe();
  const auto allocs = gpuslice::test::lines_with(r.out, "alloc ");
  ASSERT_EQ(allocs.size(), 2u) << r.describe();
  EXPECT_EQ(field(allocs[0], "rc"), "0") << r.describe();
}

TEST(ConfigFile, DebugSaysWhereEachValueCameFrom) {
  Sandbox box;
  const std::string conf = write(box, "gpuslice.conf", limits(box));
  const Result r = cleared(box, {"GPUSLICE_CONFIG_FILE=" + conf, "GPUSLICE_LOG_LEVEL=debug"}, {"init"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_NE(r.err.find("GPUSLICE_MEMORY_LIMIT[0]=256Mi (268435456 bytes) (GPUSLICE_MEMORY_LIMIT, " + conf + ":2)"),
            std::string::npos)
      << r.describe();
  EXPECT_NE(r.err.find("GPUSLICE_LOG_LEVEL=debug (GPUSLICE_LOG_LEVEL, environment)"), std::string::npos)
      << r.describe();
  EXPECT_NE(r.err.find("configuration file " + conf + ": read"), std::string::npos) << r.describe();
}

// A malformed file fails closed like a malformed quota: every CUDA call
// returns CUDA_ERROR_NOT_INITIALIZED, and the error names file and line.
TEST(ConfigFile, AMalformedFileFailsClosed) {
  Sandbox box;
  const std::string conf =
      write(box, "bad.conf", "GPUSLICE_REGION=" + box.path("c.region") + "\nGPUSLICE_MEMORY_LIMT=1Gi\n");
  const Result r = cleared(box, {"GPUSLICE_CONFIG_FILE=" + conf}, {"init", "alloc", std::to_string(kMi)});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "init", "rc"), "3") << r.describe();
  EXPECT_EQ(value(r, "alloc", "rc"), "3") << r.describe();
  EXPECT_NE(r.err.find(conf + ":2: 'GPUSLICE_MEMORY_LIMT' is not a gpuslice option or HAMi alias"), std::string::npos)
      << r.describe();
}

TEST(ConfigFile, ANamedFileThatIsMissingFailsClosed) {
  Sandbox box;
  const Result r = cleared(box, {"GPUSLICE_CONFIG_FILE=" + box.path("absent.conf")}, {"init"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "init", "rc"), "3") << r.describe();
  EXPECT_NE(r.err.find("cannot open the configuration file " + box.path("absent.conf") +
                       ": No such file or directory (ENOENT)"),
            std::string::npos)
      << r.describe();
}

}  // namespace
