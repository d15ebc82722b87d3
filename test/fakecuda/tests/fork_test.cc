// Fork safety: a child forked while another thread of its parent is inside the
// driver (cuInit included) must not hang. CUDA does not duplicate its state
// into a forked child; a child of a parent that had initialised (or was
// initialising) the driver gets CUDA_ERROR_NOT_INITIALIZED from cuInit, at once.
#include <sys/wait.h>

#include <atomic>
#include <memory>
#include <thread>

#include "common.h"
#include "state.h"

using namespace fakecuda_test;
using gpuslice::fakecuda::Config;
using gpuslice::fakecuda::State;

namespace {

// What a forked child's cuInit returns, or -SIGNAL if it had to be killed
// (a hang: SIGALRM after 5 s).
int ChildCuInit() {
  pid_t pid = fork();
  if (pid == 0) {
    alarm(5);
    _exit(static_cast<int>(cuInit(0)) & 0xFF);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

// Holds the state file's lock, so that a cuInit in another thread stops
// inside the driver (claiming its process slot) until released.
std::unique_ptr<State> OpenState() {
  Config config;
  char error[1400];
  if (!gpuslice::fakecuda::parse_config(config, error, sizeof(error))) return nullptr;
  return std::unique_ptr<State>(State::open_or_create(config, error, sizeof(error)));
}

TEST_F(FakeCuda, ChildForkedDuringCuInitDoesNotHang) {
  std::unique_ptr<State> state = OpenState();
  ASSERT_NE(state, nullptr);
  auto lock = std::make_unique<State::Lock>(*state);
  ASSERT_TRUE(lock->ok());
  std::atomic<int> parent_rc{-1};
  std::thread initialiser([&] { parent_rc = cuInit(0); });
  usleep(200 * 1000);  // the thread is now blocked inside cuInit
  ASSERT_EQ(parent_rc.load(), -1);
  EXPECT_EQ(ChildCuInit(), CUDA_ERROR_NOT_INITIALIZED);
  lock.reset();
  initialiser.join();
  EXPECT_EQ(parent_rc.load(), CUDA_SUCCESS);
  EXPECT_EQ(ChildCuInit(), CUDA_ERROR_NOT_INITIALIZED);  // forked after cuInit, as before
}

TEST_F(FakeCuda, ChildForkedDuringAnotherCallDoesNotHang) {
  ASSERT_CU(cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxCreate(&ctx, nullptr, 0, 0));
  std::unique_ptr<State> state = OpenState();
  ASSERT_NE(state, nullptr);
  auto lock = std::make_unique<State::Lock>(*state);
  std::atomic<int> parent_rc{-1};
  std::thread allocator([&] {
    cuCtxSetCurrent(ctx);
    CUdeviceptr p = 0;
    parent_rc = cuMemAlloc(&p, kMiB);  // holds the driver's lock while it waits for the state's
  });
  usleep(200 * 1000);
  EXPECT_EQ(ChildCuInit(), CUDA_ERROR_NOT_INITIALIZED);
  lock.reset();
  allocator.join();
  EXPECT_EQ(parent_rc.load(), CUDA_SUCCESS);
}

TEST_F(FakeCuda, ChildOfAnUninitialisedParentInitialises) {
  EXPECT_EQ(ChildCuInit(), CUDA_SUCCESS);
  ASSERT_CU(cuInit(0));
}

}  // namespace
