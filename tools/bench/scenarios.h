// The measurements gpuslice-bench makes, each as workers run natively and
// under libgpuslice.so, and what it derives from them. Every function returns
// its section of the JSON report; a failed worker shows up as an "error" field
// in that section, never as a made-up number.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "spawn.h"

namespace gpuslice::bench {

struct Plan {
  bool quick = false;
  std::set<std::string> sections;         // launch memory quota sweep tenants noisy
  std::vector<int> sweep_limits;          // % of the GPU
  std::vector<std::uint64_t> quotas_mib;  // quota accuracy, one process each
  std::uint64_t shared_quota_mib = 1024;  // quota raced for by several processes
  int quota_processes = 4;
  unsigned kernel_us = 1000;  // spin kernel length
  double window_s = 1.5;      // compute measurement window
  double warmup_s = 0.3;      // before each window
  int launch_batches = 200;
  int memory_batches = 200;
  int tenant_a_limit = 30;
  int tenant_b_limit = 60;
  int noisy_limit = 50;
  int procs = 1;                // processes per container (compute sections)
  int streams = 1;              // streams per process (compute sections)
  double queue_ms = 20;         // device work each process keeps queued (at least 4 kernels)
  std::string profile;          // simulated driver's FAKECUDA_PROFILE ("" on a real GPU)
  unsigned training_us = 1000;  // priority section: the low tenant's kernel length
};

// Prints "[ 3/24] what" lines on stderr unless quiet.
class Progress {
 public:
  Progress(int total, bool quiet) : total_(total), quiet_(quiet) {}
  void step(const std::string& what);

 private:
  int total_;
  int done_ = 0;
  bool quiet_;
};

// Starts `specs` together (one barrier) and returns their results in order.
std::vector<nlohmann::json> run_together(Workers& workers, std::vector<nlohmann::json> specs,
                                         const std::vector<WorkerEnv>& envs);

// How many Progress steps the plan takes.
int plan_steps(const Plan& plan);

nlohmann::json measure_launch(Workers& workers, const Plan& plan, Progress& progress);
nlohmann::json measure_memory(Workers& workers, const Plan& plan, Progress& progress);
nlohmann::json measure_quota(Workers& workers, const Plan& plan, Progress& progress);
nlohmann::json measure_sweep(Workers& workers, const Plan& plan, Progress& progress);
nlohmann::json measure_tenants(Workers& workers, const Plan& plan, Progress& progress);
nlohmann::json measure_noisy(Workers& workers, const Plan& plan, Progress& progress);

}  // namespace gpuslice::bench
