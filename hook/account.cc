// The accounting core (account.h): reserve, release and charge on this
// process's slot, the thread reserve between a thread's frees and its next
// allocations, and the records an allocation leaves for its free.
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

[[gnu::tls_model("initial-exec")]] constinit thread_local ThreadReserve* t_reserve = nullptr;

namespace {

std::atomic<ReclaimFn> g_pool_reclaim{nullptr};

// The thread reserve (account.h): bytes a thread freed, kept (up to
// kThreadReserveMax) for its own next allocations, so that a thread that
// frees and allocates small blocks in turn moves no shared word: the free
// adds to it and the allocation takes from it, where the lease fast path
// would CAS the slot's lease word each way (docs/memory-accounting.md, "The
// thread reserve"). The bytes stay counted as in use by the slot
// (committed_bytes), so nothing is ever counted short; they are only not
// offered as spare to the other processes until the thread gives them back,
// which it does whenever its allocation takes the slow path, when it frees
// more than the reserve may hold, and when it exits (the thread-exit key
// below). They are spent only while the slot's lease word is open for
// our claim (limiter::lease_open): a word made STALE by a limit change,
// CLOSED by the exit release or OWED after a theft stops the spending as it
// stops the lease fast path. Keyed by the claim (slot and lease tag) and the
// device entry. Allocations below the driver's 2 MiB large-page granule are
// the small ones a program makes and frees at a high rate.
constexpr std::uint64_t kThreadReserveMax = std::uint64_t{2} << 20;

// One pthread key for what a thread hands back when it ends: its thread
// reserve and what the launch path registered (its credit of prices taken
// ahead, hook/launch_init.cc). Armed once per thread (arm_thread_exit); its
// value is only a non-null word. Each hand-back checks that what it finds
// belongs to this process's present claim: a forked child's thread carries
// its parent's armed key, and its reserve until it claims a counter.
// Made at the first arming (arm_thread_exit), once per process (a forked
// child inherits it). No heap: keys are a fixed table in libc. Without one
// (all taken) nothing is armed: the thread reserve stays off, and a thread's
// launch credit stays taken when it ends (hook/launch_init.cc).
pthread_key_t g_thread_exit_key;
constinit platform::OnceFlag g_thread_exit_key_once;
std::atomic<ThreadExitFn> g_thread_exit_fn{nullptr};
[[gnu::tls_model("initial-exec")]] constinit thread_local bool t_exit_armed = false;

void give_back(ThreadReserve& t) noexcept;  // below, beside release()
void at_thread_exit(void*) noexcept {
  t_exit_armed = false;  // a hand-back that takes more arms it again: glibc then runs this again
  if (ThreadReserve* t = t_reserve) give_back(*t);
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
  // What this thread kept goes back first: the admission below, a theft
  // from the other slots and a refusal all see it as the slot's spare.
  if (ThreadReserve* t = t_reserve; t != nullptr && t->bytes.load(std::memory_order_relaxed) != 0) give_back(*t);
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

// Bytes back to the slot: kept as its spare (one CAS) or released.
void release_to_slot(int slot, int entry, std::uint64_t bytes) noexcept {
  if (!region_intact()) return;
  if (__builtin_expect(limiter::lease_free(g_process.region, slot, g_process.lease_tag.load(std::memory_order_relaxed),
                                           entry, bytes),
                       1))
    return;
  release_slow(slot, entry, bytes);
}

// The reserve's bytes go back to the claim they were counted on, if that is
// still ours; a reserve of another claim (a claim given up at exit) is only
// forgotten: its bytes were that claim's, released with it.
void give_back(ThreadReserve& t) noexcept {
  const std::uint64_t bytes = t.bytes.load(std::memory_order_relaxed);
  if (bytes == 0) return;
  t.bytes.store(0, std::memory_order_relaxed);
  if (g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs) return;
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (slot < 0 || slot != t.slot.load(std::memory_order_relaxed) ||
      t.tag.load(std::memory_order_relaxed) != g_process.lease_tag.load(std::memory_order_relaxed))
    return;
  release_to_slot(slot, t.entry.load(std::memory_order_relaxed), bytes);
}

// Keeps `bytes` freed on (slot, entry) in the calling thread's reserve; false
// (nothing kept) when the reserve would exceed kThreadReserveMax or the
// slot's lease cap (the most it would keep as spare: nothing under
// oversubscription, little near the quota), when the lease word is not open
// for our claim, when the thread keeps bytes of another entry, when it has
// no reserve (no op counter of its own) or no pthread key to give them back
// at thread exit (arm_thread_exit). Reads the slot's lease line, writes
// nothing shared.
inline bool kept_for_thread(int slot, int entry, std::uint64_t bytes) noexcept {
  ThreadReserve* t = t_reserve;
  if (t == nullptr) return false;
  const std::uint64_t tag = g_process.lease_tag.load(std::memory_order_relaxed);
  std::uint64_t held = t->bytes.load(std::memory_order_relaxed);
  const bool same_claim =
      t->slot.load(std::memory_order_relaxed) == slot && t->tag.load(std::memory_order_relaxed) == tag;
  if (__builtin_expect(!same_claim || t->entry.load(std::memory_order_relaxed) != entry, 0)) {
    if (held != 0 && same_claim) return false;  // ours, on another entry: kept there
    held = 0;                                   // empty, or another claim's (see give_back): re-keyed below
  }
  if (bytes > kThreadReserveMax - held || !region_intact()) return false;
  const std::uint64_t cap = limiter::lease_keep_cap(g_process.region, slot, tag, entry);
  if (bytes > cap || held > cap - bytes) return false;
  if (__builtin_expect(!t_exit_armed, 0) && !arm_thread_exit()) return false;
  t->slot.store(slot, std::memory_order_relaxed);
  t->entry.store(entry, std::memory_order_relaxed);
  t->tag.store(tag, std::memory_order_relaxed);
  t->bytes.store(held + bytes, std::memory_order_relaxed);
  return true;
}

}  // namespace

// No slot (bootstrap failed closed, or the process is past its exit-time
// release) means no admission: memory is never handed out uncounted.
// Fast paths: the thread reserve (a plain load of our slot's lease word, no
// write), else one CAS on that word. They need neither the exit bracket
// (AddingCall) nor the exit check: release_all closes the lease words and a
// stale thread's tag never matches a later claim's, so a late spend or CAS
// fails and falls to the slow path, which refuses. They do look at the
// region file first (a coarse-clock read, no syscall): a truncated region
// must fail closed, not raise SIGBUS.
bool reserve(int entry, std::uint64_t bytes) noexcept {
  const int slot = own_slot();
  if (__builtin_expect(slot >= 0 && static_cast<unsigned>(entry) < kMaxDevices, 1) && region_intact()) {
    const std::uint64_t tag = g_process.lease_tag.load(std::memory_order_relaxed);
    // From the thread reserve: a plain load of the lease word, no write.
    if (ThreadReserve* t = t_reserve; t != nullptr) {
      const std::uint64_t held = t->bytes.load(std::memory_order_relaxed);
      if (held >= bytes && t->slot.load(std::memory_order_relaxed) == slot &&
          t->entry.load(std::memory_order_relaxed) == entry && t->tag.load(std::memory_order_relaxed) == tag &&
          limiter::lease_open(g_process.region, slot, tag, entry)) {
        t->bytes.store(held - bytes, std::memory_order_relaxed);
        return true;
      }
    }
    if (limiter::lease_alloc(g_process.region, slot, tag, entry, bytes)) return true;
  }
  return reserve_slow(slot, entry, bytes);
}

// After the exit-time release (or in a child that never owned the slot)
// there is nothing of ours left to give back. Not inlined into this file's
// callers (commit): GCC would split its head off for them, and every free's
// call from the wrappers would take a jump more.
[[gnu::noinline]] void release(int entry, std::uint64_t bytes) noexcept {
  if (g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs) return;
  const int slot = g_process.slot.load(std::memory_order_acquire);
  if (slot < 0 || static_cast<unsigned>(entry) >= kMaxDevices || bytes == 0) return;
  if (__builtin_expect(kept_for_thread(slot, entry, bytes), 1)) return;
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

void reset_thread_reserve(ThreadReserve& t) noexcept {
  t.bytes.store(0, std::memory_order_relaxed);
  t.tag.store(0, std::memory_order_relaxed);
  t.slot.store(-1, std::memory_order_relaxed);
  t.entry.store(-1, std::memory_order_relaxed);
}

void commit(limiter::AllocTable& table, CUresult rc, const Reservation& r, std::uint64_t key,
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
