#include "log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <unordered_set>

#include "text.h"

namespace gpuslice::agent {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::info)};
std::atomic<const char*> g_component{"agent: "};
std::mutex g_once_mu;
std::unordered_set<std::string>* g_once = nullptr;  // leaked: logging may run during exit
constexpr std::size_t kMaxOnceKeys = 4096;

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::error: return "error: ";
    case LogLevel::warn: return "warning: ";
    case LogLevel::info: return "";
    case LogLevel::debug: return "debug: ";
  }
  return "";
}

void vlog(LogLevel level, const char* format, va_list args) {
  // The message may hold untrusted text (file and container names): it is
  // formatted first, then escaped as a whole (tools/common/text.h), so that
  // no argument can end the line early, forge another line or reach the
  // terminal as a control sequence, whatever the call site passed.
  char message[1024];
  const int m = std::vsnprintf(message, sizeof message, format, args);
  if (m < 0) return;
  const std::size_t length = std::min(static_cast<std::size_t>(m), sizeof message - 1);
  char line[4 * sizeof message + 64];  // an escape is 4 bytes for 1
  const int n = std::snprintf(line, sizeof line, "gpuslice: %s%s", g_component.load(), level_name(level));
  if (n < 0) return;
  std::size_t used = std::min(static_cast<std::size_t>(n), sizeof line - 2);
  used += tools::escape_untrusted_to(message, length, line + used, sizeof line - 1 - used);
  line[used++] = '\n';
  ssize_t ignored = ::write(STDERR_FILENO, line, used);
  (void)ignored;
}

}  // namespace

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }
void set_log_component(const char* component) { g_component.store(component); }

bool parse_log_level(const std::string& text, LogLevel* out) {
  static const std::pair<const char*, LogLevel> kLevels[] = {
      {"error", LogLevel::error}, {"warn", LogLevel::warn}, {"info", LogLevel::info}, {"debug", LogLevel::debug}};
  for (const auto& [name, level] : kLevels) {
    if (text == name) {
      *out = level;
      return true;
    }
  }
  return false;
}

void log(LogLevel level, const char* format, ...) {
  if (static_cast<int>(level) > g_level.load(std::memory_order_relaxed)) return;
  va_list args;
  va_start(args, format);
  vlog(level, format, args);
  va_end(args);
}

bool log_once(LogLevel level, const std::string& key, const char* format, ...) {
  if (static_cast<int>(level) > g_level.load(std::memory_order_relaxed)) return false;
  {
    std::lock_guard<std::mutex> lock(g_once_mu);
    if (g_once == nullptr) g_once = new std::unordered_set<std::string>;
    // Bounded: when full, start over (a message may then repeat once) rather
    // than fall silent for good on a long-lived node.
    if (g_once->size() >= kMaxOnceKeys && g_once->count(key) == 0) g_once->clear();
    if (!g_once->insert(key).second) return false;
  }
  va_list args;
  va_start(args, format);
  vlog(level, format, args);
  va_end(args);
  return true;
}

void forget_once(const std::string& key) {
  std::lock_guard<std::mutex> lock(g_once_mu);
  if (g_once != nullptr) g_once->erase(key);
}

}  // namespace gpuslice::agent
