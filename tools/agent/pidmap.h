// Host pids of the processes registered in the regions.
//
// A slot records the process as it sees itself: its pid in its own pid
// namespace, that namespace's inode and its start time. NVML reports host
// pids. A process in our own namespace is its own host pid; any other is found
// by a scan of /proc: /proc/<hostpid>/ns/pid names its namespace and the last
// NSpid field of /proc/<hostpid>/status its pid there. The start time (the
// same in every namespace) tells a recycled pid from the original.
//
// Resolved processes are watched through a pidfd in one epoll set, so that
// noticing exits costs one epoll_wait per cycle, not a syscall per process;
// without pidfds (old kernel, descriptor limit) they are re-checked in /proc
// at reap time instead. Whether a process is dead is never decided here: what
// /proc says of it is judged by the library's rule, shm::judge_liveness (a
// zombie leader whose threads still run is alive), and the agent's reaper
// judges it once more with the slot's file lock (a forked child holding the
// driver's files keeps the slot).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "platform/procfs.h"

namespace gpuslice::agent {

// Inode of the initial pid namespace (PROC_PID_INIT_INO, fixed by the kernel).
inline constexpr std::uint64_t kInitPidNamespace = 0xEFFFFFFCu;

struct ProcessKey {
  std::uint64_t pidns_inode = 0;
  std::uint64_t start_time = 0;
  std::uint32_t pid = 0;
  bool operator==(const ProcessKey&) const = default;
};

struct ProcessKeyHash {
  std::size_t operator()(const ProcessKey& k) const noexcept {
    std::uint64_t h = k.pidns_inode * 0x9E3779B97F4A7C15ull ^ k.start_time * 0xC2B2AE3D27D4EB4Full ^ k.pid;
    return static_cast<std::size_t>(h ^ (h >> 29));
  }
};

enum class Fate { alive, dead, unknown };

struct Resolution {
  std::uint32_t host_pid = 0;  // 0 = not known (or dead)
  Fate fate = Fate::unknown;
  // What /proc said of the process when its fate was last judged (an error
  // ENOENT when it is gone): the reaper judges it again with the slot's lock.
  platform::procfs::Process facts;
};

// What /proc says about one host pid.
struct ProcInfo {
  platform::procfs::Process facts;  // stat line and pid namespace
  std::uint32_t ns_pid = 0;         // last NSpid field: the pid in its own namespace
};
// false if the process does not exist (or /proc cannot be read): facts.error.
bool read_proc_info(std::uint32_t host_pid, bool want_ns_pid, ProcInfo* out);
// The process's fate by the one rule (shm::judge_liveness), the process alone
// (its slot's lock unknown): key is the slot's identity, facts what /proc says
// of the host pid taken for it.
Fate judge(const ProcessKey& key, const platform::procfs::Process& facts);

class PidMap {
 public:
  PidMap();
  ~PidMap();
  PidMap(const PidMap&) = delete;
  PidMap& operator=(const PidMap&) = delete;

  std::uint64_t own_pidns() const { return own_pidns_; }
  bool in_initial_namespace() const { return own_pidns_ == kInitPidNamespace; }

  // One cycle: begin, want() every key seen in the regions, resolve, get()
  // answers, end (forgets the keys nobody wanted).
  void begin_cycle(std::uint64_t now_ns);
  void want(const ProcessKey& key);
  // Resolves wanted keys not yet known (at most one /proc scan, and only when
  // a key appeared since the last one or a retry is due). With verify, also
  // re-checks resolved processes that have no pidfd.
  void resolve(std::uint64_t now_ns, bool verify);
  Resolution get(const ProcessKey& key) const;
  void end_cycle();

  // Processes that exited since the last cycle (seen through their pidfd).
  std::size_t exits_this_cycle() const { return exits_this_cycle_; }
  std::uint64_t full_scans() const { return full_scans_; }
  std::size_t tracked() const { return entries_.size(); }
  // Time after which a process of a visible namespace that no /proc scan
  // finds is declared dead.
  void set_unseen_grace_ns(std::uint64_t ns) { unseen_grace_ns_ = ns; }

 private:
  struct Entry {
    Resolution res;
    int pidfd = -1;
    std::uint64_t watch_id = 0;
    std::uint64_t first_seen_ns = 0;
    int scans_missed = 0;
    bool wanted = false;
  };
  struct IndexValue {
    std::uint32_t host_pid;
    platform::procfs::Process facts;
  };
  struct NsPidKey {
    std::uint64_t pidns;
    std::uint32_t pid;
    bool operator==(const NsPidKey&) const = default;
  };
  struct NsPidHash {
    std::size_t operator()(const NsPidKey& k) const noexcept {
      return static_cast<std::size_t>(k.pidns * 0x9E3779B97F4A7C15ull ^ k.pid);
    }
  };

  void resolve_own(const ProcessKey& key, Entry& e);
  void full_scan(const std::unordered_set<std::uint64_t>& namespaces);
  void settle_from_index(const ProcessKey& key, Entry& e, std::uint64_t now_ns);
  void watch(Entry& e, const ProcessKey& key);
  void unwatch(Entry& e);
  void verify(const ProcessKey& key, Entry& e);
  // Judges facts of host_pid for key's entry: alive keeps the host pid.
  Fate settle(const ProcessKey& key, Entry& e, std::uint32_t host_pid, const platform::procfs::Process& facts);

  std::uint64_t own_pidns_ = 0;
  int epoll_fd_ = -1;
  bool pidfds_work_ = true;
  std::unordered_map<ProcessKey, Entry, ProcessKeyHash> entries_;
  std::unordered_map<NsPidKey, IndexValue, NsPidHash> index_;  // from the last full scan
  std::unordered_set<std::uint64_t> seen_namespaces_;          // every namespace any scan found
  std::uint64_t full_scans_ = 0;
  std::uint64_t last_scan_ns_ = 0;
  std::uint64_t unseen_grace_ns_ = 2'000'000'000;
  std::uint64_t last_now_ns_ = 0;
  std::size_t exits_this_cycle_ = 0;
  std::unordered_map<std::uint64_t, ProcessKey> watch_ids_;  // epoll data -> key
  std::uint64_t next_watch_id_ = 1;
};

}  // namespace gpuslice::agent
