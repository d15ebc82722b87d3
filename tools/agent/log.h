// Log lines of the node tools: "gpuslice: agent: <message>" on stderr, one
// write(2) per line so that lines of concurrent threads never interleave.
// The message is escaped as a whole (tools/common/text.h: every byte outside
// printable ASCII, and the backslash, as \xNN): a name from a container's file can
// neither forge a line nor send the terminal a control sequence.
// Repeated warnings about the same thing (a corrupt file, a suspected bypass)
// are logged once per key: a hostile container must not be able to flood the
// node's log by keeping its region file broken.
#pragma once

#include <string>

namespace gpuslice::agent {

enum class LogLevel : int { error = 0, warn = 1, info = 2, debug = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Prefix after "gpuslice: " ("agent: " by default).
void set_log_component(const char* component);
bool parse_log_level(const std::string& text, LogLevel* out);

[[gnu::format(printf, 2, 3)]] void log(LogLevel level, const char* format, ...);
// Logs only the first time `key` is seen (per process; the set holds 4096
// keys and starts over when full); returns whether it logged. forget_once(key) lets the key log again (the
// condition went away and came back).
[[gnu::format(printf, 3, 4)]] bool log_once(LogLevel level, const std::string& key, const char* format, ...);
void forget_once(const std::string& key);

}  // namespace gpuslice::agent
