// One-time initialisation state, for the preload library (and anything else):
// idle -> running -> done | failed, in one atomic word. Lock-free, allocates
// nothing, never blocks in the kernel: safe in bootstrap, in a fork child and
// under the loader lock.
//
// What it does not do, on purpose: run the initialiser, or know which thread
// runs it. A caller that can be re-entered from inside its own initialiser
// (the driver's constructors calling dlsym during dlopen, a CUDA call from a
// library constructor) keeps a thread-local "initialising here" flag and
// checks it before waiting: waiting on itself would never end. Waits are
// bounded where the running thread may be waiting on the caller (the loader
// lock): see wait().
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

namespace gpuslice::platform {

class OnceFlag {
 public:
  enum State : int { kIdle = 0, kRunning = 1, kDone = 2, kFailed = 3 };

  constexpr OnceFlag() noexcept = default;

  State state() const noexcept { return static_cast<State>(state_.load(std::memory_order_acquire)); }
  bool done() const noexcept { return state() == kDone; }

  // True for exactly one caller while idle: it runs the initialiser, then
  // calls complete(), fail() or reset().
  bool claim() noexcept {
    int expected = kIdle;
    return state_.compare_exchange_strong(expected, kRunning, std::memory_order_acq_rel);
  }
  // Success publishes everything written before it (release); it wins over
  // a concurrent failure (two threads ran it after a bounded wait gave up).
  void complete() noexcept { state_.store(kDone, std::memory_order_release); }
  // Failure never overwrites another thread's success.
  void fail() noexcept {
    int expected = kRunning;
    state_.compare_exchange_strong(expected, kFailed, std::memory_order_acq_rel);
  }
  // Back to idle: not possible yet (try again later), or in a forked child
  // (the parent's run does not exist there).
  void reset() noexcept { state_.store(kIdle, std::memory_order_release); }

  // Yields while another thread runs it; returns the state it left. With a
  // clock, gives up after `limit_ns` and returns kRunning (the caller may then
  // run the initialiser itself, if that is safe).
  State wait(std::uint64_t (*clock_ns)() noexcept = nullptr, std::uint64_t limit_ns = 0) const noexcept {
    State s = state();
    if (s != kRunning) return s;
    const std::uint64_t give_up = clock_ns != nullptr ? clock_ns() + limit_ns : 0;
    while ((s = state()) == kRunning) {
      if (clock_ns != nullptr && clock_ns() >= give_up) break;
      sched_yield();
    }
    return s;
  }

 private:
  std::atomic<int> state_{kIdle};
};

}  // namespace gpuslice::platform
