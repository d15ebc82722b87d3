// The one way tools and tests start a child with a clean environment: the
// parent's, less every variable that configures gpuslice, an incumbent's
// aliases or the simulated driver, plus what the caller sets. A measurement
// or a test then sees only the quota, limit, region and device it asked for,
// whatever the shell that started it exported. Used by gpuslice-bench's
// workers (tools/bench/spawn.cc), gpuslice-microbench's children
// (bench/main.cc) and the test harness (test/harness).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace gpuslice::tools {

struct ChildEnvRules {
  // GPUSLICE_LOG_LEVEL passes: a benchmark's children log as the user asked.
  bool keep_log_level = false;
  // LD_LIBRARY_PATH passes (else the caller sets it: where the driver is).
  bool keep_library_path = true;
  // FAKECUDA_* other than FAKECUDA_STATE pass (the simulated driver's
  // profile: a benchmark runs on the profile it was started with).
  bool keep_fakecuda_profile = false;
};

// Whether the parent's variable `name` reaches the child. Never: LD_PRELOAD,
// GPUSLICE_* (but GPUSLICE_LOG_LEVEL when kept), CUDA_DEVICE_* (HAMi-core's
// names, accepted as aliases), FAKECUDA_STATE (each run has its own device).
bool inherited(const std::string& name, const ChildEnvRules& rules);

// The child's environment as NAME=value entries: the parent's inherited
// variables, then `set` on top (an empty value unsets), sorted by name.
std::vector<std::string> child_environment(const std::map<std::string, std::string>& set, const ChildEnvRules& rules);

// An execve/posix_spawn envp view of `entries` (valid while they live).
std::vector<char*> envp_of(std::vector<std::string>& entries);

}  // namespace gpuslice::tools
