// Per-cgroup device-memory limits, as NVIDIA documents them for R615 and later
// (NVML API reference: nvmlDeviceSetMemoryLimits_v1, nvmlDeviceGetMemoryLimits_v1,
// nvmlSetMemoryLimits_v1_t, nvmlGetMemoryLimits_v1_t; "MPS v3 Memory
// Partitioning"). README "Model", "Per-cgroup memory limits" says what is
// modelled and what is refused.
//
// A process's cgroup is the cgroup v2 directory its /proc/self/cgroup "0::"
// line names, under the cgroup v2 mount (FAKECUDA_CGROUP_ROOT, default
// /sys/fs/cgroup), identified by that directory's inode, which is the
// kernel's cgroup id: the same whether seen from the host or from inside a
// container's cgroup namespace, and never reused while the system runs.
#pragma once

#include <cstdint>

#include "state.h"

namespace gpuslice::fakecuda {

// NVIDIA driver branches from this one have the per-cgroup limits.
inline constexpr std::uint32_t kCgroupLimitsBranch = 615;

// The cgroup v2 mount the simulated driver reads: FAKECUDA_CGROUP_ROOT or
// /sys/fs/cgroup. Empty if it is not a cgroup2 file system.
const char* cgroup_root();
// The inode of the calling process's cgroup v2 directory; 0 if it has none
// (cgroup v1 only, no "0::" line) or the directory cannot be seen.
std::uint64_t own_cgroup_ino();
// Parses /proc/<pid>/cgroup text: the path of the "0::" line. false if none.
bool cgroup_v2_path(const char* text, char* out, std::size_t len);

// --- with the state Lock held ---
// Whether own_slot's cgroup may take `bytes` more on `dev` under its hard limit.
bool cgroup_admits_locked(State& state, int own_slot, std::uint32_t dev, std::uint64_t bytes);
// Device memory the cgroup's processes hold on `dev`, managed memory excluded.
std::uint64_t cgroup_used_locked(State& state, std::uint64_t ino, std::uint32_t dev);
// The limit entry of a cgroup, nullptr if none.
CgroupLimit* cgroup_limit_locked(State& state, std::uint64_t ino);
// Sets (clear = false) or clears a device's limits. false: the table is full.
bool cgroup_set_locked(State& state, std::uint64_t ino, std::uint32_t dev, std::uint64_t soft, std::uint64_t hard,
                       bool clear);

}  // namespace gpuslice::fakecuda
