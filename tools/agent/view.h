// A plain copy of what a region holds, for display (gpuslice-smi, /metrics).
// Taken under the SIGBUS guard; everything after that works on the copy.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "gpuslice/region.h"

namespace gpuslice::agent {

struct DeviceView {
  int index = 0;  // entry in the region (not a CUDA ordinal)
  std::uint8_t uuid[16] = {};
  std::uint64_t quota_bytes = 0;  // kUnlimited = none
  std::uint64_t used_bytes = 0;
  std::uint64_t agent_extra_bytes = 0;
  std::uint64_t oom_refusals = 0;
  std::uint64_t record_refusals = 0;  // refused: the process's allocation records could not grow
  std::uint64_t peak_used_bytes = 0;
  std::uint64_t accounting_errors = 0;
  std::uint32_t sm_limit_pct = 0;  // 0 or >= 100 = unlimited
  std::uint32_t sm_policy = 0;
  std::uint64_t throttled_ns = 0;
  std::uint64_t launches = 0;
  std::uint64_t util_permille = 0;
  std::uint64_t util_updated_ns = 0;
  std::uint64_t device_util_permille = 0;
  std::uint32_t feedback_owner_pid = 0;
  // Memory oversubscription (docs/memory.md).
  std::uint64_t resident_limit_bytes = 0;  // 0 or kUnlimited = the quota
  std::uint64_t spilled_bytes = 0;
  std::uint64_t spills = 0;
  std::uint64_t oversub_waits = 0;
  std::uint64_t oversub_wait_ns = 0;
  std::uint64_t oversub_timeouts = 0;
  std::uint32_t oversub_waiting = 0;
  std::uint32_t oversub_policy = 0;  // 0 fail, 1 spill, 2 wait
};

struct SlotView {
  int index = 0;
  std::uint32_t state = 0;  // kSlotLive, kSlotClaiming or kSlotReaping
  std::uint32_t pid = 0;
  std::uint64_t pidns_inode = 0;
  std::uint64_t start_time = 0;
  std::uint32_t host_pid = 0;
  std::array<std::uint64_t, kMaxDevices> committed_bytes{};
  std::array<std::uint64_t, kMaxDevices> context_bytes{};
  std::array<std::uint64_t, kMaxDevices> nvml_used_bytes{};
};

struct RegionView {
  std::string container_name;  // printable (escaped) form
  std::uint64_t created_ns = 0;
  std::uint64_t agent_heartbeat_ns = 0;
  std::uint64_t slots_reaped = 0;
  std::uint32_t priority = 0;                // gpuslice::Priority word (0 = not recorded yet)
  std::uint64_t priority_held_ns = 0;        // total time launches were held by higher priority
  std::uint64_t priority_held_until_ns = 0;  // held now if in the future (CLOCK_MONOTONIC)
  std::vector<DeviceView> devices;           // published entries, by index
  std::vector<SlotView> slots;               // slots that are not free, by index

  // Processes (non-free slots) holding memory on, or known by NVML on, entry `dev`.
  int processes_on(int dev) const;
};

// Copies the region; false if the file was truncated under us (SIGBUS).
bool take_view(const Region* r, RegionView* out);

bool sm_unlimited(std::uint32_t sm_limit_pct);
// "8GiB", "1.5GiB", "512MiB", "0B": binary units, at most one decimal.
std::string format_bytes(std::uint64_t bytes);
std::string sm_policy_name(std::uint32_t policy);

}  // namespace gpuslice::agent
