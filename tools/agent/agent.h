// The node agent: one cycle every --interval over every region of the region
// directory. Stateless: everything it needs is in the regions and in /proc, so
// a restarted agent picks up where the previous one was.
//
// A cycle: rescan the directory (every --rescan), sample NVML, read each
// region, map its processes to host pids, reconcile (memory, utilisation,
// bypass), write the results and the heartbeat, reap the slots of dead
// processes, and remove regions unused for --grace.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "backstop.h"
#include "board_cleanup.h"
#include "enforce.h"
#include "nvml.h"
#include "pidmap.h"
#include "reconcile.h"
#include "scan.h"
#include "shm/region_file.h"
#include "tamper.h"

namespace gpuslice::agent {

inline constexpr char kDefaultRegionDir[] = "/run/gpuslice/regions";
inline constexpr char kDefaultListen[] = "127.0.0.1:9477";

struct AgentConfig {
  std::string region_dir = kDefaultRegionDir;
  // HAMi's host directory (<hook path>/vgpu, /usr/local/vgpu by default in
  // HAMi): its containers/<pod-uid>_<container>/ and claims/<claim-uid>/
  // subdirectories are watched too (layout.h). Empty = not watched.
  std::string hami_root;
  std::uint64_t interval_ns = 100'000'000;        // one cycle
  std::uint64_t rescan_ns = 1'000'000'000;        // directory re-read
  std::uint64_t verify_ns = 1'000'000'000;        // /proc re-check of processes without a pidfd
  std::uint64_t grace_ns = 300'000'000'000;       // unused region removal; 0 = never
  std::uint64_t unseen_grace_ns = 2'000'000'000;  // a process no /proc scan finds is dead after this
  std::uint64_t bypass_tolerance_bytes = std::uint64_t{768} << 20;
  bool use_nvml = true;
  std::string nvml_library = "libnvidia-ml.so.1";
  std::size_t max_regions = 4096;
  // --metrics basic: /metrics leaves out the per-region families no shipped
  // rule or panel needs (docs/agent.md, "Scale"). Default: full.
  bool metrics_basic = false;
  // Priority board (docs/priority.md): its files unused for grace_ns are removed. Empty = not cleaned.
  std::string priority_board = kDefaultPriorityBoard;
  // The driver's per-cgroup memory limit behind each container's quota
  // (backstop.h; --driver-backstop off clears nothing and sets nothing).
  bool driver_backstop = true;
  // --enforce, --enforce-cycles (enforce.h): over quota + bypass tolerance
  // for this many consecutive cycles, report or kill.
  EnforceMode enforce = EnforceMode::report;
  std::uint32_t enforce_cycles = 3;
};

struct AgentStats {
  std::uint64_t cycles = 0;
  std::uint64_t last_cycle_ns = 0;      // wall time of the last cycle
  std::uint64_t last_cycle_cpu_ns = 0;  // CPU time of the agent's thread in it
  std::uint64_t max_cycle_ns = 0;
  std::uint64_t total_cycle_cpu_ns = 0;
  std::uint64_t slots_reaped = 0;
  std::uint64_t regions = 0;
  std::uint64_t invalid_files = 0;
  std::uint64_t regions_unwatched = 0;  // region files past --max-regions at the last rescan
  std::uint64_t regions_max = 0;        // --max-regions
  std::uint64_t log_suppressed = 0;     // warnings about invalid files over the log budget (scan.h)
  std::uint64_t regions_removed = 0;
  std::uint64_t regions_dropped_truncated = 0;
  std::uint64_t pid_scans = 0;
  std::uint64_t bypass_reports = 0;
  std::uint64_t unregistered_reports = 0;
  std::uint64_t board_files_removed = 0;  // stale priority-board files (board_cleanup.h)
  std::uint64_t slot_rereads = 0;         // reads of a region's whole slot array (slot_index.h)
  EnforceCounters enforce;                // enforce.h
  TamperCounters tamper;                  // tamper.h
  bool nvml_available = false;
  std::uint64_t nvml_devices = 0;
  std::uint64_t backstop_limits_set = 0;  // driver limits set or moved (backstop.h)
  std::uint64_t backstop_limits_cleared = 0;
  std::uint64_t backstop_errors = 0;
};

class Agent {
 public:
  explicit Agent(AgentConfig config);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Loads NVML unless disabled; without it the agent reaps and serves
  // metrics only, and says so once.
  void start();
  // One cycle with a fresh NVML sample (if NVML is available).
  void cycle();
  // One cycle with the given NVML view instead (nullptr: none). Benchmarks.
  void cycle_with(const GpuSample* gpu);
  // Reads every region's count; called just before and just after an NVML
  // sample is taken (cycle() does so itself), it gives the count the next
  // cycle compares NVML with: the larger of the reads (Reconciler::write), so
  // a free ending during the sample is no extra.
  void note_counts();

  std::string metrics_text() const;
  // The last cycle ended less than max(3 intervals, 2 s) ago.
  bool healthy() const;
  AgentStats stats() const;
  const AgentConfig& config() const { return config_; }

 private:
  void timed_cycle(const GpuSample* given, bool sample_nvml);
  void note_counts_locked();
  void run_cycle(const GpuSample* gpu, std::uint64_t now_ns);
  int reap(TrackedRegion& t);
  // This cycle's sample of a region (slot_index.h); false: truncated under us.
  bool read_region(TrackedRegion& t, std::uint64_t now_ns);

  mutable std::mutex mu_;  // cycles vs. /metrics scrapes
  AgentConfig config_;
  RegionSet regions_;
  PidMap pidmap_;
  Reconciler reconciler_;
  TamperGuard tamper_;
  Enforcer enforcer_;
  Nvml nvml_;
  Backstop backstop_;
  GpuSample gpu_;
  struct DeviceUtil {
    std::string uuid;
    std::uint32_t util_pct;
    std::uint32_t processes;
  };
  std::vector<DeviceUtil> device_util_;  // the last NVML sample, for /metrics
  shm::ProcessIdentity self_{};
  std::vector<SlotSample> scratch_;
  std::vector<unsigned char> slot_buffer_;  // one region's slot array (SlotIndex::reread)
  std::vector<TrackedRegion*> active_;
  std::vector<const SlotSample*> dead_;  // per slot index: this cycle's sample of a process found dead
  std::uint64_t last_rescan_ns_ = 0;
  std::uint64_t last_verify_ns_ = 0;
  bool rescanned_ = false;
  AgentStats stats_;
  std::atomic<std::uint64_t> last_cycle_end_ns_{0};
};

}  // namespace gpuslice::agent
