// The library in unusual processes (issue 33): a configuration file that is a
// FIFO, a program started with its standard descriptors closed. Each runs
// cuprobe under the preload library; nothing here measures time (the FIFO case
// is bounded by the run's limit, far above what a failing open takes).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>

#include "gpuslice/region.h"
#include "harness.h"
#include "shm/region_file.h"

namespace {

using namespace gpuslice;

constexpr int kLimitMs = 60000;

// cuInit must never wait for a writer that does not come: the file is opened
// without blocking, and anything but a regular file fails closed at once.
TEST(UnusualProcess, AConfigurationFileThatIsAFifoFailsClosedAtOnce) {
  test::Sandbox box;
  const std::string fifo = box.path("gpuslice.conf");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  const test::Result r =
      test::run({test::bin("cuprobe"), "init"}, test::merge(box.env(), {{"GPUSLICE_CONFIG_FILE", fifo}}), kLimitMs);
  ASSERT_FALSE(r.timed_out) << "cuInit blocked in the open of a FIFO";
  EXPECT_EQ(test::value(r, "init", "rc"), "3") << r.describe();  // CUDA_ERROR_NOT_INITIALIZED
  EXPECT_NE(r.err.find("GPUSLICE_CONFIG_FILE='" + fifo + "'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.err;
}

// A program started with standard output (or all three standard descriptors)
// closed, as a daemon or `prog >&-` is: if the region file became descriptor
// 1, the program's first printf would overwrite the region's header and every
// process of the container would then fail (bad magic).
void run_with_closed(const std::string& redirections) {
  test::Sandbox box;
  const std::string region = box.env().at("GPUSLICE_REGION");
  // The shell closes them and runs cuprobe; only cuprobe gets the library
  // (a sanitizer's runtime, which the library pulls in, expects programs
  // built with it).
  const test::Env env = test::merge(box.env(), {{"LD_PRELOAD", ""}, {"PROBE_PRELOAD", test::preload_library()}});
  const test::Result closed =
      test::run({"/bin/sh", "-c", "LD_PRELOAD=\"$PROBE_PRELOAD\" exec \"$0\" \"$@\" " + redirections,
                 test::bin("cuprobe"), "init", "ctx", "0", "alloc", "1048576", "init", "alloc", "1048576"},
                env, kLimitMs);
  ASSERT_FALSE(closed.timed_out) << closed.describe();
  EXPECT_EQ(closed.exit_code, 0) << closed.describe();
  shm::Error err{};
  Region* r = shm::attach_existing(region.c_str(), false, &err);
  EXPECT_NE(r, nullptr) << err.message;
  if (r != nullptr) {
    EXPECT_EQ(r->header.magic, kRegionMagic);
    shm::detach(r);
  }
  // Another process of the container works.
  const test::Result next =
      test::run({test::bin("cuprobe"), "init", "ctx", "0", "alloc", "1048576"}, box.env(), kLimitMs);
  EXPECT_EQ(test::value(next, "init", "rc"), "0") << next.describe();
  EXPECT_EQ(test::value(next, "alloc", "rc"), "0") << next.describe();
}

TEST(UnusualProcess, StandardOutputClosedIsNeverTheRegion) { run_with_closed(">&-"); }

TEST(UnusualProcess, AllStandardDescriptorsClosedAreNeverTheLibrarysFiles) { run_with_closed("<&- >&- 2>&-"); }

}  // namespace
