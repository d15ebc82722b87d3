// The non-template parts of PointerTable: pages, the lock's slow path, the
// process epoch. See pointer_table.h.
#include "platform/pointer_table.h"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <new>

namespace gpuslice::limiter::table_detail {

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
void lock_slow(std::atomic<std::uint32_t>& word) noexcept {
  for (unsigned round = 0;;) {
    if (word.load(std::memory_order_relaxed) == 0 && word.exchange(1, std::memory_order_acquire) == 0) return;
    backoff(&round);
  }
}

// The epoch word lives in a page the kernel zeroes in every child it forks
// (MADV_WIPEONFORK, Linux 4.14), however the child was made: a child finds 0
// and takes a new epoch. g_epoch_counter is ordinary memory, inherited: the
// child's new epoch is above every epoch its parent ever used. Without the
// advice the word is ordinary memory and a pthread_atfork child handler
// zeroes it (fork() only; _Fork and clone children are then not detected).
std::atomic<std::atomic<std::uint64_t>*> g_epoch_word{nullptr};

namespace {
std::atomic<std::uint64_t> g_epoch_counter{0};
std::atomic<std::uint64_t> g_fallback_word{0};

void zero_fallback_in_child() noexcept { g_fallback_word.store(0, std::memory_order_relaxed); }

std::atomic<std::uint64_t>* epoch_word() noexcept {
  std::atomic<std::uint64_t>* w = g_epoch_word.load(std::memory_order_acquire);
  if (w != nullptr) return w;
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

}  // namespace gpuslice::limiter::table_detail
