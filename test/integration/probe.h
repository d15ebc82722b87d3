// Shared helpers for integration tests that run cuprobe under the preload library.
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "harness.h"

namespace gpuslice::test {

inline constexpr unsigned long long kMi = 1ull << 20;

// The three ways a program reaches the driver (see cuprobe.cc).
enum class Path { direct, per_thread, get_proc_address, get_proc_address_ptsz };
inline const char* path_name(Path p) {
  switch (p) {
    case Path::direct: return "direct";
    case Path::per_thread: return "per_thread";
    case Path::get_proc_address: return "get_proc_address";
    case Path::get_proc_address_ptsz: return "get_proc_address_ptsz";
  }
  return "?";
}
inline void PrintTo(Path p, std::ostream* os) { *os << path_name(p); }
inline std::string probe_binary(Path p) {
  return bin(p == Path::direct ? "cuprobe" : p == Path::per_thread ? "cuprobe_ptds" : "cuprobe_dl");
}
inline Env path_env(Path p) { return p == Path::get_proc_address_ptsz ? Env{{"PROBE_PTSZ", "1"}} : Env{}; }

inline Result probe(Path p, const Env& env, std::vector<std::string> ops, int timeout_ms = 60000) {
  ops.insert(ops.begin(), probe_binary(p));
  return run(ops, merge(env, path_env(p)), timeout_ms);
}

// The value of `key` on the first line starting with `op` (e.g. "fill", "bytes").
inline std::string value(const Result& r, const std::string& op, const std::string& key) {
  auto lines = lines_with(r.out, op + " ");
  return lines.empty() ? "" : field(lines.front(), key);
}
inline std::vector<std::string> values(const Result& r, const std::string& op, const std::string& key) {
  std::vector<std::string> out;
  for (const auto& l : lines_with(r.out, op + " ")) out.push_back(field(l, key));
  return out;
}

// The simulated device's own count of what it holds, read with fakecuda-ctl.
unsigned long long device_used(const Sandbox& box, int device = 0);

}  // namespace gpuslice::test
