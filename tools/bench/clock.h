// CLOCK_MONOTONIC in nanoseconds: the clock of the simulated device timeline
// and the one every bench process agrees on.
#pragma once

#include <time.h>

#include <cerrno>
#include <cstdint>

namespace gpuslice::bench {

inline std::uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

inline void sleep_until_ns(std::uint64_t deadline_ns) {
  timespec deadline{};
  deadline.tv_sec = static_cast<time_t>(deadline_ns / 1000000000ull);
  deadline.tv_nsec = static_cast<long>(deadline_ns % 1000000000ull);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, nullptr) == EINTR) {
  }
}

inline void sleep_for_ns(std::uint64_t ns) { sleep_until_ns(mono_ns() + ns); }

}  // namespace gpuslice::bench
