// The node agent against real containers (docs/enforcement.md): podman (runc)
// containers of the World's slices, the agent binary on the host over their
// regions with the simulated NVML. A process of a container that unsets
// LD_PRELOAD and allocates past the quota is killed under --enforce=kill and
// only reported under report; a container that rewrites its quota in its
// (bind-mounted) region gets it back within a cycle while gpuslice-smi set on
// the host is kept; the backstop gauge says what walls such a container in.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gpuslice/region.h"
#include "podman_world.h"

using gpuslice::container_test::Image;
using gpuslice::container_test::WorldSuite;
using gpuslice::test::Result;
using namespace std::string_literals;

namespace {

constexpr unsigned long long kMi = 1ull << 20;
constexpr int kCycles = 3;  // --enforce-cycles
constexpr char kKills[] = "gpuslice_agent_enforce_kills_total{container=\"ctr-b\"";

std::string mib(unsigned long long n) { return std::to_string(n * kMi); }

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Polls `done` every 20 ms for up to `seconds`.
template <class F>
bool eventually(F done, int seconds = 60) {
  for (int i = 0; i < seconds * 50; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// The agent binary on the host, serving /metrics on a port of its own.
class HostAgent {
 public:
  HostAgent(const gpuslice::container_test::World& w, const std::string& enforce)
      : port_(std::to_string(20000 + getpid() % 20000)), out_(w.dir + "/agent-" + enforce + ".out") {
    pid_ = gpuslice::test::spawn(
        {gpuslice::test::bin("gpuslice-agent"), "--region-dir", w.regions, "--nvml",
         gpuslice::test::fakecuda_dir() + "/libnvidia-ml.so.1", "--grace", "0", "--interval", "100ms", "--enforce",
         enforce, "--enforce-cycles", std::to_string(kCycles), "--bypass-tolerance", "32Mi", "--listen",
         "127.0.0.1:" + port_},
        {{"FAKECUDA_STATE", w.state_file}}, out_);
  }
  ~HostAgent() { stop(); }
  Result stop() {
    if (pid_ <= 0) return {};
    kill(pid_, SIGTERM);
    const Result r = gpuslice::test::wait(pid_, out_, 30000);
    pid_ = -1;
    return r;
  }
  std::string metrics() const {
    return gpuslice::test::run({"/usr/bin/curl", "-sf", "--max-time", "10", "http://127.0.0.1:" + port_ + "/metrics"},
                               {}, 20000)
        .out;
  }
  // The value of the first sample starting with `series` (0: none; -1: no /metrics).
  long long value(const std::string& series) const {
    const std::string text = metrics();
    for (const std::string& l : gpuslice::test::lines_with(text, series)) {
      if (l.rfind(series, 0) == 0) return std::stoll(l.substr(l.rfind(' ') + 1));
    }
    return text.empty() ? -1 : 0;
  }
  long long cycles() const { return value("gpuslice_agent_cycles_total "); }
  // Waits until the agent has run `n` more cycles.
  bool run_cycles(int n) const {
    const long long from = cycles();
    return from >= 0 && eventually([&] { return cycles() >= from + n; });
  }

 private:
  std::string port_, out_;
  pid_t pid_ = -1;
};

class ContainerEnforce : public WorldSuite<Image::local> {};

// Slice b (128 MiB): a registered process (under LD_PRELOAD) holds 16 MiB;
// another process of the same container unsets LD_PRELOAD and takes 300 MiB.
void bypass(gpuslice::container_test::World* world, const std::string& mode) {
  using gpuslice::test::spawn;
  HostAgent agent(*world, mode);
  const std::string d = "/run/gpuslice", tag = "." + mode, host = world->b.region_dir + "/" + tag;
  const std::string script = "cuprobe init ctx 0 alloc " + mib(16) + " touch " + d + "/" + tag + "-reg waitfile " + d +
                             "/" + tag + "-release & env -u LD_PRELOAD cuprobe init ctx 0 alloc " + mib(300) +
                             " touch " + d + "/" + tag + "-over waitfile " + d + "/" + tag +
                             "-release; echo \"bypass exit=$?\"; wait";
  const std::string out = world->dir + "/bypass-" + mode + ".out";
  const pid_t ctr = spawn(world->run_argv({world->vendor_device, world->b.device}, {"/bin/sh", "-c", script}), {}, out);
  const bool over = eventually([&] { return exists(host + "-reg") && exists(host + "-over"); });
  const long long from = agent.cycles();
  long long kills = 0, reports = 0, at = -1;
  if (over) {
    eventually([&] {
      kills = agent.value(kKills);
      reports = agent.value("gpuslice_agent_over_quota_reports_total ");
      return mode == "kill" ? kills >= 1 : reports >= 1;
    });
    at = agent.cycles();
    if (mode == "report") {
      agent.run_cycles(10);
      kills = agent.value(kKills);
    }
  }
  std::ofstream(host + "-release") << "";
  const Result r = gpuslice::test::wait(ctr, out, 120000);
  const Result a = agent.stop();
  ASSERT_TRUE(over) << r.describe();
  EXPECT_EQ(gpuslice::test::lines_with(r.out, "alloc ").size(), 2u) << r.describe();
  if (mode == "kill") {
    EXPECT_EQ(kills, 1) << a.describe();
    EXPECT_NE(r.out.find("bypass exit=137"), std::string::npos) << "SIGKILLed: " << r.describe();
    // Documented bound: (--enforce-cycles + 1) cycles; plus what this
    // scrape's lag adds on a loaded machine (counted, not timed).
    EXPECT_LE(at - from, kCycles + 1 + 10) << "cycles from the excess to the kill";
  } else {
    EXPECT_EQ(reports, 1) << a.describe();
    EXPECT_EQ(kills, 0) << a.describe();
    EXPECT_NE(r.out.find("bypass exit=0"), std::string::npos) << "reported only, ran on: " << r.describe();
  }
}

TEST_F(ContainerEnforce, ProcessWithoutThePreloadPastTheQuotaIsKilled) { bypass(world, "kill"); }
TEST_F(ContainerEnforce, ProcessWithoutThePreloadPastTheQuotaIsOnlyReported) { bypass(world, "report"); }

}  // namespace
