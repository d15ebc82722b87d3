#include "barrier.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>

#include "platform/clock.h"

namespace gpuslice::bench {

namespace {

constexpr std::uint64_t kPollNs = 200 * 1000;

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

void touch(const std::string& path) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error("cannot create " + path);
  close(fd);
}

}  // namespace

std::uint64_t barrier_arrive_and_wait(const std::string& dir, int index, std::uint64_t timeout_ns) {
  touch(dir + "/ready." + std::to_string(index));
  const std::string go = dir + "/go";
  const std::uint64_t deadline = platform::monotonic_ns() + timeout_ns;
  while (!exists(go)) {
    if (platform::monotonic_ns() > deadline) throw std::runtime_error("no start signal from the orchestrator");
    platform::sleep_ns(kPollNs);
  }
  std::ifstream in(go);
  unsigned long long start = 0;
  if (!(in >> start)) throw std::runtime_error("unreadable start signal " + go);
  return start;
}

bool barrier_release(const std::string& dir, int count, const std::vector<pid_t>& pids, std::uint64_t lead_ns,
                     std::uint64_t timeout_ns, std::uint64_t* start_ns) {
  const std::uint64_t deadline = platform::monotonic_ns() + timeout_ns;
  for (int i = 0; i < count; ++i) {
    while (!exists(dir + "/ready." + std::to_string(i))) {
      for (pid_t pid : pids) {
        // A worker that died before arriving would hold the others forever.
        siginfo_t info{};
        if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) {
          return false;
        }
      }
      if (platform::monotonic_ns() > deadline) return false;
      platform::sleep_ns(kPollNs);
    }
  }
  *start_ns = platform::monotonic_ns() + lead_ns;
  // Written then renamed: a worker never reads a half-written start time.
  const std::string tmp = dir + "/go.tmp";
  {
    std::ofstream out(tmp);
    out << *start_ns << "\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), (dir + "/go").c_str()) == 0;
}

}  // namespace gpuslice::bench
