// Lifecycle edges of the preload library (issue 9): bootstrap racing a
// library constructor, children made without fork handlers, allocations
// after the exit-time release, NULL out-parameters as the first call, a
// region file truncated under the processes, region permissions, and lookups
// of names that are not driver entry points.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"

using namespace gpuslice::test;

namespace {

constexpr unsigned long long kMi = 1ull << 20;

std::string lib(const std::string& name) { return std::string(GPUSLICE_HARDENING_DIR) + "/lib" + name + ".so"; }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Env limited(const Sandbox& box, const Env& extra = {}) {
  return merge(merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "8Mi"}}), extra);
}

// --- 1. bootstrap never waits on a thread that waits for the loader lock ---

class LifecycleDeadlock : public ::testing::TestWithParam<const char*> {};

TEST_P(LifecycleDeadlock, ConstructorCallingTheDriverDuringAnotherThreadsBootstrapDoesNotHang) {
  Sandbox box;
  const std::string mode = std::string(GetParam()) == "launch" ? "deadlock-launch" : "deadlock";
  Result r = run({bin("lifecycle_probe"), mode, lib("lifecycle_ctor_lib")},
                 limited(box, {{"LIFECYCLE_CTOR", GetParam()}}), 30000);
  ASSERT_FALSE(r.timed_out) << "deadlock: the constructor waits on bootstrap, bootstrap on the loader lock\n"
                            << r.describe();
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "deadlock", "loaded"), "1") << r.describe();
  EXPECT_EQ(value(r, "deadlock", "ctor_rc"), "0") << r.describe();
  EXPECT_EQ(value(r, "deadlock", "thread_rc"), "0") << r.describe();
}

INSTANTIATE_TEST_SUITE_P(Lifecycle, LifecycleDeadlock, ::testing::Values("cuinit", "dlsym", "launch"));

// --- 2. fork variants, exit ---

class LifecycleFork : public ::testing::TestWithParam<const char*> {};

TEST_P(LifecycleFork, ChildThatExitsDoesNotFreeItsParentsCharge) {
  Sandbox box;
  Result r = run({bin("lifecycle_probe"), "fork-exit", GetParam()}, limited(box));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "fork-exit", "extra_bytes"), std::to_string(2 * kMi))
      << "the parent holds 6 MiB of 8: it may add 2, whatever its child did at exit\n"
      << r.describe();
}

TEST_P(LifecycleFork, ChildWithoutForkHandlersAccountsOnItsOwnSlot) {
  Sandbox box;
  Result r = run({bin("lifecycle_probe"), "fork-inherit", GetParam()}, limited(box));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "fork-inherit", "child_bytes"), std::to_string(8 * kMi)) << r.describe();
  EXPECT_EQ(value(r, "fork-inherit", "parent_bytes"), std::to_string(8 * kMi))
      << "the dead child's memory was its own (reaped), not charged to the parent\n"
      << r.describe();
}

// vfork is left out: a vfork child that calls exit() runs every library's destructors in its
// parent's memory (the simulated driver's too); gpuslice's own exit path checks the pid first.
INSTANTIATE_TEST_SUITE_P(Lifecycle, LifecycleFork, ::testing::Values("fork", "_Fork", "clone"));

TEST(Lifecycle, AllocationsAfterTheExitReleaseAreRefused) {
  Sandbox box;
  Result r = run({bin("lifecycle_probe"), "hold", std::to_string(8 * kMi)},
                 limited(box, {{"LD_PRELOAD", preload_library() + " " + lib("lifecycle_late_lib")}}));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "hold", "rc"), "0") << r.describe();
  EXPECT_EQ(value(r, "late", "ok_mib"), "0")
      << "a destructor that runs after gpuslice's own must not allocate unlimited\n"
      << r.describe();
}

TEST(Lifecycle, ExecLeavesNothingChargedToTheNewImage) {
  Sandbox box;
  Result r = run({bin("lifecycle_probe"), "exec"}, limited(box));
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "fill", "bytes"), std::to_string(8 * kMi))
      << "the image before execve held 6 MiB; its memory went with it\n"
      << r.describe();
}

// --- 3. NULL out-parameters as the first call ---

TEST(Lifecycle, NullArrayOutParametersAsFirstCallAreInvalidValue) {
  Sandbox box;
  for (const Env& extra : {Env{}, Env{{"GPUSLICE_MEMORY_LIMIT", "lots"}}}) {
    Result r = run({bin("lifecycle_probe"), "null-arrays"}, merge(limited(box), extra));
    ASSERT_EQ(r.exit_code, 0) << r.describe();
    EXPECT_EQ(value(r, "null-arrays", "array"), "1") << r.describe();
    EXPECT_EQ(value(r, "null-arrays", "array3d"), "1") << r.describe();
    EXPECT_EQ(value(r, "null-arrays", "mipmapped"), "1") << r.describe();
  }
}

// --- 4. a region file truncated while in use ---

TEST(Lifecycle, TruncatedRegionFailsClosedInsteadOfSigbus) {
  Sandbox box;
  Result r = run({bin("lifecycle_probe"), "truncate"}, limited(box));
  ASSERT_EQ(r.signal, 0) << "killed by a signal (SIGBUS)\n" << r.describe();
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "truncate", "first_rc"), "0") << r.describe();
  EXPECT_NE(value(r, "truncate", "second_rc"), "0") << r.describe();
  // The free after the loss fails closed as the allocation does (before the
  // driver, the region untouched), on the pair's fast way too (hook/memory.cc).
  EXPECT_EQ(value(r, "truncate", "free_rc"), "3") << "CUDA_ERROR_NOT_INITIALIZED\n" << r.describe();
  EXPECT_EQ(value(r, "truncate", "survived"), "1") << r.describe();
  auto errors = lines_with(r.err, "gpuslice: error: GPUSLICE_REGION=");
  ASSERT_EQ(errors.size(), 1u) << r.describe();
  EXPECT_NE(errors[0].find("truncated"), std::string::npos) << r.describe();
}

// --- 5. region permissions ---

TEST(Lifecycle, RegionIsSharedWithAnotherUserWhateverTheUmask) {
  Sandbox box;
  Env env = limited(box);
  Result r = run({"/bin/sh", "-c", "umask 077; exec \"$0\" share 1024", bin("lifecycle_probe")}, env);
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  ASSERT_EQ(value(r, "share", "rc"), "0") << r.describe();
  struct stat st {};
  ASSERT_EQ(stat(box.path("container.region").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0666u) << "created with an explicit mode, not the creator's umask";
  if (geteuid() != 0) GTEST_SKIP() << "dropping to another uid needs root";
  // The simulated machine's own files are not gpuslice's business: open them up.
  ASSERT_EQ(chmod(box.dir().c_str(), 0777), 0);
  ASSERT_EQ(chmod(box.path("fakecuda.state").c_str(), 0666), 0);
  // root's entrypoint holds 6 MiB while a process that dropped to uid 65534 asks.
  const std::string held = box.path("root.out");
  pid_t root = spawn({bin("lifecycle_probe"), "share", std::to_string(6 * kMi), "-", "20000"}, env, held);
  std::string seen;
  for (int i = 0; i < 1000 && seen.find("rc=") == std::string::npos; ++i) {
    usleep(10 * 1000);
    seen = read_file(held);
  }
  ASSERT_NE(seen.find("share uid=0 rc=0"), std::string::npos) << seen;
  Result user = run({bin("lifecycle_probe"), "share", std::to_string(4 * kMi), "65534"}, env);
  Result fits = run({bin("lifecycle_probe"), "share", std::to_string(2 * kMi), "65534"}, env);
  kill(root, SIGKILL);
  wait(root, held);
  ASSERT_EQ(user.exit_code, 0) << user.describe();
  EXPECT_EQ(value(user, "share", "rc"), "2") << "one quota for both users: 6 + 4 MiB > 8 MiB\n" << user.describe();
  EXPECT_EQ(value(fits, "share", "rc"), "0") << fits.describe();
}

// --- 6. hygiene ---

TEST(Lifecycle, NamesThatAreNotEntryPointsDoNotLoadTheDriver) {
  Sandbox box;
  Result r = run({bin("lifecycle_nocuda")}, box.env());
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "nocuda", "cuserid"), "1") << r.describe();
  EXPECT_EQ(value(r, "nocuda", "driver_loaded"), "0") << r.describe();
  EXPECT_EQ(value(r, "nocuda", "nvml_loaded"), "0") << r.describe();
  EXPECT_EQ(r.err.find("gpuslice:"), std::string::npos) << r.describe();
}

TEST(Lifecycle, WithoutLimitsNoThreadAndNoNvml) {
  Sandbox box;
  Result r = run({bin("lifecycle_probe"), "quiet"}, box.env());
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(value(r, "quiet", "alloc_rc"), "0") << r.describe();
  EXPECT_EQ(value(r, "quiet", "launched"), "20") << r.describe();
  EXPECT_EQ(value(r, "quiet", "feedback_thread"), "0") << r.describe();
  EXPECT_EQ(value(r, "quiet", "nvml_loaded"), "0") << r.describe();
  // The control: with limits the thread (compute) and NVML (context memory) are what enforce them.
  Sandbox other;
  Result limited_run = run({bin("lifecycle_probe"), "quiet"},
                           merge(other.env(), {{"GPUSLICE_SM_LIMIT", "50"}, {"GPUSLICE_MEMORY_LIMIT", "8Mi"}}));
  EXPECT_EQ(value(limited_run, "quiet", "nvml_loaded"), "1") << limited_run.describe();
  EXPECT_EQ(value(limited_run, "quiet", "feedback_thread"), "1") << limited_run.describe();
}

TEST(Lifecycle, ErrorLinesCarryOnePrefix) {
  Sandbox box;
  for (const Env& extra : {Env{{"GPUSLICE_MEMORY_LIMIT", "lots"}}, Env{{"GPUSLICE_REGION", "/proc/none/x.region"}}}) {
    Result r = run({bin("lifecycle_probe"), "hold", "1024"}, merge(limited(box), extra));
    EXPECT_EQ(r.exit_code, 3) << r.describe();
    EXPECT_EQ(lines_with(r.err, "gpuslice: error: ").size(), 1u) << r.describe();
    EXPECT_EQ(r.err.find("gpuslice: error: gpuslice:"), std::string::npos) << r.describe();
  }
}

TEST(Lifecycle, UnusableRealLibrariesFailClosed) {
  Sandbox box;
  // Missing, and present but not what the variable names (libc loads, exports neither).
  for (const auto& [variable, path] : std::vector<std::pair<std::string, std::string>>{
           {"GPUSLICE_REAL_LIBNVML", box.path("missing/libnvidia-ml.so.1")},
           {"GPUSLICE_REAL_LIBNVML", "libc.so.6"},
           {"GPUSLICE_REAL_LIBCUDA", "libc.so.6"}}) {
    Result r = run({bin("lifecycle_probe"), "hold", "1024"}, limited(box, {{variable, path}}));
    EXPECT_EQ(r.exit_code, 3) << "cuInit fails closed\n" << r.describe();
    auto errors = lines_with(r.err, "gpuslice: error: ");
    ASSERT_EQ(errors.size(), 1u) << r.describe();
    EXPECT_NE(errors[0].find(variable + "=" + path), std::string::npos) << r.describe();
  }
}

}  // namespace
