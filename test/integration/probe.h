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
inline std::string probe_program(Path p) {
  return p == Path::direct ? "cuprobe" : p == Path::per_thread ? "cuprobe_ptds" : "cuprobe_dl";
}
inline Env path_env(Path p) { return p == Path::get_proc_address_ptsz ? Env{{"PROBE_PTSZ", "1"}} : Env{}; }

// cuprobe reaching the driver by `p`; its output is read with value() and
// values() (harness.h).
inline Result probe(Path p, const Env& env, const std::vector<std::string>& ops, int timeout_ms = 60000) {
  return Probe{{probe_program(p)}, timeout_ms}.with_env(merge(env, path_env(p)), ops);
}

// The simulated device's own count of what it holds, read with fakecuda-ctl.
unsigned long long device_used(const Sandbox& box, int device = 0);

}  // namespace gpuslice::test
