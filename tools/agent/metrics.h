// /metrics: the Prometheus text exposition format (version 0.0.4), one family
// at a time (# HELP, # TYPE, then every series), labels escaped, names from
// region files treated as untrusted text.
#pragma once

#include <cstdint>
#include <memory>
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
  std::vector<MetricsDevice> devices;                      // NVML's devices in the last cycle
  bool basic = false;                                      // --metrics basic (docs/agent.md, "Scale")
  std::vector<RegionCount> enforce_kills, tamper_repairs;  // enforce.h, tamper.h
};

// What a scrape read from the regions: read under the agent's lock, written
// out after it (a cycle does not wait for the text of thousands of regions).
struct MetricsRows;
struct MetricsRowsFree {
  void operator()(MetricsRows* m) const;
};
using MetricsSnapshot = std::unique_ptr<MetricsRows, MetricsRowsFree>;
MetricsSnapshot read_metrics(const MetricsInput& in);
std::string render_metrics(MetricsSnapshot rows);    // makes the label text (no lock needed)
std::string render_metrics(const MetricsInput& in);  // both
// A label value escaped for the text format (\\, \" and \n).
std::string escape_label(const std::string& value);

}  // namespace gpuslice::agent
