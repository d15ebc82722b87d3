// The human-readable table of a gpuslice-bench run, from its JSON report.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>

namespace gpuslice::bench {

void print_table(const nlohmann::json& report, std::FILE* out);

}  // namespace gpuslice::bench
