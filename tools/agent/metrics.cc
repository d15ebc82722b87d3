#include "metrics.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <string_view>

#include "region_io.h"
#include "limiter/lease.h"
#include "shm/region_file.h"
#include "text.h"
#include "view.h"

using namespace std::string_literals;

#ifndef GPUSLICE_VERSION
#define GPUSLICE_VERSION "unknown"
#endif

namespace gpuslice::agent {

// What a scrape read from the regions (under the agent's lock); written out
// without it.
struct MetricsRows {
  // What /metrics shows of one device entry, read fresh (guarded).
  struct Row {
    // Oversubscription configured or ever used on the entry: its families are
    // written only then (six series of zeros per device entry otherwise).
    bool oversub() const {
      return dev.oversub_policy != 0 || dev.spilled_bytes != 0 || dev.oversub_waits != 0 || dev.oversub_timeouts != 0 ||
             dev.oversub_waiting != 0 || (dev.resident_limit_bytes != 0 && dev.resident_limit_bytes != kUnlimited);
    }
    std::size_t region;  // its RegionRow
    DeviceView dev;
    DeviceStats stats;
    std::uint32_t processes;
    // Made by render_metrics, after the agent's lock:
    std::string labels;        // container="..",region="..",device="..",uuid=".."
    std::string short_labels;  // container="..",region="..",device="..": the backstop series (one per entry)
  };

  // Copied under the agent's lock; the label text is made after it.
  struct RegionRow {
    char name[sizeof(RegionHeader::container_name)];  // the header's, NUL-terminated
    std::string rel;
    OwnerLabels owner;
    std::string labels;  // container="..",region=".." (render_metrics)
    std::string base;    // the same, without the owner labels
    std::uint32_t processes;
    std::uint64_t heartbeat_ns;
    std::uint32_t priority = 0;  // RegionHeader::priority (docs/priority.md)
    std::uint64_t held_ns = 0, held_until_ns = 0;
  };
  std::vector<Row> rows;
  std::vector<RegionRow> regions;
  AgentStats stats;
  std::vector<MetricsDevice> devices;
  bool basic = false;
  std::vector<RegionCount> enforce_kills, tamper_repairs;
};

void MetricsRowsFree::operator()(MetricsRows* m) const { delete m; }

namespace {

class Writer {
 public:
  explicit Writer(std::string* out) : out_(out) {}
  // Starts a family; false (and its samples are dropped) when it is left out.
  bool family(const char* name, const char* type, const char* help, bool wanted = true) {
    skip_ = !wanted;
    name_ = name;
    if (skip_) return false;
    *out_ += "# HELP ";
    *out_ += name;
    *out_ += ' ';
    *out_ += help;
    *out_ += "\n# TYPE ";
    *out_ += name;
    *out_ += ' ';
    *out_ += type;
    *out_ += '\n';
    return true;
  }
  // The shortest text that reads back as the same double (std::to_chars),
  // where "%.17g" wrote 0.050000000000000003 for 0.05.
  void sample(const std::string& labels, double value) {
    char buf[64];
    const auto end = std::to_chars(buf, buf + sizeof buf, value).ptr;
    line(labels, std::string_view(buf, static_cast<std::size_t>(end - buf)));
  }
  void sample_u64(const std::string& labels, std::uint64_t value) {
    char buf[32];
    const auto end = std::to_chars(buf, buf + sizeof buf, value).ptr;
    line(labels, std::string_view(buf, static_cast<std::size_t>(end - buf)));
  }

 private:
  void line(const std::string& labels, std::string_view value) {
    if (skip_) return;
    out_->append(name_);
    if (!labels.empty()) {
      out_->push_back('{');
      out_->append(labels);
      out_->push_back('}');
    }
    out_->push_back(' ');
    out_->append(value);
    out_->push_back('\n');
  }
  std::string* out_;
  const char* name_ = "";
  bool skip_ = false;
};

std::string region_labels(const std::string& container, const std::string& rel) {
  return "container=\""s + escape_label(container) + "\",region=\"" + escape_label(tools::escape_untrusted(rel)) + "\"";
}

// Kubernetes owner labels, after the others (label names as kube-state-metrics
// and cAdvisor spell them: snake_case, "uid" for an object's UID). Only those
// known are written: an empty label is an absent one in Prometheus.
std::string owner_labels_text(const OwnerLabels& o) {
  std::string out;
  if (!o.pod_uid.empty()) out += ",pod_uid=\"" + escape_label(o.pod_uid) + "\"";
  if (!o.claim_uid.empty()) out += ",claim_uid=\"" + escape_label(o.claim_uid) + "\"";
  return out;
}

}  // namespace

std::string escape_label(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

MetricsSnapshot read_metrics(const MetricsInput& in) {
  MetricsSnapshot snap(new MetricsRows);
  using Row = MetricsRows::Row;
  std::vector<Row>& rows = snap->rows;
  std::vector<MetricsRows::RegionRow>& region_rows = snap->regions;
  snap->stats = in.stats;
  snap->devices = in.devices;
  snap->basic = in.basic;
  snap->enforce_kills = in.enforce_kills;
  snap->tamper_repairs = in.tamper_repairs;
  for (const TrackedRegion* t : in.regions) {
    const Region* r = t->map.get();
    DeviceView devs[kMaxDevices];
    int count = 0;
    char name[sizeof(RegionHeader::container_name)] = {};
    std::uint64_t heartbeat = 0;
    std::uint32_t priority = 0;
    std::uint64_t held_ns = 0, held_until_ns = 0;
    const bool ok = guarded([&] {
      priority = r->header.priority.load(std::memory_order_relaxed);
      held_ns = r->header.priority_held_ns.load(std::memory_order_relaxed);
      held_until_ns = r->header.priority_held_until_ns.load(std::memory_order_relaxed);
      std::memcpy(name, r->header.container_name, sizeof name);
      heartbeat = r->header.agent_heartbeat_ns.load(std::memory_order_relaxed);
      for (const DeviceSample& d : t->sample.devices) {
        const DeviceState& s = r->devices[d.index];
        DeviceView& v = devs[count++];
        v.index = d.index;
        std::memcpy(v.uuid, d.uuid, sizeof v.uuid);
        v.quota_bytes = s.quota_bytes.load(std::memory_order_relaxed);
        v.used_bytes = s.used_bytes.load(std::memory_order_relaxed);
        v.used_bytes -= std::min(v.used_bytes, limiter::spare_lease_bytes(r, d.index));  // leases are not used
        v.agent_extra_bytes = s.agent_extra_bytes.load(std::memory_order_relaxed);
        v.oom_refusals = s.oom_refusals.load(std::memory_order_relaxed);
        v.record_refusals = s.record_refusals.load(std::memory_order_relaxed);
        v.peak_used_bytes = s.peak_used_bytes.load(std::memory_order_relaxed);
        v.accounting_errors = s.accounting_errors.load(std::memory_order_relaxed);
        v.resident_limit_bytes = s.resident_limit_bytes.load(std::memory_order_relaxed);
        v.spilled_bytes = s.spilled_bytes.load(std::memory_order_relaxed);
        v.oversub_waits = s.oversub_waits.load(std::memory_order_relaxed);
        v.oversub_wait_ns = s.oversub_wait_ns.load(std::memory_order_relaxed);
        v.oversub_timeouts = s.oversub_timeouts.load(std::memory_order_relaxed);
        v.oversub_waiting = s.oversub_waiting.load(std::memory_order_relaxed);
        v.oversub_policy = s.oversub_policy.load(std::memory_order_relaxed);
        v.sm_limit_pct = s.sm_limit_pct.load(std::memory_order_relaxed);
        v.throttled_ns = s.throttled_ns.load(std::memory_order_relaxed);
        v.launches = s.launches.load(std::memory_order_relaxed);
        v.util_permille = s.util_permille.load(std::memory_order_relaxed);
        v.util_updated_ns = s.util_updated_ns.load(std::memory_order_relaxed);
      }
    });
    if (!ok) continue;  // truncated under us: the next cycle drops it
    name[sizeof name - 1] = '\0';
    MetricsRows::RegionRow& rr = region_rows.emplace_back();
    std::memcpy(rr.name, name, sizeof name);
    rr.rel = t->rel;
    rr.owner = t->owner;
    rr.processes = static_cast<std::uint32_t>(t->sample.slots.size());
    rr.heartbeat_ns = heartbeat;
    rr.priority = priority;
    rr.held_ns = held_ns;
    rr.held_until_ns = held_until_ns;
    for (int i = 0; i < count; ++i) {
      const int dev = devs[i].index;
      std::uint32_t processes = 0;
      for (const SlotSample& s : t->sample.slots) {
        if (s.committed_bytes[dev] != 0 || s.nvml_now_bytes[dev] != 0) ++processes;
      }
      rows.push_back({region_rows.size() - 1, devs[i], t->sample.stats[dev], processes, {}, {}});
    }
  }
  return snap;
}

namespace {

// The label text of every row, made without the agent's lock.
void make_labels(MetricsRows* in) {
  for (MetricsRows::RegionRow& r : in->regions) {
    // The name the container gave itself (GPUSLICE_CONTAINER_NAME) wins; HAMi
    // sets none, and its directory names the container instead.
    std::string container = printable(r.name, sizeof r.name);
    if (container.empty()) container = tools::escape_untrusted(r.owner.container);
    r.base = region_labels(container, r.rel);
    r.labels = r.base + owner_labels_text(r.owner);
  }
  for (MetricsRows::Row& row : in->rows) {
    const MetricsRows::RegionRow& r = in->regions[row.region];
    row.short_labels = r.base + ",device=\"" + std::to_string(row.dev.index) + "\"";
    row.labels = row.short_labels + ",uuid=\"" + format_uuid(row.dev.uuid) + "\"" + owner_labels_text(r.owner);
  }
}

}  // namespace

std::string render_metrics(const MetricsInput& in) { return render_metrics(read_metrics(in)); }

std::string render_metrics(MetricsSnapshot snapshot) {
  make_labels(snapshot.get());
  const MetricsRows& in = *snapshot;
  using Row = MetricsRows::Row;
  using RegionRow = MetricsRows::RegionRow;
  const std::vector<Row>& rows = in.rows;
  const std::vector<RegionRow>& region_rows = in.regions;

  std::string out;
  out.reserve(4096 + rows.size() * (in.basic ? 1500 : 2500));
  Writer w(&out);
  const bool full = !in.basic;  // --metrics basic leaves these families out
  w.family("gpuslice_memory_quota_bytes", "gauge",
           "Device-memory quota of the container on the device (absent when unlimited).");
  for (const Row& r : rows) {
    if (r.dev.quota_bytes != kUnlimited) w.sample_u64(r.labels, r.dev.quota_bytes);
  }
  w.family("gpuslice_memory_used_bytes", "gauge",
           "Device memory the container uses: counted by gpuslice plus what NVML shows beyond that.");
  for (const Row& r : rows) {
    const std::uint64_t sum = r.dev.used_bytes + r.dev.agent_extra_bytes;
    w.sample_u64(r.labels, sum < r.dev.used_bytes ? kUnlimited : sum);
  }
  w.family("gpuslice_memory_counted_bytes", "gauge",
           "Device memory reserved through gpuslice (DeviceState::used_bytes).", full);
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.used_bytes);
  w.family("gpuslice_memory_agent_extra_bytes", "gauge",
           "Device memory NVML shows for the container beyond what gpuslice counted (contexts, bypasses).", full);
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.agent_extra_bytes);
  w.family("gpuslice_memory_nvml_bytes", "gauge",
           "Device memory NVML reports for the container's processes (last cycle).", full);
  for (const Row& r : rows) {
    if (r.stats.nvml_known) w.sample_u64(r.labels, r.stats.nvml_bytes);
  }
  w.family("gpuslice_memory_peak_bytes", "gauge", "Highest device memory counted for the container.", full);
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.peak_used_bytes);
  w.family("gpuslice_oom_refusals_total", "counter", "Allocations refused because of the quota.");
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.oom_refusals);
  w.family("gpuslice_record_refusals_total", "counter",
           "Allocations refused because a process's allocation records could not grow (address space).");
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.record_refusals);
  w.family("gpuslice_accounting_errors_total", "counter", "Accounting inconsistencies detected and clamped.");
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.accounting_errors);
  w.family("gpuslice_memory_resident_bytes", "gauge",
           "Device memory counted for the container that is resident on the device (counted minus spilled).");
  for (const Row& r : rows)
    if (r.oversub())
      w.sample_u64(r.labels, r.dev.used_bytes > r.dev.spilled_bytes ? r.dev.used_bytes - r.dev.spilled_bytes : 0);
  w.family("gpuslice_memory_spilled_bytes", "gauge",
           "Memory served as host-resident managed memory under GPUSLICE_OVERSUBSCRIBE=spill (within the quota).");
  for (const Row& r : rows)
    if (r.oversub()) w.sample_u64(r.labels, r.dev.spilled_bytes);
  w.family("gpuslice_memory_resident_limit_bytes", "gauge",
           "Device-resident allowance (GPUSLICE_MEMORY_RESIDENT; absent = the quota).");
  for (const Row& r : rows) {
    if (r.dev.resident_limit_bytes != 0 && r.dev.resident_limit_bytes != kUnlimited)
      w.sample_u64(r.labels, r.dev.resident_limit_bytes);
  }
  w.family("gpuslice_memory_waits_total", "counter",
           "Allocations that waited for device memory under GPUSLICE_OVERSUBSCRIBE=wait.");
  for (const Row& r : rows)
    if (r.oversub()) w.sample_u64(r.labels, r.dev.oversub_waits);
  w.family("gpuslice_memory_wait_seconds_total", "counter", "Time allocations spent waiting for device memory.", full);
  for (const Row& r : rows)
    if (r.oversub()) w.sample(r.labels, static_cast<double>(r.dev.oversub_wait_ns) / 1e9);
  w.family("gpuslice_memory_wait_timeouts_total", "counter", "Waits for device memory that ended in out-of-memory.");
  for (const Row& r : rows)
    if (r.oversub()) w.sample_u64(r.labels, r.dev.oversub_timeouts);
  w.family("gpuslice_memory_waiting", "gauge", "Allocations waiting for device memory now.");
  for (const Row& r : rows)
    if (r.oversub()) w.sample_u64(r.labels, r.dev.oversub_waiting);
  w.family("gpuslice_sm_limit_percent", "gauge",
           "Share of the device's compute time the container may use (100 = unlimited).");
  for (const Row& r : rows) w.sample_u64(r.labels, sm_unlimited(r.dev.sm_limit_pct) ? 100 : r.dev.sm_limit_pct);
  w.family("gpuslice_sm_utilization_ratio", "gauge",
           "Measured SM utilisation of the container on the device (0-1; absent before the first sample).");
  for (const Row& r : rows) {
    if (r.dev.util_updated_ns != 0) w.sample(r.labels, static_cast<double>(r.dev.util_permille) / 1000.0);
  }
  w.family("gpuslice_throttled_seconds_total", "counter",
           "Time the container's launching threads were held back by the SM limit.");
  for (const Row& r : rows) w.sample(r.labels, static_cast<double>(r.dev.throttled_ns) / 1e9);
  w.family("gpuslice_launches_total", "counter", "Kernels launched by the container.", full);
  for (const Row& r : rows) w.sample_u64(r.labels, r.dev.launches);
  w.family("gpuslice_processes", "gauge", "Processes of the container holding memory on the device.", full);
  for (const Row& r : rows) w.sample_u64(r.labels, r.processes);
  w.family("gpuslice_bypass_suspected_processes", "gauge",
           "Registered processes holding more device memory than they accounted for, beyond the tolerance.");
  for (const Row& r : rows) w.sample_u64(r.labels, r.stats.suspected);
  w.family("gpuslice_unregistered_processes", "gauge",
           "Processes of the container's pid namespace using the device without gpuslice.");
  for (const Row& r : rows) w.sample_u64(r.labels, r.stats.unregistered);

  w.family("gpuslice_memory_backstop", "gauge",
           "1 for the wall behind the container's quota on the device: kind=driver (the driver's per-cgroup limit), "
           "agent (the agent enforces) or none (docs/agent.md, \"Driver backstop\").",
           full);
  std::uint64_t kinds[3] = {0, 0, 0};
  for (const Row& r : rows) {
    const auto kind = static_cast<BackstopKind>(r.stats.backstop < 3 ? r.stats.backstop : 0);
    ++kinds[static_cast<int>(kind)];
    if (full) w.sample_u64(r.short_labels + ",kind=\"" + backstop_name(kind) + "\"", 1);
  }
  w.family("gpuslice_backstop_entries", "gauge",
           "Device entries of containers by the wall behind their quota (kind=driver, agent or none).");
  for (int k = 2; k >= 0; --k) w.sample_u64("kind=\""s + backstop_name(static_cast<BackstopKind>(k)) + "\"", kinds[k]);
  w.family("gpuslice_memory_backstop_limit_bytes", "gauge",
           "The driver's hard limit the agent set on the container's cgroup for the device (absent when none).", full);
  for (const Row& r : rows) {
    if (r.stats.backstop_limit_bytes != 0) w.sample_u64(r.short_labels, r.stats.backstop_limit_bytes);
  }

  w.family("gpuslice_container_processes", "gauge", "Processes registered in the container's region.", full);
  for (const RegionRow& r : region_rows) w.sample_u64(r.labels, r.processes);

  w.family("gpuslice_device_sm_utilization_ratio", "gauge",
           "Measured SM utilisation of the whole device (0-1), from NVML.");
  for (const MetricsDevice& d : in.devices) w.sample("uuid=\""s + escape_label(d.uuid) + "\"", d.util_pct / 100.0);
  w.family("gpuslice_device_processes", "gauge", "Compute processes NVML lists on the device.");
  for (const MetricsDevice& d : in.devices) w.sample_u64("uuid=\""s + escape_label(d.uuid) + "\"", d.processes);

  const AgentStats& s = in.stats;
  w.family("gpuslice_agent_info", "gauge", "The agent's version.");
  w.sample_u64("version=\"" GPUSLICE_VERSION "\"", 1);
  w.family("gpuslice_agent_cycles_total", "counter", "Cycles run.");
  w.sample_u64("", s.cycles);
  w.family("gpuslice_agent_cycle_seconds", "gauge", "Wall time of the last cycle.");
  w.sample("", static_cast<double>(s.last_cycle_ns) / 1e9);
  w.family("gpuslice_agent_cycle_cpu_seconds", "gauge", "CPU time of the last cycle.");
  w.sample("", static_cast<double>(s.last_cycle_cpu_ns) / 1e9);
  w.family("gpuslice_agent_cycle_cpu_seconds_total", "counter", "CPU time of every cycle.");
  w.sample("", static_cast<double>(s.total_cycle_cpu_ns) / 1e9);
  w.family("gpuslice_agent_cycle_seconds_max", "gauge", "Longest cycle so far (wall time).");
  w.sample("", static_cast<double>(s.max_cycle_ns) / 1e9);
  w.family("gpuslice_agent_regions", "gauge", "Regions watched.");
  w.sample_u64("", s.regions);
  w.family("gpuslice_agent_invalid_files", "gauge", "Files in the region directory skipped as not valid regions.");
  w.sample_u64("", s.invalid_files);
  w.family("gpuslice_agent_regions_max", "gauge", "Most regions watched at once (--max-regions).");
  w.sample_u64("", s.regions_max);
  w.family("gpuslice_agent_regions_unwatched", "gauge",
           "Region files found but not watched, reaped or removed because --max-regions was reached.");
  w.sample_u64("", s.regions_unwatched);
  w.family("gpuslice_agent_log_suppressed_total", "counter",
           "Warnings about invalid files not logged because of the log budget (docs/agent.md).");
  w.sample_u64("", s.log_suppressed);
  w.family("gpuslice_agent_regions_removed_total", "counter", "Unused regions removed after the grace period.");
  w.sample_u64("", s.regions_removed);
  w.family("gpuslice_agent_regions_truncated_total", "counter",
           "Regions dropped because their file shrank while mapped.");
  w.sample_u64("", s.regions_dropped_truncated);
  w.family("gpuslice_agent_slots_reaped_total", "counter", "Slots of exited processes reclaimed by the agent.");
  w.sample_u64("", s.slots_reaped);
  w.family("gpuslice_agent_slot_rereads_total", "counter",
           "Reads of a region's whole slot array (at first sight, after a claim or release, every ~10 s).");
  w.sample_u64("", s.slot_rereads);
  w.family("gpuslice_agent_pid_scans_total", "counter", "Full /proc scans to map processes of other pid namespaces.");
  w.sample_u64("", s.pid_scans);
  w.family("gpuslice_agent_bypass_reports_total", "counter",
           "Registered processes reported for holding more than they accounted for.");
  w.sample_u64("", s.bypass_reports);
  w.family("gpuslice_agent_unregistered_reports_total", "counter",
           "Unregistered processes reported in a container's pid namespace.");
  w.sample_u64("", s.unregistered_reports);
  w.family("gpuslice_agent_backstop_limits_set_total", "counter", "Driver memory limits set or moved (backstop).");
  w.sample_u64("", s.backstop_limits_set);
  w.family("gpuslice_agent_backstop_limits_cleared_total", "counter", "Driver memory limits cleared (backstop).");
  w.sample_u64("", s.backstop_limits_cleared);
  w.family("gpuslice_agent_backstop_errors_total", "counter", "NVML errors setting or clearing a driver limit.");
  w.sample_u64("", s.backstop_errors);
  w.family("gpuslice_agent_enforce_kills_total", "counter",
           "Processes the agent killed (--enforce=kill): their container held more than its quota plus "
           "--bypass-tolerance for --enforce-cycles cycles.");
  for (const RegionCount& c : in.enforce_kills) w.sample_u64(region_labels(c.container, c.rel), c.value);
  w.family("gpuslice_agent_over_quota_reports_total", "counter",
           "Containers found holding more than their quota plus --bypass-tolerance for --enforce-cycles cycles.");
  w.sample_u64("", s.enforce.over_reports);
  w.family("gpuslice_agent_enforce_kill_failures_total", "counter",
           "Processes chosen to be killed that were not (gone, their pid recycled, no permission).");
  w.sample_u64("", s.enforce.kill_failures);
  w.family("gpuslice_agent_tamper_repairs_total", "counter",
           "Limits (quota, SM limit, SM policy, priority) a container rewrote in its region and the agent put back.");
  for (const RegionCount& c : in.tamper_repairs) w.sample_u64(region_labels(c.container, c.rel), c.value);
  w.family("gpuslice_agent_grants_applied_total", "counter",
           "Operator changes of a region's limits (gpuslice-smi set) the agent took as the limits to keep.");
  w.sample_u64("", s.tamper.grants_applied);
  w.family("gpuslice_agent_nvml_available", "gauge", "1 if NVML was loaded (utilisation and reconciliation run).");
  w.sample_u64("", s.nvml_available ? 1 : 0);
  w.family("gpuslice_agent_heartbeat_age_seconds", "gauge", "Time since the agent's heartbeat in each region.", full);
  const std::uint64_t now = monotonic_ns();
  for (const RegionRow& r : region_rows) {
    if (r.heartbeat_ns != 0)
      w.sample(r.labels, now >= r.heartbeat_ns ? static_cast<double>(now - r.heartbeat_ns) / 1e9 : 0.0);
  }
  w.family("gpuslice_priority_level", "gauge",
           "Priority of the container's work (1 low, 2 normal, 3 high; docs/priority.md).");
  for (const RegionRow& r : region_rows) w.sample_u64(r.labels, r.priority >= 1 && r.priority <= 3 ? r.priority : 2);
  w.family("gpuslice_priority_held", "gauge",
           "1 while the container's launches are held by a higher-priority container.");
  for (const RegionRow& r : region_rows) w.sample_u64(r.labels, r.held_until_ns > now ? 1 : 0);
  w.family("gpuslice_priority_held_seconds_total", "counter",
           "Time the container's launches waited for higher-priority containers.");
  for (const RegionRow& r : region_rows) w.sample(r.labels, static_cast<double>(r.held_ns) / 1e9);
  return out;
}

}  // namespace gpuslice::agent
