#include "hook/log.h"

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <unistd.h>

namespace gpuslice::hook {

std::atomic<int> g_log_level{static_cast<int>(LogLevel::warn)};

void log_write(LogLevel level, const char* fmt, ...) noexcept {
  static const char* const kNames[] = {"error", "warning", "info", "debug"};
  const int saved_errno = errno;  // logging must not disturb the caller's errno
  char line[1024];
  int n = std::snprintf(line, sizeof line, "gpuslice: %s: ", kNames[static_cast<int>(level)]);
  va_list args;
  va_start(args, fmt);
  int m = std::vsnprintf(line + n, sizeof line - static_cast<size_t>(n) - 1, fmt, args);
  va_end(args);
  size_t len = static_cast<size_t>(n) + (m < 0 ? 0 : static_cast<size_t>(m));
  if (len > sizeof line - 2) len = sizeof line - 2;
  // Messages built for tools (shm::Error, option errors) carry their own
  // "gpuslice: " prefix: one per line is enough.
  static constexpr char kPrefix[] = "gpuslice: ";
  constexpr size_t kPrefixLen = sizeof kPrefix - 1;
  if (len >= static_cast<size_t>(n) + kPrefixLen && std::memcmp(line + n, kPrefix, kPrefixLen) == 0) {
    std::memmove(line + n, line + n + kPrefixLen, len - static_cast<size_t>(n) - kPrefixLen);
    len -= kPrefixLen;
  }
  line[len++] = '\n';
  ssize_t ignored = ::write(STDERR_FILENO, line, len);
  (void)ignored;
  errno = saved_errno;
}

}  // namespace gpuslice::hook
