// chaos_torture: the launcher (default) and the worker (--worker N) of the
// chaos torture suite. See test/chaos/README.md.
//
//   chaos_torture [--seeds A[-B][,C[-D]...]] [--classes all|c1,c2,...] [--exclude c1,...]
//                 [--procs P] [--threads T] [--ops N] [--quota MiB] [--lag MS] [--read-delay US] [--exact] [--no-chaos] [--no-refusals] [--overcount] [--no-preload] [--library PATH] [--keep] [--verbose]
//
// For each seed: a fresh directory with a simulated machine (FAKECUDA_STATE)
// and a region (GPUSLICE_REGION); P worker processes of that container under
// libgpuslice.so, with FAKECUDA_CHAOS_SEED=<seed> (stream = worker index) and
// FAKECUDA_MONITOR=1; the launcher changes the quota with gpuslice-smi set
// ("smi") and SIGKILLs and replaces workers ("kill"). The seed also picks
// which of the selected classes the schedule uses (each with probability
// 2/3, at least one; --exact: all of them). A schedule fails on a monitor violation, a worker that
// crashed or failed, or a hang (30 s). Prints one line per seed and a
// summary; exits 0 when every schedule passed, 1 otherwise, 2 on bad usage.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "monitor_internal.h"
#include "torture.h"

extern char** environ;

namespace gpuslice::chaos {
namespace {

std::uint64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000 + static_cast<std::uint64_t>(ts.tv_nsec) / 1000000;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

bool known(const std::string& c) {
  const auto& all = all_classes();
  return std::find(all.begin(), all.end(), c) != all.end();
}

struct Options {
  std::vector<std::uint64_t> seeds{1};  // --seeds A[-B][,C[-D]...]
  std::vector<std::string> classes = all_classes();
  int procs = 3, threads = 3, ops = 120;
  std::uint64_t quota_mib = 256;
  std::uint64_t lag_ms = 100;       // FAKECUDA_MONITOR_LAG_MS
  std::uint64_t read_delay_us = 0;  // --read-delay: FAKECUDA_MONITOR_READ_DELAY_US (test knob)
  bool keep = false, verbose = false;
  bool exact = false;
  bool chaos = true;
  bool judge_refusals = true;  // --no-refusals: FAKECUDA_MONITOR_REFUSALS=0
  bool overcount = false;      // --overcount: FAKECUDA_MONITOR_OVERCOUNT=1 (the checkpoints judge over-counts)
  bool preload =
      true;  // --no-preload: workers after the first (which creates the region) run without gpuslice  // --no-chaos: the monitor only (to measure what the perturbation adds)  // every selected class in every schedule (else the seed picks a subset)
  std::string build = GPUSLICE_TEST_BUILD_DIR;
  std::string library;  // --library: the preloaded gpuslice (default <build>/lib/libgpuslice.so)
};

std::vector<std::string> base_env() {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string v = *e;
    if (v.rfind("LD_PRELOAD=", 0) == 0 || v.rfind("GPUSLICE_", 0) == 0 || v.rfind("FAKECUDA_", 0) == 0 ||
        v.rfind("CUDA_DEVICE_", 0) == 0 || v.rfind("CUDA_OVERSUBSCRIBE", 0) == 0 ||
        v.rfind("LD_LIBRARY_PATH=", 0) == 0) {
      continue;
    }
    env.push_back(v);
  }
  return env;
}

pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env, const std::string& log) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
  }
  std::vector<char*> a, e;
  for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  for (const auto& s : env) e.push_back(const_cast<char*>(s.c_str()));
  e.push_back(nullptr);
  execve(a[0], a.data(), e.data());
  _exit(127);
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int count_of(const std::string& text, const std::string& word) {
  int n = 0;
  for (std::size_t p = text.find(word); p != std::string::npos; p = text.find(word, p + 1)) ++n;
  return n;
}

struct SeedResult {
  int violations = 0;
  int failures = 0;
  bool hang = false;
  std::uint64_t checks = 0;
  std::uint64_t refusals_judged = 0, refusals_skipped = 0;
  std::uint64_t count_judged = 0, count_unsettled = 0;  // count checks (monitor.cc)
  std::uint64_t count_released = 0;                     // of those, excusing a dead process's files released
  std::string classes;
  std::string detail;
};

SeedResult run_seed(const Options& o, std::uint64_t seed, const char* self) {
  SeedResult result;
  Rng rng(seed);
  std::vector<std::string> picked;
  for (const std::string& c : o.classes) {
    if (o.exact || rng.below(3) != 0) picked.push_back(c);
  }
  if (picked.empty()) picked.push_back(o.classes[rng.below(o.classes.size())]);
  result.classes = join(picked);
  auto has = [&](const char* c) { return std::find(picked.begin(), picked.end(), c) != picked.end(); };
  std::vector<std::string> worker_classes;
  for (const auto& c : picked) {
    if (!launcher_class(c)) worker_classes.push_back(c);
  }
  if (worker_classes.empty()) worker_classes.push_back("alloc");

  char dir_template[] = "/tmp/gpuslice-chaos-XXXXXX";
  const char* dir_c = mkdtemp(dir_template);
  if (dir_c == nullptr) {
    result.failures = 1;
    result.detail = "mkdtemp failed";
    return result;
  }
  const std::string dir = dir_c;
  bool agent_on = false;
  for (const auto& c : picked) agent_on = agent_on || agent_class(c);
  // With the agent, the region lies in the directory it watches (and may remove).
  const std::string region_dir = dir + "/regions";
  if (agent_on) mkdir(region_dir.c_str(), 0700);
  const std::string region = agent_on ? region_dir + "/c.region" : dir + "/region";
  const std::uint64_t quota = o.quota_mib << 20;
  std::vector<std::string> env = base_env();
  const std::string preload = "LD_PRELOAD=" + (o.library.empty() ? o.build + "/lib/libgpuslice.so" : o.library);
  env.push_back("LD_LIBRARY_PATH=" + o.build + "/fakecuda");
  // The simulated machine, given to every process that may create its state
  // (the first to open it does, with its own variables): the agent too, which
  // often opens it first; with the defaults there (contexts and modules hold
  // nothing) a seed tested no implicit memory at all.
  const std::vector<std::string> machine{"FAKECUDA_STATE=" + dir + "/state", "FAKECUDA_MEMORY=8Gi",
                                         "FAKECUDA_CONTEXT_MEMORY=16Mi", "FAKECUDA_MODULE_MEMORY=1"};
  env.insert(env.end(), machine.begin(), machine.end());
  env.push_back("GPUSLICE_REGION=" + region);
  env.push_back("GPUSLICE_MEMORY_LIMIT=" + std::to_string(o.quota_mib) + "Mi");
  env.push_back("FAKECUDA_MONITOR=1");
  env.push_back("FAKECUDA_MONITOR_LAG_MS=" + std::to_string(o.lag_ms));
  env.push_back("FAKECUDA_MONITOR_REPORT=" + dir + "/violations");
  env.push_back("FAKECUDA_MONITOR_CALLS=1");  // the worker brackets its calls: the count is judged at once
  if (!o.judge_refusals) env.push_back("FAKECUDA_MONITOR_REFUSALS=0");
  if (o.overcount) env.push_back("FAKECUDA_MONITOR_OVERCOUNT=1");
  if (o.read_delay_us != 0) env.push_back("FAKECUDA_MONITOR_READ_DELAY_US=" + std::to_string(o.read_delay_us));
  if (o.chaos) env.push_back("FAKECUDA_CHAOS_SEED=" + std::to_string(seed));
  if (has("resident-wait") || has("resident-spill")) {
    const bool wait = has("resident-wait") && (!has("resident-spill") || rng.chance(50));
    env.push_back(std::string("GPUSLICE_OVERSUBSCRIBE=") + (wait ? "wait" : "spill"));
    env.push_back("GPUSLICE_MEMORY_RESIDENT=" + std::to_string(o.quota_mib / 2) + "Mi");
    env.push_back("GPUSLICE_OVERSUBSCRIBE_WAIT=20ms");
    result.classes += wait ? " (wait)" : " (spill)";
  }
  const std::string log = dir + "/workers.log";
  auto start_worker = [&](int index) {
    std::vector<std::string> worker_env = env;
    worker_env.push_back("FAKECUDA_CHAOS_STREAM=" + std::to_string(index));
    if (o.preload || index == 0) worker_env.push_back(preload);
    return spawn({self, "--worker", std::to_string(index), "--seed", std::to_string(seed), "--threads",
                  std::to_string(o.threads), "--ops", std::to_string(o.ops), "--classes", join(worker_classes),
                  "--quota", std::to_string(quota)},
                 worker_env, log);
  };
  // The agent (agent classes): the deployed binary with the simulated NVML
  // (reconciliation: agent_extra_bytes), reaping, and region removal after a
  // short grace; SIGKILLed and restarted at random ("agent-kill").
  std::string interval = has("agent-fast") && (!has("agent") || rng.chance(50)) ? "5ms" : "100ms";
  if (agent_on) result.classes.append(" (agent ").append(interval).append(")");
  auto start_agent = [&] {
    std::vector<std::string> agent_env = base_env();
    agent_env.insert(agent_env.end(), machine.begin(), machine.end());
    return spawn(
        {o.build + "/bin/gpuslice-agent", "--region-dir", region_dir, "--nvml", o.build + "/fakecuda/libnvidia-ml.so.1",
         "--interval", interval, "--rescan", interval, "--grace", "10ms", "--listen", "off"},
        agent_env, dir + "/agent.log");
  };
  pid_t agent = agent_on ? start_agent() : -1;
  int agent_kills = 0;
  auto note = [&](const std::string& line) {
    if (FILE* f = std::fopen(log.c_str(), "a")) {
      std::fprintf(f, "launcher: %s\n", line.c_str());
      std::fclose(f);
    }
  };
  std::map<pid_t, int> live;
  for (int i = 0; i < o.procs; ++i) {
    live[start_worker(i)] = i;
    if (i == 0 && !o.preload) {
      // The others bypass gpuslice: let the first create the region (and its
      // device entry, at its first context) so that the monitor has a quota.
      for (int t = 0; t < 500 && access(region.c_str(), F_OK) != 0; ++t) usleep(10000);
      usleep(100000);
    }
  }
  int next_index = o.procs;
  int kills = 0;
  int waves = has("gap") ? 1 : 0;  // waves still to start once the container is empty
  const std::uint64_t begin = now_ms();
  while (!live.empty()) {
    int status = 0;
    pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0 && done == agent) {
      ++result.failures;
      result.detail.append(" agent status ").append(std::to_string(status)).append(";");
      agent = -1;
      continue;
    }
    if (done > 0) {
      auto it = live.find(done);
      if (it != live.end()) {
        const bool killed_by_us = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
        if (!killed_by_us && (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
          ++result.failures;
          result.detail += " worker " + std::to_string(it->second) + " status " + std::to_string(status) + ";";
        }
        live.erase(it);
        if (live.empty() && waves > 0) {
          // The container empty for a while: the agent may remove the region.
          --waves;
          const std::uint64_t gap_ms = rng.below(150);
          note(std::string("container empty for ").append(std::to_string(gap_ms)).append(" ms"));
          usleep(static_cast<useconds_t>(gap_ms * 1000));
          for (int i = 0; i < o.procs; ++i, ++next_index) live[start_worker(next_index)] = next_index;
        }
      }
      continue;
    }
    if (now_ms() - begin > 30000) {
      result.hang = true;
      for (auto& [pid, index] : live) kill(pid, SIGKILL);
      for (auto& [pid, index] : live) waitpid(pid, &status, 0);
      live.clear();
      break;
    }
    if (has("smi") && rng.chance(12)) {
      static const std::uint64_t kFractions[] = {4, 3, 2, 1};  // quota * x / 4
      const std::uint64_t mib = o.quota_mib * kFractions[rng.below(4)] / 4;
      pid_t smi =
          spawn({o.build + "/bin/gpuslice-smi", "set", "--region", region, "--memory", std::to_string(mib) + "Mi"},
                base_env(), dir + "/smi.log");
      waitpid(smi, &status, 0);
    }
    if (has("kill") && kills < 3 && rng.chance(8)) {
      auto victim = live.begin();
      std::advance(victim, static_cast<long>(rng.below(live.size())));
      kill(victim->first, SIGKILL);
      if (FILE* f = std::fopen(log.c_str(), "a")) {
        std::fprintf(f, "launcher: SIGKILL worker %d pid %d at +%llu ms\n", victim->second,
                     static_cast<int>(victim->first), static_cast<unsigned long long>(now_ms() - begin));
        std::fclose(f);
      }
      ++kills;
      live[start_worker(next_index)] = next_index;
      ++next_index;
    }
    if (has("agent-kill") && agent > 0 && agent_kills < 5 && rng.chance(4)) {
      kill(agent, SIGKILL);
      waitpid(agent, &status, 0);
      note(std::string("SIGKILL agent pid ")
               .append(std::to_string(agent))
               .append(" at +")
               .append(std::to_string(now_ms() - begin))
               .append(" ms"));
      ++agent_kills;
      usleep(static_cast<useconds_t>(rng.below(50) * 1000));  // down for a while (at most 49 ms)
      agent = start_agent();
    }
    usleep(static_cast<useconds_t>(2000 + rng.below(8000)));
  }
  if (agent > 0) {
    int status = 0;
    kill(agent, SIGKILL);
    waitpid(agent, &status, 0);
  }
  // Reap children the workers' forks may have left (none expected).
  // The monitor's own count of checks (<state>.monitor: magic, violations, checks).
  {
    std::ifstream in(dir + "/state.monitor", std::ios::binary);
    std::uint64_t words[3] = {};
    if (in.read(reinterpret_cast<char*>(words), sizeof(words))) result.checks = words[2];
    // And the refusals it judged and those it could not (refusal.cc).
    using gpuslice::chaos::internal::MonitorShared;
    std::uint64_t refusals[4] = {};
    in.seekg(static_cast<std::streamoff>(offsetof(MonitorShared, refusals_judged)));
    static_assert(offsetof(MonitorShared, refusals_skipped) == offsetof(MonitorShared, refusals_judged) + 8);
    static_assert(offsetof(MonitorShared, count_unsettled) == offsetof(MonitorShared, refusals_judged) + 24);
    if (in && in.read(reinterpret_cast<char*>(refusals), sizeof(refusals))) {
      result.refusals_judged = refusals[0];
      result.refusals_skipped = refusals[1];
      result.count_judged = refusals[2];
      result.count_unsettled = refusals[3];
    }
    std::uint64_t released = 0;
    in.clear();
    in.seekg(static_cast<std::streamoff>(offsetof(MonitorShared, count_released)));
    if (in && in.read(reinterpret_cast<char*>(&released), sizeof(released))) result.count_released = released;
  }
  const std::string report = read_file(dir + "/violations");
  result.violations = count_of(report, "fakecuda-monitor: VIOLATION");
  if (result.violations > 0 || result.failures > 0 || result.hang || o.verbose) {
    result.detail += "\n" + report;
    const std::string workers = read_file(log);
    if (result.failures > 0 || result.hang || o.verbose) {
      result.detail += workers;
      if (agent_on) result.detail += read_file(dir + "/agent.log");
    } else {
      std::istringstream in(workers);  // the launcher's own lines (kills)
      for (std::string line; std::getline(in, line);) {
        if (line.rfind("launcher:", 0) == 0) result.detail += line + "\n";
      }
    }
  }
  if (!o.keep) {
    std::string cmd = "rm -rf '" + dir + "'";
    if (std::system(cmd.c_str()) != 0) result.detail += " (could not remove " + dir + ")";
  } else {
    result.detail += " (kept " + dir + ")";
  }
  return result;
}

int usage(const char* why) {
  std::fprintf(stderr, "chaos_torture: %s\nclasses:", why);
  for (const auto& c : all_classes()) std::fprintf(stderr, " %s", c.c_str());
  std::fprintf(stderr, "\n");
  return 2;
}

bool parse_u64(const char* text, std::uint64_t& out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  char* end = nullptr;
  out = std::strtoull(text, &end, 10);
  return *end == '\0';
}

}  // namespace
}  // namespace gpuslice::chaos

int main(int argc, char** argv) {
  using namespace gpuslice::chaos;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 2;
  self[n] = '\0';
  Options o;
  WorkerOptions w;
  bool worker = false;
  std::vector<std::string> exclude;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    std::uint64_t x = 0;
    if (a == "--keep") {
      o.keep = true;
      continue;
    }
    if (a == "--verbose") {
      o.verbose = true;
      continue;
    }
    if (a == "--exact") {
      o.exact = true;
      continue;
    }
    if (a == "--no-chaos") {
      o.chaos = false;
      continue;
    }
    if (a == "--no-refusals") {
      o.judge_refusals = false;
      continue;
    }
    if (a == "--overcount") {
      o.overcount = true;
      continue;
    }
    if (a == "--no-preload") {
      o.preload = false;
      continue;
    }
    if (v == nullptr) return usage(("missing value after " + a).c_str());
    ++i;
    if (a == "--worker" && parse_u64(v, x)) {
      worker = true;
      w.index = static_cast<int>(x);
    } else if (a == "--seed" && parse_u64(v, x)) {
      w.seed = x;
      o.seeds = {x};
    } else if (a == "--seeds") {
      // Ranges, comma-separated: the CI subset leaves out seeds that find a
      // known open defect (CMakeLists.txt).
      o.seeds.clear();
      for (const std::string& s : split(v)) {
        std::size_t dash = s.find('-');
        std::uint64_t lo = 0, hi = 0;
        if (!parse_u64(s.substr(0, dash).c_str(), lo) ||
            (dash != std::string::npos && !parse_u64(s.substr(dash + 1).c_str(), hi)))
          return usage("--seeds: expected A or A-B, comma-separated");
        if (dash == std::string::npos) hi = lo;
        if (hi < lo) return usage("--seeds: B < A");
        for (std::uint64_t seed = lo; seed <= hi; ++seed) o.seeds.push_back(seed);
      }
      if (o.seeds.empty()) return usage("--seeds: none");
    } else if (a == "--classes") {
      if (std::string(v) != "all") o.classes = split(v);
      w.classes = o.classes;
    } else if (a == "--exclude")
      exclude = split(v);
    else if (a == "--library" && *v != '\0')
      o.library = v;
    else if (a == "--lag" && parse_u64(v, x) && x >= 1 && x <= 60000)
      o.lag_ms = x;
    else if (a == "--read-delay" && parse_u64(v, x) && x <= 10000)
      o.read_delay_us = x;
    else if (a == "--procs" && parse_u64(v, x) && x >= 1 && x <= 32)
      o.procs = static_cast<int>(x);
    else if (a == "--threads" && parse_u64(v, x) && x >= 1 && x <= 32) {
      o.threads = static_cast<int>(x);
      w.threads = o.threads;
    } else if (a == "--ops" && parse_u64(v, x) && x >= 1) {
      o.ops = static_cast<int>(x);
      w.ops = o.ops;
    } else if (a == "--quota" && parse_u64(v, x)) {
      w.quota = x;
      o.quota_mib = x >> 20 ? x >> 20 : x;
    } else
      return usage(("bad argument " + a + " " + v).c_str());
  }
  for (const auto& c : o.classes) {
    if (!known(c)) return usage(("unknown class '" + c + "'").c_str());
  }
  for (const auto& c : exclude) {
    if (!known(c)) return usage(("unknown class '" + c + "'").c_str());
    o.classes.erase(std::remove(o.classes.begin(), o.classes.end(), c), o.classes.end());
  }
  if (o.classes.empty()) return usage("no class left");
  if (worker) {
    w.classes.clear();
    for (const auto& c : o.classes) {
      if (!launcher_class(c)) w.classes.push_back(c);
    }
    return run_worker(w, self);
  }
  const std::uint64_t begin = now_ms();
  int violations = 0, failed = 0;
  std::uint64_t judged = 0, skipped = 0, count_judged = 0, count_unsettled = 0, count_released = 0;
  std::string failed_seeds;
  for (std::uint64_t seed : o.seeds) {
    const std::uint64_t t0 = now_ms();
    SeedResult r = run_seed(o, seed, self);
    const bool bad = r.violations > 0 || r.failures > 0 || r.hang;
    violations += r.violations;
    judged += r.refusals_judged;
    skipped += r.refusals_skipped;
    count_judged += r.count_judged;
    count_unsettled += r.count_unsettled;
    count_released += r.count_released;
    if (bad) {
      ++failed;
      failed_seeds += (failed_seeds.empty() ? "" : " ") + std::to_string(seed);
    }
    std::printf("seed=%llu classes=%s checks=%llu violations=%d failures=%d hang=%d time_ms=%llu%s\n",
                static_cast<unsigned long long>(seed), r.classes.c_str(), static_cast<unsigned long long>(r.checks),
                r.violations, r.failures, r.hang ? 1 : 0, static_cast<unsigned long long>(now_ms() - t0),
                bad || o.verbose ? r.detail.c_str() : "");
    std::fflush(stdout);
  }
  const double secs = static_cast<double>(now_ms() - begin) / 1000.0;
  const std::uint64_t count = o.seeds.size();
  std::printf(
      "summary: seeds=%llu failed=%d violations=%d time_s=%.1f seeds_per_s=%.2f classes=%s failed_seeds=[%s] "
      "refusals_judged=%llu refusals_not_judged=%llu count_checks_judged=%llu count_checks_not_settled=%llu "
      "count_checks_excusing_released_files=%llu\n",
      static_cast<unsigned long long>(count), failed, violations, secs, static_cast<double>(count) / secs,
      join(o.classes).c_str(), failed_seeds.c_str(), static_cast<unsigned long long>(judged),
      static_cast<unsigned long long>(skipped), static_cast<unsigned long long>(count_judged),
      static_cast<unsigned long long>(count_unsettled), static_cast<unsigned long long>(count_released));
  return failed == 0 ? 0 : 1;
}
