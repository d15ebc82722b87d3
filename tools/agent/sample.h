// What the agent reads from one region in a cycle, and what it concluded, kept
// with the region for the next /metrics scrape. Buffers are reused between
// cycles (no allocation in the steady state).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "gpuslice/region.h"
#include "pidmap.h"

namespace gpuslice::agent {

struct DeviceSample {
  int index = 0;  // entry in the region
  std::uint8_t uuid[16] = {};
  std::uint64_t used_bytes = 0;
  std::uint64_t agent_extra_bytes = 0;  // as found (written back only when it changes)
  int gpu = -1;                         // index into GpuSample::devices, -1 = NVML does not know it
};

struct SlotSample {
  int index = 0;
  ProcessKey key;
  std::uint32_t recorded_host_pid = 0;
  std::array<std::uint64_t, kMaxDevices> committed_bytes{};
  std::array<std::uint64_t, kMaxDevices> nvml_used_bytes{};  // as found
  std::array<std::uint64_t, kMaxDevices> nvml_now_bytes{};   // what NVML says this cycle
  Resolution res;                                            // filled by the pid map
};

// Per device entry, the agent's conclusions of the last cycle.
struct DeviceStats {
  std::uint64_t nvml_bytes = 0;  // what NVML says the container's processes hold
  bool nvml_known = false;
  std::uint32_t suspected = 0;     // registered processes holding more than they accounted for
  std::uint32_t unregistered = 0;  // processes of the container's pid namespace outside gpuslice
  std::uint64_t util_busy_ns = 0;  // its processes' device time in NVML's window (GpuDevice::util_window_ns)
  std::uint64_t util_permille = 0;
  // The wall behind gpuslice's accounting (backstop.h): BackstopKind, and the
  // driver's hard limit the agent set (0 = none).
  std::uint8_t backstop = 0;
  std::uint64_t backstop_limit_bytes = 0;
};

struct RegionSample {
  char container_name[sizeof(RegionHeader::container_name)] = {};  // raw; printable() before use
  std::vector<DeviceSample> devices;                               // published entries
  std::vector<SlotSample> slots;    // slots of processes (live, or claiming with an identity)
  std::uint32_t busy_slots = 0;     // every slot read that is not free
  std::uint32_t reaping_slots = 0;  // left mid-reap by a dead reaper
  std::uint32_t live_slots = 0;     // of them, kSlotLive
  std::array<DeviceStats, kMaxDevices> stats{};
};

}  // namespace gpuslice::agent
