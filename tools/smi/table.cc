// The default output: one table per device (by UUID) listing the containers
// that use it, then the processes, in the spirit of nvidia-smi.
#include <algorithm>
#include <cstdio>
#include <map>

#include "region_io.h"
#include "smi.h"

using namespace std::string_literals;

#ifndef GPUSLICE_VERSION
#define GPUSLICE_VERSION "unknown"
#endif

namespace gpuslice::smi {
namespace {

using agent::DeviceView;
using agent::format_bytes;
using agent::RegionView;
using agent::SlotView;

constexpr std::uint64_t kStaleNs = 10'000'000'000;  // utilisation older than this is not shown

enum class Align { left, right };
struct Column {
  const char* title;
  std::size_t width;
  Align align;
};

// Appends s padded (or cut, marked '~') to exactly width characters. (Appends
// only: GCC 12 at -O3 warns wrongly about string operator+ chains.)
void fit(std::string& out, const std::string& s, std::size_t width, Align align) {
  if (s.size() > width) {
    out.append(s, 0, width - 1).push_back('~');
    return;
  }
  if (align == Align::right) out.append(width - s.size(), ' ');
  out += s;
  if (align == Align::left) out.append(width - s.size(), ' ');
}

std::string rule(const std::vector<Column>& cols, char fill, char cross) {
  std::string out(1, cross);
  for (const Column& c : cols) {
    out.append(c.width + 2, fill);
    out += cross;
  }
  out += '\n';
  return out;
}

std::string row(const std::vector<Column>& cols, const std::vector<std::string>& cells) {
  std::string out = "|";
  for (std::size_t i = 0; i < cols.size(); ++i) {
    out += ' ';
    fit(out, cells[i], cols[i].width, cols[i].align);
    out += " |";
  }
  out += '\n';
  return out;
}

std::size_t total_width(const std::vector<Column>& cols) {
  std::size_t w = 1;
  for (const Column& c : cols) w += c.width + 3;
  return w;
}

std::string banner(const std::string& text, std::size_t width) {
  std::string out = "| ";
  fit(out, text, width - 4, Align::left);
  out += " |\n";
  return out;
}

std::string pct(std::uint64_t permille) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%llu.%llu%%", static_cast<unsigned long long>(permille / 10),
                static_cast<unsigned long long>(permille % 10));
  return buf;
}

std::string seconds(std::uint64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fs", static_cast<double>(ns) / 1e9);
  return buf;
}

// The name, and the priority when it is not the default ("train [low, held]").
std::string container_label(const Shown& s, std::uint64_t now_ns) {
  std::string label = s.view.container_name.empty() ? s.path : s.view.container_name;
  const std::string level = priority_text(s.view);
  const bool held = priority_held(s.view, now_ns);
  if (level != "normal" || held) label += " ["s + level + (held ? ", held]" : "]");
  return label;
}

std::uint64_t used_total(const DeviceView& d) {
  const std::uint64_t sum = d.used_bytes + d.agent_extra_bytes;
  return sum < d.used_bytes ? kUnlimited : sum;
}

std::string agent_line(const Snapshot& s) {
  std::uint64_t newest = 0;
  for (const Shown& r : s.regions) newest = std::max(newest, r.view.agent_heartbeat_ns);
  if (newest == 0) return "agent: no heartbeat (utilisation not measured)";
  const std::uint64_t age = s.now_ns > newest ? s.now_ns - newest : 0;
  return std::string(age > kStaleNs ? "agent: stale, last cycle " : "agent: last cycle ") + seconds(age) + " ago";
}

}  // namespace

std::string render_table(const Snapshot& s) {
  const std::vector<Column> cols = {{"Container", 20, Align::left}, {"Memory used / quota", 21, Align::right},
                                    {"Mem%", 4, Align::right},      {"SM limit", 12, Align::right},
                                    {"SM util", 7, Align::right},   {"Throttled", 9, Align::right},
                                    {"OOM", 5, Align::right},       {"Procs", 5, Align::right}};
  const std::size_t width = total_width(cols);
  std::string out;
  {
    const std::string left = "gpuslice-smi " GPUSLICE_VERSION;
    const std::string right = agent_line(s);
    const std::size_t gap = width > left.size() + right.size() ? width - left.size() - right.size() : 1;
    out += left + std::string(gap, ' ') + right + "\n";
  }
  if (s.regions.empty()) return out + "No gpuslice regions.\n";

  // Devices by UUID, in order of first appearance (regions are sorted by path).
  std::vector<std::string> uuids;
  std::map<std::string, std::vector<std::pair<const Shown*, const DeviceView*>>> by_uuid;
  for (const Shown& r : s.regions) {
    for (const DeviceView& d : r.view.devices) {
      const std::string u = agent::format_uuid(d.uuid);
      if (by_uuid.find(u) == by_uuid.end()) uuids.push_back(u);
      by_uuid[u].push_back({&r, &d});
    }
  }
  if (uuids.empty()) out += "No device in use yet (no process has created a context).\n";
  for (const std::string& u : uuids) {
    out += rule({{"", width - 4, Align::left}}, '-', '+');
    std::uint64_t device_util = 0, device_util_at = 0;
    for (const auto& [r, d] : by_uuid[u]) {
      if (d->util_updated_ns > device_util_at) {
        device_util_at = d->util_updated_ns;
        device_util = d->device_util_permille;
      }
    }
    std::string title = "GPU "s + u;
    if (device_util_at != 0 && s.now_ns - device_util_at <= kStaleNs) title += "   device SM util "s + pct(device_util);
    out += banner(title, width);
    out += rule(cols, '-', '+');
    std::vector<std::string> head;
    for (const Column& c : cols) head.push_back(c.title);
    out += row(cols, head);
    out += rule(cols, '=', '+');
    for (const auto& [r, d] : by_uuid[u]) {
      const std::uint64_t used = used_total(*d);
      const bool limited = d->quota_bytes != kUnlimited;
      std::string mem_pct = "-";
      if (limited && d->quota_bytes != 0) {
        const auto p = static_cast<unsigned __int128>(used) * 100 / d->quota_bytes;
        mem_pct = std::to_string(static_cast<std::uint64_t>(std::min<unsigned __int128>(p, 999))) + "%";
      }
      const std::string sm = agent::sm_unlimited(d->sm_limit_pct)
                                 ? "unlimited"
                                 : std::to_string(d->sm_limit_pct) + "% " + agent::sm_policy_name(d->sm_policy);
      std::string util = "-";
      if (d->util_updated_ns != 0 && s.now_ns >= d->util_updated_ns && s.now_ns - d->util_updated_ns <= kStaleNs) {
        util = pct(d->util_permille);
      }
      const std::string memory = format_bytes(used) + " / " + (limited ? format_bytes(d->quota_bytes) : "-");
      out += row(cols, {container_label(*r, s.now_ns), memory, mem_pct, sm, util, seconds(d->throttled_ns),
                        std::to_string(d->oom_refusals), std::to_string(r->view.processes_on(d->index))});
    }
    out += rule(cols, '-', '+');
  }

  const std::vector<Column> pcols = {{"GPU", 12, Align::left},      {"Container", 20, Align::left},
                                     {"PID", 8, Align::right},      {"Host PID", 8, Align::right},
                                     {"Counted", 10, Align::right}, {"Context", 10, Align::right},
                                     {"NVML", 10, Align::right}};
  out += "\n"s + rule(pcols, '-', '+');
  std::vector<std::string> head;
  for (const Column& c : pcols) head.push_back(c.title);
  out += row(pcols, head);
  out += rule(pcols, '=', '+');
  bool any = false;
  for (const Shown& r : s.regions) {
    for (const SlotView& p : r.view.slots) {
      if (p.state != kSlotLive) continue;
      const std::string host = p.host_pid != 0 ? std::to_string(p.host_pid) : "-";
      bool shown = false;
      for (const DeviceView& d : r.view.devices) {
        const int i = d.index;
        if (p.committed_bytes[i] == 0 && p.nvml_used_bytes[i] == 0) continue;
        out +=
            row(pcols, {agent::format_uuid(d.uuid).substr(0, 12), container_label(r, s.now_ns), std::to_string(p.pid),
                        host, format_bytes(p.committed_bytes[i]), format_bytes(p.context_bytes[i]),
                        p.nvml_used_bytes[i] != 0 ? format_bytes(p.nvml_used_bytes[i]) : "-"});
        shown = any = true;
      }
      if (!shown) {
        out += row(pcols, {"-", container_label(r, s.now_ns), std::to_string(p.pid), host, "0B", "0B", "-"});
        any = true;
      }
    }
  }
  if (!any) out += banner("No running processes", total_width(pcols));
  out += rule(pcols, '-', '+');
  return out;
}

}  // namespace gpuslice::smi
