// The node agent against real containers (docs/enforcement.md): podman (runc)
// containers of the World's slices, the agent binary on the host over their
// regions with the simulated NVML. A process of a container that unsets
// LD_PRELOAD and allocates past the quota is killed under --enforce=kill and
// only reported under report; a container that rewrites its quota in its
// (bind-mounted) region gets it back within a cycle while gpuslice-smi set on
// the host is kept; the backstop gauge says what walls such a container in.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
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
  HostAgent(const gpuslice::container_test::World& w, const std::string& enforce,
            const gpuslice::test::Env& machine = {})
      : out_(w.dir + "/agent-" + enforce + ".out") {
    // A port free a moment ago; another if the agent could not listen there.
    for (int attempt = 0; attempt < 5; ++attempt) {
      port_ = std::to_string(free_port());
      pid_ = gpuslice::test::spawn(
          {gpuslice::test::bin("gpuslice-agent"), "--region-dir", w.regions, "--nvml",
           gpuslice::test::fakecuda_dir() + "/libnvidia-ml.so.1", "--grace", "0", "--interval", "100ms", "--rescan",
           "100ms", "--enforce", enforce, "--enforce-cycles", std::to_string(kCycles), "--bypass-tolerance", "32Mi",
           "--listen", "127.0.0.1:" + port_},
          gpuslice::test::merge({{"FAKECUDA_STATE", w.state_file}}, machine), out_);
      if (eventually([&] { return !metrics().empty() || exited(pid_); }, 30) && !metrics().empty()) return;
      stop();
    }
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
  // The backstop gauge of a container's device entry: 1 under its kind.
  long long backstop(const std::string& container, const std::string& kind) const {
    for (const std::string& l : gpuslice::test::lines_with(metrics(), "gpuslice_memory_backstop{")) {
      if (l.rfind("gpuslice_memory_backstop{", 0) == 0 &&
          l.find("container=\"" + container + "\"") != std::string::npos &&
          l.find("kind=\"" + kind + "\"") != std::string::npos)
        return std::stoll(l.substr(l.rfind(' ') + 1));
    }
    return 0;
  }
  long long cycles() const { return value("gpuslice_agent_cycles_total "); }
  // Waits until the agent has run `n` more cycles.
  bool run_cycles(int n) const {
    const long long from = cycles();
    return from >= 0 && eventually([&] { return cycles() >= from + n; });
  }

 private:
  // A zombie (not reaped: stop() waits for it).
  static bool exited(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::size_t paren = text.rfind(')');
    return paren == std::string::npos || text.compare(paren + 2, 1, "Z") == 0;
  }
  static int free_port() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = 0;
    if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
  }
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

// Slice a (256 MiB): a process of the container rewrites the quota in its
// region (bind-mounted at /run/gpuslice) with dd; the host's agent puts it
// back within a cycle. A host-side gpuslice-smi set is kept.
TEST_F(ContainerEnforce, QuotaRewrittenInTheContainerIsRestoredAndSmiSetIsKept) {
  using gpuslice::test::spawn;
  HostAgent agent(*world, "report");
  const std::string d = "/run/gpuslice", host = world->a.region_dir;
  const std::size_t offset = offsetof(gpuslice::Region, devices) + offsetof(gpuslice::DeviceState, quota_bytes);
  // 1 GiB, little-endian, as octal escapes for busybox printf.
  const std::string script = "cuprobe init ctx 0 alloc " + mib(16) + " touch " + d + "/.t-reg waitfile " + d +
                             "/.t-release & while [ ! -e " + d + "/.t-write ]; do sleep 0.05; done; " +
                             "printf '\\000\\000\\000\\100\\000\\000\\000\\000' | busybox dd of=\"$GPUSLICE_REGION\" "
                             "bs=1 seek=" +
                             std::to_string(offset) + " count=8 conv=notrunc && busybox touch " + d +
                             "/.t-written; wait";
  const std::string out = world->dir + "/tamper.out";
  const pid_t ctr = spawn(world->run_argv({world->vendor_device, world->a.device}, {"/bin/sh", "-c", script}), {}, out);
  const std::string region = host + "/slice.region";
  auto quota = [&] {
    unsigned long long q = 0;
    std::ifstream in(region, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(reinterpret_cast<char*>(&q), sizeof q);
    return q;
  };
  bool written = false;
  unsigned long long given = 0, restored = 0, kept = 0;
  long long repairs = -1, grants = -1;
  Result set;
  const auto watched = [&] { return agent.metrics().find("container=\"ctr-a\"") != std::string::npos; };
  if (eventually([&] { return exists(host + "/.t-reg"); }) && eventually(watched) && agent.run_cycles(2)) {
    given = quota();
    std::ofstream(host + "/.t-write") << "";
    written = eventually([&] { return exists(host + "/.t-written"); });
    agent.run_cycles(2);
    restored = quota();
    repairs = agent.value("gpuslice_agent_tamper_repairs_total{container=\"ctr-a\"");
    set = gpuslice::test::run({gpuslice::test::bin("gpuslice-smi"), "set", "--region", region, "--memory", "200Mi"}, {},
                              30000);
    agent.run_cycles(3);
    kept = quota();
    grants = agent.value("gpuslice_agent_grants_applied_total ");
    gpuslice::test::run({gpuslice::test::bin("gpuslice-smi"), "set", "--region", region, "--memory", "256Mi"}, {},
                        30000);
  }
  std::ofstream(host + "/.t-write") << "";  // whatever happened: the container ends
  std::ofstream(host + "/.t-release") << "";
  const Result r = gpuslice::test::wait(ctr, out, 120000);
  const Result a = agent.stop();
  ASSERT_EQ(given, 256 * kMi) << "the limits the container was given, at offset " << offset << ": " << r.describe();
  ASSERT_TRUE(written) << r.describe();
  EXPECT_EQ(restored, 256 * kMi) << "rewritten to 1 GiB in the container, put back: " << a.describe();
  EXPECT_EQ(repairs, 1) << a.describe();
  EXPECT_EQ(set.exit_code, 0) << set.describe();
  EXPECT_EQ(kept, 200 * kMi) << "the operator's change is kept: " << a.describe();
  EXPECT_EQ(grants, 1) << a.describe();
  EXPECT_EQ(r.exit_code, 0) << r.describe();
}

// The driver's wall (R615+) in a podman container. podman here (4.3, runc,
// cgroupfs) runs containers on the host's cgroup v1 hierarchies; runc also
// puts the container's processes in a cgroup v2 directory of the hybrid
// host's unified hierarchy (/sys/fs/cgroup/unified/<parent>/libpod-<id>),
// which the agent finds and NVML can limit. The simulated driver runs inside
// the container's processes and must see that directory to charge them to it
// (the real one is in the kernel): this test's vendor device is an R615
// machine of its own (the driver version is the machine's: its state) that
// also mounts the unified hierarchy read-only as FAKECUDA_CGROUP_ROOT.
TEST_F(ContainerEnforce, DriverWallRefusesABypassingProcessAtTheQuota) {
  using gpuslice::test::spawn;
  const std::string unified = "/sys/fs/cgroup/unified";
  if (access((unified + "/cgroup.procs").c_str(), F_OK) != 0) GTEST_SKIP() << "no cgroup v2 hierarchy at " << unified;
  const std::string tag = "t" + std::to_string(getpid()), version = "615.20", machine = world->dir + "/r615";
  const std::string state = machine + "/fakecuda.state";
  std::filesystem::create_directories(machine);
  const Result init = gpuslice::test::run({gpuslice::test::bin("cuprobe"), "init"},
                                          {{"FAKECUDA_STATE", state},
                                           {"FAKECUDA_DRIVER_VERSION", version},
                                           {"FAKECUDA_MEMORY", "1Gi"},
                                           {"LD_LIBRARY_PATH", gpuslice::test::fakecuda_dir()}},
                                          30000);
  ASSERT_EQ(init.exit_code, 0) << init.describe();
  const std::string spec = gpuslice::container_test::World::cdi_dir() + "/gpuslice-test-"s + tag + "-r615.json";
  const std::string lib = gpuslice::test::fakecuda_dir();
  std::ofstream(spec)
      << R"({"cdiVersion": "0.5.0", "kind": "fakecuda.example/r615", "devices": [{"name": ")" << tag
      << R"(", "containerEdits": {"env": ["FAKECUDA_STATE=/run/fakecuda/fakecuda.state", )"
      << R"("FAKECUDA_CGROUP_ROOT=/run/fakecuda-cgroup"], "mounts": [)"
      << R"({"hostPath": ")" << lib << R"(/libcuda.so.1", "containerPath": )"
      << R"("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "options": ["ro", "nosuid", "nodev", "bind"]}, )"
      << R"({"hostPath": ")" << lib << R"(/libnvidia-ml.so.1", "containerPath": )"
      << R"("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "options": ["ro", "nosuid", "nodev", "bind"]}, )"
      << R"({"hostPath": ")" << machine << R"(", "containerPath": "/run/fakecuda", )"
      << R"("options": ["rw", "nosuid", "nodev", "bind"]}, )"
      << R"({"hostPath": ")" << unified << R"(", "containerPath": "/run/fakecuda-cgroup", )"
      << R"("options": ["ro", "nosuid", "nodev", "rbind"]}]}}]})";
  HostAgent agent(*world, "report", {{"FAKECUDA_STATE", state}, {"FAKECUDA_CGROUP_ROOT", unified}});
  const std::string d = "/run/gpuslice", host = world->b.region_dir;
  const std::string script = "cuprobe init ctx 0 alloc " + mib(16) + " touch " + d + "/.w-reg waitfile " + d +
                             "/.w-release & while [ ! -e " + d + "/.w-go ]; do sleep 0.05; done; " +
                             "env -u LD_PRELOAD cuprobe init ctx 0 fill alloc " + std::to_string(4 * kMi) +
                             "; busybox touch " + d + "/.w-release; wait";
  const std::string out = world->dir + "/wall.out";
  const pid_t ctr =
      spawn(world->run_argv({"fakecuda.example/r615=" + tag, world->b.device}, {"/bin/sh", "-c", script}), {}, out);
  long long driver = 0;
  if (eventually([&] { return exists(host + "/.w-reg"); })) {
    eventually([&] { return (driver = agent.backstop("ctr-b", "driver")) == 1; }, 30);
  }
  std::ofstream(host + "/.w-go") << "";
  const Result r = gpuslice::test::wait(ctr, out, 120000);
  const Result a = agent.stop();
  std::remove(spec.c_str());
  std::remove((host + "/.w-go").c_str());
  ASSERT_EQ(driver, 1) << "gpuslice_memory_backstop{kind=\"driver\"}: " << a.describe() << r.describe();
  const auto fills = gpuslice::test::lines_with(r.out, "fill ");
  ASSERT_EQ(fills.size(), 1u) << r.describe();
  const unsigned long long filled = std::stoull(gpuslice::test::field(fills[0], "bytes"));
  EXPECT_GT(filled, 0u) << r.describe();
  EXPECT_LE(filled + 16 * kMi, world->b.quota) << "never past the quota, whatever path: " << r.describe();
  EXPECT_NE(fills[0].find("rc=2"), std::string::npos) << "refused by the driver (out of memory): " << r.describe();
}

}  // namespace
