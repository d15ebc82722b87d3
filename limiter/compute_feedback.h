// Where the compute controller's measurements come from, and the one
// background thread a process may run for it. No driver here: NVML is reached
// through function pointers the preload library resolves (so tests can drive
// the loop with a scripted NVML and a region in memory).
//
// Every process that launches on a limited device runs the thread; per device
// entry, one of the container's processes is elected feedback owner
// (DeviceState::feedback_owner_pid + heartbeat) and every kControlPeriodNs
// takes a measurement and runs control_step():
//   - the node agent's, when it is alive (RegionHeader::agent_heartbeat_ns
//     recent): DeviceState::util_permille / device_util_permille over the
//     window since the previous util_updated_ns;
//   - otherwise NVML's per-process utilisation since the previous sample
//     (nvmlDeviceGetProcessUtilization with lastSeenTimeStamp), split into the
//     container's processes (the region's live slots) and everybody else.
//     The owner then publishes it in util_permille & co. for the tools.
//     "The container's processes" include the ones that exited in the last
//     kDepartedKeepNs (Region::departed): a process that queues work and
//     exits without waiting for it is still charged for it once it runs.
// Every process also re-reads the limits into the launch path's caches every
// kRefreshNs, so a limit changed at run time takes effect within that.
#pragma once

#include <cstdint>

#include "gpuslice/nvml_abi.h"
#include "gpuslice/region.h"
#include "limiter/compute_control.h"
#include "limiter/compute_samples.h"

namespace gpuslice::limiter {

inline constexpr std::uint64_t kFeedbackTickNs = 10'000'000;   // thread wake-up period
inline constexpr std::uint64_t kRefreshNs = 100'000'000;       // limit caches re-read
inline constexpr std::uint64_t kAgentFreshNs = 2'000'000'000;  // agent heartbeat considered alive
// How long an exited process's device time is still the container's: longer
// than any queue the limiter lets a process leave behind.
inline constexpr std::uint64_t kDepartedKeepNs = 60'000'000'000;

struct NvmlApi {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*handle_by_uuid)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*process_utilization)(nvmlDevice_t, nvmlProcessUtilizationSample_t*, unsigned int*,
                                      unsigned long long) = nullptr;
  // Optional: used to check that NVML's pids are the region's (pid namespaces).
  nvmlReturn_t (*running_processes)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*) = nullptr;
};

struct FeedbackHost {
  Region* region = nullptr;
  // Resolves NVML, on the feedback thread when first needed; false if none.
  bool (*load_nvml)(NvmlApi* out) noexcept = nullptr;
  // Re-reads the limits into the launch path's caches.
  void (*refresh)() noexcept = nullptr;
  // Region entries (bit i = entry i) this process launches on.
  std::uint32_t (*entries)() noexcept = nullptr;
  // One warning line (without the "gpuslice: " prefix), capped by the caller.
  void (*warn)(const char* message) noexcept = nullptr;
  // Clocks: CLOCK_MONOTONIC ns and CLOCK_REALTIME us (NVML's timestamps).
  std::uint64_t (*mono_ns)() noexcept = nullptr;
  std::uint64_t (*real_us)() noexcept = nullptr;
};

// Per device entry, what the loop remembers between ticks (owner only).
struct EntryFeedback {
  ControlState control;
  bool owner = false;
  std::uint64_t last_step_ns = 0;
  // NVML source
  nvmlDevice_t nvml_device = nullptr;
  bool nvml_failed = false;
  SampleClock nvml_clock;  // last_seen_us 0 = no baseline yet
  std::uint32_t steps_since_check = 0;
  bool pids_ok = true;
  // agent source
  bool from_agent = false;
  std::uint64_t agent_last_ns = 0;  // util_updated_ns consumed last
};

// The loop's state and one iteration; the thread calls tick() every
// kFeedbackTickNs. Only ever used by one thread at a time.
class FeedbackLoop {
 public:
  FeedbackLoop(const FeedbackHost& host, std::uint32_t self_pid) noexcept : host_(host), self_(self_pid) {}
  void tick() noexcept;
  const EntryFeedback& entry(int i) const noexcept { return entries_[i]; }
  // Measurement of entry `e` over the window since the previous call; false
  // when there is none this time (no new agent sample, NVML unavailable).
  bool measure(int e, std::uint64_t now_ns, Measurement* out) noexcept;

 private:
  bool measure_agent(int e, Measurement* out) noexcept;
  bool measure_nvml(int e, std::uint64_t now_ns, Measurement* out) noexcept;
  bool nvml_ready() noexcept;
  bool open_device(int e) noexcept;
  bool pids_match(int e) noexcept;
  bool in_container(std::uint32_t pid) const noexcept;
  static bool ours(const void* loop, std::uint32_t pid) noexcept;
  void collect_pids(std::uint64_t now_ns) noexcept;
  void warn(const char* message) noexcept;

  FeedbackHost host_;
  std::uint32_t self_;
  EntryFeedback entries_[kMaxDevices];
  std::uint64_t next_refresh_ns_ = 0;
  int nvml_state_ = 0;  // 0 not tried, 1 ready, 2 unavailable
  NvmlApi nvml_{};
  std::uint32_t pids_[kMaxSlots + kMaxDeparted];
  std::uint32_t pid_count_ = 0;
};

// Starts this process's feedback thread (once; again in a forked child, which
// inherits no threads). The thread blocks every signal, never exits, and only
// sleeps between ticks. False if it cannot be created (the launch path then
// runs on its estimate alone).
bool ensure_feedback_thread(const FeedbackHost& host) noexcept;
// At exit: the thread stops calling anything (NVML's own static state is
// being destroyed). Called from the preload library's destructor. Waits
// (bounded) for a tick in progress to end.
void stop_feedback_thread() noexcept;

// At exit of a process that launched on limited devices: records it in
// Region::departed (pid as NVML reports it) so that the work it leaves queued
// is still measured as the container's, and hands its feedback roles over at
// once instead of after kOwnerTimeoutNs.
void record_departure(Region* r, std::uint32_t nvml_pid, std::uint32_t self, std::uint64_t now_ns) noexcept;

}  // namespace gpuslice::limiter
