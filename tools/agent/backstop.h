// The driver's per-cgroup memory limit as a backstop behind gpuslice's own
// accounting (docs/agent.md, "Driver backstop"). NVIDIA's driver from R615
// refuses, in the driver, any allocation that would take a cgroup v2
// directory's device memory past the hard limit NVML set on it, whatever path
// the process took to the driver. For every container the agent knows, it
// sets that hard limit on the container's cgroup, on each GPU of the region,
// to the container's quota (soft limit 0), keeps it in step with the quota
// (gpuslice-smi set), and clears it once the region is gone and the cgroup
// has no process left (a removed cgroup loses its limits with it).
//
// The container's cgroup is the one all its registered processes share
// (their /proc/<pid>/cgroup "0::" line, read in the agent's cgroup
// namespace: the host's): the leaf cgroup a runtime makes per container
// (runc/crun with the systemd or cgroupfs driver, a Kubernetes container's
// cgroup below its pod's). Processes in several cgroups, or in the root
// cgroup, or in the agent's own cgroup or an ancestor of it, get no limit:
// one limit for all of them would be the wrong total, or would reach
// processes that are not the container's.
//
// Where the driver has no wall (older than R615, a MIG instance, no cgroup v2,
// an NVML error) the entry says so: its kind is "agent" when the agent
// enforces instead (--enforce=kill), "none" otherwise; the log says why,
// once per cause.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpuslice/region.h"

namespace gpuslice::agent {

class Nvml;
struct TrackedRegion;

enum class BackstopKind : std::uint8_t { none = 0, agent = 1, driver = 2 };
const char* backstop_name(BackstopKind kind);

// The cgroup v2 path in /proc/<pid>/cgroup text ("0::<path>"); false if none.
bool cgroup_v2_line(const std::string& text, std::string* path);
// The cgroup v2 mount point in /proc/self/mountinfo text ("" if none);
// /sys/fs/cgroup when it is one, else the first cgroup2 mount.
std::string cgroup2_mount(const std::string& mountinfo);
// The cgroup the processes share, or "" and why not (a path each, "" = unknown).
std::string common_cgroup(const std::vector<std::string>& paths, const std::string& own, std::string* why);

class Backstop {
 public:
  // enabled = false (--driver-backstop off): every entry says none, nothing is set.
  explicit Backstop(bool enabled);
  ~Backstop();
  Backstop(const Backstop&) = delete;
  Backstop& operator=(const Backstop&) = delete;

  // Once per cycle, after reconciliation: sets, moves or clears limits and
  // writes each device entry's kind into its DeviceStats. nvml: nullptr
  // without NVML. agent_enforces: the agent kills past the quota (kind agent
  // where the driver has no wall).
  void cycle(const std::vector<TrackedRegion*>& active, Nvml* nvml, bool agent_enforces, std::uint64_t now_ns);

  std::uint64_t limits_set() const { return limits_set_; }
  std::uint64_t limits_cleared() const { return limits_cleared_; }
  std::uint64_t errors() const { return errors_; }

 private:
  struct Applied {
    std::string cgroup;  // full path the limit is on ("" = none)
    std::uint64_t hard = 0;
    int gpu = -1;     // NVML device index
    int last_rc = 0;  // last NVML error (0 = none)
    std::uint64_t retry_ns = 0;
    std::string tried_cgroup;  // the target of the failed attempt
    std::uint64_t tried_hard = 0;
  };
  struct Entry {
    Applied dev[kMaxDevices];
    std::string rel;     // the region, as logged
    std::string cgroup;  // the container's cgroup as last resolved (relative path)
    std::string why;     // why there is none
    std::uint64_t pids_sig = 0;
    std::uint64_t resolved_ns = 0;
    bool seen = false;
  };
  void resolve(Entry& e, const TrackedRegion& t, std::uint64_t now_ns);
  bool apply(Applied& a, Nvml& nvml, int gpu, const std::string& cgroup, std::uint64_t hard, const std::string& rel,
             std::uint64_t now_ns);
  void clear(Applied& a, Nvml& nvml, const std::string& rel);

  bool enabled_;
  std::string mount_;                               // the cgroup v2 mount ("" = none)
  std::string own_cgroup_;                          // the agent's own cgroup
  std::unordered_map<std::string, Entry> entries_;  // by region path
  std::string key_;                                 // scratch: the key looked up
  std::vector<std::uint32_t> pids_;                 // scratch: resolve()'s processes
  std::vector<int> gpu_rc_;                         // per NVML device: an error no retry changes (0 = none)
  std::uint64_t limits_set_ = 0, limits_cleared_ = 0, errors_ = 0;
};

}  // namespace gpuslice::agent
