#include "hook/runtime.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <cstring>

#include "hook/log.h"
#include "hook/real.h"
#include "limiter/memory_accounting.h"

extern char** environ;

namespace gpuslice::hook {

std::atomic<int> g_ready{kReadyNo};
Process g_process{nullptr, {-1}, {}};

namespace {

Config g_config;
std::atomic<int> g_config_state{0};  // 0 unparsed, 1 parsing, 2 parsed
std::atomic<int> g_boot_busy{0};
std::atomic<bool> g_atfork_registered{false};
std::atomic<ReclaimFn> g_pool_reclaim{nullptr};
[[gnu::tls_model("initial-exec")]] thread_local bool t_booting = false;

// ordinal -> region entry + 1 (0 = not mapped yet), and the reverse map.
std::atomic<int> g_entry_of_ordinal[kMaxDevices];
std::atomic<int> g_ordinal_of_entry[kMaxDevices];

// A forked child is a new process: it must claim its own slot (the parent's
// usage stays the parent's) before it accounts anything.
void after_fork_in_child() noexcept {
  g_process.slot.store(-1, std::memory_order_relaxed);
  g_boot_busy.store(0, std::memory_order_relaxed);
  if (g_ready.load(std::memory_order_relaxed) == kReadyYes) g_ready.store(kReadyNo, std::memory_order_release);
}

void log_effective_options(const limiter::Options& o) noexcept {
  if (o.unknown_variable[0] != '\0')
    GPUSLICE_LOG(warn, "%s is not a gpuslice option (see gpuslice-smi options)", o.unknown_variable);
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

CUresult bootstrap_now() noexcept {
  const Config& cfg = config();
  if (!cfg.valid) {
    GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED", cfg.error.message);
    return fail_closed();
  }
  log_effective_options(cfg.options);
  if (!load_driver()) return fail_closed();

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
    region = shm::attach(cfg.options.region, cfg.options.container_name, &err);
    if (region == nullptr) {
      GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED", err.message);
      return fail_closed();
    }
  }
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
  g_process.slot.store(slot, std::memory_order_release);
  if (!g_atfork_registered.exchange(true)) pthread_atfork(nullptr, nullptr, after_fork_in_child);
  g_ready.store(kReadyYes, std::memory_order_release);
  return CUDA_SUCCESS;
}

}  // namespace

const Config& config() noexcept {
  if (g_config_state.load(std::memory_order_acquire) == 2) return g_config;
  int expected = 0;
  if (g_config_state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    g_config.valid = limiter::parse_options(environ, &g_config.options, &g_config.error);
    if (g_config.valid) g_log_level.store(g_config.options.log_level, std::memory_order_relaxed);
    g_config_state.store(2, std::memory_order_release);
  } else {
    while (g_config_state.load(std::memory_order_acquire) != 2) sched_yield();
  }
  return g_config;
}

CUresult bootstrap() noexcept {
  int s = g_ready.load(std::memory_order_acquire);
  if (s == kReadyYes) return CUDA_SUCCESS;
  if (s == kReadyFailed) return kFailClosed;
  if (t_booting) return kFailClosed;  // re-entered from inside bootstrap: not ready yet
  int expected = 0;
  if (g_boot_busy.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    t_booting = true;
    CUresult rc = bootstrap_now();
    t_booting = false;
    return rc;
  }
  while ((s = g_ready.load(std::memory_order_acquire)) == kReadyNo) sched_yield();
  return s == kReadyYes ? CUDA_SUCCESS : kFailClosed;
}

int device_entry(CUdevice ordinal) noexcept {
  if (ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) return -1;
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

int current_device_entry(CUresult* rc) noexcept {
  CUdevice dev = 0;
  CUresult r = real_cuCtxGetDevice(&dev);
  if (r != CUDA_SUCCESS) {
    *rc = r;
    return -1;
  }
  int entry = device_entry(dev);
  if (entry < 0) *rc = CUDA_ERROR_OUT_OF_MEMORY;
  return entry;
}

int ordinal_of_entry(int entry) noexcept {
  if (entry < 0 || static_cast<unsigned>(entry) >= kMaxDevices) return -1;
  return g_ordinal_of_entry[entry].load(std::memory_order_acquire) - 1;
}

// A slot of -1 here means the process is past its exit-time release: what
// the runtime frees during teardown is no longer the container's concern.
bool reserve(int entry, std::uint64_t bytes) noexcept {
  int slot = g_process.slot.load(std::memory_order_relaxed);
  if (slot < 0) return true;
  if (limiter::reserve(g_process.region, slot, entry, bytes, g_process.self)) return true;
  if (ReclaimFn reclaim = g_pool_reclaim.load(std::memory_order_acquire)) {
    reclaim();  // dead slots were already reaped by reserve(): only pools may have given memory back
    if (limiter::try_reserve(g_process.region, slot, entry, bytes)) return true;
  }
  return false;
}

void release(int entry, std::uint64_t bytes) noexcept {
  int slot = g_process.slot.load(std::memory_order_relaxed);
  if (slot >= 0) limiter::release(g_process.region, slot, entry, bytes);
}

bool charge(int entry, std::uint64_t bytes) noexcept {
  int slot = g_process.slot.load(std::memory_order_relaxed);
  return slot < 0 || limiter::charge(g_process.region, slot, entry, bytes);
}

void set_pool_reclaim(ReclaimFn fn) noexcept { g_pool_reclaim.store(fn, std::memory_order_release); }

// At a clean exit the driver frees everything this process held: return it to
// the container's budget now instead of waiting for a reaper.
[[gnu::destructor]] static void release_at_exit() noexcept {
  if (g_ready.load(std::memory_order_acquire) != kReadyYes) return;
  Region* r = g_process.region;
  int slot = g_process.slot.exchange(-1, std::memory_order_acq_rel);
  if (r == nullptr || slot < 0) return;
  limiter::release_all(r, slot);
  shm::release_slot(r, slot);
}

}  // namespace gpuslice::hook
