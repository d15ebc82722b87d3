#include "enforce.h"

#include <errno.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <cstring>

#include "log.h"
#include "platform/procfs.h"
#include "region_io.h"
#include "text.h"
#include "view.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

constexpr std::uint64_t kForgetKilledNs = 60'000'000'000;  // a killed process NVML still lists is not chosen again

std::string container_of(const TrackedRegion& t) {
  std::string name = printable(t.sample.container_name, sizeof t.sample.container_name);
  return name.empty() ? tools::escape_untrusted(t.owner.container) : name;
}

}  // namespace

bool maps_file(std::uint32_t host_pid, dev_t dev, ino_t ino) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/maps", host_pid);
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return false;
  char* line = nullptr;
  std::size_t cap = 0;
  bool found = false;
  while (!found && getline(&line, &cap, f) > 0) {
    unsigned maj = 0, min = 0;
    unsigned long long inode = 0;
    // address perms offset major:minor inode [path]
    if (std::sscanf(line, "%*s %*s %*s %x:%x %llu", &maj, &min, &inode) == 3) {
      found = inode == static_cast<unsigned long long>(ino) && maj == major(dev) && min == minor(dev);
    }
  }
  std::free(line);
  std::fclose(f);
  return found;
}

bool kill_if_same(std::uint32_t host_pid, std::uint64_t start_time, std::uint64_t pidns, std::string* why) {
  if (host_pid <= 1 || host_pid == static_cast<std::uint32_t>(getpid())) {
    *why = "never the agent itself or pid 1";
    return false;
  }
  // The pidfd names the process that has the pid now: checked below, and the
  // signal goes to that same process even if the pid is recycled meanwhile.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(host_pid), 0u));
  if (pidfd < 0 && errno != ENOSYS) {
    *why = "pidfd_open: "s + std::strerror(errno);
    return false;
  }
  platform::procfs::Process p;
  const int err = platform::procfs::read_process(host_pid, pidns != 0, &p);
  auto done = [&](bool ok, std::string what) {
    if (pidfd >= 0) close(pidfd);
    if (!ok) *why = std::move(what);
    return ok;
  };
  if (err != 0) return done(false, "gone ("s + std::strerror(err) + ")");
  if (p.stat.start_time != start_time) return done(false, "its pid now names another process (start time differs)");
  if (pidns != 0 && p.pidns_inode != pidns) return done(false, "its pid now names a process of another pid namespace");
  if (p.stat.state == 'Z' || p.stat.state == 'X') return done(false, "already exiting");
  const long rc = pidfd >= 0 ? syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0u)
                             : kill(static_cast<pid_t>(host_pid), SIGKILL);
  return done(rc == 0, rc == 0 ? "" : "signal: "s + std::strerror(errno));
}

Enforcer::Enforcer(EnforceMode mode, std::uint64_t tolerance_bytes, std::uint32_t cycles)
    : mode_(mode), tolerance_(tolerance_bytes), cycles_(cycles < 1 ? 1 : cycles) {}

void Enforcer::run(const std::vector<TrackedRegion*>& regions, const std::vector<UnregisteredProc>& unregistered,
                   const GpuSample* gpu, std::uint64_t now_ns) {
  if (gpu == nullptr) {
    episodes_.clear();
    return;
  }
  for (TrackedRegion* t : regions) {
    if (t->dropped) continue;
    const Region* r = t->map.get();
    for (const DeviceSample& d : t->sample.devices) {
      const DeviceStats& st = t->sample.stats[d.index];
      if (d.gpu < 0 || !st.nvml_known) continue;
      std::uint64_t quota = kUnlimited;
      if (!guarded([&] { quota = r->devices[d.index].quota_bytes.load(std::memory_order_relaxed); })) break;
      if (quota == kUnlimited) continue;
      const std::uint64_t dying = killed_bytes(*t, d, unregistered);
      const std::uint64_t held = st.nvml_bytes > dying ? st.nvml_bytes - dying : 0;
      const bool over = held > quota && held - quota > tolerance_;
      if (!over) continue;  // an episode not seen this cycle ends below
      const std::string key = t->rel + "\n" + std::to_string(t->map.inode()) + "\n" + std::to_string(d.index);
      Episode& e = episodes_[key];
      e.seen_ns = now_ns;
      if (++e.cycles >= cycles_) act(*t, d, quota, held, e, unregistered, gpu, now_ns);
    }
  }
  for (auto it = episodes_.begin(); it != episodes_.end();) {
    it = it->second.seen_ns != now_ns ? episodes_.erase(it) : std::next(it);
  }
  for (auto* m : {&killed_, &passed_}) {
    for (auto it = m->begin(); it != m->end();) {
      it = now_ns - it->second > kForgetKilledNs ? m->erase(it) : std::next(it);
    }
  }
}

std::uint64_t Enforcer::killed_bytes(const TrackedRegion& t, const DeviceSample& d,
                                     const std::vector<UnregisteredProc>& unregistered) const {
  if (killed_.empty()) return 0;
  std::uint64_t bytes = 0;
  for (const UnregisteredProc& u : unregistered) {
    if (u.region == &t && u.gpu == d.gpu && killed_.count({u.host_pid, u.start_time}) != 0) bytes += u.used_bytes;
  }
  for (const SlotSample& s : t.sample.slots) {
    if (s.res.host_pid != 0 && killed_.count({s.res.host_pid, s.key.start_time}) != 0)
      bytes += s.nvml_now_bytes[d.index];
  }
  return bytes;
}

bool Enforcer::choose(const TrackedRegion& t, const DeviceSample& d, const std::vector<UnregisteredProc>& unregistered,
                      Victim* out) const {
  auto skip = [&](std::uint32_t pid, std::uint64_t start) {
    return killed_.count({pid, start}) != 0 || passed_.count({pid, start}) != 0;
  };
  std::vector<Victim> unreg, reg;
  for (const UnregisteredProc& u : unregistered) {
    if (u.region == &t && u.gpu == d.gpu && u.pidns != 0 && !skip(u.host_pid, u.start_time))
      unreg.push_back(Victim{u.host_pid, 0, u.start_time, u.pidns, u.used_bytes, false});
  }
  for (const SlotSample& s : t.sample.slots) {
    if (s.res.fate != Fate::alive || s.res.host_pid == 0 || s.key.pidns_inode == 0) continue;
    if (skip(s.res.host_pid, s.key.start_time) || s.nvml_now_bytes[d.index] == 0) continue;
    reg.push_back(
        Victim{s.res.host_pid, s.key.pid, s.key.start_time, s.key.pidns_inode, s.nvml_now_bytes[d.index], true});
  }
  auto largest_first = [](const Victim& x, const Victim& y) { return x.used_bytes > y.used_bytes; };
  std::sort(unreg.begin(), unreg.end(), largest_first);
  std::sort(reg.begin(), reg.end(), largest_first);
  // A slot is the container's word: its process must map this very region
  // file (a slot forged to name another container's process does not), and
  // an unregistered process's pid namespace must hold such a process.
  std::map<std::uint64_t, bool> ns_proven;
  auto namespace_is_ours = [&](std::uint64_t pidns) {
    auto [it, inserted] = ns_proven.try_emplace(pidns, false);
    if (!inserted) return it->second;
    for (const SlotSample& s : t.sample.slots) {
      if (s.res.fate == Fate::alive && s.res.host_pid != 0 && s.key.pidns_inode == pidns &&
          maps_file(s.res.host_pid, t.map.device(), t.map.inode())) {
        return it->second = true;
      }
    }
    return false;
  };
  // A process that never registered first: nothing it holds was admitted.
  for (const Victim& v : unreg) {
    if (namespace_is_ours(v.pidns)) {
      *out = v;
      return true;
    }
  }
  for (const Victim& v : reg) {
    if (maps_file(v.host_pid, t.map.device(), t.map.inode())) {
      *out = v;
      return true;
    }
  }
  return false;
}

void Enforcer::act(TrackedRegion& t, const DeviceSample& d, std::uint64_t quota, std::uint64_t held, Episode& e,
                   const std::vector<UnregisteredProc>& unregistered, const GpuSample* gpu, std::uint64_t now_ns) {
  const std::string container = container_of(t);
  const std::string& uuid = gpu->devices[static_cast<std::size_t>(d.gpu)].uuid_text;
  if (!e.reported) {
    e.reported = true;
    ++counters_.over_reports;
    log(LogLevel::warn,
        "container \"%s\" (region %s): holds %s on %s according to NVML, above its quota %s plus the tolerance %s "
        "for %u cycle(s)%s",
        container.c_str(), t.rel.c_str(), format_bytes(held).c_str(), uuid.c_str(), format_bytes(quota).c_str(),
        format_bytes(tolerance_).c_str(), e.cycles,
        mode_ == EnforceMode::kill ? "" : " (--enforce=report: nothing is killed)");
  }
  if (mode_ != EnforceMode::kill) return;
  Victim v;
  if (!choose(t, d, unregistered, &v)) {
    log_once(LogLevel::warn, "enforce-none:"s + t.rel + ":" + std::to_string(d.index),
             "container \"%s\" (region %s): over its quota on %s but no process of it can be chosen to kill",
             container.c_str(), t.rel.c_str(), uuid.c_str());
    return;
  }
  std::string why;
  if (!kill_if_same(v.host_pid, v.start_time, v.pidns, &why)) {
    ++counters_.kill_failures;
    passed_[{v.host_pid, v.start_time}] = now_ns;  // not chosen again for a while: the next holder is
    log(LogLevel::warn, "container \"%s\" (region %s): did not kill host pid %u: %s", container.c_str(), t.rel.c_str(),
        v.host_pid, why.c_str());
    return;
  }
  ++counters_.kills;
  ++kills_[{container, t.rel}];
  killed_[{v.host_pid, v.start_time}] = now_ns;
  e.cycles = 0;  // its memory takes a moment to go: another process only after as many cycles again
  e.reported = false;
  log(LogLevel::warn,
      "container \"%s\" (region %s): killed host pid %u (%s%s), holding %s on %s: the container held %s, above its "
      "quota %s plus the tolerance %s for %u cycle(s) (--enforce=kill)",
      container.c_str(), t.rel.c_str(), v.host_pid, v.registered ? "registered, pid " : "not registered with gpuslice",
      v.registered ? std::to_string(v.ns_pid).c_str() : "", format_bytes(v.used_bytes).c_str(), uuid.c_str(),
      format_bytes(held).c_str(), format_bytes(quota).c_str(), format_bytes(tolerance_).c_str(), cycles_);
}

std::vector<RegionCount> Enforcer::kills_by_region() const {
  std::vector<RegionCount> out;
  for (const auto& [k, n] : kills_) out.push_back({k.first, k.second, n});
  return out;
}

}  // namespace gpuslice::agent
