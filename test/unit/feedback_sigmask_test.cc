// The compute feedback thread (limiter/compute_feedback.cc) starts with every
// signal blocked, so that signals sent to the process reach the application's
// own threads, and its creation leaves the calling thread's mask as it was.
// (It used to ask for the mask with pthread_attr_setsigmask_np, glibc 2.32+;
// it now blocks around pthread_create to stay under the glibc floor.)
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "limiter/compute_feedback.h"
#include "platform/clock.h"

namespace {

std::uint64_t mono() noexcept { return gpuslice::platform::monotonic_ns(); }

// SigBlk of one of this process's threads, as the kernel reports it.
std::uint64_t blocked_mask(const std::string& task_dir) {
  std::ifstream status(task_dir + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("SigBlk:", 0) == 0) return std::stoull(line.substr(7), nullptr, 16);
  return 0;
}

std::string find_thread(const std::string& name) {
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string text;
    std::getline(comm, text);
    if (text == name) return task.path();
  }
  return "";
}

bool has(std::uint64_t mask, int sig) { return (mask >> (sig - 1)) & 1u; }

TEST(FeedbackThread, BlocksEverySignalAndLeavesTheCallersMask) {
  // The caller blocks SIGUSR1 only.
  sigset_t mine;
  sigemptyset(&mine);
  sigaddset(&mine, SIGUSR1);
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &mine, nullptr), 0);

  gpuslice::limiter::FeedbackHost host;  // no region: each tick returns at once
  host.mono_ns = mono;
  ASSERT_TRUE(gpuslice::limiter::ensure_feedback_thread(host));

  sigset_t after;
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, nullptr, &after), 0);
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig >= 32 && sig < SIGRTMIN) continue;  // glibc's internal signals
    EXPECT_EQ(sigismember(&after, sig), sig == SIGUSR1 ? 1 : 0) << "caller's mask changed for signal " << sig;
  }

  std::string task;
  for (int i = 0; i < 500 && task.empty(); ++i) {
    task = find_thread("gpuslice-fb");
    if (task.empty()) usleep(2000);
  }
  ASSERT_FALSE(task.empty()) << "no thread named gpuslice-fb";
  const std::uint64_t blocked = blocked_mask(task);
  for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGTERM, SIGCHLD, SIGCONT, SIGTSTP,
                  SIGWINCH, SIGIO, SIGPROF, SIGVTALRM, SIGURG})
    EXPECT_TRUE(has(blocked, sig)) << "the feedback thread accepts signal " << sig << " (SigBlk " << std::hex << blocked
                                   << ")";
  for (int sig = SIGRTMIN; sig <= SIGRTMAX; ++sig)
    EXPECT_TRUE(has(blocked, sig)) << "the feedback thread accepts real-time signal " << sig;
}

}  // namespace
