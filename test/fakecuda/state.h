// The simulated machine's shared state: one file, mapped MAP_SHARED by every
// process that loads the fake driver or the fake NVML, so all of them see one
// set of devices, as on real hardware. Fixed-width fields only; everything a
// second process may touch is a std::atomic (TSan-clean across processes).
//
// Two kinds of synchronisation, chosen per path:
//  - memory bookkeeping (claim a process slot, charge bytes, reap the dead) takes
//    one robust process-shared mutex: the fake is a test double and exact OOM
//    decisions are worth a lock; a holder killed by SIGKILL is recovered through
//    EOWNERDEAD, and every critical section leaves the state valid at each step.
//  - the kernel timeline (timeline.h) is lock-free, because benchmarks time
//    launches through it.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gpuslice::fakecuda {

inline constexpr std::uint64_t kStateMagic = 0x4554415453414b46ull;  // "FKASTATE"
inline constexpr std::uint32_t kStateAbiVersion = 6;
inline constexpr std::uint32_t kMaxDevices = 16;
inline constexpr std::uint32_t kMaxSlots = 512;
// cgroups with a device-memory limit set (cgroup_limits.h).
inline constexpr std::uint32_t kMaxCgroupLimits = 1024;
// >= 10 s of back-to-back 20 us kernels (500,000) per device.
inline constexpr std::uint64_t kRingEntries = std::uint64_t{1} << 19;

static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

// One kernel on a device's timeline. Written with a per-entry sequence number
// (odd while being written) so readers never see a torn record.
struct RingEntry {
  std::atomic<std::uint64_t> seq;       // 2*index+2 once entry `index` is complete
  std::atomic<std::uint64_t> start_ns;  // CLOCK_MONOTONIC
  std::atomic<std::uint64_t> end_ns;
  std::atomic<std::uint64_t> pids;  // host_pid << 32 | pid (pid in the launcher's namespace)
};
static_assert(sizeof(RingEntry) == 32);

struct alignas(64) DeviceShared {
  alignas(64) std::atomic<std::uint64_t> busy_until_ns;  // end of the last kernel submitted (CAS)
  alignas(64) std::atomic<std::uint64_t> ring_head;      // entries ever appended
  std::atomic<std::uint64_t> busy_total_ns;
  std::atomic<std::uint64_t> kernels;
};

// One process that called cuInit. Liveness is an OFD byte lock the owner holds on
// the state file at kSlotLockBase + index: the kernel drops it when the process
// dies, whatever its pid namespace, and pid reuse cannot fake it.
struct alignas(64) ProcSlot {
  std::atomic<std::uint32_t> state;                       // 0 free, 1 claimed
  std::atomic<std::uint32_t> pid;                         // getpid() of the owner (its own namespace)
  std::atomic<std::uint32_t> host_pid;                    // first NSpid field: what NVML reports
  std::atomic<std::uint32_t> generation;                  // bumped at each claim
  std::atomic<std::uint64_t> start_time;                  // /proc/<pid>/stat field 22 (clock ticks)
  std::atomic<std::uint64_t> pidns_inode;                 // /proc/self/ns/pid inode
  std::atomic<std::uint64_t> alloc_bytes[kMaxDevices];    // allocations, pool reserves, VMM, arrays
  std::atomic<std::uint64_t> context_bytes[kMaxDevices];  // FAKECUDA_CONTEXT_MEMORY per live context
  std::atomic<std::uint32_t> contexts[kMaxDevices];       // live contexts (primary counted once)
  std::atomic<std::uint64_t> busy_ns[kMaxDevices];        // device time submitted by this process
  std::atomic<std::uint32_t> graphics[kMaxDevices];       // live graphics allocations (interop.cc): a graphics context
  std::atomic<std::uint64_t> managed_bytes[kMaxDevices];  // the managed part of alloc_bytes (outside cgroup limits)
  // The same, lowered after alloc_bytes where managed_bytes is lowered before
  // (State::uncharge_managed): the figure device_managed_locked() sums.
  std::atomic<std::uint64_t> managed_held_bytes[kMaxDevices];
  std::atomic<std::uint64_t> cgroup_ino;  // its cgroup v2 directory's inode at cuInit; 0 = none
};

// A device-memory limit on one cgroup v2 directory (nvmlDeviceSetMemoryLimits_v1,
// cgroup_limits.h), keyed by the directory's inode (the kernel's cgroup id:
// never reused while the system runs, so a removed cgroup's limits match
// nothing again). Written under the state mutex.
struct CgroupLimit {
  std::atomic<std::uint64_t> ino;      // 0 = free entry
  std::atomic<std::uint32_t> limited;  // bit d: device d has a limit
  std::atomic<std::uint32_t> reserved;
  std::atomic<std::uint64_t> soft[kMaxDevices];
  std::atomic<std::uint64_t> hard[kMaxDevices];
};

struct StateHeader {
  std::uint64_t magic;
  std::uint32_t abi_version;
  std::uint32_t header_size;
  std::uint64_t total_size;
  std::uint32_t devices;
  std::uint32_t sms;
  std::uint64_t memory_bytes;   // per device
  std::uint64_t context_bytes;  // per context
  std::uint64_t uuid_seed;      // from the state file's path: UUIDs are stable per path
  std::uint64_t created_mono_ns;
  std::uint64_t created_real_ns;  // CLOCK_REALTIME at the same instant: NVML sample timestamps
  std::uint64_t ring_offset;      // byte offset of device 0's ring
  std::uint64_t ring_entries;
  // Timing model (README "Profiles"); fixed by the file's creator like the rest.
  std::uint32_t profile;         // Profile
  std::uint32_t jitter_pct;      // each kernel's run time varies uniformly by +-jitter_pct %
  std::uint32_t module_memory;   // 1: loaded modules hold device memory (globals + code)
  std::uint32_t integrated;      // 1: an integrated GPU (FAKECUDA_INTEGRATED): memory is system memory
  std::uint64_t seed;            // jitter's seed
  std::uint64_t nvml_period_ns;  // NVML sample period; 0 = exact windows (ideal)
  std::uint64_t timeslice_ns;    // realistic scheduler's slice between contexts
  std::uint64_t launch_cost_ns;  // device time a launch takes before its kernel runs
  std::uint64_t queue_depth;     // pending launches per stream before a launch blocks; 0 = unbounded
  std::uint64_t sched_offset;    // byte offset of device 0's scheduler (realistic profile only)
  char driver_version[32];       // FAKECUDA_DRIVER_VERSION: nvmlSystemGetDriverVersion
  std::uint32_t driver_branch;   // its first number (615 and up: per-cgroup memory limits)
  std::uint32_t reserved1;
  alignas(64) pthread_mutex_t mutex;  // robust, process-shared
  // One past the highest slot ever claimed: scans of the slots (usage,
  // reaping) stop there, so an allocation costs what the processes in use
  // make it cost, not a walk of all kMaxSlots. Only grows (under the mutex).
  std::atomic<std::uint32_t> slots_high;
  // Work counted for tests (fakecuda-ctl counters): NVML process lists
  // served, and probes of a process slot's liveness lock.
  std::atomic<std::uint64_t> nvml_process_lists;
  std::atomic<std::uint64_t> slot_probes;
  DeviceShared device[kMaxDevices];
  ProcSlot slot[kMaxSlots];
  CgroupLimit cgroup_limit[kMaxCgroupLimits];
};

inline constexpr off_t kSlotLockBase = off_t{1} << 40;

enum class Profile : std::uint32_t { ideal = 0, realistic = 1 };

struct Config {
  Profile profile = Profile::ideal;
  std::uint32_t jitter_pct = 0;
  std::uint32_t module_memory = 0;
  std::uint64_t seed = 1;
  std::uint64_t nvml_period_ns = 0;
  std::uint64_t timeslice_ns = 0;
  std::uint64_t launch_cost_ns = 0;
  std::uint64_t queue_depth = 0;
  std::uint32_t devices = 1;
  std::uint64_t memory_bytes = std::uint64_t{16} << 30;
  std::uint32_t sms = 132;
  std::uint32_t integrated = 0;
  std::uint64_t context_bytes = 0;
  char driver_version[32] = "580.65.06";
  std::uint32_t driver_branch = 580;
  char state_path[1024] = {};
};

// Reads FAKECUDA_* from the environment. On failure writes one line naming the
// variable, the value and what was expected into `error` and returns false.
bool parse_config(Config& config, char* error, std::size_t error_len);
struct StateHeader;
// CUDA_VISIBLE_DEVICES (`text`, nullptr = unset) as the driver reads it at
// cuInit: fills out[ordinal] = physical index, returns how many are visible.
std::uint32_t parse_visible_devices(const char* text, const StateHeader& header, std::uint32_t devices,
                                    std::uint32_t out[]);
// Strict size parser: digits, then optional B, K/M/G/T (base 1000) or Ki/Mi/Gi/Ti (1024).
bool parse_size(const char* text, std::uint64_t& out);
// The path FAKECUDA_STATE names, or the per-user default.
void state_path_from_env(char* out, std::size_t len);

std::uint64_t mono_ns();

// A process's mapping of the state file.
class State {
 public:
  // Attaches to config.state_path, creating it race-free (built in a temporary
  // file, then link()ed into place) if absent. nullptr + message on failure.
  static State* open_or_create(const Config& config, char* error, std::size_t error_len);
  // Attaches to an existing file only.
  static State* open_existing(const char* path, char* error, std::size_t error_len);
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  StateHeader& header() { return *header_; }
  DeviceShared& device(std::uint32_t index) { return header_->device[index]; }
  RingEntry* ring(std::uint32_t index);
  std::uint32_t device_count() const { return header_->devices; }

  // The robust, process-shared mutex: false only if it is unrecoverable.
  // Code in this library uses the guard below; lock()/unlock() serve an
  // observer whose hold spans its own calls (fakecuda_state_lock).
  bool lock();
  void unlock();
  // Robust-mutex guard. ok() is false only if the mutex is unrecoverable.
  class Lock {
   public:
    explicit Lock(State& state);
    ~Lock();
    bool ok() const { return locked_; }
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    State& state_;
    bool locked_ = false;
  };

  // --- with Lock held ---
  // Frees every claimed slot whose owner is gone (skipping own_slot). Returns the count.
  int reap_locked(int own_slot);
  // One past the highest slot ever claimed (StateHeader::slots_high).
  int slots_high() const;
  // Claims a slot for this process and takes its liveness lock. -1 if none free.
  int claim_slot_locked(std::uint32_t pid, std::uint32_t host_pid, std::uint64_t start_time, std::uint64_t pidns_inode,
                        std::uint64_t cgroup_ino = 0);
  // Bytes held on a device by every claimed slot.
  std::uint64_t device_used_locked(std::uint32_t dev) const;
  // The managed part of it, and (*used) the device's held bytes read in the same pass.
  std::uint64_t device_managed_locked(std::uint32_t dev, std::uint64_t* used) const;
  // Adds `bytes` to own slot's allocation (or context) counter if the device
  // has room and the slot's cgroup limit (cgroup_limits.h) allows it.
  bool charge_locked(int own_slot, std::uint32_t dev, std::uint64_t bytes, bool context);
  // The same for managed memory: counted on the device, outside cgroup limits.
  bool charge_managed_locked(int own_slot, std::uint32_t dev, std::uint64_t bytes);
  void uncharge_managed(int own_slot, std::uint32_t dev, std::uint64_t bytes);

  // --- lock-free ---
  void uncharge(int own_slot, std::uint32_t dev, std::uint64_t bytes, bool context);
  bool slot_alive(int index) const;  // owner still holds its liveness lock (not for own slot)
  // Gives the slot back (clears counters, drops the liveness lock).
  void release_slot(int own_slot);
  // After fork(): the child must not keep the parent's open file description (it
  // would keep the parent's liveness locks alive after the parent dies).
  void forget_fd_after_fork();
  int fd() const { return fd_; }

 private:
  State() = default;
  static State* map_fd(int fd, char* error, std::size_t error_len);
  int fd_ = -1;
  StateHeader* header_ = nullptr;
  std::size_t mapped_size_ = 0;
};

// Test probes of the simulated driver (chaos.h): called after every charge
// granted by charge_locked (state Lock held) and after every uncharge. Null
// (the default) costs one load and a branch.
using ChargeProbe = void (*)(State& state, int slot, std::uint32_t dev, std::uint64_t bytes, bool context);
extern std::atomic<ChargeProbe> g_charge_probe;
extern std::atomic<ChargeProbe> g_uncharge_probe;

// Identity of the calling process, as recorded in its slot.
struct ProcessIdentity {
  std::uint32_t pid;
  std::uint32_t host_pid;
  std::uint64_t start_time;
  std::uint64_t pidns_inode;
  std::uint64_t cgroup_ino;  // its cgroup v2 directory (cgroup_limits.h); 0 = none
};
ProcessIdentity current_process_identity();

}  // namespace gpuslice::fakecuda

namespace gpuslice::fakecuda {

// What both libraries report for every simulated device.
inline constexpr const char* kDeviceName = "NVIDIA H100 80GB HBM3 (fakecuda)";
inline constexpr int kDriverVersion = 13000;                      // cuDriverGetVersion
inline constexpr const char* kDriverVersionString = "580.65.06";  // FAKECUDA_DRIVER_VERSION's default

// 16 UUID bytes, deterministic per (state file path, device index).
void device_uuid(const StateHeader& header, std::uint32_t dev, unsigned char out[16]);
// NVML's spelling of the same bytes: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
void device_uuid_string(const StateHeader& header, std::uint32_t dev, char* out, std::size_t len);

// One process's holdings on one device, for NVML, fakecuda-ctl and the test API.
struct ProcessUsage {
  std::uint32_t pid;
  std::uint32_t host_pid;
  std::uint32_t device;
  std::uint32_t contexts;
  std::uint64_t used_bytes;     // allocations + context memory
  std::uint64_t context_bytes;  // the context-memory part of used_bytes
  std::uint64_t busy_ns;        // device time submitted so far
  std::uint32_t graphics;       // live graphics allocations (a graphics context: NVML's graphics list)
  std::uint64_t start_time;     // the process's start time and pid namespace (host_pid_seen_here)
  std::uint64_t pidns_inode;
};
// With the state Lock held, after reaping: every claimed slot that has a context
// or memory on `dev` (every device if dev < 0). Returns how many exist; fills at most `max`.
int collect_usage_locked(State& state, int dev, ProcessUsage* out, int max);
// The pid NVML reports for `u`, as the calling process's /proc names it. A
// process whose own /proc was private (a container's) recorded only its pid
// there (NSpid had one field); the real driver knows the host pid whatever
// /proc the process saw, so it is looked up here: the process of that pid
// namespace with that innermost pid and start time. Unchanged otherwise.
std::uint32_t host_pid_seen_here(const ProcessUsage& u);

}  // namespace gpuslice::fakecuda
