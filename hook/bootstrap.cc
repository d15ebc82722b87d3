// Bootstrap of the preload library (bootstrap.h): options, driver, region and
// this process's slot, lazily on the first hooked call, allocation-free,
// thread-safe and re-entrancy-safe; and again in a forked child, which is a
// new process with a slot of its own.
#include "hook/bootstrap.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>

#include <cstring>

#include "hook/config.h"
#include "hook/log.h"
#include "hook/real.h"
#include "hook/region.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"

namespace gpuslice::hook {

namespace {

std::atomic<int> g_boot_busy{0};
[[gnu::tls_model("initial-exec")]] thread_local bool t_booting = false;
std::atomic<bool> g_atfork_registered{false};
std::atomic<bool> g_queried{false};  // this process asked cuMemGetInfo already (reap_before_first_query)

// A forked child is a new process: it must claim its own slot (the parent's
// usage stays the parent's) before it accounts anything.
void after_fork_in_child() noexcept {
  g_process.slot.store(-1, std::memory_order_relaxed);
  g_boot_busy.store(0, std::memory_order_relaxed);         // a forked child may claim a slot again
  g_accounting_calls.store(0, std::memory_order_relaxed);  // the parent's threads are not here
  g_exited.store(false, std::memory_order_relaxed);        // forked from a destructor: a new process all the same
  g_queried.store(false, std::memory_order_relaxed);       // its first query is its own
  if (g_ready.load(std::memory_order_relaxed) == kReadyYes) g_ready.store(kReadyNo, std::memory_order_release);
}

// The fork handler, registered once the first claim succeeded.
void register_fork_handler() noexcept {
  if (!g_atfork_registered.exchange(true)) pthread_atfork(nullptr, nullptr, after_fork_in_child);
}

void log_effective_options(const options::Options& o) noexcept {
  if (o.unknown_variable[0] != '\0')
    GPUSLICE_LOG(warn, "%s is not a gpuslice option (see gpuslice-smi options)", o.unknown_variable);
  if (o.alias_warning[0] != '\0') GPUSLICE_LOG(warn, "%s", o.alias_warning);
  if (g_log_level.load(std::memory_order_relaxed) < static_cast<int>(LogLevel::debug)) return;
  char text[8192];
  if (options::format_effective_options(o, text, sizeof text) < 0) return;
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
// address space. Reaped exactly, or it would stay charged while we live —
// unless a child it forked still holds its files (shm::judge_liveness).
bool held_by_previous_image(const Slot& s, shm::SlotLock lock, void* ctx) noexcept {
  const auto* self = static_cast<const shm::ProcessIdentity*>(ctx);
  return lock != shm::SlotLock::held && s.pid.load(std::memory_order_relaxed) == self->pid &&
         s.start_time.load(std::memory_order_relaxed) == self->start_time &&
         s.pidns_inode.load(std::memory_order_relaxed) == self->pidns_inode;
}

void reap_previous_image(Region* region, const shm::Observer& self) noexcept {
  if (self.start_time == 0 || self.pidns_inode == 0) return;  // identity unknown: the agent reaps it
  shm::ProcessIdentity id = self;
  bool found = false;
  for (const Slot& s : region->slots)
    found = found || (s.state.load(std::memory_order_acquire) == kSlotLive &&
                      held_by_previous_image(s, shm::SlotLock::unknown, &id));
  if (!found) return;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (limiter::reap_slots(region, self, held_by_previous_image, &id) != limiter::kReapBusy) return;
    sched_yield();
  }
}

// Memory of the container's processes that died without exiting returns
// through the agent's cycle, through the first allocation that would not fit
// without it (reserve's slow path reaps) and through a process's first
// cuMemGetInfo (reap_before_first_query). A start adds only a bounded sweep
// — a few live slots judged, wherever the pid hashes — so that its cost does
// not grow with the live processes (issue 35: a full pass at every start
// judged every slot, with a lock probe that walks the file's list of locks,
// quadratic for a burst); a claim that finds no free slot still reaps all.
constexpr std::uint32_t kStartSweepSlots = 4;

void sweep_at_start(Region* region, const shm::Observer& self) noexcept {
  if (self.start_time == 0 || self.pidns_inode == 0) return;  // cannot judge liveness: the agent reaps
  limiter::reap_sweep(region, self, (self.pid * 2654435761u) % kMaxSlots, kStartSweepSlots);
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
    GPUSLICE_LOG(info,
                 "this process's identity is not readable from /proc; if it dies without exiting, "
                 "its memory returns through the node agent");
  }
  Region* region = g_process.region;  // kept across fork: the mapping is inherited
  // Our own open description of the region file: it holds our slot's file
  // lock (shm::lock_slot_file), and judges the others' locks.
  int lock_fd = -1;
  if (region == nullptr) {
    shm::Error err{};
    int fd = -1;
    // GPUSLICE_PASSTHROUGH (HAMi's CUDA_DISABLE_CONTROL): no limits (the
    // parser cleared them) and nothing shared: a private region, no file.
    region = cfg.options.passthrough ? shm::create_private(cfg.options.container_name, &err)
                                     : shm::attach(cfg.options.region, cfg.options.container_name, &err, nullptr, &fd);
    watch_region_file(fd);
    if (region == nullptr) {
      GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED", err.message);
      return fail_closed();
    }
    lock_fd = fd;
  } else if (!cfg.options.passthrough) {
    // A forked child: the inherited descriptor is our parent's description,
    // whose lock on the parent's slot we keep holding with it (as we keep the
    // driver's files, and the parent's device memory, until exec or exit).
    // A description of its own of the file mapped (not what the path names now).
    lock_fd = shm::reopen(g_region_fd.load(std::memory_order_acquire), cfg.options.region);
    // Joined again under the joining lock, as attach joins (shm::rejoin): the
    // agent never removes the region between here and our claim. A region
    // the agent already removed (idle since our parent exited) is never
    // claimed in: we attach by name, as a new process would.
    if (lock_fd >= 0 && !shm::rejoin(lock_fd, cfg.options.region)) {
      close(lock_fd);
      lock_fd = -1;
      shm::Error err{};
      region = shm::attach(cfg.options.region, cfg.options.container_name, &err, nullptr, &lock_fd);
      if (region == nullptr) {
        GPUSLICE_LOG(error, "%s; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED", err.message);
        return fail_closed();
      }
      watch_region_file(lock_fd);  // the inherited description stays open: our parent's slot lock
    }
  }
  // Who judges the others' slots: we, through our own description's view of their locks.
  const shm::Observer observer(self, lock_fd);
  reap_previous_image(region, observer);
  sweep_at_start(region, observer);
  int slot = shm::claim_slot(region, self);
  // All slots taken: reap the dead. Another live reaper may hold the reaper
  // lock for a moment (kReapBusy), so retry a few times — never wait on it.
  for (int attempt = 0; slot < 0 && attempt < 8; ++attempt) {
    if (limiter::reap_dead(region, observer) == limiter::kReapBusy) sched_yield();
    slot = shm::claim_slot(region, self);
  }
  if (slot < 0) {
    shm::end_attach(lock_fd);
    GPUSLICE_LOG(error,
                 "GPUSLICE_REGION=%s: all %u process slots are held by live processes, expected a "
                 "free slot; CUDA calls fail with CUDA_ERROR_NOT_INITIALIZED",
                 cfg.options.region, kMaxSlots);
    return fail_closed();
  }
  // Without the lock (no OFD locks; a description of a dead owner's child
  // still holding it) our liveness is judged by pid alone, as before.
  if (lock_fd >= 0 && !shm::lock_slot_file(lock_fd, slot))
    GPUSLICE_LOG(debug, "slot %d: its file lock is not available; liveness by pid only", slot);
  // Our slot is in the region now: the agent keeps it (shm::end_attach).
  shm::end_attach(lock_fd);
  hold_slot_lock(lock_fd);
  g_process.region = region;
  g_process.self = observer;
  g_process.lease_tag.store(limiter::lease_tag(region, slot), std::memory_order_relaxed);
  g_process.slot.store(slot, std::memory_order_release);
  register_fork_handler();
  own_claimed_slot();
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

void reap_before_first_query() noexcept {
  if (g_queried.load(std::memory_order_relaxed) || g_queried.exchange(true)) return;
  const shm::Observer& self = g_process.self;
  if (g_process.region == nullptr || self.start_time == 0 || self.pidns_inode == 0) return;  // the agent reaps
  // Another process reaping at that moment (kReapBusy) is given a few
  // yields, never waited on.
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (limiter::reap_dead(g_process.region, self) != limiter::kReapBusy) return;
    sched_yield();
  }
}

// A child the kernel forked without our fork handler (_Fork, raw clone)
// still holds its parent's slot index: it claims its own (one thread does,
// the others yield; the claim takes no loader lock) before any accounting.
bool adopt_as_new_process() noexcept {
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

}  // namespace gpuslice::hook
