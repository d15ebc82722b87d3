#include "backstop.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "gpuslice/nvml_abi.h"
#include "log.h"
#include "nvml.h"
#include "region_io.h"
#include "scan.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

// How often a failed set is tried again (the same target), and how often the
// container's cgroup is read again while its processes stay the same.
constexpr std::uint64_t kRetryNs = 10'000'000'000;
constexpr std::uint64_t kResolveNs = 60'000'000'000;
// A region gone whose cgroup still has processes: checked this often.
constexpr std::uint64_t kGoneCheckNs = 1'000'000'000;

std::string read_text(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0 || out.size() > (std::size_t{1} << 20)) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// A cgroup with no process left (cgroup.procs empty).
bool cgroup_empty(const std::string& dir) {
  return read_text(dir + "/cgroup.procs").find_first_not_of(" \n") == std::string::npos;
}

}  // namespace

const char* backstop_name(BackstopKind kind) {
  switch (kind) {
    case BackstopKind::driver: return "driver";
    case BackstopKind::agent: return "agent";
    case BackstopKind::none: break;
  }
  return "none";
}

bool cgroup_v2_line(const std::string& text, std::string* path) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) == 0 && line.size() > 3 && line[3] == '/') {
      *path = line.substr(3);
      return true;
    }
  }
  return false;
}

std::string cgroup2_mount(const std::string& mountinfo) {
  std::istringstream in(mountinfo);
  std::string line, first;
  while (std::getline(in, line)) {
    const auto dash = line.find(" - ");
    if (dash == std::string::npos || line.compare(dash + 3, 8, "cgroup2 ") != 0) continue;
    std::istringstream fields(line.substr(0, dash));
    std::string f, mount_point;
    for (int i = 0; i < 5 && fields >> f; ++i) {
      if (i == 4) mount_point = f;
    }
    if (mount_point == "/sys/fs/cgroup") return mount_point;
    if (first.empty() && mount_point.find('\\') == std::string::npos) first = mount_point;
  }
  return first;
}

std::string common_cgroup(const std::vector<std::string>& paths, const std::string& own, std::string* why) {
  if (paths.empty()) {
    *why = "no process of the container is known yet";
    return "";
  }
  for (const std::string& p : paths) {
    if (p.empty()) {
      *why = "a process of the container has no cgroup v2 (cgroup v1)";
      return "";
    }
    if (p.rfind("/..", 0) == 0) {
      *why = "a process's cgroup is outside the agent's cgroup namespace (run the agent in the host's)";
      return "";
    }
    if (p != paths.front()) {
      *why = "the container's processes are in more than one cgroup";
      return "";
    }
  }
  const std::string& path = paths.front();
  if (path == "/") {
    *why = "the container's processes are in the root cgroup";
    return "";
  }
  if (own == path || own.rfind(path + "/", 0) == 0) {
    *why = "the container's processes are in the agent's own cgroup (or an ancestor of it)";
    return "";
  }
  why->clear();
  return path;
}

Backstop::Backstop(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  mount_ = cgroup2_mount(read_text("/proc/self/mountinfo"));
  cgroup_v2_line(read_text("/proc/self/cgroup"), &own_cgroup_);
}

Backstop::~Backstop() = default;

void Backstop::resolve(Entry& e, const TrackedRegion& t, std::uint64_t now) {
  std::uint64_t sig = 0;
  std::vector<std::uint32_t>& pids = pids_;  // kept across cycles: no allocation per region
  pids.clear();
  for (const SlotSample& s : t.sample.slots) {
    if (s.res.fate != Fate::alive || s.res.host_pid == 0) continue;
    pids.push_back(s.res.host_pid);
    sig = sig * 0x100000001B3ull ^ s.res.host_pid;
  }
  if (pids.empty()) return;  // keep the cgroup last resolved: the container may start processes again
  if (sig == e.pids_sig && e.resolved_ns != 0 && now - e.resolved_ns < kResolveNs) return;
  e.pids_sig = sig;
  e.resolved_ns = now;
  std::vector<std::string> paths;
  for (std::uint32_t pid : pids) {
    std::string path;
    const std::string text = read_text("/proc/" + std::to_string(pid) + "/cgroup");
    if (text.empty()) continue;  // exited since the pid map saw it
    cgroup_v2_line(text, &path);
    paths.push_back(path);
  }
  if (paths.empty()) return;
  e.cgroup = common_cgroup(paths, own_cgroup_, &e.why);
}

bool Backstop::apply(Applied& a, Nvml& nvml, int gpu, const std::string& cgroup, std::uint64_t hard,
                     const std::string& rel, std::uint64_t now) {
  const int rc = nvml.set_memory_limit(static_cast<std::size_t>(gpu), cgroup, 0, hard);
  if (rc != NVML_SUCCESS) {
    ++errors_;
    // What no retry changes (the driver's branch, a MIG device, the symbol,
    // our privilege): not tried again on this device.
    if (rc == NVML_ERROR_NOT_SUPPORTED || rc == NVML_ERROR_FUNCTION_NOT_FOUND || rc == NVML_ERROR_NO_PERMISSION) {
      if (gpu_rc_.size() <= static_cast<std::size_t>(gpu)) gpu_rc_.resize(static_cast<std::size_t>(gpu) + 1, 0);
      gpu_rc_[static_cast<std::size_t>(gpu)] = rc;
    }
    a.last_rc = rc;
    a.retry_ns = now + kRetryNs;
    a.tried_cgroup = cgroup;
    a.tried_hard = hard;
    log_once(LogLevel::warn, "backstop-rc-"s + std::to_string(rc),
             "no driver backstop: nvmlDeviceSetMemoryLimits_v1 on %s (region %s): %s; driver %s (the limit needs "
             "R615+, a non-MIG GPU and cgroup v2 at /sys/fs/cgroup); logged once per cause",
             cgroup.c_str(), rel.c_str(), nvml.error_text(rc).c_str(), nvml.driver_version().c_str());
    return false;
  }
  if (a.cgroup != cgroup || a.hard != hard)
    log(LogLevel::info, "driver backstop: region %s: %s limited to %llu bytes on NVML device %d", rel.c_str(),
        cgroup.c_str(), static_cast<unsigned long long>(hard), gpu);
  ++limits_set_;
  a.cgroup = cgroup;
  a.hard = hard;
  a.gpu = gpu;
  a.last_rc = 0;
  return true;
}

void Backstop::clear(Applied& a, Nvml& nvml, const std::string& rel) {
  if (a.cgroup.empty()) return;
  if (is_dir(a.cgroup)) {
    const int rc = nvml.set_memory_limit(static_cast<std::size_t>(a.gpu), a.cgroup, 0, NVML_DEVICE_MEMORY_LIMIT_MAX);
    if (rc != NVML_SUCCESS) {
      ++errors_;
      log(LogLevel::warn, "driver backstop: region %s: clearing the limit on %s: %s", rel.c_str(), a.cgroup.c_str(),
          nvml.error_text(rc).c_str());
      return;
    }
    ++limits_cleared_;
    log(LogLevel::info, "driver backstop: region %s: limit on %s cleared", rel.c_str(), a.cgroup.c_str());
  }
  a = Applied{};
}

void Backstop::cycle(const std::vector<TrackedRegion*>& active, Nvml* nvml, bool agent_enforces, std::uint64_t now) {
  for (auto& [key, e] : entries_) e.seen = false;
  const auto fallback = static_cast<std::uint8_t>(agent_enforces ? BackstopKind::agent : BackstopKind::none);
  // Why none can be set, once per cycle (not once per region: there may be thousands).
  bool possible = enabled_;
  if (possible && !active.empty() && (nvml == nullptr || !nvml->available())) {
    log_once(LogLevel::warn, "backstop-no-nvml", "no driver backstop: NVML is not loaded");
    possible = false;
  }
  if (possible && !active.empty() && mount_.empty()) {
    log_once(LogLevel::warn, "backstop-no-cgroup2",
             "no driver backstop: no cgroup v2 mount (a cgroup v1 host); the driver's memory limit needs cgroup v2");
    possible = false;
  }
  for (TrackedRegion* t : active) {
    if (t->dropped) continue;
    for (const DeviceSample& d : t->sample.devices) {
      t->sample.stats[d.index].backstop = fallback;
      t->sample.stats[d.index].backstop_limit_bytes = 0;
    }
    if (!possible) continue;
    key_.assign(std::to_string(t->root)).append(1, ':').append(t->rel);  // no allocation once key_ is long enough
    auto found = entries_.find(key_);
    if (found == entries_.end()) found = entries_.emplace(key_, Entry{}).first;
    Entry& e = found->second;
    e.seen = true;
    e.rel = t->rel;
    resolve(e, *t, now);
    const Region* r = t->map.get();
    for (const DeviceSample& d : t->sample.devices) {
      DeviceStats& st = t->sample.stats[d.index];
      Applied& a = e.dev[d.index];
      std::uint64_t quota = kUnlimited;
      if (!guarded([&] { quota = r->devices[d.index].quota_bytes.load(std::memory_order_relaxed); })) break;
      if (d.gpu < 0) {
        log_once(LogLevel::warn, "backstop-gpu",
                 "no driver backstop for region %s (and any other, logged once): a device of it is unknown to NVML "
                 "(a MIG instance?)",
                 t->rel.c_str());
        continue;
      }
      if (static_cast<std::size_t>(d.gpu) < gpu_rc_.size() && gpu_rc_[static_cast<std::size_t>(d.gpu)] != 0)
        continue;                 // the driver cannot, on this device, for the agent's life
      if (quota == kUnlimited) {  // nothing to hold: a limit set earlier goes
        if (!a.cgroup.empty()) clear(a, *nvml, t->rel);
        continue;
      }
      if (e.cgroup.empty()) {
        if (!a.cgroup.empty()) {  // resolved before; its processes are gone for now
          st.backstop = static_cast<std::uint8_t>(BackstopKind::driver);
          st.backstop_limit_bytes = a.hard;
        } else if (!e.why.empty()) {  // once per cause: there are few, regions may be thousands
          log_once(LogLevel::warn, "backstop-why:"s + e.why,
                   "no driver backstop for region %s (and any other, logged once): %s", t->rel.c_str(), e.why.c_str());
        }
        continue;
      }
      const std::string full = mount_ + e.cgroup;
      const bool in_force = a.cgroup == full && a.hard == quota && a.gpu == d.gpu;
      const bool waiting = a.last_rc != 0 && a.tried_cgroup == full && a.tried_hard == quota && now < a.retry_ns;
      if (!in_force && !waiting) {
        if (!a.cgroup.empty() && (a.cgroup != full || a.gpu != d.gpu)) clear(a, *nvml, t->rel);
        apply(a, *nvml, d.gpu, full, quota, t->rel, now);
      }
      if (a.cgroup == full && a.hard == quota && a.last_rc == 0) {
        st.backstop = static_cast<std::uint8_t>(BackstopKind::driver);
        st.backstop_limit_bytes = a.hard;
      }
    }
  }
  // Regions gone: their limits are cleared once their cgroup has no process
  // left (a container that is still running keeps its wall), or forgotten
  // when the cgroup itself is gone (its limits went with it).
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (e.seen || (e.resolved_ns != 0 && now - e.resolved_ns < kGoneCheckNs)) {
      ++it;
      continue;
    }
    e.resolved_ns = now;
    bool keep = false;
    for (Applied& a : e.dev) {
      if (a.cgroup.empty()) continue;
      if (!is_dir(a.cgroup)) {
        a = Applied{};
      } else if (!cgroup_empty(a.cgroup) || nvml == nullptr) {
        keep = true;
      } else {
        clear(a, *nvml, e.rel);
        keep = keep || !a.cgroup.empty();
      }
    }
    it = keep ? std::next(it) : entries_.erase(it);
  }
}

}  // namespace gpuslice::agent
