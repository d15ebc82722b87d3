// The container's region as this process sees it: the watch on the region
// file (truncated under our mapping?) and the map between CUDA device
// ordinals and region device entries.
// gpuslice: hot path (no heap, no locks)
#include "hook/region.h"

#include <cstdlib>

#include "hook/config.h"
#include "hook/devices.h"
#include "hook/log.h"
#include "hook/process.h"
#include "hook/real.h"
#include "shm/region_file.h"

namespace gpuslice::hook {

namespace {

// The region file stays open to be looked at: a file shrunk under our shared
// mapping raises SIGBUS at the next touch, and the library installs no signal
// handler. region_intact() (region.h) looks (fstat) at most once per coarse
// clock tick.
std::atomic<RegionLostFn> g_on_region_lost{nullptr};

[[gnu::cold, gnu::noinline]] bool region_file_check(int fd) noexcept {
  shm::Error err{};
  if (shm::mapped_file_intact(fd, config().options.region, &err)) return true;
  g_region_checked_tick.store(-1, std::memory_order_relaxed);  // no fast "intact" from now on
  if (!g_region_lost.exchange(true, std::memory_order_acq_rel))
    GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED from now on", err.message);
  g_ready.store(kReadyFailed, std::memory_order_seq_cst);
  if (RegionLostFn fn = g_on_region_lost.load(std::memory_order_seq_cst)) fn();  // after g_ready (memory.cc)
  return false;
}

// ordinal -> region entry + 1 (0 = not mapped yet), and the reverse map.
std::atomic<int> g_entry_of_ordinal[kMaxDevices];
std::atomic<int> g_ordinal_of_entry[kMaxDevices];

}  // namespace

void set_on_region_lost(RegionLostFn fn) noexcept { g_on_region_lost.store(fn, std::memory_order_seq_cst); }

std::atomic<int> g_region_fd{-1};
std::atomic<std::int64_t> g_region_checked_tick{-1};
std::atomic<bool> g_region_lost{false};

void watch_region_file(int fd) noexcept { g_region_fd.store(fd, std::memory_order_release); }

// The slow half of region_intact(): a lost region stays lost; no watched
// file is intact; else the tick is taken (other threads skip the look until
// it changes, as before this one looked) and the file looked at.
bool region_check_now(std::int64_t tick) noexcept {
  if (g_region_lost.load(std::memory_order_relaxed)) return false;
  const int fd = g_region_fd.load(std::memory_order_relaxed);
  g_region_checked_tick.store(tick, std::memory_order_relaxed);
  if (fd < 0) return true;
  return region_file_check(fd);
}

int device_entry(CUdevice ordinal) noexcept {
  if (ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) return -1;
  if (!region_intact()) return -1;
  int v = g_entry_of_ordinal[ordinal].load(std::memory_order_acquire);
  if (__builtin_expect(v > 0, 1)) return v - 1;
  if (real_cuDeviceGetUuid_v2 == nullptr) return -1;
  CUuuid uuid{};
  if (real_cuDeviceGetUuid_v2(&uuid, ordinal) != CUDA_SUCCESS) return -1;
  const options::Options& o = config().options;
  const auto* id = reinterpret_cast<const std::uint8_t*>(uuid.bytes);
  // Limits are per container ordinal (devices.cc), not this process's.
  const int container = container_ordinal(ordinal, id);
  std::uint64_t memory = 0;
  std::uint32_t sm = 0;
  container_limits(container, &memory, &sm);
  if (container < 0)
    GPUSLICE_WARN_CAPPED(3,
                         "device %d (as this process's CUDA_VISIBLE_DEVICES numbers it): not one of the "
                         "container's devices by index or NVML UUID; the smallest configured limits apply",
                         ordinal);
  int entry = shm::device_index(g_process.region, id, memory, sm, o.sm_policy);
  if (entry < 0) {
    GPUSLICE_WARN_CAPPED(3,
                         "GPUSLICE_REGION=%s: all %u device entries are taken, expected a free one "
                         "for device %d; its allocations fail",
                         o.region, kMaxDevices, ordinal);
    return -1;
  }
  const DeviceState& d = g_process.region->devices[entry];
  if (d.quota_bytes.load(std::memory_order_relaxed) != memory)
    GPUSLICE_LOG(info,
                 "device %d: the region's quota (%llu bytes) differs from this process's setting "
                 "(%llu bytes); the region's value applies",
                 ordinal, static_cast<unsigned long long>(d.quota_bytes.load(std::memory_order_relaxed)),
                 static_cast<unsigned long long>(memory));
  g_ordinal_of_entry[entry].store(ordinal + 1, std::memory_order_release);
  g_entry_of_ordinal[ordinal].store(entry + 1, std::memory_order_release);
  return entry;
}

// The entry of the only device (>= 0), kSeveralDevices, or kNotCounted until
// the driver could count its devices (it cannot before cuInit).
std::atomic<int> g_single_entry{kNotCounted};

int current_device_entry_slow(CUresult* rc) noexcept {
  CUdevice dev = 0;
  CUresult r = real_cuCtxGetDevice(&dev);
  if (r != CUDA_SUCCESS) {
    *rc = r;
    return -1;
  }
  int entry = device_entry(dev);
  if (entry < 0) {
    *rc = CUDA_ERROR_OUT_OF_MEMORY;
    return -1;
  }
  if (g_single_entry.load(std::memory_order_relaxed) == kNotCounted) {
    int count = 0;
    if (real_cuDeviceGetCount != nullptr && real_cuDeviceGetCount(&count) == CUDA_SUCCESS && count > 0)
      g_single_entry.store(count == 1 ? entry : kSeveralDevices, std::memory_order_relaxed);
  }
  return entry;
}

int device_entry_of_uuid(const std::uint8_t uuid[16]) noexcept {
  if (!region_intact()) return -1;
  std::uint64_t memory = 0;
  std::uint32_t sm = 0;
  container_limits(nvml_index_of(uuid), &memory, &sm);
  return shm::device_index(g_process.region, uuid, memory, sm, config().options.sm_policy);
}

int ordinal_of_entry(int entry) noexcept {
  if (entry < 0 || static_cast<unsigned>(entry) >= kMaxDevices) return -1;
  return g_ordinal_of_entry[entry].load(std::memory_order_acquire) - 1;
}

}  // namespace gpuslice::hook
