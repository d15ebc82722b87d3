// --enforce=kill: the agent as enforcer where nothing else stops a process
// that goes around the library (docs/agent.md, "Enforcement";
// docs/security.md). A container whose device memory as NVML measures it
// (its registered processes plus the unregistered ones of its pid namespace,
// reconcile.h) stays above its quota plus --bypass-tolerance for
// --enforce-cycles consecutive cycles gets one process killed (SIGKILL): an
// unregistered one first (the largest), else the registered process holding
// the most. Only a process the agent attributed to that container (its slot's
// identity resolved by the pid map, or its pid namespace the container's
// own) and proven its: a registered one maps the region file, an unregistered
// one shares its pid namespace with one that does. Never the agent, pid 1 or
// a process outside a container's namespace;
// its identity (start time and pid namespace) is checked again on a pidfd
// right before the signal, so a recycled pid is never signalled. Under
// --enforce=report (the default) the same condition is only logged and
// counted.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "nvml.h"
#include "scan.h"

namespace gpuslice::agent {

enum class EnforceMode { report, kill };

// A process of a container's pid namespace that NVML lists on a device and
// that has no slot in the region (Reconciler::attribute_unregistered).
struct UnregisteredProc {
  const TrackedRegion* region = nullptr;
  int gpu = -1;  // index into GpuSample::devices
  std::uint32_t host_pid = 0;
  std::uint64_t start_time = 0;
  std::uint64_t pidns = 0;
  std::uint64_t used_bytes = 0;
};

// A counter per container and region, for /metrics.
struct RegionCount {
  std::string container;  // printable
  std::string rel;
  std::uint64_t value = 0;
};

// Sends SIGKILL to host_pid only if it is still the process with this start
// time (and, pidns != 0, in this pid namespace), checked on a pidfd held across
// the check and the signal (pidfd_open + pidfd_send_signal; kill(2) after the
// check where the kernel has no pidfds, before 5.3). Never this process or
// pid 1. false + why when nothing was sent.
bool kill_if_same(std::uint32_t host_pid, std::uint64_t start_time, std::uint64_t pidns, std::string* why);
// host_pid has this file mapped (/proc/<pid>/maps): what the library does
// with its region in every registered process, and what no slot forged to
// name another container's process can make that process do.
bool maps_file(std::uint32_t host_pid, dev_t dev, ino_t ino);

struct EnforceCounters {
  std::uint64_t kills = 0;          // processes killed
  std::uint64_t over_reports = 0;   // containers found over quota + tolerance for the cycles (either mode)
  std::uint64_t kill_failures = 0;  // a chosen process could not be killed (gone, recycled, no permission)
};

class Enforcer {
 public:
  Enforcer(EnforceMode mode, std::uint64_t tolerance_bytes, std::uint32_t cycles);

  // After Reconciler::compute: the regions of this cycle and the unregistered
  // processes attributed to them.
  void run(const std::vector<TrackedRegion*>& regions, const std::vector<UnregisteredProc>& unregistered,
           const GpuSample* gpu, std::uint64_t now_ns);

  const EnforceCounters& counters() const { return counters_; }
  std::vector<RegionCount> kills_by_region() const;

 private:
  struct Episode {
    std::uint32_t cycles = 0;  // consecutive cycles over quota + tolerance
    bool reported = false;
    std::uint64_t seen_ns = 0;
  };
  struct Victim {
    std::uint32_t host_pid = 0;
    std::uint32_t ns_pid = 0;  // 0 = unregistered (its pid inside is not known)
    std::uint64_t start_time = 0;
    std::uint64_t pidns = 0;
    std::uint64_t used_bytes = 0;
    bool registered = false;
  };
  std::uint64_t killed_bytes(const TrackedRegion& t, const DeviceSample& d,
                             const std::vector<UnregisteredProc>& unregistered) const;
  bool choose(const TrackedRegion& t, const DeviceSample& d, const std::vector<UnregisteredProc>& unregistered,
              Victim* out) const;
  void act(TrackedRegion& t, const DeviceSample& d, std::uint64_t quota, std::uint64_t held, Episode& e,
           const std::vector<UnregisteredProc>& unregistered, const GpuSample* gpu, std::uint64_t now_ns);

  EnforceMode mode_;
  std::uint64_t tolerance_;
  std::uint32_t cycles_;
  std::unordered_map<std::string, Episode> episodes_;  // region key + device entry
  // (host pid, start time) -> when: processes killed (their memory, still
  // listed by NVML while the driver tears them down, is not counted again),
  // and those that could not be (not chosen again for a while).
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::uint64_t> killed_, passed_;
  std::map<std::pair<std::string, std::string>, std::uint64_t> kills_;  // (container, rel) -> kills
  EnforceCounters counters_;
};

}  // namespace gpuslice::agent
