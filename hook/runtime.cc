#include "hook/runtime.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <new>

#include "hook/log.h"
#include "hook/oversub.h"
#include "hook/real.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "limiter/options_file.h"

extern char** environ;

namespace gpuslice::hook {

std::atomic<int> g_ready{kReadyNo};
Process g_process{nullptr, {-1}, {}, {0}};

namespace {

Config g_config;
// The configuration file's text while config() parses it (static: no heap, 64 KiB).
limiter::ConfigFileBuffer g_config_file;
std::atomic<int> g_config_state{0};  // 0 unparsed, 1 parsing, 2 parsed
std::atomic<int> g_boot_busy{0};
std::atomic<bool> g_atfork_registered{false};
std::atomic<ReclaimFn> g_pool_reclaim{nullptr};
[[gnu::tls_model("initial-exec")]] thread_local bool t_booting = false;

// Ownership of the slot across process creation. The word lives in a page
// the kernel zeroes in every child it forks (MADV_WIPEONFORK), however the
// child was made: fork() with its handlers, _Fork(), raw clone(). A child
// that finds it zero holds its parent's slot and must claim its own before
// accounting anything. Kernels before 4.14 lack the advice: the word then
// stays in ordinary memory and only fork() (through pthread_atfork) and the
// exit path's pid check protect the parent's slot (docs/security.md).
enum : std::uint32_t { kSlotNotOurs = 0, kSlotAdopting = 1, kSlotOurs = 2 };
std::atomic<std::uint32_t> g_fallback_owner{kSlotNotOurs};
std::atomic<std::atomic<std::uint32_t>*> g_owner{&g_fallback_owner};

// Set once the exit-time release ran: later allocations (other libraries'
// destructors, threads still running during exit) are refused, not left
// unlimited. Threads inside reserve()/charge() are counted so that the slot
// is only given back when none of them can still write to it.
std::atomic<bool> g_exited{false};
std::atomic<int> g_accounting_calls{0};

// The region file stays open to be looked at: a file shrunk under our shared
// mapping raises SIGBUS at the next touch, and the library installs no signal
// handler. region_intact() looks (fstat) at most once per coarse clock tick.
std::atomic<int> g_region_fd{-1};
std::atomic<std::int64_t> g_region_checked_tick{-1};
std::atomic<bool> g_region_lost{false};

[[gnu::cold, gnu::noinline]] bool region_file_check(int fd) noexcept {
  shm::Error err{};
  if (shm::mapped_file_intact(fd, config().options.region, &err)) return true;
  if (!g_region_lost.exchange(true, std::memory_order_acq_rel))
    GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED from now on", err.message);
  g_ready.store(kReadyFailed, std::memory_order_release);
  return false;
}

// ordinal -> region entry + 1 (0 = not mapped yet), and the reverse map.
std::atomic<int> g_entry_of_ordinal[kMaxDevices];
std::atomic<int> g_ordinal_of_entry[kMaxDevices];

// A forked child is a new process: it must claim its own slot (the parent's
// usage stays the parent's) before it accounts anything.
void after_fork_in_child() noexcept {
  g_process.slot.store(-1, std::memory_order_relaxed);
  g_boot_busy.store(0, std::memory_order_relaxed);
  g_accounting_calls.store(0, std::memory_order_relaxed);  // the parent's threads are not here
  g_exited.store(false, std::memory_order_relaxed);         // forked from a destructor: a new process all the same
  if (g_ready.load(std::memory_order_relaxed) == kReadyYes) g_ready.store(kReadyNo, std::memory_order_release);
}

// The owner word, mapped once: a private anonymous page with MADV_WIPEONFORK.
void map_owner_word() noexcept {
  if (g_owner.load(std::memory_order_acquire) != &g_fallback_owner) return;
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return;
  if (madvise(page, 4096, MADV_WIPEONFORK) != 0) {
    munmap(page, 4096);
    return;
  }
  auto* word = new (page) std::atomic<std::uint32_t>{kSlotNotOurs};
  std::atomic<std::uint32_t>* expected = &g_fallback_owner;
  if (!g_owner.compare_exchange_strong(expected, word, std::memory_order_acq_rel)) munmap(page, 4096);
}

void log_effective_options(const limiter::Options& o) noexcept {
  if (o.unknown_variable[0] != '\0')
    GPUSLICE_LOG(warn, "%s is not a gpuslice option (see gpuslice-smi options)", o.unknown_variable);
  if (o.alias_warning[0] != '\0') GPUSLICE_LOG(warn, "%s", o.alias_warning);
  if (g_log_level.load(std::memory_order_relaxed) < static_cast<int>(LogLevel::debug)) return;
  char text[8192];
  if (limiter::format_effective_options(o, text, sizeof text) < 0) return;
  // One write per line keeps each line whole when several processes log at once.
  for (char* line = text; *line != '\0';) {
    char* end = std::strchr(line, '\n');
    if (end != nullptr) *end = '\0';
    GPUSLICE_LOG(debug, "%s", std::strncmp(line, "gpuslice: ", 10) == 0 ? line + 10 : line);
    if (end == nullptr) break;
    line = end + 1;
  }
}

CUresult fail_closed() noexcept {
  g_ready.store(kReadyFailed, std::memory_order_release);
  return kFailClosed;
}

// A slot with our own identity (pid, pid namespace, start time: nobody else
// can hold all three) was claimed by a previous image of this very process,
// before it called execve: no destructor ran, and its memory went with its
// address space. Reaped exactly, or it would stay charged while we live.
bool held_by_previous_image(const Slot& s, void* ctx) noexcept {
  const auto* self = static_cast<const shm::ProcessIdentity*>(ctx);
  return s.pid.load(std::memory_order_relaxed) == self->pid &&
         s.start_time.load(std::memory_order_relaxed) == self->start_time &&
         s.pidns_inode.load(std::memory_order_relaxed) == self->pidns_inode;
}

void reap_previous_image(Region* region, const shm::ProcessIdentity& self) noexcept {
  if (self.start_time == 0 || self.pidns_inode == 0) return;  // identity unknown: the agent reaps it
  shm::ProcessIdentity id = self;
  bool found = false;
  for (const Slot& s : region->slots)
    found = found || (s.state.load(std::memory_order_acquire) == kSlotLive && held_by_previous_image(s, &id));
  if (!found) return;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (limiter::reap_slots(region, self, held_by_previous_image, &id) != limiter::kReapBusy) return;
    sched_yield();
  }
}

// Frameworks size themselves from cuMemGetInfo at start-up (vLLM,
// TensorFlow, JAX's preallocation): memory of the container's processes that
// died without exiting must not be in the first answer. One pass of the
// reaper (a kill(pid, 0) and a /proc read per live slot); another process
// reaping at that moment (kReapBusy) is given a few yields, never waited on.
void reap_at_start(Region* region, const shm::ProcessIdentity& self) noexcept {
  if (self.start_time == 0 || self.pidns_inode == 0) return;  // cannot judge liveness: the agent reaps
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (limiter::reap_dead(region, self) != limiter::kReapBusy) return;
    sched_yield();
  }
}

// Claims this process's slot: runs on one thread at a time. Nothing here
// takes the loader lock (no dlopen/dlsym), so a thread waiting for it never
// waits on a thread that waits for the loader.
CUresult claim_now() noexcept {
  const Config& cfg = config();
  log_effective_options(cfg.options);
  shm::ProcessIdentity self{};
  if (!shm::read_identity(0, &self)) {
    // /proc belongs to another pid namespace (or is missing): our slot's
    // liveness is then unknown to other processes, and only the node agent
    // (which maps namespaces) can reap it after we die. Accounting still works.
    GPUSLICE_LOG(info, "this process's identity is not readable from /proc; if it dies without exiting, "
                       "its memory returns through the node agent");
  }
  Region* region = g_process.region;  // kept across fork: the mapping is inherited
  if (region == nullptr) {
    shm::Error err{};
    int fd = -1;
    // GPUSLICE_PASSTHROUGH (HAMi's CUDA_DISABLE_CONTROL): no limits (the
    // parser cleared them) and nothing shared: a private region, no file.
    region = cfg.options.passthrough ? shm::create_private(cfg.options.container_name, &err)
                                     : shm::attach(cfg.options.region, cfg.options.container_name, &err, nullptr, &fd);
    g_region_fd.store(fd, std::memory_order_release);
    if (region == nullptr) {
      GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED", err.message);
      return fail_closed();
    }
  }
  reap_previous_image(region, self);
  reap_at_start(region, self);
  int slot = shm::claim_slot(region, self);
  // All slots taken: reap the dead. Another live reaper may hold the reaper
  // lock for a moment (kReapBusy), so retry a few times — never wait on it.
  for (int attempt = 0; slot < 0 && attempt < 8; ++attempt) {
    if (limiter::reap_dead(region, self) == limiter::kReapBusy) sched_yield();
    slot = shm::claim_slot(region, self);
  }
  if (slot < 0) {
    GPUSLICE_LOG(error, "GPUSLICE_REGION=%s: all %u process slots are held by live processes, expected a "
                        "free slot; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED",
                 cfg.options.region, kMaxSlots);
    return fail_closed();
  }
  g_process.region = region;
  g_process.self = self;
  g_process.lease_tag.store(limiter::lease_tag(region, slot), std::memory_order_relaxed);
  g_process.slot.store(slot, std::memory_order_release);
  if (!g_atfork_registered.exchange(true)) pthread_atfork(nullptr, nullptr, after_fork_in_child);
  map_owner_word();
  g_owner.load(std::memory_order_acquire)->store(kSlotOurs, std::memory_order_release);
  g_ready.store(kReadyYes, std::memory_order_release);
  return CUDA_SUCCESS;
}

// Steps that every thread may run for itself, without waiting for another
// thread: parsing the options (pure computation) and loading the libraries
// (dlopen is reference-counted and recursive under the loader lock).
CUresult prepare() noexcept {
  const Config& cfg = config();
  if (!cfg.valid) {
    static std::atomic<bool> reported{false};
    if (!reported.exchange(true))
      GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED", cfg.error.message);
    return kFailClosed;
  }
  if (!load_driver()) return kFailClosed;
  // An explicit NVML path that cannot be used fails closed like an explicit
  // driver path: the context memory it measures would go uncounted.
  if (std::strcmp(cfg.options.real_libnvml_source.name, "default") != 0 && !load_nvml()) return kFailClosed;
  return CUDA_SUCCESS;
}

}  // namespace

const Config& config() noexcept {
  if (g_config_state.load(std::memory_order_acquire) == 2) return g_config;
  int expected = 0;
  if (g_config_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    g_config.valid = limiter::load_options(environ, limiter::kDefaultConfigFile, &g_config_file, &g_config.options,
                                           &g_config.error);
    if (g_config.valid) g_log_level.store(g_config.options.log_level, std::memory_order_relaxed);
    g_config_state.store(2, std::memory_order_release);
  } else {
    while (g_config_state.load(std::memory_order_acquire) != 2) sched_yield();
  }
  return g_config;
}

// Bootstrap never waits on something that can wait on it. The thread that
// finds bootstrap in progress elsewhere may hold the loader lock (a library
// constructor calling cuInit, or dlsym of a driver name) while the other
// thread sits in dlopen of the driver waiting for that lock: so loading is
// done by every thread for itself (prepare), and only the slot claim — a
// handful of syscalls, no loader — is done once while others yield.
CUresult bootstrap() noexcept {
  int s = g_ready.load(std::memory_order_acquire);
  if (s == kReadyYes) return CUDA_SUCCESS;
  if (s == kReadyFailed) return kFailClosed;
  if (t_booting) return kFailClosed;  // re-entered from inside bootstrap: not ready yet
  t_booting = true;
  CUresult rc = prepare();
  if (rc != CUDA_SUCCESS) {
    t_booting = false;
    return fail_closed();
  }
  int expected = 0;
  if (g_boot_busy.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    rc = claim_now();
    t_booting = false;
    return rc;
  }
  t_booting = false;
  while ((s = g_ready.load(std::memory_order_acquire)) == kReadyNo) sched_yield();
  return s == kReadyYes ? CUDA_SUCCESS : kFailClosed;
}

bool region_intact(bool force) noexcept {
  if (__builtin_expect(g_region_lost.load(std::memory_order_relaxed), 0)) return false;
  const int fd = g_region_fd.load(std::memory_order_relaxed);
  if (fd < 0) return true;
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);  // vDSO: no syscall
  const std::int64_t tick = static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
  if (!force && g_region_checked_tick.load(std::memory_order_relaxed) == tick) return true;
  g_region_checked_tick.store(tick, std::memory_order_relaxed);
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
  const limiter::Options& o = config().options;
  int entry = shm::device_index(g_process.region, reinterpret_cast<const std::uint8_t*>(uuid.bytes),
                                o.memory_limit[ordinal], o.sm_limit[ordinal], o.sm_policy);
  if (entry < 0) {
    GPUSLICE_WARN_CAPPED(3, "GPUSLICE_REGION=%s: all %u device entries are taken, expected a free one "
                            "for device %d; its allocations fail",
                         o.region, kMaxDevices, ordinal);
    return -1;
  }
  const DeviceState& d = g_process.region->devices[entry];
  if (d.quota_bytes.load(std::memory_order_relaxed) != o.memory_limit[ordinal])
    GPUSLICE_LOG(info, "device %d: the region's quota (%llu bytes) differs from this process's setting "
                       "(%llu bytes); the region's value applies",
                 ordinal, static_cast<unsigned long long>(d.quota_bytes.load(std::memory_order_relaxed)),
                 static_cast<unsigned long long>(o.memory_limit[ordinal]));
  g_ordinal_of_entry[entry].store(ordinal + 1, std::memory_order_release);
  g_entry_of_ordinal[ordinal].store(entry + 1, std::memory_order_release);
  return entry;
}

namespace {
// The entry of the only device (>= 0), kSeveralDevices, or kNotCounted until
// the driver could count its devices (it cannot before cuInit).
enum : int { kNotCounted = -1, kSeveralDevices = -2 };
std::atomic<int> g_single_entry{kNotCounted};

[[gnu::noinline]] int current_device_entry_slow(CUresult* rc) noexcept {
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
}  // namespace

int current_device_entry(CUresult* rc) noexcept {
  const int single = g_single_entry.load(std::memory_order_relaxed);
  if (__builtin_expect(single >= 0, 1)) return single;
  return current_device_entry_slow(rc);
}

int ordinal_of_entry(int entry) noexcept {
  if (entry < 0 || static_cast<unsigned>(entry) >= kMaxDevices) return -1;
  return g_ordinal_of_entry[entry].load(std::memory_order_acquire) - 1;
}

namespace {

// A child the kernel forked without our fork handler (_Fork, raw clone)
// still holds its parent's slot index: it claims its own (one thread does,
// the others yield; the claim takes no loader lock) before any accounting.
[[gnu::cold, gnu::noinline]] bool adopt_as_new_process() noexcept {
  std::atomic<std::uint32_t>* owner = g_owner.load(std::memory_order_acquire);
  std::uint32_t expected = kSlotNotOurs;
  if (owner->compare_exchange_strong(expected, kSlotAdopting, std::memory_order_acq_rel)) {
    after_fork_in_child();
    g_ready.store(kReadyNo, std::memory_order_release);
    const bool ok = bootstrap() == CUDA_SUCCESS;
    if (!ok) owner->store(kSlotOurs, std::memory_order_release);  // failed closed: slot stays -1
    return ok;
  }
  while (owner->load(std::memory_order_acquire) == kSlotAdopting) sched_yield();
  return g_ready.load(std::memory_order_acquire) == kReadyYes;
}

// The slot this process may account on, or -1. Hot path: two loads.
inline int own_slot() noexcept {
  if (__builtin_expect(g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs, 0) &&
      !adopt_as_new_process())
    return -1;
  return g_process.slot.load(std::memory_order_acquire);
}

// Brackets an operation that may add to the slot (see release_at_exit).
struct AddingCall {
  AddingCall() noexcept { g_accounting_calls.fetch_add(1, std::memory_order_seq_cst); }
  ~AddingCall() { g_accounting_calls.fetch_sub(1, std::memory_order_release); }
  AddingCall(const AddingCall&) = delete;
  AddingCall& operator=(const AddingCall&) = delete;
};

bool refused_after_exit() noexcept {
  if (!g_exited.load(std::memory_order_seq_cst)) return false;
  GPUSLICE_WARN_CAPPED(1, "an allocation during process exit, after gpuslice released this process's memory, "
                          "is refused with CUDA_ERROR_OUT_OF_MEMORY");
  return true;
}


[[gnu::noinline]] bool reserve_slow(int slot, int entry, std::uint64_t bytes) noexcept {
  AddingCall bracket;
  if (refused_after_exit() || !region_intact() || slot < 0) return false;
  // Oversubscription reads used_bytes as device-resident memory: a spare
  // lease would count as resident there, so its processes take none.
  if (oversubscribing() ? limiter::reserve(g_process.region, slot, entry, bytes, g_process.self)
                        : limiter::reserve(g_process.region, slot, g_process.lease_tag.load(std::memory_order_relaxed),
                                           entry, bytes, g_process.self))
    return true;
  if (ReclaimFn reclaim = g_pool_reclaim.load(std::memory_order_acquire)) {
    reclaim();  // dead slots were already reaped by reserve(): only pools may have given memory back
    if (limiter::try_reserve(g_process.region, slot, entry, bytes)) return true;
  }
  return false;
}

[[gnu::noinline]] void release_slow(int slot, int entry, std::uint64_t bytes) noexcept {
  if (g_exited.load(std::memory_order_acquire) || !region_intact()) return;
  limiter::release(g_process.region, slot, g_process.lease_tag.load(std::memory_order_relaxed), entry, bytes);
}

}  // namespace

// No slot (bootstrap failed closed, or the process is past its exit-time
// release) means no admission: memory is never handed out uncounted.
// Fast path: one CAS on our slot's lease word. It needs neither the exit
// bracket (AddingCall) nor the exit check: release_all closes the lease words
// and a stale thread's tag never matches a later claim's, so a late CAS
// fails and falls to the slow path, which refuses. It does look at the
// region file first (a coarse-clock read, no syscall): a truncated region
// must fail closed, not raise SIGBUS.
bool reserve(int entry, std::uint64_t bytes) noexcept {
  const int slot = own_slot();
  if (__builtin_expect(slot >= 0 && static_cast<unsigned>(entry) < kMaxDevices, 1) && region_intact() &&
      limiter::lease_alloc(g_process.region, slot, g_process.lease_tag.load(std::memory_order_relaxed), entry, bytes))
    return true;
  return reserve_slow(slot, entry, bytes);
}

// After the exit-time release (or in a child that never owned the slot)
// there is nothing of ours left to give back.
void release(int entry, std::uint64_t bytes) noexcept {
  if (g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs) return;
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (slot < 0 || static_cast<unsigned>(entry) >= kMaxDevices || bytes == 0 || !region_intact()) return;
  if (__builtin_expect(limiter::lease_free(g_process.region, slot,
                                           g_process.lease_tag.load(std::memory_order_relaxed), entry, bytes),
                       1))
    return;
  release_slow(slot, entry, bytes);
}

bool charge(int entry, std::uint64_t bytes) noexcept {
  const int slot = own_slot();  // before the bracket: adopting resets the count
  AddingCall bracket;
  if (refused_after_exit() || !region_intact() || slot < 0) return false;
  return limiter::charge(g_process.region, slot, entry, bytes);
}

void set_pool_reclaim(ReclaimFn fn) noexcept { g_pool_reclaim.store(fn, std::memory_order_release); }

// At a clean exit the driver frees everything this process held: return it to
// the container's budget now instead of waiting for a reaper.
// Only the process that claimed the slot may do this: a child made by vfork,
// _Fork or clone that calls exit() runs this destructor too (a vfork child
// even in its parent's memory), so it checks ownership and the pid before it
// writes anything. Allocations after this point are refused (reserve()); the
// slot itself is given back only when no thread is inside reserve()/charge(),
// otherwise it stays live and the reaper settles it after the process ended.
[[gnu::destructor]] static void release_at_exit() noexcept {
  if (g_ready.load(std::memory_order_acquire) != kReadyYes) return;
  if (g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs) return;
  if (static_cast<std::uint32_t>(getpid()) != g_process.self.pid) return;
  Region* r = g_process.region;
  int slot = g_process.slot.load(std::memory_order_acquire);
  if (r == nullptr || slot < 0 || !region_intact(true)) return;
  g_exited.store(true, std::memory_order_seq_cst);
  limiter::release_all(r, slot);
  if (g_accounting_calls.load(std::memory_order_seq_cst) == 0) shm::release_slot(r, slot);
}

}  // namespace gpuslice::hook
