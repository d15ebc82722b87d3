// This process's slot across its life: ownership across fork (and _Fork,
// clone), the accounting calls that add to or release from the slot, and the
// exit-time release.
#include "hook/runtime.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <new>

#include "hook/log.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"

namespace gpuslice::hook {

// Defined beside the accounting calls that read them on every allocation.
std::atomic<int> g_ready{kReadyNo};
Process g_process{nullptr, {-1}, {}, {0}};

namespace {

std::atomic<bool> g_atfork_registered{false};
std::atomic<int> g_slot_lock_fd{-1};  // our own description of the region file (shm::lock_slot_file)
std::atomic<ReclaimFn> g_pool_reclaim{nullptr};

// The thread reserve (runtime.h): bytes a thread freed, kept (up to
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
pthread_key_t g_thread_exit_key;
std::atomic<bool> g_thread_exit_key_made{false};
std::atomic<ThreadExitFn> g_thread_exit_fn{nullptr};
[[gnu::tls_model("initial-exec")]] constinit thread_local bool t_exit_armed = false;

void give_back(ThreadReserve& t) noexcept;  // below, beside release()
void at_thread_exit(void*) noexcept {
  t_exit_armed = false;  // a hand-back that takes more arms it again: glibc then runs this again
  if (ThreadReserve* t = t_reserve) give_back(*t);
  if (ThreadExitFn fn = g_thread_exit_fn.load(std::memory_order_acquire)) fn();
}

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

// A forked child is a new process: it must claim its own slot (the parent's
// usage stays the parent's) before it accounts anything.
void after_fork_in_child() noexcept {
  g_process.slot.store(-1, std::memory_order_relaxed);
  restart_bootstrap_in_child();
  g_accounting_calls.store(0, std::memory_order_relaxed);  // the parent's threads are not here
  g_exited.store(false, std::memory_order_relaxed);        // forked from a destructor: a new process all the same
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

}  // namespace

void hold_slot_lock(int fd) noexcept { g_slot_lock_fd.store(fd, std::memory_order_release); }

// The slot just claimed (g_process.slot) is this process's: the fork handler
// and the owner word (bootstrap.cc calls this once the claim succeeded).
void own_claimed_slot() noexcept {
  if (!g_atfork_registered.exchange(true)) {
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
    // No heap: keys are a fixed table in libc. Without one (all taken)
    // nothing is armed: the thread reserve stays off, and a thread's launch
    // credit stays taken when it ends (hook/launch_init.cc).
    if (pthread_key_create(&g_thread_exit_key, at_thread_exit) == 0)
      g_thread_exit_key_made.store(true, std::memory_order_release);
  }
  map_owner_word();
  g_owner.load(std::memory_order_acquire)->store(kSlotOurs, std::memory_order_release);
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
  GPUSLICE_WARN_CAPPED(1,
                       "an allocation during process exit, after gpuslice released this process's memory, "
                       "is refused with CUDA_ERROR_OUT_OF_MEMORY");
  return true;
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
// there is nothing of ours left to give back.
void release(int entry, std::uint64_t bytes) noexcept {
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
  if (!g_thread_exit_key_made.load(std::memory_order_acquire) ||
      pthread_setspecific(g_thread_exit_key, &t_exit_armed) != 0)
    return false;
  t_exit_armed = true;
  return true;
}

void reset_thread_reserve(ThreadReserve& t) noexcept {
  t.bytes.store(0, std::memory_order_relaxed);
  t.tag.store(0, std::memory_order_relaxed);
  t.slot.store(-1, std::memory_order_relaxed);
  t.entry.store(-1, std::memory_order_relaxed);
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
  limiter::release_all(r, slot);
  if (g_accounting_calls.load(std::memory_order_seq_cst) == 0) shm::release_slot(r, slot);
  // The driver frees this process's memory at its own exit teardown, whoever
  // else still has its files open (a forked child): nothing left to hold.
  shm::unlock_slot_file(g_slot_lock_fd.load(std::memory_order_acquire), slot);
}

}  // namespace gpuslice::hook
