// Logging for the preload library: every line starts with "gpuslice:", is
// formatted into a stack buffer and written with one write(2) — no allocation,
// safe during bootstrap. A disabled level costs one relaxed load.
#pragma once

#include <atomic>

namespace gpuslice::hook {

enum class LogLevel : int { error = 0, warn = 1, info = 2, debug = 3 };

extern std::atomic<int> g_log_level;

[[gnu::format(printf, 2, 3), gnu::cold, gnu::noinline]] void log_write(LogLevel level, const char* fmt, ...) noexcept;

#define GPUSLICE_LOG(level, ...)                                                   \
  do {                                                                             \
    if (static_cast<int>(::gpuslice::hook::LogLevel::level) <=                     \
        ::gpuslice::hook::g_log_level.load(std::memory_order_relaxed))             \
      ::gpuslice::hook::log_write(::gpuslice::hook::LogLevel::level, __VA_ARGS__); \
  } while (0)

// A warning printed at most `limit` times per process (repeated warnings are capped).
#define GPUSLICE_WARN_CAPPED(limit, ...)                                                                         \
  do {                                                                                                           \
    static std::atomic<int> gpuslice_warn_count_{0};                                                             \
    if (gpuslice_warn_count_.fetch_add(1, std::memory_order_relaxed) < (limit)) GPUSLICE_LOG(warn, __VA_ARGS__); \
  } while (0)

}  // namespace gpuslice::hook
