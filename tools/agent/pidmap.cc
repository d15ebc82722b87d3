#include "pidmap.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "log.h"
#include "platform/procfs.h"
#include "shm/region_file.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

constexpr std::uint64_t kRescanRetryNs = 1'000'000'000;  // unresolved keys: one /proc scan per second at most

int pidfd_open(std::uint32_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0u)); }

}  // namespace

bool read_proc_info(std::uint32_t host_pid, bool want_ns_pid, ProcInfo* out) {
  *out = ProcInfo{};
  // (EACCES on the ns link, no ptrace access: namespace unknown, 0.)
  if (platform::procfs::read_process(host_pid, true, &out->facts) != 0) return false;
  if (want_ns_pid) {
    platform::procfs::NsPids ns;
    if (const int e = platform::procfs::read_nspid(host_pid, &ns); e != 0 && e != EINVAL) return false;
    out->ns_pid = ns.innermost;  // 0 without an NSpid line
  }
  return true;
}

Fate judge(const ProcessKey& key, const platform::procfs::Process& facts) {
  switch (shm::judge_liveness(facts, key.pidns_inode, key.start_time, shm::SlotLock::unknown)) {
    case shm::Liveness::alive: return Fate::alive;
    case shm::Liveness::dead: return Fate::dead;
    case shm::Liveness::unknown: break;
  }
  return Fate::unknown;
}

PidMap::PidMap() {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) == 0) own_pidns_ = st.st_ino;
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) pidfds_work_ = false;
}

PidMap::~PidMap() {
  for (auto& [key, e] : entries_) unwatch(e);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void PidMap::begin_cycle(std::uint64_t now_ns) {
  exits_this_cycle_ = 0;
  last_now_ns_ = now_ns;
  if (epoll_fd_ < 0 || watch_ids_.empty()) return;
  epoll_event events[256];
  for (;;) {
    const int n = epoll_wait(epoll_fd_, events, 256, 0);
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) {
      auto it = watch_ids_.find(events[i].data.u64);
      if (it == watch_ids_.end()) continue;
      const ProcessKey key = it->second;
      auto entry = entries_.find(key);
      if (entry != entries_.end()) {
        // The whole thread group has exited (a pidfd is readable only then):
        // what /proc says now is judged like any other fact. Without its
        // pidfd, a process still alive is re-checked in /proc (verify).
        Entry& e = entry->second;
        const std::uint32_t host_pid = e.res.host_pid;
        unwatch(e);
        ProcInfo info;
        read_proc_info(host_pid, false, &info);
        settle(key, e, host_pid, info.facts);
        ++exits_this_cycle_;
      }
    }
    if (n < 256) break;
  }
}

void PidMap::want(const ProcessKey& key) {
  auto [it, inserted] = entries_.try_emplace(key);
  if (inserted) it->second.first_seen_ns = last_now_ns_;
  it->second.wanted = true;
}

void PidMap::resolve(std::uint64_t now_ns, bool verify_all) {
  std::unordered_set<std::uint64_t> namespaces;
  bool fresh = false;
  for (auto& [key, e] : entries_) {
    if (!e.wanted) continue;
    if (e.res.fate == Fate::alive) {
      if (verify_all && e.pidfd < 0) verify(key, e);
      continue;
    }
    if (e.res.fate == Fate::dead || key.pidns_inode == 0 || key.pid == 0) continue;
    if (key.pidns_inode == own_pidns_) {
      resolve_own(key, e);
      continue;
    }
    namespaces.insert(key.pidns_inode);
    if (e.first_seen_ns > last_scan_ns_ || full_scans_ == 0) fresh = true;
  }
  if (namespaces.empty()) return;
  if (!fresh && now_ns - last_scan_ns_ < kRescanRetryNs) return;
  full_scan(namespaces);
  last_scan_ns_ = now_ns;
  for (auto& [key, e] : entries_) {
    if (e.wanted && e.res.fate == Fate::unknown && key.pidns_inode != 0 && key.pid != 0 &&
        key.pidns_inode != own_pidns_) {
      settle_from_index(key, e, now_ns);
    }
  }
}

Resolution PidMap::get(const ProcessKey& key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? Resolution{} : it->second.res;
}

void PidMap::end_cycle() {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!it->second.wanted) {
      unwatch(it->second);
      it = entries_.erase(it);
    } else {
      it->second.wanted = false;
      ++it;
    }
  }
}

void PidMap::resolve_own(const ProcessKey& key, Entry& e) {
  // Our namespace: the pid is authoritative.
  ProcInfo info;
  const bool exists = read_proc_info(key.pid, false, &info);
  if (exists && info.facts.pidns_inode == 0) return;  // no access to its namespace: cannot tell
  if (settle(key, e, key.pid, info.facts) == Fate::alive) watch(e, key);
}

void PidMap::full_scan(const std::unordered_set<std::uint64_t>& namespaces) {
  ++full_scans_;
  index_.clear();
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return;
  char path[64];
  while (dirent* d = readdir(dir)) {
    if (d->d_name[0] < '1' || d->d_name[0] > '9') continue;
    char* end = nullptr;
    const unsigned long pid = std::strtoul(d->d_name, &end, 10);
    if (*end != '\0' || pid == 0 || pid > 0x7fffffff) continue;
    std::snprintf(path, sizeof path, "/proc/%lu/ns/pid", pid);
    struct stat st {};
    if (stat(path, &st) != 0) continue;
    if (seen_namespaces_.size() < 65536) seen_namespaces_.insert(st.st_ino);
    if (namespaces.count(st.st_ino) == 0) continue;
    // A zombie too: the rule judges it (its threads may still run).
    ProcInfo info;
    if (!read_proc_info(static_cast<std::uint32_t>(pid), true, &info)) continue;
    if (info.facts.pidns_inode != st.st_ino || info.ns_pid == 0) continue;  // changed under us
    index_[{info.facts.pidns_inode, info.ns_pid}] = {static_cast<std::uint32_t>(pid), info.facts};
  }
  closedir(dir);
}

void PidMap::settle_from_index(const ProcessKey& key, Entry& e, std::uint64_t now_ns) {
  auto it = index_.find({key.pidns_inode, key.pid});
  if (it != index_.end() && (key.start_time == 0 || it->second.facts.stat.start_time == key.start_time)) {
    e.scans_missed = 0;
    if (settle(key, e, it->second.host_pid, it->second.facts) == Fate::alive) watch(e, key);
    return;
  }
  ++e.scans_missed;
  // Only a namespace we can see (we are in the initial one, or a scan found
  // it before) lets absence mean death; otherwise the agent is blind to it.
  const bool visible = in_initial_namespace() || seen_namespaces_.count(key.pidns_inode) != 0;
  if (visible && e.scans_missed >= 2 && now_ns - e.first_seen_ns >= unseen_grace_ns_) {
    platform::procfs::Process absent;
    absent.error = ENOENT;  // no process of its namespace has its pid
    settle(key, e, 0, absent);
  }
  if (!visible && e.scans_missed == 2) {
    log_once(LogLevel::warn, "invisible-ns:"s + std::to_string(key.pidns_inode),
             "no process of pid namespace %llu is visible in /proc: its processes cannot be mapped to host pids or "
             "reaped by the agent (run the agent in the host pid namespace: hostPID: true)",
             static_cast<unsigned long long>(key.pidns_inode));
  }
}

void PidMap::watch(Entry& e, const ProcessKey& key) {
  if (!pidfds_work_ || e.pidfd >= 0) return;
  const int fd = pidfd_open(e.res.host_pid);
  if (fd < 0) {
    if (errno == ENOSYS || errno == EINVAL) {
      pidfds_work_ = false;
      log(LogLevel::info, "pidfd_open unavailable (%s): process exits are checked in /proc at reap time",
          std::strerror(errno));
    } else if (errno == ESRCH) {
      platform::procfs::Process gone;
      gone.error = ESRCH;
      settle(key, e, e.res.host_pid, gone);
    }
    return;
  }
  // The pid may have been recycled between the lookup and pidfd_open: the
  // pidfd is for the right process only if it is still judged alive (the
  // start time matches) afterwards.
  ProcInfo info;
  read_proc_info(e.res.host_pid, false, &info);
  if (settle(key, e, e.res.host_pid, info.facts) != Fate::alive) {
    close(fd);
    return;
  }
  const std::uint64_t id = next_watch_id_++;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    close(fd);
    return;
  }
  e.pidfd = fd;
  e.watch_id = id;
  watch_ids_[id] = key;
}

void PidMap::unwatch(Entry& e) {
  if (e.pidfd < 0) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, e.pidfd, nullptr);
  close(e.pidfd);
  e.pidfd = -1;
  watch_ids_.erase(e.watch_id);
}

void PidMap::verify(const ProcessKey& key, Entry& e) {
  ProcInfo info;
  read_proc_info(e.res.host_pid, false, &info);
  settle(key, e, e.res.host_pid, info.facts);
}

Fate PidMap::settle(const ProcessKey& key, Entry& e, std::uint32_t host_pid, const platform::procfs::Process& facts) {
  const Fate fate = judge(key, facts);
  e.res = {fate == Fate::alive ? host_pid : 0, fate, facts};
  return fate;
}

}  // namespace gpuslice::agent
