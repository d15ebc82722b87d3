// The non-template parts of PointerTable: pages, the lock's slow path, the
// process epoch. See pointer_table.h.
#include "platform/pointer_table.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

#include <new>

namespace gpuslice::platform::table_detail {

void* map_pages(std::size_t bytes) noexcept {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void unmap_pages(void* p, std::size_t bytes) noexcept {
  if (p != nullptr) munmap(p, bytes);
}

void backoff(unsigned* round) noexcept {
  if (*round < 64) {
    ++*round;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    sched_yield();  // the holder may be descheduled: let it run
  }
}

// A holder keeps the lock for a few hundred instructions (a growth: one
// mmap and a rehash of one shard), so spinning briefly is usually enough.
// When it is not, the holder was preempted: with more threads than cores
// (a framework's 32 threads in a 2-core container) sched_yield() mostly
// hands the core to another waiter, and the waiters burn whole time slices
// in a convoy until the scheduler happens to run the holder (measured: the
// allocation pair at 32 threads on 2 cores went from ~+50 to over +1000 ns
// in some runs). So a waiter marks the word 2 ("waiters") and sleeps on it
// (futex), which leaves the cores to the holder; the unlock of a word marked
// 2 wakes one. The mark can be lost (the fast path's exchange writes 1 over
// it, an unlock can read 1 just before a waiter marks it): a waiter never
// relies on a wake, its sleep is bounded, 50 us doubling up to 4 ms.
void lock_slow(std::atomic<std::uint32_t>& word) noexcept {
  long sleep_ns = 50'000;
  for (unsigned round = 0; round < 64; ++round) {
    if (word.load(std::memory_order_relaxed) == 0 && word.exchange(1, std::memory_order_acquire) == 0) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  // Taken with the mark: the unlock then makes one needless wake call, which
  // keeps any other sleeper from waiting for its timeout.
  while (word.exchange(kLockWaiters, std::memory_order_acquire) != 0) {
    const timespec timeout{0, sleep_ns};
    const int saved_errno = errno;  // the caller's errno survives
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, kLockWaiters, &timeout, nullptr, 0);
    errno = saved_errno;
    if (sleep_ns < 4'000'000) sleep_ns *= 2;
  }
}

void wake_one(std::atomic<std::uint32_t>& word) noexcept {
  const int saved_errno = errno;
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  errno = saved_errno;
}

std::atomic<std::uint32_t> g_stuck_shards{0};

namespace {
struct StuckTable {
  std::atomic<void*> table{nullptr};
  std::atomic<RegrowFn> regrow{nullptr};
};
StuckTable g_stuck_tables[32];
}  // namespace

namespace {
std::atomic<StuckFn> g_on_stuck{nullptr};
}  // namespace

void set_on_stuck(StuckFn fn) noexcept { g_on_stuck.store(fn, std::memory_order_seq_cst); }

void note_stuck(void* table, RegrowFn regrow) noexcept {
  if (StuckFn fn = g_on_stuck.load(std::memory_order_seq_cst)) fn();
  for (StuckTable& e : g_stuck_tables) {
    void* seen = e.table.load(std::memory_order_acquire);
    if (seen == table) return;
    if (seen == nullptr && e.table.compare_exchange_strong(seen, table, std::memory_order_acq_rel)) {
      e.regrow.store(regrow, std::memory_order_release);
      return;
    }
    if (seen == table) return;
  }
}

bool regrow_stuck() noexcept {
  for (StuckTable& e : g_stuck_tables) {
    void* table = e.table.load(std::memory_order_acquire);
    const RegrowFn regrow = e.regrow.load(std::memory_order_acquire);
    if (table != nullptr && regrow != nullptr) regrow(table);
  }
  return g_stuck_shards.load(std::memory_order_relaxed) == 0;
}

// The epoch word lives in a page the kernel zeroes in every child it forks
// (MADV_WIPEONFORK, Linux 4.14), however the child was made: a child finds 0
// and takes a new epoch. g_epoch_counter is ordinary memory, inherited: the
// child's new epoch is above every epoch its parent ever used. Without the
// advice the word is ordinary memory and a pthread_atfork child handler
// zeroes it (fork() only; _Fork and clone children are then not detected).
namespace {
std::atomic<std::uint64_t> g_unset_word{0};  // never written: g_epoch_word's target until the first epoch
}  // namespace
std::atomic<std::atomic<std::uint64_t>*> g_epoch_word{&g_unset_word};

namespace {
std::atomic<std::uint64_t> g_epoch_counter{0};
std::atomic<std::uint64_t> g_fallback_word{0};

void zero_fallback_in_child() noexcept { g_fallback_word.store(0, std::memory_order_relaxed); }

std::atomic<std::uint64_t>* epoch_word() noexcept {
  std::atomic<std::uint64_t>* w = g_epoch_word.load(std::memory_order_acquire);
  if (w != &g_unset_word) return w;
  std::atomic<std::uint64_t>* fresh = &g_fallback_word;
  void* page = map_pages(4096);
  if (page != nullptr && madvise(page, 4096, MADV_WIPEONFORK) == 0) {
    fresh = new (page) std::atomic<std::uint64_t>{0};
  } else {
    unmap_pages(page, 4096);
    page = nullptr;
  }
  if (g_epoch_word.compare_exchange_strong(w, fresh, std::memory_order_acq_rel)) {
    if (page == nullptr) pthread_atfork(nullptr, nullptr, zero_fallback_in_child);
    return fresh;
  }
  unmap_pages(page, 4096);  // another thread published first
  return w;
}
}  // namespace

std::uint64_t epoch_slow() noexcept {
  std::atomic<std::uint64_t>* w = epoch_word();
  std::uint64_t e = w->load(std::memory_order_acquire);
  if (e != 0) return e;
  const std::uint64_t mine = g_epoch_counter.fetch_add(1, std::memory_order_relaxed) + 1;
  if (w->compare_exchange_strong(e, mine, std::memory_order_acq_rel)) return mine;
  return e;  // another thread of this process took the epoch first
}

}  // namespace gpuslice::platform::table_detail
