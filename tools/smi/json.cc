// --json: the same data for scripts, one document per line (one per refresh
// with --watch). Sizes in bytes, times in nanoseconds, null for "none".
#include <nlohmann/json.hpp>

#include "region_io.h"
#include "smi.h"

#ifndef GPUSLICE_VERSION
#define GPUSLICE_VERSION "unknown"
#endif

namespace gpuslice::smi {
namespace {

using nlohmann::json;

json device_json(const agent::DeviceView& d, const agent::RegionView& v, std::uint64_t now_ns) {
  json j;
  j["index"] = d.index;
  j["uuid"] = agent::format_uuid(d.uuid);
  const std::uint64_t sum = d.used_bytes + d.agent_extra_bytes;
  j["memory"] = {
      {"quota_bytes", d.quota_bytes == kUnlimited ? json(nullptr) : json(d.quota_bytes)},
      {"used_bytes", sum < d.used_bytes ? kUnlimited : sum},
      {"counted_bytes", d.used_bytes},
      {"agent_extra_bytes", d.agent_extra_bytes},
      {"peak_bytes", d.peak_used_bytes},
      {"oom_refusals", d.oom_refusals},
      {"accounting_errors", d.accounting_errors},
      {"resident_limit_bytes", d.resident_limit_bytes == 0 || d.resident_limit_bytes == kUnlimited
                                   ? json(nullptr)
                                   : json(d.resident_limit_bytes)},
      {"spilled_bytes", d.spilled_bytes},
      {"spills", d.spills},
      {"oversubscribe", d.oversub_policy == 1   ? "spill"
                        : d.oversub_policy == 2 ? "wait"
                                                : "fail"},
      {"waits", d.oversub_waits},
      {"wait_ns", d.oversub_wait_ns},
      {"wait_timeouts", d.oversub_timeouts},
      {"waiting", d.oversub_waiting},
  };
  const bool measured = d.util_updated_ns != 0;
  j["compute"] = {
      {"sm_limit_pct", agent::sm_unlimited(d.sm_limit_pct) ? json(nullptr) : json(d.sm_limit_pct)},
      {"sm_policy", agent::sm_policy_name(d.sm_policy)},
      {"util_permille", measured ? json(d.util_permille) : json(nullptr)},
      {"device_util_permille", measured ? json(d.device_util_permille) : json(nullptr)},
      {"util_age_ns", measured && now_ns >= d.util_updated_ns ? json(now_ns - d.util_updated_ns) : json(nullptr)},
      {"throttled_ns", d.throttled_ns},
      {"launches", d.launches},
  };
  j["processes"] = v.processes_on(d.index);
  return j;
}

json process_json(const agent::SlotView& p, const agent::RegionView& v) {
  json j;
  j["slot"] = p.index;
  j["pid"] = p.pid;
  j["host_pid"] = p.host_pid != 0 ? json(p.host_pid) : json(nullptr);
  j["state"] = p.state == kSlotLive ? "live" : p.state == kSlotReaping ? "reaping" : "claiming";
  json devices = json::array();
  for (const agent::DeviceView& d : v.devices) {
    const int i = d.index;
    if (p.committed_bytes[i] == 0 && p.nvml_used_bytes[i] == 0 && p.context_bytes[i] == 0) continue;
    devices.push_back({{"index", i},
                       {"uuid", agent::format_uuid(d.uuid)},
                       {"counted_bytes", p.committed_bytes[i]},
                       {"context_bytes", p.context_bytes[i]},
                       {"nvml_used_bytes", p.nvml_used_bytes[i]}});
  }
  j["devices"] = devices;
  return j;
}

}  // namespace

std::string render_json(const Snapshot& s) {
  json doc;
  doc["version"] = GPUSLICE_VERSION;
  doc["regions"] = json::array();
  for (const Shown& r : s.regions) {
    json j;
    j["path"] = r.path;
    j["container"] = r.view.container_name;
    j["agent_heartbeat_age_ns"] = r.view.agent_heartbeat_ns != 0 && s.now_ns >= r.view.agent_heartbeat_ns
                                      ? json(s.now_ns - r.view.agent_heartbeat_ns)
                                      : json(nullptr);
    j["slots_reaped"] = r.view.slots_reaped;
    j["priority"] = priority_text(r.view);
    j["priority_held"] = priority_held(r.view, s.now_ns);
    j["priority_held_ns"] = r.view.priority_held_ns;
    json devices = json::array();
    for (const agent::DeviceView& d : r.view.devices) devices.push_back(device_json(d, r.view, s.now_ns));
    j["devices"] = devices;
    json processes = json::array();
    for (const agent::SlotView& p : r.view.slots) processes.push_back(process_json(p, r.view));
    j["processes"] = processes;
    doc["regions"].push_back(j);
  }
  // File names may hold any bytes: replace invalid UTF-8 rather than throw.
  return doc.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace gpuslice::smi
