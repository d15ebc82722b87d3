// gpuslice-bench's priority section (docs/priority.md): a high-priority
// "inference" tenant (bursts of short kernels, each followed by a
// synchronize, random idle gaps) alone and next to a saturating low-priority
// "training" tenant, natively and under gpuslice; burst latency p50/p99, the
// low tenant's harvest of the high one's idle time, reaction and release.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>

#include "scenarios.h"
#include "spawn.h"

namespace gpuslice::bench {

int priority_steps(const Plan& plan);
nlohmann::json measure_priority(Workers& workers, const Plan& plan, Progress& progress);
// Worker task "burst" (see priority.cc).
nlohmann::json run_burst_worker(const nlohmann::json& spec);
// The section as a table (after the report's own tables).
void print_priority_table(const nlohmann::json& report, std::FILE* out);

}  // namespace gpuslice::bench
