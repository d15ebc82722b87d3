// Reconciliation of what NVML sees with what the regions counted.
//
// Per container and device: the NVML usage of its processes (registered ones
// through their slots, plus processes of its pid namespace that never
// registered: LD_PRELOAD removed, a static binary), written as
//   DeviceState::agent_extra_bytes = max(0, NVML total - (used_bytes - spare leases))
// so that the quota bounds what the device really holds (context memory the
// library could not measure, allocations it never saw); per slot the NVML
// usage (Slot::nvml_used_bytes) and the host pid; per container and device the
// measured SM utilisation. A process holding more than it accounted for (plus
// a tolerance for its context) is reported as a possible bypass, unless NVML
// lists it with a graphics context: graphics memory, counted all the same.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "enforce.h"
#include "nvml.h"
#include "pidmap.h"
#include "scan.h"

namespace gpuslice::agent {

// Reads what a cycle needs from a region (guarded): the device entries and the
// given slots (those in use, slot_index.h). false: the file was truncated
// under us. scratch: a buffer reused across regions.
bool read_sample(const Region* r, const std::vector<std::uint16_t>& slots, RegionSample* out,
                 std::vector<SlotSample>* scratch);

// Each published device's count (used_bytes less spare leases), read just
// before and again just after an NVML sample, into t.counted_at_nvml: the
// larger of the reads this cycle (guarded). false: not mapped or truncated
// under us.
bool note_counted(TrackedRegion& t);

struct ReconcileCounters {
  std::uint64_t bypass_reports = 0;        // registered processes newly found over their account
  std::uint64_t unregistered_reports = 0;  // unregistered processes newly found in a container
};

class Reconciler {
 public:
  Reconciler(std::uint64_t bypass_tolerance_bytes, std::uint64_t own_pidns);

  // Start of a cycle: NVML's view (nullptr: running without NVML).
  void begin(const GpuSample* gpu, std::uint64_t now_ns);
  // Links a region's device entries to NVML devices (by UUID).
  void match_devices(RegionSample& s) const;
  // After the pid map answered for every slot: NVML usage and utilisation per
  // container, device and slot; unregistered processes; bypass reports.
  void compute(const std::vector<TrackedRegion*>& regions);
  // Writes the results into the region (guarded); false if it was truncated.
  bool write(TrackedRegion& t, std::uint64_t now_ns) const;

  const ReconcileCounters& counters() const { return counters_; }
  // This cycle's unregistered processes attributed to a container that has an
  // entry for their device (the enforcer's candidates, enforce.h).
  const std::vector<UnregisteredProc>& unregistered() const { return unregistered_; }

 private:
  struct GpuProc {
    std::uint64_t used_bytes;
    bool used_known;
    bool graphics;  // NVML lists it with a graphics context too
  };
  struct NsCache {
    std::uint64_t pidns_inode;
    std::uint64_t start_time;
    std::uint64_t checked_ns;
  };
  void compute_region(TrackedRegion& t);
  void attribute_unregistered(const std::unordered_map<std::uint64_t, TrackedRegion*>& by_ns);
  bool report(const std::string& key);  // true the first time the key is confirmed

  std::uint64_t tolerance_;
  std::uint64_t own_pidns_;
  const GpuSample* gpu_ = nullptr;
  std::uint64_t now_ns_ = 0;
  std::vector<std::unordered_map<std::uint32_t, GpuProc>> procs_;  // per NVML device: host pid -> usage
  std::unordered_set<std::uint32_t> claimed_;                      // host pids registered in some slot
  std::unordered_map<std::uint32_t, NsCache> ns_cache_;            // unregistered host pid -> namespace
  // Reports already made -> cycle stamp when last confirmed (forgotten once the
  // condition is gone, so that it is reported again if it comes back).
  std::unordered_map<std::string, std::uint64_t> reported_;
  ReconcileCounters counters_;
  std::vector<UnregisteredProc> unregistered_;
};

}  // namespace gpuslice::agent
