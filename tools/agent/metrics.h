// /metrics: the Prometheus text exposition format (version 0.0.4), one family
// at a time (# HELP, # TYPE, then every series), labels escaped, names from
// region files treated as untrusted text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "agent.h"

namespace gpuslice::agent {

struct MetricsDevice {
  std::string uuid;
  std::uint32_t util_pct;
  std::uint32_t processes;
};

struct MetricsInput {
  AgentStats stats;
  std::vector<const TrackedRegion*> regions;
  std::vector<MetricsDevice> devices;  // NVML's devices in the last cycle
};

std::string render_metrics(const MetricsInput& in);
// A label value escaped for the text format (\\, \" and \n).
std::string escape_label(const std::string& value);

}  // namespace gpuslice::agent
