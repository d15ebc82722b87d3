// gpuslice-bench's oversubscription section (docs/memory.md
// "Oversubscription"): one container with a device-resident allowance under
// its quota, two processes: a "holder" that holds memory and frees it piece
// by piece, and a "grower" that allocates past the allowance on a fixed
// schedule, under GPUSLICE_OVERSUBSCRIBE=spill and =wait. A third process,
// outside the container, samples the container's region (counted, spilled,
// waiting) and, on the simulated driver, what the device really holds: the
// memory over time that --plots draws.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>

#include "scenarios.h"
#include "spawn.h"

namespace gpuslice::bench {

int oversub_steps(const Plan& plan);
nlohmann::json measure_oversub(Workers& workers, const Plan& plan, Progress& progress);

// Worker tasks (times in ns from the common start, sizes in bytes):
//  memplan   actions [{at_ns, op: alloc|free|freeall, bytes}], each run no
//            earlier than at_ns and after the previous one; "free" frees the
//            oldest allocation held. Reports the context's counted bytes
//            (cuMemGetInfo's total - free right after cuInit) and each
//            action's start, end and result.
//  memwatch  region, interval_ns, run_ns: samples the region's device 0 (and
//            the simulated device) every interval_ns from the start.
nlohmann::json run_oversub_worker(const nlohmann::json& spec);

// The section as a few lines (after the report's other tables).
void print_oversub_table(const nlohmann::json& report, std::FILE* out);

}  // namespace gpuslice::bench
