// The one monotonic clock and sleep of the library, its tools and tests:
// CLOCK_MONOTONIC nanoseconds (the simulated driver's timeline uses the same
// clock), and sleeps that resume after signals.
#pragma once

#include <time.h>

#include <cerrno>
#include <cstdint>

// Called through its GOT entry, not a PLT stub: one jump fewer a call (the
// preload library's truncated-region look, hook/region.h, reads the coarse
// clock on every allocation and free).
#if defined(__GNUC__) && !defined(__clang__)  // clang has no such attribute (its -fno-plt is per file)
extern "C" int clock_gettime(clockid_t, struct timespec*) noexcept __attribute__((noplt));
#endif

namespace gpuslice::platform {

inline std::uint64_t monotonic_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

// NVML's clock: its utilisation samples are stamped in CPU (wall-clock)
// microseconds.
inline std::uint64_t realtime_us() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec) / 1000;
}

inline void sleep_ns(std::uint64_t ns) noexcept {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000ull), static_cast<long>(ns % 1'000'000'000ull)};
  // Again only after a signal (it returns the error, not -1): any other
  // error (a seccomp filter's EPERM) ends the sleep, never spins for ever.
  while (clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, &ts) == EINTR) {}
}

// A bounded poll's pause, for the library's waits on a peer that is inside
// the driver (a measurement's drain, a busy pool's mutex, a placement drop):
// each pause() sleeps, then doubles the next sleep up to a cap, and returns
// the nanoseconds it slept. The caller owns the bound (a deadline or a sum).
class Backoff {
 public:
  constexpr Backoff(std::uint64_t first_ns, std::uint64_t cap_ns) noexcept : next_ns_(first_ns), cap_ns_(cap_ns) {}
  std::uint64_t pause() noexcept {
    const std::uint64_t ns = next_ns_;
    sleep_ns(ns);
    next_ns_ = ns >= cap_ns_ / 2 ? cap_ns_ : ns * 2;
    return ns;
  }

 private:
  std::uint64_t next_ns_;
  std::uint64_t cap_ns_;
};

// Until monotonic_ns() reads deadline_ns (at once if it already has): the
// bench's processes start and pace their work on deadlines of this clock that
// they share, so a late waker does not shift the schedule.
inline void sleep_until_ns(std::uint64_t deadline_ns) noexcept {
  timespec deadline{static_cast<time_t>(deadline_ns / 1'000'000'000ull),
                    static_cast<long>(deadline_ns % 1'000'000'000ull)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, nullptr) == EINTR) {}
}

}  // namespace gpuslice::platform
