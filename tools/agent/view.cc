#include "view.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "region_io.h"
#include "limiter/lease.h"
#include "shm/region_file.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

// Raw copies taken under the guard: trivially destructible, preallocated.
struct RawHeader {
  char name[sizeof(RegionHeader::container_name)];
  std::uint64_t created_ns, heartbeat_ns, slots_reaped;
  std::uint32_t priority;
  std::uint64_t priority_held_ns, priority_held_until_ns;
};

void copy_device(const DeviceState& d, int index, DeviceView* v) {
  v->index = index;
  std::memcpy(v->uuid, d.uuid, sizeof v->uuid);
  v->quota_bytes = d.quota_bytes.load(std::memory_order_relaxed);
  v->used_bytes = d.used_bytes.load(std::memory_order_relaxed);
  v->agent_extra_bytes = d.agent_extra_bytes.load(std::memory_order_relaxed);
  v->oom_refusals = d.oom_refusals.load(std::memory_order_relaxed);
  v->record_refusals = d.record_refusals.load(std::memory_order_relaxed);
  v->resident_limit_bytes = d.resident_limit_bytes.load(std::memory_order_relaxed);
  v->spilled_bytes = d.spilled_bytes.load(std::memory_order_relaxed);
  v->spills = d.spills.load(std::memory_order_relaxed);
  v->oversub_waits = d.oversub_waits.load(std::memory_order_relaxed);
  v->oversub_wait_ns = d.oversub_wait_ns.load(std::memory_order_relaxed);
  v->oversub_timeouts = d.oversub_timeouts.load(std::memory_order_relaxed);
  v->oversub_waiting = d.oversub_waiting.load(std::memory_order_relaxed);
  v->oversub_policy = d.oversub_policy.load(std::memory_order_relaxed);
  v->peak_used_bytes = d.peak_used_bytes.load(std::memory_order_relaxed);
  v->accounting_errors = d.accounting_errors.load(std::memory_order_relaxed);
  v->sm_limit_pct = d.sm_limit_pct.load(std::memory_order_relaxed);
  v->sm_policy = d.sm_policy.load(std::memory_order_relaxed);
  v->throttled_ns = d.throttled_ns.load(std::memory_order_relaxed);
  v->launches = d.launches.load(std::memory_order_relaxed);
  v->util_permille = d.util_permille.load(std::memory_order_relaxed);
  v->util_updated_ns = d.util_updated_ns.load(std::memory_order_relaxed);
  v->device_util_permille = d.device_util_permille.load(std::memory_order_relaxed);
  v->feedback_owner_pid = d.feedback_owner_pid.load(std::memory_order_relaxed);
}

void copy_slot(const Slot& s, int index, std::uint32_t state, SlotView* v) {
  v->index = index;
  v->state = state;
  v->pid = s.pid.load(std::memory_order_relaxed);
  v->pidns_inode = s.pidns_inode.load(std::memory_order_relaxed);
  v->start_time = s.start_time.load(std::memory_order_relaxed);
  v->host_pid = s.host_pid.load(std::memory_order_relaxed);
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    const std::uint64_t committed = s.committed_bytes[d].load(std::memory_order_relaxed);
    const std::uint64_t lease = s.lease[d].word.load(std::memory_order_relaxed);
    const std::uint64_t not_used = limiter::lease_spare(lease) + limiter::lease_owed(lease);
    v->committed_bytes[d] = committed > not_used ? committed - not_used : 0;
    v->context_bytes[d] = s.context_bytes[d].load(std::memory_order_relaxed);
    v->nvml_used_bytes[d] = s.nvml_used_bytes[d].load(std::memory_order_relaxed);
  }
}

}  // namespace

int RegionView::processes_on(int dev) const {
  if (dev < 0 || dev >= static_cast<int>(kMaxDevices)) return 0;
  int count = 0;
  for (const SlotView& s : slots) {
    if (s.state == kSlotLive && (s.committed_bytes[dev] != 0 || s.nvml_used_bytes[dev] != 0)) ++count;
  }
  return count;
}

bool take_view(const Region* r, RegionView* out) {
  // Sized before the guard so that nothing allocates inside it.
  // Slots go through a scratch buffer so that a view keeps only the used ones.
  thread_local std::vector<SlotView> scratch;
  out->devices.resize(kMaxDevices);
  scratch.resize(kMaxSlots);
  RawHeader raw{};
  std::size_t devices = 0, slots = 0;
  const bool ok = guarded([&] {
    std::memcpy(raw.name, r->header.container_name, sizeof raw.name);
    raw.created_ns = r->header.created_ns;
    raw.heartbeat_ns = r->header.agent_heartbeat_ns.load(std::memory_order_relaxed);
    raw.slots_reaped = r->header.slots_reaped.load(std::memory_order_relaxed);
    raw.priority = r->header.priority.load(std::memory_order_relaxed);
    raw.priority_held_ns = r->header.priority_held_ns.load(std::memory_order_relaxed);
    raw.priority_held_until_ns = r->header.priority_held_until_ns.load(std::memory_order_relaxed);
    for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
      const DeviceState& d = r->devices[i];
      if (d.uuid_state.load(std::memory_order_acquire) != shm::kDevicePublished) continue;
      DeviceView& dv = out->devices[devices++];
      copy_device(d, static_cast<int>(i), &dv);
      // Spare quota leases are admitted, not allocated: not shown as used.
      dv.used_bytes -= std::min(dv.used_bytes, limiter::spare_lease_bytes(r, static_cast<int>(i)));
    }
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      const Slot& s = r->slots[i];
      const std::uint32_t state = s.state.load(std::memory_order_acquire);
      if (state != kSlotLive && state != kSlotReaping) continue;
      copy_slot(s, static_cast<int>(i), state, &scratch[slots++]);
    }
  });
  out->devices.resize(ok ? devices : 0);
  out->slots.assign(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(ok ? slots : 0));
  if (!ok) return false;
  raw.name[sizeof raw.name - 1] = '\0';  // a hostile writer may have removed the NUL since validation
  out->container_name = printable(raw.name, sizeof raw.name);
  out->created_ns = raw.created_ns;
  out->agent_heartbeat_ns = raw.heartbeat_ns;
  out->slots_reaped = raw.slots_reaped;
  out->priority = raw.priority;
  out->priority_held_ns = raw.priority_held_ns;
  out->priority_held_until_ns = raw.priority_held_until_ns;
  return true;
}

bool sm_unlimited(std::uint32_t sm_limit_pct) { return sm_limit_pct == 0 || sm_limit_pct >= 100; }

std::string format_bytes(std::uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int unit = 0;
  std::uint64_t whole = bytes, rest = 0;
  while (whole >= 1024 && unit < 6) {
    rest = whole % 1024;
    whole /= 1024;
    ++unit;
  }
  std::uint64_t tenth = (rest * 10 + 512) / 1024;
  if (tenth == 10) {
    ++whole;
    tenth = 0;
  }
  char text[48];
  if (tenth != 0) {
    std::snprintf(text, sizeof text, "%llu.%llu%s", static_cast<unsigned long long>(whole),
                  static_cast<unsigned long long>(tenth), kUnits[unit]);
  } else {
    std::snprintf(text, sizeof text, "%llu%s", static_cast<unsigned long long>(whole), kUnits[unit]);
  }
  return text;
}

std::string sm_policy_name(std::uint32_t policy) {
  switch (static_cast<SmPolicy>(policy)) {
    case SmPolicy::hard: return "hard";
    case SmPolicy::elastic: return "elastic";
  }
  return "policy-"s + std::to_string(policy);
}

}  // namespace gpuslice::agent
