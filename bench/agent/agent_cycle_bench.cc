// agent-cycle-bench: CPU time of one agent cycle over many regions.
//
// Builds --regions synthetic regions below a temporary directory, each with
// one device entry and --procs registered processes. The processes are real
// (forked sleepers), so the agent maps, watches and liveness-checks real pids
// exactly as on a node. NVML is either the simulated library (--nvml PATH:
// Agent::cycle(), real dlopen()ed NVML calls) or a synthetic NVML view that
// lists every one of those processes with memory and utilisation
// (Agent::cycle_with(): the reconciliation at full size). Reports CPU time per
// cycle (the agent's thread), steady state and with the directory re-read.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "agent.h"
#include "cli.h"
#include "limiter/memory_accounting.h"
#include "log.h"
#include "region_io.h"

using namespace std::string_literals;

using namespace gpuslice;
using namespace gpuslice::agent;

namespace {

struct Options {
  int regions = 256;
  int procs = 16;
  int cycles = 200;
  std::string nvml;  // "" = synthetic NVML view only
};

struct Stats {
  double mean_ms, p50_ms, p99_ms, max_ms;
};

Stats summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  auto at = [&](double q) {
    return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
  };
  return {sum / static_cast<double>(v.size()), at(0.5), at(0.99), v.back()};
}

void print(const char* what, const Stats& cpu, const Stats& wall) {
  std::printf("%-44s cpu mean %.3f ms  p50 %.3f  p99 %.3f  max %.3f | wall mean %.3f ms\n", what, cpu.mean_ms,
              cpu.p50_ms, cpu.p99_ms, cpu.max_ms, wall.mean_ms);
}

template <class F>
std::pair<Stats, Stats> measure(Agent& a, int cycles, F&& one) {
  std::vector<double> cpu, wall;
  for (int i = 0; i < cycles; ++i) {
    one();
    const AgentStats s = a.stats();
    cpu.push_back(static_cast<double>(s.last_cycle_cpu_ns) / 1e6);
    wall.push_back(static_cast<double>(s.last_cycle_ns) / 1e6);
  }
  return {summarize(cpu), summarize(wall)};
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"agent-cycle-bench: CPU time of one agent cycle over many synthetic regions (docs/benchmarks.md)",
               "agent-cycle-bench"};
  app.add_option("--regions", o.regions, "regions (containers) below a temporary directory [256]")
      ->check(CLI::Range(1, 100000));
  app.add_option("--procs", o.procs, "registered processes per region, each a real sleeper [16]")
      ->check(CLI::Range(1, static_cast<int>(kMaxSlots)));
  app.add_option("--cycles", o.cycles, "cycles measured per configuration [200]")->check(CLI::Range(1, 1000000));
  app.add_option("--nvml", o.nvml, "the (simulated) NVML library; without it a synthetic NVML view")
      ->check(CLI::ExistingFile);
  if (const std::optional<int> stop = gpuslice::tools::parse(app, argc, argv, gpuslice::tools::BadCommandLine::cli11))
    return *stop;
  set_log_level(LogLevel::warn);
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }

  char tmpl[] = "/tmp/gpuslice-agent-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string dir = tmpl;
  if (!o.nvml.empty()) setenv("FAKECUDA_STATE", (dir + "/fakecuda.state").c_str(), 1);

  // The processes: one sleeper per slot, killed with us.
  const int total = o.regions * o.procs;
  std::vector<pid_t> children;
  children.reserve(static_cast<std::size_t>(total));
  const pid_t parent = getpid();
  for (int i = 0; i < total; ++i) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "agent-cycle-bench: fork failed after %d processes\n", i);
      break;
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(0);
      for (;;) pause();
    }
    children.push_back(pid);
  }

  // The device: the simulated NVML's device 0 when it is used (UUIDs derive from the state path).
  std::uint8_t uuid[16];
  for (int i = 0; i < 16; ++i) uuid[i] = static_cast<std::uint8_t>(0xa0 + i);
  AgentConfig cfg;
  cfg.region_dir = dir + "/regions";
  cfg.grace_ns = 0;
  cfg.use_nvml = !o.nvml.empty();
  cfg.nvml_library = o.nvml;
  Agent agent(cfg);
  agent.start();
  GpuSample probe_sample;
  if (!o.nvml.empty()) {
    Nvml nvml;
    std::string why;
    if (nvml.open(o.nvml, &why) && nvml.device_count() > 0) {
      nvml.sample(&probe_sample);
      std::memcpy(uuid, probe_sample.devices[0].uuid, 16);
    } else {
      std::fprintf(stderr, "agent-cycle-bench: %s\n", why.c_str());
    }
  }

  GpuSample sample;
  sample.devices.resize(1);
  GpuDevice& g = sample.devices[0];
  std::memcpy(g.uuid, uuid, 16);
  g.uuid_text = format_uuid(uuid);
  g.processes_known = g.util_known = g.device_util_known = true;
  std::size_t child = 0;
  for (int r = 0; r < o.regions; ++r) {
    const std::string path = cfg.region_dir + "/pod-" + std::to_string(r) + "/c.region";
    shm::Error err{};
    Region* region = shm::attach(path.c_str(), ("bench-"s + std::to_string(r)).c_str(), &err);
    if (region == nullptr) {
      std::fprintf(stderr, "%s\n", err.message);
      return 1;
    }
    const int dev = shm::device_index(region, uuid, std::uint64_t{8} << 30, 50, SmPolicy::hard);
    for (int p = 0; p < o.procs && child < children.size(); ++p, ++child) {
      shm::ProcessIdentity id{};
      shm::read_identity(static_cast<std::uint32_t>(children[child]), &id);
      const int slot = shm::claim_slot(region, id);
      limiter::charge(region, slot, dev, std::uint64_t{64} << 20);
      g.processes.push_back({id.pid, (std::uint64_t{64} << 20) + (std::uint64_t{300} << 20), true});
      g.util_busy_ns[id.pid] = 3'000'000;  // 3% of the window
    }
    shm::detach(region);
  }
  g.util_window_ns = 100'000'000;
  g.device_util_pct = 100;
  g.device_util_permille = 1000;

  std::printf("agent-cycle-bench: %d regions x %d processes (%zu real processes), %d cycles each\n", o.regions, o.procs,
              children.size(), o.cycles);
  for (int i = 0; i < 3; ++i) agent.cycle_with(&sample);  // map every process, open pidfds
  auto [steady_cpu, steady_wall] = measure(agent, o.cycles, [&] { agent.cycle_with(&sample); });
  print("synthetic NVML view (all processes listed)", steady_cpu, steady_wall);
  if (!o.nvml.empty()) {
    auto [cpu, wall] = measure(agent, o.cycles, [&] { agent.cycle(); });
    print("simulated NVML library (dlopen)", cpu, wall);
  }
  // A scrape: the regions are read under the agent's lock (read_metrics), the
  // text made after it; callgrind --toggle-collect=*read_metrics* counts the
  // part a cycle may wait for.
  {
    std::vector<double> ms;
    std::size_t bytes = 0;
    for (int i = 0; i < 5; ++i) {
      const std::uint64_t t0 = monotonic_ns();
      bytes = agent.metrics_text().size();
      ms.push_back(static_cast<double>(monotonic_ns() - t0) / 1e6);
    }
    const Stats m = summarize(ms);
    std::printf("/metrics text: %zu bytes, wall mean %.3f ms  p50 %.3f  max %.3f (5 scrapes)\n", bytes, m.mean_ms,
                m.p50_ms, m.max_ms);
  }
  // Directory re-read every cycle (normally once a second: every 10th cycle).
  {
    AgentConfig rescan = cfg;
    rescan.rescan_ns = 0;
    Agent b(rescan);
    b.start();
    for (int i = 0; i < 3; ++i) b.cycle_with(&sample);
    auto [cpu, wall] = measure(b, std::max(10, o.cycles / 4), [&] { b.cycle_with(&sample); });
    print("synthetic NVML view, directory re-read", cpu, wall);
    std::printf("amortised at 100 ms cycles, 1 s re-read: cpu %.3f ms per cycle\n",
                (9 * steady_cpu.mean_ms + cpu.mean_ms) / 10);
  }
  const AgentStats s = agent.stats();
  std::printf("regions %llu, slots reaped %llu, pid scans %llu\n", static_cast<unsigned long long>(s.regions),
              static_cast<unsigned long long>(s.slots_reaped), static_cast<unsigned long long>(s.pid_scans));
  for (pid_t pid : children) kill(pid, SIGKILL);
  for (pid_t pid : children) waitpid(pid, nullptr, 0);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return s.slots_reaped == 0 ? 0 : 1;  // every process stayed alive: nothing may be reaped
}
