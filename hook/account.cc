// The accounting core (account.h): reserve, release and charge on this
// process's slot, and the records an allocation leaves for its free.
// gpuslice: hot path (no heap, no locks)
#include "hook/account.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "hook/bootstrap.h"
#include "hook/config.h"
#include "hook/lifecycle.h"
#include "hook/log.h"
#include "hook/region.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "platform/once.h"

namespace gpuslice::hook {

namespace {

std::atomic<ReclaimFn> g_pool_reclaim{nullptr};

// One pthread key for what a thread hands back when it ends: what the launch
// path registered (its credit of prices taken ahead, hook/launch_init.cc).
// Armed once per thread (arm_thread_exit); its value is only a non-null
// word. The hand-back checks that what it finds belongs to this process's
// present claim: a forked child's thread carries its parent's armed key.
// Made at the first arming (arm_thread_exit), once per process (a forked
// child inherits it). No heap: keys are a fixed table in libc. Without one
// (all taken) nothing is armed: a thread's launch credit stays taken when it
// ends (hook/launch_init.cc).
pthread_key_t g_thread_exit_key;
constinit platform::OnceFlag g_thread_exit_key_once;
std::atomic<ThreadExitFn> g_thread_exit_fn{nullptr};
[[gnu::tls_model("initial-exec")]] constinit thread_local bool t_exit_armed = false;

void at_thread_exit(void*) noexcept {
  t_exit_armed = false;  // a hand-back that takes more arms it again: glibc then runs this again
  if (ThreadExitFn fn = g_thread_exit_fn.load(std::memory_order_acquire)) fn();
}

bool thread_exit_key_made() noexcept {
  if (g_thread_exit_key_once.claim()) {
    if (pthread_key_create(&g_thread_exit_key, at_thread_exit) == 0)
      g_thread_exit_key_once.complete();
    else
      g_thread_exit_key_once.fail();
  }
  return g_thread_exit_key_once.wait() == platform::OnceFlag::kDone;
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

// A table of records could not grow (platform::table_detail::g_stuck_shards):
// its growth is tried again; if it still cannot, the allocation is refused
// before the driver makes it, never admitted without a record (issue 35).
[[gnu::cold, gnu::noinline]] bool records_have_room(int entry) noexcept {
  if (platform::table_detail::regrow_stuck()) return true;
  if (g_process.region != nullptr && static_cast<unsigned>(entry) < kMaxDevices)
    g_process.region->devices[entry].record_refusals.fetch_add(1, std::memory_order_relaxed);
  GPUSLICE_WARN_CAPPED(3,
                       "this process's allocation records cannot grow (mmap failed: address space exhausted?); "
                       "allocations are refused with CUDA_ERROR_OUT_OF_MEMORY until memory is freed");
  return false;
}

[[gnu::noinline]] void release_slow(int slot, int entry, std::uint64_t bytes) noexcept {
  if (g_exited.load(std::memory_order_acquire) || !region_intact()) return;
  limiter::release(g_process.region, slot, g_process.lease_tag.load(std::memory_order_relaxed), entry, bytes);
}

// Bytes back to the slot: kept as its spare (one CAS) or released.
void release_to_slot(int slot, int entry, std::uint64_t bytes) noexcept {
  if (!region_intact()) return;
  if (__builtin_expect(limiter::lease_free(g_process.region, slot, g_process.lease_tag.load(std::memory_order_relaxed),
                                           entry, bytes),
                       1))
    return;
  release_slow(slot, entry, bytes);
}

}  // namespace

// No slot (bootstrap failed closed, or the process is past its exit-time
// release) means no admission: memory is never handed out uncounted.
// Fast path (inline in account.h, and again here after an adoption): one CAS
// on our slot's lease word. It needs neither the exit bracket (AddingCall)
// nor the exit check: release_all closes the lease words and a stale
// thread's tag never matches a later claim's, so a late CAS fails and falls
// to the slow path, which refuses. It does look at the region file first (a
// coarse-clock read, no syscall): a truncated region must fail closed, not
// raise SIGBUS. It does need the owner word (own_slot): a child that has yet
// to claim its own slot still holds its parent's index and tag.
bool reserve_out_of_line(int entry, std::uint64_t bytes) noexcept {
  if (__builtin_expect(platform::table_detail::g_stuck_shards.load(std::memory_order_relaxed) != 0, 0) &&
      !records_have_room(entry))
    return false;
  const int slot = own_slot();
  if (__builtin_expect(slot >= 0 && static_cast<unsigned>(entry) < kMaxDevices, 1) && region_intact()) {
    const std::uint64_t tag = g_process.lease_tag.load(std::memory_order_relaxed);
    if (limiter::lease_alloc(g_process.region, slot, tag, entry, bytes)) return true;
  }
  return reserve_slow(slot, entry, bytes);
}

// What a thread frees goes back to the slot at once (its spare lease, or
// released): no thread keeps freed bytes for itself, so what is shown, what
// is refused and what a lowered quota bounds are the slot's alone
// (docs/memory-accounting.md, "Freed bytes and threads").
// After the exit-time release (or in a child that never owned the slot)
// there is nothing of ours left to give back. The fast half is inline
// (account.h); this is the whole, for what it did not take.
void release_out_of_line(int entry, std::uint64_t bytes) noexcept {
  if (g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs) return;
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (slot < 0 || static_cast<unsigned>(entry) >= kMaxDevices || bytes == 0) return;
  release_to_slot(slot, entry, bytes);
}

bool charge(int entry, std::uint64_t bytes) noexcept {
  const int slot = own_slot();  // before the bracket: adopting resets the count
  AddingCall bracket;
  if (refused_after_exit() || !region_intact() || slot < 0) return false;
  return limiter::charge(g_process.region, slot, entry, bytes);
}

void set_pool_reclaim(ReclaimFn fn) noexcept { g_pool_reclaim.store(fn, std::memory_order_release); }

void set_thread_exit(ThreadExitFn fn) noexcept { g_thread_exit_fn.store(fn, std::memory_order_release); }

// pthread_setspecific may allocate (glibc callocs a block for keys past its
// first 32): never during bootstrap, at a thread's first hand-back to arm.
bool arm_thread_exit() noexcept {
  if (t_exit_armed) return true;
  if (!thread_exit_key_made() || pthread_setspecific(g_thread_exit_key, &t_exit_armed) != 0) return false;
  t_exit_armed = true;
  return true;
}

void commit_slow(limiter::AllocTable& table, CUresult rc, Reservation r, std::uint64_t key,
                 limiter::AllocKind kind) noexcept {
  if (rc != CUDA_SUCCESS) {
    release(r.entry, r.bytes);
    return;
  }
  const limiter::AllocRecord rec{r.bytes, r.entry, kind};
  if (__builtin_expect(platform::record(table, key, rec, release_record), 1)) return;
  GPUSLICE_WARN_CAPPED(3, "allocation table full; %llu bytes stay counted until the process exits",
                       static_cast<unsigned long long>(r.bytes));
}

void release_record_slow(const limiter::AllocRecord& rec) noexcept {
  if (rec.kind == limiter::AllocKind::spilled) oversub_unspill(rec.dev, rec.bytes);
  release(rec.dev, rec.bytes);
  oversub_freed(rec.dev, rec.kind, rec.bytes);
}

// Spilled bytes are this process's slot's (oversub.cc counted them there).
void oversub_unspill(int entry, std::uint64_t bytes) noexcept {
  if (entry < 0 || g_process.region == nullptr) return;
  limiter::uncount_spilled(g_process.region, g_process.slot.load(std::memory_order_acquire), entry, bytes);
}

// The waiters of oversub.cc sleep on the device's free generation (a shared
// futex: the word is in the region, mapped by every process).
void wake_oversub_waiters(int entry) noexcept {
  DeviceState& d = g_process.region->devices[entry];
  d.free_generation.fetch_add(1, std::memory_order_seq_cst);
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&d.free_generation), FUTEX_WAKE, 0x7fffffff, nullptr, nullptr, 0);
}

}  // namespace gpuslice::hook
