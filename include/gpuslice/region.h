// The shared region: the one ABI shared by every process of a container, the
// node agent and gpuslice-smi. Fixed-width fields only; every field another
// process may touch concurrently is a lock-free std::atomic. Layout changes
// bump kRegionAbiVersion; test/unit/region_layout_test.cc pins the offsets.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gpuslice {

inline constexpr std::uint64_t kRegionMagic = 0x45434c5353555047ull;  // "GPUSSLCE" little-endian
inline constexpr std::uint32_t kRegionAbiVersion = 1;
inline constexpr std::uint32_t kMaxDevices = 16;
inline constexpr std::uint32_t kMaxSlots = 1024;
inline constexpr std::uint64_t kUnlimited = ~std::uint64_t{0};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(std::atomic<std::int64_t>::is_always_lock_free);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

enum class SmPolicy : std::uint32_t { hard = 0, elastic = 1 };

// Per (container, device) state. Claimed by UUID on first use by any process
// (uuid_state: 0 free, 1 being written, 2 published, 3 abandoned: its writer
// stalled or died while writing it; never used again).
struct alignas(64) DeviceState {
  std::atomic<std::uint32_t> uuid_state;
  std::uint32_t reserved0;
  std::uint8_t uuid[16];                     // CUuuid / NVML UUID bytes
  // --- memory ---
  std::atomic<std::uint64_t> quota_bytes;    // kUnlimited = no quota
  std::atomic<std::uint64_t> used_bytes;     // bytes reserved by live+unreaped slots (= sum of slot committed)
  std::atomic<std::uint64_t> agent_extra_bytes;  // what NVML shows beyond our count (written by the agent)
  std::atomic<std::uint64_t> oom_refusals;   // allocations refused for quota
  std::atomic<std::uint64_t> peak_used_bytes;
  // Releases that asked for more than was committed, and reaper snapshots that
  // found a negative dead contribution: each was clamped, never underflowed.
  std::atomic<std::uint64_t> accounting_errors;
  std::uint64_t reserved1[1];
  // --- compute (token bucket; see docs/limiter.md) ---
  alignas(64) std::atomic<std::uint32_t> sm_limit_pct;  // 0 or >=100 = unlimited
  std::atomic<std::uint32_t> sm_policy;      // SmPolicy
  std::atomic<std::int64_t> tokens_ns;       // device-time credit; negative = debt of admitted launches, repaid by refill
  std::atomic<std::uint64_t> last_refill_ns; // CLOCK_MONOTONIC ns of the last refill
  std::atomic<std::uint64_t> cost_scale_ppm; // controller's correction to the launch-cost estimate (1e6 = 1.0)
  std::atomic<std::uint64_t> throttled_ns;   // total time launching threads slept
  std::atomic<std::uint64_t> launches;       // kernels launched by the container
  std::atomic<std::uint64_t> queued_ns;      // estimated un-run device time queued (bounded)
  std::atomic<std::uint64_t> credited_ns;      // cumulative credit put into tokens_ns (spent = credited - tokens)
  // --- feedback (written by the agent, or by the elected process) ---
  alignas(64) std::atomic<std::uint64_t> util_permille;     // measured SM utilisation of the container, 0..1000
  std::atomic<std::uint64_t> util_updated_ns;  // CLOCK_MONOTONIC ns of the last sample
  std::atomic<std::uint64_t> device_util_permille;  // whole device (for elastic policy)
  std::atomic<std::uint32_t> feedback_owner_pid;    // elected sampler when no agent runs
  std::atomic<std::uint32_t> elastic_permille;  // share granted by the elastic controller (0 = configured share)
  std::atomic<std::uint64_t> feedback_heartbeat_ns;  // last cycle of the elected feedback owner
  std::atomic<std::uint64_t> scale_updated_ns;       // when cost_scale_ppm was last measured (0 = prior)
  std::uint64_t reserved4[2];
};
static_assert(sizeof(DeviceState) == 256);

// Per-process slot. Claimed by CAS on state, never moved or compacted.
enum SlotState : std::uint32_t { kSlotFree = 0, kSlotClaiming = 1, kSlotLive = 2, kSlotReaping = 3 };

struct alignas(64) Slot {
  std::atomic<std::uint32_t> state;          // SlotState
  std::atomic<std::uint32_t> pid;            // pid in the owner's pid namespace
  std::atomic<std::uint64_t> pidns_inode;    // st_ino of /proc/<pid>/ns/pid
  std::atomic<std::uint64_t> start_time;     // /proc/<pid>/stat field 22 (clock ticks since boot)
  std::atomic<std::uint32_t> host_pid;       // filled by the agent (0 = unknown)
  std::atomic<std::uint32_t> reserved0;
  // Seqlock bracket of the accounting operations (threads of one process share
  // the slot, so it counts): low 20 bits = operations in flight, the rest = a
  // generation bumped by each completed one. The reaper only trusts a snapshot
  // in which every live slot has zero in flight and is unchanged. See
  // docs/memory-accounting.md.
  std::atomic<std::uint64_t> seq;
  std::uint64_t reserved1[3];
  std::atomic<std::uint64_t> committed_bytes[kMaxDevices];  // this process's share of DeviceState::used_bytes
  std::atomic<std::uint64_t> context_bytes[kMaxDevices];    // part of committed_bytes held by contexts
  std::atomic<std::uint64_t> nvml_used_bytes[kMaxDevices];  // what NVML says it holds (agent)
};
static_assert(sizeof(Slot) % 64 == 0);

struct RegionHeader {
  std::uint64_t magic;                       // kRegionMagic, published last by the creator
  std::uint32_t abi_version;                 // kRegionAbiVersion
  std::uint32_t header_size;                 // sizeof(RegionHeader)
  std::uint64_t total_size;                  // sizeof(Region)
  std::uint32_t max_devices;                 // kMaxDevices
  std::uint32_t max_slots;                   // kMaxSlots
  std::uint64_t created_ns;                  // CLOCK_REALTIME at creation
  char container_name[64];                   // GPUSLICE_CONTAINER_NAME at creation, NUL-terminated
  std::atomic<std::uint64_t> agent_heartbeat_ns;  // CLOCK_MONOTONIC of the agent's last cycle (0 = none)
  std::atomic<std::uint32_t> live_slots;     // approximate, for tools
  std::uint32_t reserved0;
  // Reaper lock: 0 = free, else the holder's identity packed by
  // limiter::reaper_token (pid, pid-namespace and start-time bits) so that a
  // dead holder is recognised and the lock taken over; nobody waits on it.
  std::atomic<std::uint64_t> reaper_lock;
  std::atomic<std::uint64_t> slots_reaped;   // total dead slots reclaimed
  // --- priority between tenants (docs/priority.md) ---
  std::atomic<std::uint32_t> priority;       // gpuslice::Priority: 0 = not recorded yet, 1 low, 2 normal, 3 high
  std::uint32_t reserved2;
  std::atomic<std::uint64_t> priority_held_ns;        // total time the container's launches were held
  std::atomic<std::uint64_t> priority_held_until_ns;  // CLOCK_MONOTONIC: held now if in the future
  std::uint64_t reserved1[11];
};

struct Region {
  RegionHeader header;
  alignas(64) DeviceState devices[kMaxDevices];
  alignas(64) Slot slots[kMaxSlots];
};

static_assert(offsetof(Region, header) == 0);
static_assert(sizeof(RegionHeader) % 8 == 0);

}  // namespace gpuslice
