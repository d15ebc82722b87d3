// Command-line values of the tools: durations ("100ms", "1.5s", "5m") and
// sizes (options::parse_size's grammar: B, K/M/G/T base 1000, Ki/Mi/Gi/Ti
// base 1024). Strict: trailing junk is an error.
#pragma once

#include <cstdint>
#include <string>

namespace gpuslice::agent {

// <number>[.<digits>]<unit>, unit ns|us|ms|s|m|h. "0" alone is accepted.
bool parse_duration(const std::string& text, std::uint64_t* ns);
std::string format_duration(std::uint64_t ns);  // "100ms", "5m0s"-free: "300s" -> "5m"

}  // namespace gpuslice::agent
