// The agent beside memory shared between processes of one container (issue
// 36): the exporter's allocation is counted in the container's table of
// shared allocations, not in its slot, while NVML shows it as the
// exporter's. That is no bypass: the agent must neither report one nor see
// memory beyond the container's count.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent.h"
#include "agent_test_util.h"
#include "limiter/memory_accounting.h"

using namespace gpuslice;
using namespace gpuslice::agent_test;

namespace {

// One rank of test/hardening/programs/shared_peer.cc, driven over its stdin.
class Rank {
 public:
  Rank(const std::vector<std::string>& args, const test::Env& env) {
    signal(SIGPIPE, SIG_IGN);
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    std::vector<std::string> argv{test::bin("shared_peer")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<std::string> envs;
    for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
#if defined(__SANITIZE_ADDRESS__)
    // The preload library comes before libasan in a sanitized rank: allowed
    // (as test/harness's child environment says).
    envs.push_back("ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0");
#endif
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      std::vector<char*> a, e;
      for (auto& s : argv) a.push_back(s.data());
      a.push_back(nullptr);
      for (auto& s : envs) e.push_back(s.data());
      e.push_back(nullptr);
      execve(a[0], a.data(), e.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~Rank() {
    close(to_);
    close(from_);
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  int ask(const std::string& command) {
    const std::string line = command + "\n";
    if (write(to_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return -1001;
    return answer();
  }
  int answer() {  // the rc of the next "<word> rc=R" line; -1000: none within 60 s
    std::string line;
    char c = 0;
    while (true) {
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, 60000) <= 0 || read(from_, &c, 1) != 1) return -1000;
      if (c == '\n') break;
      line += c;
    }
    const std::size_t at = line.find("rc=");
    return at == std::string::npos ? -1002 : std::stoi(line.substr(at + 3));
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

TEST(AgentReconcile, MemorySharedWithinTheContainerIsNoBypass) {
  test::Sandbox box;
  const test::Env env =
      test::merge(box.env(), {{"GPUSLICE_REGION", container_region(box)}, {"GPUSLICE_MEMORY_LIMIT", "512Mi"}});
  const std::string socket = box.path("s");
  Rank exporter({"export", "vmm", std::to_string(128 * kMi), socket}, env);
  ASSERT_EQ(exporter.answer(), 0);
  Rank importer({"import", "vmm", socket, std::to_string(128 * kMi)}, env);
  ASSERT_EQ(exporter.ask("serve"), 0);
  ASSERT_EQ(importer.answer(), 0);
  auto cfg = config_for(box);
  cfg.bypass_tolerance_bytes = 32 * kMi;
  agent::Agent a(cfg);
  a.start();
  ASSERT_TRUE(a.stats().nvml_available);
  a.cycle();
  a.cycle();
  Region* r = attach(container_region(box));
  ASSERT_NE(r, nullptr);
  const int dev = first_device(r);
  ASSERT_GE(dev, 0);
  EXPECT_EQ(a.stats().bypass_reports, 0u) << "the exporter's NVML figure includes the shared 128 MiB";
  EXPECT_EQ(r->devices[dev].agent_extra_bytes.load(), 0u);
  EXPECT_EQ(limiter::used_bytes(r, dev), 128 * kMi) << "counted once";
  shm::detach(r);
}

}  // namespace
