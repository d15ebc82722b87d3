// The microbenchmark cases: each call measured through the driver's own entry
// point ("native") and through libgpuslice.so's wrapper ("gpuslice"), at
// 1, 2, 8 and 32 threads, in the same process.
#pragma once

#include <string>
#include <vector>

#include "fixture.h"

namespace gpuslice::microbench {

// The control side's private delay before each native call, in empty loop
// turns (cases.cc): --control-turns.
inline constexpr int kDefaultControlTurns = 100;
inline constexpr int kMaxControlTurns = 100000;

struct CaseSet {
  std::vector<std::string> calls;  // case names, e.g. "cuLaunchKernel"
  std::vector<int> threads;
  int control_turns = kDefaultControlTurns;
};

// Every case name, in table order.
const std::vector<std::string>& all_cases();

// Registers `set` with Google Benchmark as "<call>/<native|gpuslice>/threads:N".
void register_cases(Fixture& fixture, const CaseSet& set);

}  // namespace gpuslice::microbench
