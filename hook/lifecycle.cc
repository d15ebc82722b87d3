// This process's slot across its life (lifecycle.h): whose it is across
// process creation (fork, _Fork, clone: the owner word), and the exit-time
// release. Claiming it, and claiming again in a child, is bootstrap.cc's;
// accounting on it is account.cc's.
#include "hook/lifecycle.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <new>
#include <type_traits>

#include "hook/log.h"
#include "hook/process.h"
#include "hook/region.h"
#include "limiter/memory_accounting.h"
#include "limiter/shared_allocs.h"
#include "shm/region_file.h"

namespace gpuslice::hook {

namespace {

std::atomic<int> g_slot_lock_fd{-1};  // our own description of the region file (shm::lock_slot_file)

// The owner word's home before it is mapped, and where it stays on kernels
// without MADV_WIPEONFORK (lifecycle.h); its slot stays null.
constinit OwnerPage g_fallback_page{{kSlotNotOurs}, {0}, {nullptr}, {0}, {nullptr}, {nullptr}, {nullptr}, {-2}};
std::atomic<std::uint32_t>& g_fallback_owner = g_fallback_page.owner;
static_assert(std::is_standard_layout_v<OwnerPage> && offsetof(OwnerPage, owner) == 0);

// The owner word, mapped once: a private anonymous page with MADV_WIPEONFORK.
void map_owner_word() noexcept {
  if (g_owner.load(std::memory_order_acquire) != &g_fallback_owner) return;
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return;
  if (madvise(page, 4096, MADV_WIPEONFORK) != 0) {
    munmap(page, 4096);
    return;
  }
  auto* fresh = new (page) OwnerPage{{kSlotNotOurs}, {0}, {nullptr}, {0}, {nullptr}, {nullptr}, {nullptr}, {-2}};
  std::atomic<std::uint32_t>* expected = &g_fallback_owner;
  if (!g_owner.compare_exchange_strong(expected, &fresh->owner, std::memory_order_acq_rel)) munmap(page, 4096);
}

}  // namespace

std::atomic<std::atomic<std::uint32_t>*> g_owner{&g_fallback_page.owner};
std::atomic<bool> g_exited{false};
std::atomic<int> g_accounting_calls{0};

void hold_slot_lock(int fd) noexcept { g_slot_lock_fd.store(fd, std::memory_order_release); }

void own_claimed_slot() noexcept {
  map_owner_word();
  std::atomic<std::uint32_t>* owner = g_owner.load(std::memory_order_acquire);
  if (owner != &g_fallback_owner) {
    auto* page = reinterpret_cast<OwnerPage*>(owner);
    const int slot = g_process.slot.load(std::memory_order_acquire);
    page->slot.store(slot >= 0 ? &g_process.region->slots[slot] : nullptr, std::memory_order_release);
  }
  owner->store(kSlotOurs, std::memory_order_release);
}

bool refused_after_exit() noexcept {
  if (!g_exited.load(std::memory_order_seq_cst)) return false;
  GPUSLICE_WARN_CAPPED(1,
                       "an allocation during process exit, after gpuslice released this process's memory, "
                       "is refused with CUDA_ERROR_OUT_OF_MEMORY");
  return true;
}

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
  limiter::shared_leave_all(r, slot);
  limiter::release_all(r, slot);
  if (g_accounting_calls.load(std::memory_order_seq_cst) == 0) shm::release_slot(r, slot);
  // The driver frees this process's memory at its own exit teardown, whoever
  // else still has its files open (a forked child): nothing left to hold.
  shm::unlock_slot_file(g_slot_lock_fd.load(std::memory_order_acquire), slot);
}

}  // namespace gpuslice::hook
