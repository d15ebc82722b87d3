// Shared pieces of the simulated driver's tests.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fakecuda_query.h"

extern char** environ;

// The per-thread-default-stream entry points, which plain cuda.h only declares
// under CUDA_API_PER_THREAD_DEFAULT_STREAM (as the same names): same types.
extern "C" {
decltype(cuLaunchKernel) cuLaunchKernel_ptsz;
decltype(cuLaunchKernelEx) cuLaunchKernelEx_ptsz;
decltype(cuLaunchCooperativeKernel) cuLaunchCooperativeKernel_ptsz;
decltype(cuStreamSynchronize) cuStreamSynchronize_ptsz;
decltype(cuGraphLaunch) cuGraphLaunch_ptsz;
decltype(cuMemAllocAsync) cuMemAllocAsync_ptsz;
decltype(cuMemAllocFromPoolAsync) cuMemAllocFromPoolAsync_ptsz;
decltype(cuMemFreeAsync) cuMemFreeAsync_ptsz;
}

#define ASSERT_CU(call) ASSERT_EQ((call), CUDA_SUCCESS) << #call
#define EXPECT_CU(call) EXPECT_EQ((call), CUDA_SUCCESS) << #call

namespace fakecuda_test {

constexpr unsigned long long kMiB = 1ull << 20;

// Gives each test a fresh state file; the configuration is set before cuInit.
class FakeCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    // cuInit binds the process to one state file: one test per process (CTest).
    static bool used = false;
    if (used) GTEST_SKIP() << "one test per process: run through ctest";
    used = true;
    char dir[] = "/tmp/fakecuda-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    state_ = dir_ + "/state";
    setenv("FAKECUDA_STATE", state_.c_str(), 1);
    setenv("FAKECUDA_MEMORY", "1Gi", 1);
    setenv("FAKECUDA_DEVICES", "2", 1);
    unsetenv("FAKECUDA_CONTEXT_MEMORY");
    unsetenv("FAKECUDA_SMS");
  }
  void TearDown() override {
    if (state_.empty()) return;
    unlink(state_.c_str());
    rmdir(dir_.c_str());
  }
  // Initialises and makes a created context on device 0 current.
  void InitWithContext(CUcontext* ctx = nullptr) {
    ASSERT_CU(cuInit(0));
    CUcontext created = nullptr;
    ASSERT_CU(cuCtxCreate(&created, nullptr, 0, 0));
    if (ctx != nullptr) *ctx = created;
  }
  std::string dir_;
  std::string state_;
};

// A helper process (fakecuda_helper) started with the fake on its library
// path; its stdout is readable line by line.
struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;

  static Child Spawn(const std::vector<std::string>& args, const std::vector<std::string>& prefix = {}) {
    Child child;
    int fds[2];
    if (pipe(fds) != 0) return child;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    std::vector<std::string> argv_storage = prefix;
    argv_storage.push_back(FAKECUDA_HELPER);
    argv_storage.insert(argv_storage.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& arg : argv_storage) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_storage;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string(*e).rfind("LD_LIBRARY_PATH=", 0) != 0) env_storage.emplace_back(*e);
    }
    env_storage.push_back(std::string("LD_LIBRARY_PATH=") + FAKECUDA_LIB_DIR);
    std::vector<char*> envp;
    for (std::string& entry : env_storage) envp.push_back(entry.data());
    envp.push_back(nullptr);
    int rc = posix_spawnp(&child.pid, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    if (rc != 0) {
      child.pid = -1;
      close(fds[0]);
      return child;
    }
    child.out = fdopen(fds[0], "r");
    return child;
  }
  std::string ReadLine() {
    char line[256];
    if (out == nullptr || std::fgets(line, sizeof(line), out) == nullptr) return "";
    std::string text(line);
    if (!text.empty() && text.back() == '\n') text.pop_back();
    return text;
  }
  int Wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    if (out != nullptr) std::fclose(out);
    out = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void Kill() {
    kill(pid, SIGKILL);
    Wait();
  }
};

}  // namespace fakecuda_test
