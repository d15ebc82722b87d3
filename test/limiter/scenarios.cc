#include "scenarios.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "gpuslice/region.h"
#include "platform/clock.h"
#include "shm/region_file.h"

namespace gpuslice::test::limiter {

std::uint64_t mono_now_ns() { return platform::monotonic_ns(); }

std::vector<std::string> spin(const std::string& path, unsigned kernel_us, double seconds, const std::string& via,
                              double inflight_ms) {
  std::ostringstream s, m;
  s << seconds;
  m << inflight_ms;
  return {"--path", path,    "--kernel-us", std::to_string(kernel_us), "--seconds",
          s.str(),  "--via", via,           "--inflight-ms",           m.str()};
}

std::uint64_t ContainerResult::first_start() const {
  std::uint64_t t = ~0ull;
  for (const auto& p : procs)
    if (p.start_ns != 0 && p.start_ns < t) t = p.start_ns;
  return t == ~0ull ? 0 : t;
}

std::string ContainerResult::describe() const {
  std::ostringstream s;
  for (const auto& p : procs)
    s << "pid " << p.pid << " start=" << p.start_ns << " end=" << p.end_ns << " launches=" << p.launches << " "
      << p.result.describe() << "\n";
  return s.str();
}

Machine::Machine() {
  // The harness gives children no FAKECUDA_* of ours: the profile is passed on explicitly.
  const char* profile = std::getenv("FAKECUDA_PROFILE");
  profile_ = profile != nullptr ? profile : "";
}

Env Machine::env(bool preload) const {
  Env e = sandbox_.env(preload);
  if (!profile_.empty()) e["FAKECUDA_PROFILE"] = profile_;
  return e;
}

std::string Machine::region_path(const std::string& container) const { return sandbox_.path(container + ".region"); }

std::vector<ContainerResult> Machine::run(const std::vector<Container>& containers, int timeout_ms) {
  struct Pending {
    double delay_s;
    std::size_t container;
    const Proc* proc;
    std::vector<std::string> argv;
    Env env;
    std::string out;
  };
  std::vector<Pending> pending;
  for (std::size_t c = 0; c < containers.size(); ++c) {
    const Container& k = containers[c];
    Env env = this->env(true);
    env["GPUSLICE_REGION"] = region_path(k.name);
    env["GPUSLICE_CONTAINER_NAME"] = k.name;
    if (!k.sm_limit.empty()) env["GPUSLICE_SM_LIMIT"] = k.sm_limit;
    if (!k.sm_policy.empty()) env["GPUSLICE_SM_POLICY"] = k.sm_policy;
    env = merge(env, k.extra);
    for (std::size_t p = 0; p < k.procs.size(); ++p) {
      std::vector<std::string> argv{bin("spinload")};
      argv.insert(argv.end(), k.procs[p].args.begin(), k.procs[p].args.end());
      pending.push_back(Pending{k.procs[p].delay_s, c, &k.procs[p], argv, env,
                                sandbox_.path(k.name + "." + std::to_string(p) + ".out")});
    }
  }
  std::stable_sort(pending.begin(), pending.end(),
                   [](const Pending& a, const Pending& b) { return a.delay_s < b.delay_s; });
  std::vector<ContainerResult> results(containers.size());
  std::vector<std::pair<pid_t, std::size_t>> started;
  const std::uint64_t t0 = mono_now_ns();
  for (const Pending& p : pending) {
    const std::uint64_t at = t0 + static_cast<std::uint64_t>(p.delay_s * 1e9);
    const std::uint64_t now = mono_now_ns();
    if (at > now) usleep(static_cast<useconds_t>((at - now) / 1000));
    started.emplace_back(spawn(p.argv, p.env, p.out), &p - pending.data());
  }
  // Processes to kill mid-run (a container process dying at a random point).
  std::vector<std::pair<double, pid_t>> kills;
  for (const auto& [pid, index] : started)
    if (pending[index].proc->kill_after_s > 0) kills.emplace_back(pending[index].proc->kill_after_s, pid);
  std::sort(kills.begin(), kills.end());
  for (const auto& [when, pid] : kills) {
    const std::uint64_t at = t0 + static_cast<std::uint64_t>(when * 1e9);
    const std::uint64_t now = mono_now_ns();
    if (at > now) usleep(static_cast<useconds_t>((at - now) / 1000));
    kill(pid, SIGKILL);
  }
  for (const auto& [pid, index] : started) {
    const Pending& p = pending[index];
    ProcResult r;
    r.pid = pid;
    r.result = wait(pid, p.out, timeout_ms);
    for (const std::string& line : lines_with(r.result.out, "spinload ")) {
      r.start_ns = std::strtoull(field(line, "start_ns").c_str(), nullptr, 10);
      r.end_ns = std::strtoull(field(line, "end_ns").c_str(), nullptr, 10);
      r.launches = std::strtoull(field(line, "launches").c_str(), nullptr, 10);
    }
    results[p.container].procs.push_back(r);
  }
  return results;
}

std::uint64_t Machine::busy_ns(std::uint64_t t0, std::uint64_t t1, pid_t pid, int device) const {
  std::vector<std::string> argv{bin("fakecuda-ctl"), "busy", std::to_string(device), std::to_string(t0),
                                std::to_string(t1)};
  if (pid != 0) argv.push_back(std::to_string(pid));
  Result r = gpuslice::test::run(argv, env(false), 30000);
  if (r.exit_code != 0) throw std::runtime_error("fakecuda-ctl busy failed: " + r.describe());
  return std::strtoull(r.out.c_str(), nullptr, 10);
}

double Machine::share(const ContainerResult& c, std::uint64_t t0, std::uint64_t t1, int device) const {
  std::uint64_t busy = 0;
  for (const auto& p : c.procs) busy += busy_ns(t0, t1, p.pid, device);
  return t1 > t0 ? 100.0 * static_cast<double>(busy) / static_cast<double>(t1 - t0) : 0.0;
}

bool Machine::set_region_limit(const std::string& container, unsigned pct) const {
  shm::Error err{};
  Region* r = shm::attach_existing(region_path(container).c_str(), true, &err);
  if (r == nullptr) return false;
  bool any = false;
  for (DeviceState& d : r->devices) {
    if (d.uuid_state.load() != shm::kDevicePublished) continue;
    d.sm_limit_pct.store(pct);
    any = true;
  }
  shm::detach(r);
  return any;
}

}  // namespace gpuslice::test::limiter
