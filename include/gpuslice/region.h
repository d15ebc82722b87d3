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
inline constexpr std::uint32_t kRegionAbiVersion = 5;
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
// One cache line per access pattern (ABI v2): read-mostly configuration; the
// memory counters every allocation writes; the token bucket every limited
// launch writes; batched statistics; what the feedback owner and the agent
// write; then room for later fields (priority, memory oversubscription), so
// that adding them needs no ABI bump.
struct alignas(64) DeviceState {
  // --- line 0: identity and configuration, read by every call, written rarely ---
  std::atomic<std::uint32_t> uuid_state;
  std::uint32_t reserved0;
  std::uint8_t uuid[16];                        // CUuuid / NVML UUID bytes
  std::atomic<std::uint64_t> quota_bytes;       // kUnlimited = no quota
  std::atomic<std::uint32_t> sm_limit_pct;      // 0 or >=100 = unlimited
  std::atomic<std::uint32_t> sm_policy;         // SmPolicy
  std::atomic<std::uint64_t> cost_scale_ppm;    // controller's correction to the launch-cost estimate (1e6 = 1.0)
  std::atomic<std::uint64_t> scale_updated_ns;  // when cost_scale_ppm was last measured (0 = prior)
  std::atomic<std::uint32_t> elastic_permille;  // share granted by the elastic controller (0 = configured share)
  std::uint32_t reserved1;
  // --- line 1: memory, written by every allocation and free ---
  alignas(64) std::atomic<std::uint64_t> used_bytes;  // bytes reserved by live+unreaped slots (= sum of slot committed)
  std::atomic<std::uint64_t> peak_used_bytes;
  std::atomic<std::uint64_t> oom_refusals;  // allocations refused for quota
  // Releases that asked for more than was committed, and reaper snapshots that
  // found a negative dead contribution: each was clamped, never underflowed.
  std::atomic<std::uint64_t> accounting_errors;
  // Bumped (seq_cst) by every change that makes admitted spare leases
  // unspendable: a lower quota (gpuslice-smi set), more agent_extra_bytes, a
  // resident allowance published (ABI v4). A refill that saw it change
  // returns the lease it just took (limiter/lease.h).
  std::atomic<std::uint64_t> lease_epoch;
  // The size of the last context any process of the container measured
  // exactly on this device (hook/context.cc; 0 = none yet): reserved against
  // the quota (and the resident allowance) before a new context is created,
  // then settled to that context's own measurement. Written rarely.
  std::atomic<std::uint64_t> context_size_bytes;
  // Allocations refused because the process's records of them could not grow
  // (its address space exhausted: platform::table_detail::g_stuck_shards):
  // never admitted without a record that lets their free release them.
  std::atomic<std::uint64_t> record_refusals;
  // The size of a process's first context on this device, measured exactly
  // once per configuration (hook/context.cc, first_context_key): key << 40 |
  // bytes, 0 = none. A later first context of the same key is counted at it
  // without a measurement (no NVML process list: start-up O(1), issue 35).
  std::atomic<std::uint64_t> first_context;
  // --- line 2: the token bucket (docs/limiter.md), written by every limited launch ---
  alignas(64) std::atomic<
      std::int64_t> tokens_ns;  // device-time credit; negative = debt of admitted launches, repaid by refill
  std::atomic<std::uint64_t> last_refill_ns;  // CLOCK_MONOTONIC ns of the last refill
  std::atomic<std::uint64_t> credited_ns;     // cumulative credit put into tokens_ns (spent = credited - tokens)
  std::uint64_t reserved3[5];
  // --- line 3: statistics, batched adds ---
  alignas(64) std::atomic<std::uint64_t> throttled_ns;  // total time launching threads slept
  std::atomic<std::uint64_t> launches;                  // kernels launched by the container
  std::uint64_t reserved4[6];
  // --- line 4: feedback (written by the agent, or by the elected process) ---
  alignas(64) std::atomic<std::uint64_t> util_permille;  // measured SM utilisation of the container, 0..1000
  std::atomic<std::uint64_t> util_updated_ns;            // CLOCK_MONOTONIC ns of the last sample
  std::atomic<std::uint64_t> device_util_permille;       // whole device (for elastic policy)
  std::atomic<std::uint32_t> feedback_owner_pid;         // elected sampler when no agent runs
  std::uint32_t reserved5;
  std::atomic<std::uint64_t> feedback_heartbeat_ns;  // last cycle of the elected feedback owner
  std::atomic<std::uint64_t> agent_extra_bytes;      // what NVML shows beyond our count (written by the agent)
  std::uint64_t reserved6[2];
  // --- line 5: memory oversubscription (GPUSLICE_OVERSUBSCRIBE, docs/memory.md) ---
  alignas(
      64) std::atomic<std::uint64_t> resident_limit_bytes;  // device-resident allowance; 0 or kUnlimited = the quota
  std::atomic<std::uint64_t> spilled_bytes;                 // part of used_bytes served as host-resident managed memory
  std::atomic<std::uint64_t> oversub_waits;                 // allocations that waited for device memory
  std::atomic<std::uint64_t> oversub_wait_ns;               // total time they waited
  std::atomic<std::uint64_t> oversub_timeouts;              // waits that ended in out-of-memory
  std::atomic<std::uint32_t> oversub_waiting;               // allocations waiting now
  std::atomic<std::uint32_t> free_generation;               // bumped by every release: waiters sleep on it (futex)
  std::atomic<std::uint32_t> oversub_policy;                // 0 fail, 1 spill, 2 wait (as the first process set it)
  std::uint32_t reserved7;
  std::atomic<std::uint64_t> spills;  // allocations served by spilling
  // --- line 6: spilled bytes as two monotonic totals (ABI v4): spilled
  // memory = in - out. Resident memory is read as used_bytes - (in - out)
  // with `in` read before used_bytes and `out` after, which can only
  // overstate it (docs/memory.md); spilled_bytes stays for display.
  alignas(64) std::atomic<std::uint64_t> spilled_in_bytes;  // every byte ever counted as spilled
  std::atomic<std::uint64_t> spilled_out_bytes;             // every such byte freed, exited or reaped
  std::uint64_t reserved8[6];
  // --- line 7: reserved for later fields (per-device priority), zero until then ---
  alignas(64) std::uint64_t reserved_future[8];
};
static_assert(sizeof(DeviceState) == 512);

// Per-process slot. Claimed by CAS on state, never moved or compacted.
enum SlotState : std::uint32_t { kSlotFree = 0, kSlotClaiming = 1, kSlotLive = 2, kSlotReaping = 3 };

struct alignas(64) Slot {
  // --- line 0: identity, written when claimed (host_pid: by the agent) ---
  std::atomic<std::uint32_t> state;        // SlotState
  std::atomic<std::uint32_t> pid;          // pid in the owner's pid namespace
  std::atomic<std::uint64_t> pidns_inode;  // st_ino of /proc/<pid>/ns/pid
  std::atomic<std::uint64_t> start_time;   // /proc/<pid>/stat field 22 (clock ticks since boot)
  std::atomic<std::uint32_t> host_pid;     // filled by the agent (0 = unknown)
  std::atomic<std::uint32_t> reserved0;
  // Bit e: this process holds shared allocation e (Region::shared, ABI v5).
  std::atomic<std::uint64_t> shared_held;
  std::uint64_t reserved1[3];
  // --- line 1: written by every accounting operation of the process ---
  // Seqlock bracket of the accounting operations (threads of one process share
  // the slot, so it counts): low 20 bits = operations in flight, the rest = a
  // generation bumped by each completed one. The reaper only trusts a snapshot
  // in which every live slot has zero in flight and is unchanged. See
  // docs/memory-accounting.md.
  alignas(64) std::atomic<std::uint64_t> seq;
  // Bumped by every claim (shm::claim_slot), never 0 for a claimed slot: the
  // low 16 bits tag the lease words of this claim (limiter/lease.h), so that a
  // stale thread of a previous owner can never move a new owner's lease.
  std::atomic<std::uint32_t> claim_generation;
  // Refills that may take a lease (limiter/memory_accounting.cc): low 16 bits
  // in flight (from before their admission until the lease is in the word),
  // high 16 bits a generation bumped by each that ended. A refusal is final
  // only after a try no refill of another process overlapped.
  std::atomic<std::uint32_t> refills;
  // Allocations of this process waiting for device memory now, per device
  // (ABI v4): the reaper takes a dead waiter's out of
  // DeviceState::oversub_waiting.
  std::atomic<std::uint16_t> oversub_waiting[kMaxDevices];
  std::uint64_t reserved2[2];
  // This process's share of DeviceState::used_bytes, spare lease included
  // (its share is committed - owed: see lease[] and docs/memory-accounting.md).
  std::atomic<std::uint64_t> committed_bytes[kMaxDevices];
  std::atomic<std::uint64_t> context_bytes[kMaxDevices];    // part of committed_bytes held by contexts
  std::atomic<std::uint64_t> nvml_used_bytes[kMaxDevices];  // what NVML says it holds (agent)
  // Part of committed_bytes served as host-resident managed memory (spilled);
  // the reaper subtracts a dead process's from DeviceState::spilled_bytes.
  std::atomic<std::uint64_t> spilled_bytes[kMaxDevices];
  // --- lines 10-13: quota leases (ABI v3), one line per 4 devices, written
  // by the owner's allocations and frees (one RMW each) and, rarely, by a
  // thief, the reaper or a limit change. word = claim tag (16 bits) | OWED |
  // CLOSED | STALE (ABI v4) | 45-bit amount: the spare part of
  // committed_bytes (or, when OWED, bytes a thief took back into used_bytes
  // that committed_bytes still holds); STALE: admitted under limits that
  // changed since, not spendable (limiter/lease.h). cap_bytes:
  // the most spare a free may keep (set when a lease is taken, by headroom).
  struct alignas(16) Lease {
    std::atomic<std::uint64_t> word;
    std::atomic<std::uint64_t> cap_bytes;
  };
  alignas(64) Lease lease[kMaxDevices];
};
static_assert(sizeof(Slot) % 64 == 0);

// A process of the container that exited recently (ring, oldest overwritten):
// its kernels may still be queued or running on the devices, and the compute
// feedback keeps attributing their device time to the container
// (limiter/compute_feedback.h). Written by the exiting process; a record whose
// seq is odd is being written.
struct alignas(16) DepartedProcess {
  std::atomic<std::uint32_t> pid;          // as NVML reports it (the host pid when known)
  std::atomic<std::uint32_t> seq;          // odd while being written
  std::atomic<std::uint64_t> departed_ns;  // CLOCK_MONOTONIC at exit
};
inline constexpr std::uint32_t kMaxDeparted = 64;

// Device memory shared between processes of the container (ABI v5): an
// allocation one process exported and others imported, counted once
// (limiter/shared_allocs.h, docs/memory-accounting.md). Its bytes are in
// used_bytes through charged_bytes, not through any slot; its holders are the
// slots whose shared_held has its bit. state = generation << 32 | (slot + 1)
// << 8 | SharedPhase (the slot claiming or closing it; 0 when active or free).
enum SharedPhase : std::uint32_t { kSharedFree = 0, kSharedClaiming = 1, kSharedActive = 2, kSharedClosing = 3 };
inline constexpr std::uint32_t kMaxShared = 64;
struct alignas(64) SharedAlloc {
  std::atomic<std::uint64_t> state;
  std::atomic<std::uint64_t> key;            // identity of the shareable handle (hook/vmm.cc)
  std::atomic<std::uint64_t> charged_bytes;  // part of the device's used_bytes held by this entry
  std::atomic<std::uint32_t> device;         // device entry
  std::uint32_t reserved0;
  std::uint64_t reserved1[4];
};
static_assert(sizeof(SharedAlloc) == 64);

struct RegionHeader {
  std::uint64_t magic;                            // kRegionMagic, published last by the creator
  std::uint32_t abi_version;                      // kRegionAbiVersion
  std::uint32_t header_size;                      // sizeof(RegionHeader)
  std::uint64_t total_size;                       // sizeof(Region)
  std::uint32_t max_devices;                      // kMaxDevices
  std::uint32_t max_slots;                        // kMaxSlots
  std::uint64_t created_ns;                       // CLOCK_REALTIME at creation
  char container_name[64];                        // GPUSLICE_CONTAINER_NAME at creation, NUL-terminated
  std::atomic<std::uint64_t> agent_heartbeat_ns;  // CLOCK_MONOTONIC of the agent's last cycle (0 = none)
  std::atomic<std::uint32_t> live_slots;          // approximate, for tools
  std::uint32_t reserved0;
  // Reaper lock: 0 = free, else the holder's identity packed by
  // limiter::reaper_token (pid, pid-namespace and start-time bits) so that a
  // dead holder is recognised and the lock taken over; nobody waits on it.
  std::atomic<std::uint64_t> reaper_lock;
  std::atomic<std::uint64_t> slots_reaped;  // total dead slots reclaimed
  // --- priority between tenants (docs/priority.md) ---
  std::atomic<std::uint32_t> priority;  // gpuslice::Priority: 0 = not recorded yet, 1 low, 2 normal, 3 high
  std::uint32_t reserved2;
  std::atomic<std::uint64_t> priority_held_ns;        // total time the container's launches were held
  std::atomic<std::uint64_t> priority_held_until_ns;  // CLOCK_MONOTONIC: held now if in the future
  std::atomic<std::uint64_t> departed_next;           // departed[] records written so far (next one: % kMaxDeparted)
  std::uint64_t reserved3[3];
  // Bit i: slot i took a quota lease since it was claimed (set once per claim
  // and device by the lease path, cleared when the slot is freed). Thefts and
  // the display of spare leases look only at these slots (ABI v3).
  alignas(64) std::atomic<std::uint64_t> lease_holders[kMaxSlots / 64];
  // Reserved for later header fields, zero until then.
  std::uint64_t reserved1[24];
};

struct Region {
  RegionHeader header;
  alignas(64) DeviceState devices[kMaxDevices];
  alignas(64) Slot slots[kMaxSlots];
  alignas(64) DepartedProcess departed[kMaxDeparted];
  alignas(64) SharedAlloc shared[kMaxShared];  // ABI v5
};

static_assert(offsetof(Region, header) == 0);
static_assert(sizeof(RegionHeader) % 8 == 0);
static_assert(sizeof(RegionHeader) == 512);

}  // namespace gpuslice
