// The agent at the size of a full node (docs/agent.md, "Scale"): 1,024
// regions, each with a device and a real registered process, watched by the
// gpuslice-agent binary. Its resident set, its anonymous memory (heap,
// stacks) and the size of /metrics are asserted against the budget the docs
// state; the cycle's CPU and wall time are printed (the machine is shared:
// times are reported, not asserted).
//
// GPUSLICE_AGENT_SCALE_REGIONS=<n> runs the same measurement at another size
// (the table in docs/agent.md), GPUSLICE_AGENT_SCALE_BINARY=<path> with
// another build of the agent; the budget is asserted at the default 1,024.
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "agent_test_util.h"

using namespace std::string_literals;

using namespace gpuslice;
using namespace gpuslice::agent_test;
using gpuslice::test::Sandbox;

namespace {

constexpr std::uint64_t kBudgetRssBytes = 64 * kMi;       // whole resident set at 1,024 regions
constexpr std::uint64_t kBudgetAnonBytes = 32 * kMi;      // heap, stacks: what a memory limit is charged for
constexpr std::size_t kBudgetMetricsBytes = 5 * kMi / 2;  // /metrics at 1,024 regions (--metrics full)
constexpr std::size_t kBudgetBasicBytes = 3 * kMi / 2;    // with --metrics basic

int scale_regions() {
  const char* v = std::getenv("GPUSLICE_AGENT_SCALE_REGIONS");
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : 1024;
}

// Sleepers killed with the test: one real process per region.
class Sleepers {
 public:
  explicit Sleepers(int n) {
    const pid_t parent = getpid();
    for (int i = 0; i < n; ++i) {
      const pid_t pid = fork();
      if (pid < 0) break;
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(0);
        for (;;) pause();
      }
      pids_.push_back(pid);
    }
  }
  ~Sleepers() {
    for (pid_t p : pids_) kill(p, SIGKILL);
    for (pid_t p : pids_) waitpid(p, nullptr, 0);
  }
  const std::vector<pid_t>& pids() const { return pids_; }

 private:
  std::vector<pid_t> pids_;
};

// Value of an unlabelled sample ("name value"), -1 if absent.
double sample(const std::string& body, const std::string& name) {
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + " ", 0) == 0) return std::strtod(line.c_str() + name.size() + 1, nullptr);
  }
  return -1;
}

// A "Name:   123 kB" field of /proc/<pid>/status, in bytes.
std::uint64_t status_bytes(pid_t pid, const std::string& field) {
  std::istringstream in(read_file("/proc/"s + std::to_string(pid) + "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::strtoull(line.c_str() + field.size() + 1, nullptr, 10) * 1024;
  }
  return 0;
}

// One region per sleeper, as the library creates them: pod-<i>/c.region, one
// device entry, the sleeper's slot holding 64 MiB.
void make_regions(const std::string& dir, const std::vector<pid_t>& pids) {
  mkdir(dir.c_str(), 0755);
  for (std::size_t i = 0; i < pids.size(); ++i) {
    Region* r = make_region(dir + "/pod-" + std::to_string(i) + "/c.region", "scale-"s + std::to_string(i));
    ASSERT_NE(r, nullptr);
    const int dev = add_device(r, 0xa0, 8ull << 30, 50);
    Identity id;
    ASSERT_TRUE(identity(static_cast<std::uint32_t>(pids[i]), &id));
    const int slot = add_slot(r, id.ns_pid, id.pidns, id.start_time);
    ASSERT_GE(slot, 0);
    r->slots[slot].committed_bytes[dev].store(64 * kMi);
    r->devices[dev].used_bytes.store(64 * kMi);
    shm::detach(r);
    // As on a node in its steady state: a pod directory last changed when its
    // region was made, long ago (the agent's re-read then skips it: scan.h).
    const std::string pod = dir + "/pod-" + std::to_string(i);
    const timespec old_time[2] = {{time(nullptr) - 60, 0}, {time(nullptr) - 60, 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, pod.c_str(), old_time, 0), 0);
  }
}

struct Figures {
  std::uint64_t rss = 0, anon = 0;
  std::size_t metrics_bytes = 0;
};

void measure(const char* metrics_mode, Figures* out) {
  const int n = scale_regions();
  Sandbox box;
  Sleepers sleepers(n);
  ASSERT_EQ(static_cast<int>(sleepers.pids().size()), n);
  // GPUSLICE_AGENT_SCALE_DIR=<dir>: the regions on another file system (a
  // tmpfs such as /dev/shm, as /run is on a node) instead of the sandbox's.
  const char* other_dir = std::getenv("GPUSLICE_AGENT_SCALE_DIR");
  const std::string dir =
      other_dir != nullptr ? other_dir + "/gpuslice-scale-"s + std::to_string(getpid()) : region_dir(box);
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      if (dir.rfind("/tmp/gpuslice-test-", 0) != 0) test::run({"/bin/rm", "-rf", dir}, {});
    }
  } cleanup{dir};
  make_regions(dir, sleepers.pids());
  if (::testing::Test::HasFatalFailure()) return;
  const int port = free_port();
  ASSERT_GT(port, 0);
  const std::string max_regions = std::to_string(std::max(4096, n));
  std::vector<std::string> argv = {test::bin("gpuslice-agent"),
                                   "--region-dir",
                                   dir,
                                   "--nvml",
                                   fake_nvml(),
                                   "--max-regions",
                                   max_regions,
                                   "--listen",
                                   "127.0.0.1:"s + std::to_string(port)};
  if (std::string(metrics_mode) != "full") argv.insert(argv.end(), {"--metrics", metrics_mode});
  // Another build of the agent (the figures before a change, docs/agent.md).
  if (const char* other = std::getenv("GPUSLICE_AGENT_SCALE_BINARY")) argv[0] = other;
  pid_t agent = test::spawn(argv, box.env(false), "/dev/null");
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1, 0);
  client.set_read_timeout(30, 0);
  std::string body;
  auto scrape = [&] {
    auto res = client.Get("/metrics");
    body = res && res->status == 200 ? res->body : "";
    return !body.empty();
  };
  ASSERT_TRUE(eventually([&] { return scrape() && sample(body, "gpuslice_agent_regions") == n; }, 60000))
      << "regions watched: " << sample(body, "gpuslice_agent_regions");
  // Ten more cycles: the steady state, every region read ten times.
  const double cycles0 = sample(body, "gpuslice_agent_cycles_total");
  const double cpu0 = sample(body, "gpuslice_agent_cycle_cpu_seconds_total");
  ASSERT_TRUE(
      eventually([&] { return scrape() && sample(body, "gpuslice_agent_cycles_total") >= cycles0 + 10; }, 60000));
  const double cycles = sample(body, "gpuslice_agent_cycles_total") - cycles0;
  const double cpu_ms = (sample(body, "gpuslice_agent_cycle_cpu_seconds_total") - cpu0) / cycles * 1e3;
  double wall_ms = 0, wall_sum_ms = 0;  // the largest and the mean of ten successive scrapes' last cycle
  for (int i = 0; i < 10 && scrape(); ++i) {
    const double ms = sample(body, "gpuslice_agent_cycle_seconds") * 1e3;
    wall_ms = std::max(wall_ms, ms);
    wall_sum_ms += ms;
  }
  ASSERT_TRUE(scrape());
  const std::size_t metrics_bytes = body.size();

  const std::uint64_t rss = status_bytes(agent, "VmRSS"), anon = status_bytes(agent, "RssAnon");
  const std::uint64_t file = status_bytes(agent, "RssFile"), shmem = status_bytes(agent, "RssShmem");
  std::printf(
      "agent scale (--metrics %s): regions %d  rss %.1f MiB (anon %.1f, file %.1f, shmem %.1f)  cycle cpu %.2f ms  "
      "wall mean %.2f ms, max %.2f ms (10 scrapes)  /metrics %zu bytes\n",
      metrics_mode, n, static_cast<double>(rss) / kMi, static_cast<double>(anon) / kMi, static_cast<double>(file) / kMi,
      static_cast<double>(shmem) / kMi, cpu_ms, wall_sum_ms / 10, wall_ms, metrics_bytes);
  kill(agent, SIGTERM);
  const test::Result a = test::wait(agent);
  EXPECT_EQ(a.exit_code, 0) << a.describe();
  *out = {rss, anon, metrics_bytes};
}

// A sanitizer's shadow memory and quarantine are the agent's memory too:
// the budget is the plain build's (the sizes of /metrics hold everywhere).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kMemoryBudgetApplies = false;
#else
constexpr bool kMemoryBudgetApplies = true;
#endif

TEST(AgentScale, MemoryCycleAndMetricsAtAThousandRegions) {
  Figures f;
  measure("full", &f);
  if (HasFatalFailure() || scale_regions() != 1024) return;
  if (kMemoryBudgetApplies) {
    EXPECT_LE(f.rss, kBudgetRssBytes);
    EXPECT_LE(f.anon, kBudgetAnonBytes);
  }
  EXPECT_LE(f.metrics_bytes, kBudgetMetricsBytes);
}

TEST(AgentScale, BasicMetricsAtAThousandRegions) {
  Figures f;
  measure("basic", &f);
  if (HasFatalFailure() || scale_regions() != 1024) return;
  if (kMemoryBudgetApplies) {
    EXPECT_LE(f.rss, kBudgetRssBytes);
  }
  EXPECT_LE(f.metrics_bytes, kBudgetBasicBytes);
}

}  // namespace
