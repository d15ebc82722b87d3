// Tampered regions are repaired (docs/agent.md, "Tampered regions"). The
// region file is the container's to write, so a process in it can rewrite its
// own quota, compute limit, policy or priority. The agent keeps the limits the
// container was given: for each device entry the values it first saw
// (written by the container's first process, from the environment or
// configuration file the runtime gave it), changed only by grant records
// (grant.h) that `gpuslice-smi set` writes where no container can; any other
// value found in the region is put back within the cycle, counted and logged.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "enforce.h"
#include "scan.h"

namespace gpuslice::agent {

struct TamperCounters {
  std::uint64_t repairs = 0;         // fields put back
  std::uint64_t grants_applied = 0;  // operator changes (grant records) taken
};

class TamperGuard {
 public:
  // roots: the agent's region directories; a grant directory is kept at the
  // top of each.
  explicit TamperGuard(const std::vector<std::string>& roots);
  ~TamperGuard();
  TamperGuard(const TamperGuard&) = delete;
  TamperGuard& operator=(const TamperGuard&) = delete;

  // Once per cycle, after the regions were read.
  void run(const std::vector<TrackedRegion*>& regions, std::uint64_t now_ns);

  const TamperCounters& counters() const { return counters_; }
  std::vector<RegionCount> repairs_by_region() const;

 private:
  struct Limits {
    bool known = false;
    std::uint8_t uuid[16] = {};
    std::uint64_t quota = 0;
    std::uint32_t sm = 0;
    std::uint32_t policy = 0;
  };
  // UUIDs whose limits are kept per region, at most: the first seen are the
  // container's devices; past this a rewritten UUID names no device anyway.
  static constexpr std::size_t kMaxKeptDevices = 64;
  struct Kept {
    dev_t dev = 0;
    ino_t ino = 0;
    std::vector<Limits> given;    // by UUID, never forgotten while the region is watched
    Limits devices[kMaxDevices];  // per entry: given[] of its UUID
    std::uint32_t priority = 0;   // 0 = none seen yet
    std::uint64_t seen_ns = 0;
    // As kept before this cycle's grant records: a field the operator just
    // changed that the region still holds at its old value is smi's change
    // not written yet (smi records first), not the container's.
    Limits before[kMaxDevices];
    std::uint32_t priority_before = 0;
    Limits* given_for(const std::uint8_t uuid[16]) {
      for (Limits& l : given) {
        if (std::memcmp(l.uuid, uuid, sizeof l.uuid) == 0) return &l;
      }
      return nullptr;
    }
  };
  struct Found {  // the region's values this cycle
    std::uint32_t priority = 0;
    Limits devices[kMaxDevices];
  };
  void open_grant_dirs();
  bool list_records();  // into records_; false: none
  void apply_grants(const std::map<std::pair<dev_t, ino_t>, std::pair<TrackedRegion*, Kept*>>& by_file);
  void check(TrackedRegion& t, Kept& k, const Found& f);

  std::vector<std::string> dirs_;  // <root>/.gpuslice-grants
  std::vector<int> fds_;           // -1 until made and found sound
  std::vector<bool> warned_;
  std::unordered_map<const TrackedRegion*, Kept> kept_;
  std::vector<Found> found_;  // this cycle's, per region (reused)
  struct Record {
    std::string name;
    dev_t dev;
    ino_t ino;
    std::uint64_t written_ns;
  };
  std::vector<std::vector<Record>> records_;                              // per grant directory
  std::map<std::pair<std::string, std::string>, std::uint64_t> repairs_;  // (container, rel) -> fields put back
  TamperCounters counters_;
  std::uint64_t now_ns_ = 0;
  std::uint64_t last_dir_try_ns_ = 0;
};

}  // namespace gpuslice::agent
