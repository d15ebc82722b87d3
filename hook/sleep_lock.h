// The launch side's one lock (marker rings, priority's board state): a word
// taken by CAS around short critical sections, off the hot path. A waiter
// sleeps between tries, never spins: the holder may be preempted (a container
// with one or two CPUs), or be inside a driver call.
#pragma once

#include <atomic>
#include <cstdint>

#include "platform/clock.h"

namespace gpuslice::hook {

struct SleepLock {
  static constexpr std::uint64_t kPollNs = 20'000;
  std::atomic<std::uint32_t> word{0};

  bool try_lock() noexcept {
    std::uint32_t expected = 0;
    return word.compare_exchange_strong(expected, 1, std::memory_order_acquire);
  }
  void lock() noexcept {
    while (!try_lock()) platform::sleep_ns(kPollNs);
  }
  void unlock() noexcept { word.store(0, std::memory_order_release); }
  // In a fork child: the thread that held it does not exist there.
  void reset() noexcept { word.store(0, std::memory_order_relaxed); }
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

}  // namespace gpuslice::hook
