// A SIGKILLed process whose forked child lives on (issue 20's `kill` class):
// the child keeps the driver's files — with the real driver, and with the
// simulator, which models it — so the dead parent's device memory stays
// allocated until the child execs or exits. gpuslice must keep counting it
// that long (shm::lock_slot_file: the slot's file lock is shared with the
// child exactly as the driver's files are), or another process is admitted
// above the quota while the device still holds the dead parent's memory.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "harness.h"

using namespace gpuslice::test;

namespace {

constexpr unsigned long long kMi = 1ull << 20;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool gone(pid_t pid) {
  for (int i = 0; i < 500; ++i) {
    if (kill(pid, 0) != 0) return true;
    // An orphan's zombie has closed its files already: as good as gone here,
    // once it is the last of its threads. A zombie leader whose other threads
    // (a sanitizer's background thread) still run their exit still holds the
    // files they share (/proc/<pid>/stat: state, field 3; num_threads, 20).
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto paren = line.rfind(')');
    if (paren != std::string::npos) {
      std::istringstream fields(line.substr(paren + 1));
      std::string field[18];
      for (std::string& f : field) fields >> f;
      if (field[0] == "Z" && field[17] == "1") return true;
    }
    usleep(10 * 1000);
  }
  return false;
}

TEST(ForkedChildHoldsTheDriverFiles, DeadParentsMemoryStaysCountedUntilTheChildExits) {
  Sandbox box;
  const Env env = merge(box.env(), {{"GPUSLICE_MEMORY_LIMIT", "64Mi"}});
  const std::string out = box.path("holder.out");
  const pid_t holder = spawn({bin("forked_holder"), "hold", std::to_string(48 * kMi)}, env, out);
  std::string seen;
  for (int i = 0; i < 1000 && seen.find("child=") == std::string::npos; ++i) {
    usleep(10 * 1000);
    seen = read_file(out);
  }
  ASSERT_NE(seen.find("hold rc=0 child="), std::string::npos) << seen;
  const pid_t child = static_cast<pid_t>(std::stol(seen.substr(seen.find("child=") + 6)));
  ASSERT_GT(child, 0) << seen;
  kill(holder, SIGKILL);
  int status = 0;
  waitpid(holder, &status, 0);

  // The parent is gone; its 48 MiB are still on the device (the child has
  // the driver's files): 32 MiB more would put the container at 80 MiB.
  Result refused = run({bin("forked_holder"), "alloc", std::to_string(32 * kMi)}, env);
  // Once the child exits, the memory goes, and the reaper may give it back.
  kill(child, SIGKILL);
  ASSERT_TRUE(gone(child));
  Result fits = run({bin("forked_holder"), "alloc", std::to_string(32 * kMi)}, env);

  EXPECT_NE(refused.out.find("alloc rc=2"), std::string::npos)
      << "admitted while the dead parent's memory is still on the device (held by its forked child)\n"
      << refused.describe();
  EXPECT_NE(fits.out.find("alloc rc=0"), std::string::npos) << fits.describe();
}

}  // namespace
