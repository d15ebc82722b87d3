// Compute-limiter scenarios on the simulated driver, shared by the timing
// tests and gpuslice-limiter-sweep: containers (a region each, with their own
// GPUSLICE_SM_LIMIT/POLICY) of spinload processes on one simulated machine,
// and the device time each one really got, read from the simulated timeline
// with fakecuda-ctl (never from the limiter's own bookkeeping).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"

namespace gpuslice::test::limiter {

struct Proc {
  std::vector<std::string> args;  // spinload arguments
  double delay_s = 0;             // start this long after the scenario starts
  double kill_after_s = 0;        // > 0: SIGKILL it this long after the scenario starts
};

struct Container {
  std::string name;
  std::string sm_limit;   // GPUSLICE_SM_LIMIT ("" = unset: unlimited)
  std::string sm_policy;  // GPUSLICE_SM_POLICY ("" = default, hard)
  std::vector<Proc> procs;
  Env extra;  // more environment
};

struct ProcResult {
  pid_t pid = 0;
  std::uint64_t start_ns = 0;  // first launch (CLOCK_MONOTONIC)
  std::uint64_t end_ns = 0;    // last launch
  std::uint64_t launches = 0;
  Result result;
};

struct ContainerResult {
  std::vector<ProcResult> procs;
  std::uint64_t first_start() const;  // earliest first launch of its processes
  std::string describe() const;
};

// One simulated machine: a sandbox with the device state and the regions.
// Its timing model is FAKECUDA_PROFILE as this process has it (ideal when
// unset): CTest runs the timing tests once per profile (test/limiter/CMakeLists.txt).
class Machine {
 public:
  Machine();
  const std::string& profile() const { return profile_; }
  // Runs the containers' processes concurrently (each after its delay) and
  // waits for all of them.
  std::vector<ContainerResult> run(const std::vector<Container>& containers, int timeout_ms = 120000);
  // Device time in [t0, t1) of one process (pid 0: every process).
  std::uint64_t busy_ns(std::uint64_t t0, std::uint64_t t1, pid_t pid = 0, int device = 0) const;
  // A container's share of [t0, t1), in percent, from the timeline.
  double share(const ContainerResult& c, std::uint64_t t0, std::uint64_t t1, int device = 0) const;
  std::string region_path(const std::string& container) const;
  const Sandbox& sandbox() const { return sandbox_; }
  // Sets DeviceState::sm_limit_pct of a container's (already created) region
  // entries, as the agent or gpuslice-smi would. False if it cannot.
  bool set_region_limit(const std::string& container, unsigned pct) const;

 private:
  Env env(bool preload) const;

  Sandbox sandbox_;
  std::string profile_;
};

// spinload arguments for the common cases.
std::vector<std::string> spin(const std::string& path, unsigned kernel_us, double seconds,
                              const std::string& via = "symbol", double inflight_ms = 20.0);

std::uint64_t mono_now_ns();

}  // namespace gpuslice::test::limiter
