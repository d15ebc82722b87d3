#include "reconcile.h"

#include <algorithm>
#include <cstring>

#include "limiter/agent_extra.h"
#include "limiter/compute_samples.h"
#include "log.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "limiter/shared_allocs.h"
#include "shm/region_file.h"
#include "view.h"

using namespace std::string_literals;

namespace gpuslice::agent {

bool read_sample(const Region* r, const std::vector<std::uint16_t>& slot_list, RegionSample* out,
                 std::vector<SlotSample>* scratch) {
  // Sized before the guard: nothing allocates inside it. Slots go through the
  // shared scratch buffer so that each region keeps only its live ones.
  out->devices.resize(kMaxDevices);
  scratch->resize(kMaxSlots);
  std::size_t devices = 0, slots = 0;
  std::uint32_t busy = 0, reaping = 0, live = 0;
  std::uint32_t published = 0;  // bit mask of published entries
  const bool ok = guarded([&] {
    std::memcpy(out->container_name, r->header.container_name, sizeof out->container_name);
    for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
      const DeviceState& d = r->devices[i];
      if (d.uuid_state.load(std::memory_order_acquire) != shm::kDevicePublished) continue;
      DeviceSample& ds = out->devices[devices++];
      ds.index = static_cast<int>(i);
      std::memcpy(ds.uuid, d.uuid, sizeof ds.uuid);
      ds.used_bytes = d.used_bytes.load(std::memory_order_relaxed);
      ds.agent_extra_bytes = d.agent_extra_bytes.load(std::memory_order_relaxed);
      ds.gpu = -1;
      published |= 1u << i;
    }
    for (const std::uint32_t i : slot_list) {
      const Slot& s = r->slots[i % kMaxSlots];
      const std::uint32_t state = s.state.load(std::memory_order_acquire);
      if (state == kSlotFree) continue;
      ++busy;
      if (state == kSlotReaping) ++reaping;
      if (state == kSlotLive) ++live;
      const std::uint64_t start_time = s.start_time.load(std::memory_order_relaxed);
      // A claimer that has not written its start time yet is not judged.
      if (state != kSlotLive && !(state == kSlotClaiming && start_time != 0)) continue;
      SlotSample& ss = (*scratch)[slots++];
      ss.index = static_cast<int>(i);
      ss.key.pid = s.pid.load(std::memory_order_relaxed);
      ss.key.pidns_inode = s.pidns_inode.load(std::memory_order_relaxed);
      ss.key.start_time = start_time;
      ss.recorded_host_pid = s.host_pid.load(std::memory_order_relaxed);
      ss.res = Resolution{};
      for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
        const bool on = (published >> d) & 1u;
        // What the process holds in use: its spare quota lease and bytes a
        // thief took back are counted but not allocated (limiter/lease.h).
        const std::uint64_t lease = s.lease[d].word.load(std::memory_order_relaxed);
        const std::uint64_t committed = s.committed_bytes[d].load(std::memory_order_relaxed);
        const std::uint64_t not_used = limiter::lease_spare(lease) + limiter::lease_owed(lease);
        ss.committed_bytes[d] = on && committed > not_used ? committed - not_used : 0;
        // Shared allocations it holds are counted in no slot; NVML may show them as its own.
        if (on) ss.committed_bytes[d] += limiter::shared_held_bytes(r, static_cast<int>(i), static_cast<int>(d));
        ss.nvml_used_bytes[d] = on ? s.nvml_used_bytes[d].load(std::memory_order_relaxed) : 0;
        ss.nvml_now_bytes[d] = 0;
      }
    }
  });
  out->devices.resize(ok ? devices : 0);
  out->slots.assign(scratch->begin(), scratch->begin() + static_cast<std::ptrdiff_t>(ok ? slots : 0));
  out->busy_slots = busy;
  out->reaping_slots = reaping;
  out->live_slots = live;
  out->container_name[sizeof out->container_name - 1] = '\0';
  return ok;
}

// What the container's calls hold by its count: spare quota leases are
// counted but not allocated, so they must not hide memory NVML sees.
static std::uint64_t counted_net(const Region* r, int dev) {
  const std::uint64_t counted = r->devices[dev].used_bytes.load(std::memory_order_relaxed);
  const std::uint64_t spare = limiter::spare_lease_bytes(r, dev);
  return counted > spare ? counted - spare : 0;
}

bool note_counted(TrackedRegion& t) {
  const Region* r = t.map.get();
  if (r == nullptr) return false;
  return guarded([&] {
    for (std::uint32_t i = 0; i < kMaxDevices; ++i) {
      const std::uint64_t now = r->devices[i].uuid_state.load(std::memory_order_acquire) == shm::kDevicePublished
                                    ? counted_net(r, static_cast<int>(i))
                                    : 0;
      t.counted_at_nvml[i] = t.counted_at_nvml_known ? std::max(t.counted_at_nvml[i], now) : now;
    }
  });
}

Reconciler::Reconciler(std::uint64_t bypass_tolerance_bytes, std::uint64_t own_pidns)
    : tolerance_(bypass_tolerance_bytes), own_pidns_(own_pidns) {}

void Reconciler::begin(const GpuSample* gpu, std::uint64_t now_ns) {
  gpu_ = gpu;
  now_ns_ = now_ns;
  claimed_.clear();
  unregistered_.clear();
  const std::size_t n = gpu != nullptr ? gpu->devices.size() : 0;
  procs_.resize(n);
  for (std::size_t g = 0; g < n; ++g) {
    auto& m = procs_[g];
    m.clear();
    for (const GpuProcess& p : gpu->devices[g].processes) {
      GpuProc& e = m[p.host_pid];  // one pid may be listed more than once (MIG instances): add up
      e.used_bytes += p.used_bytes;
      e.used_known = p.used_known;
      e.graphics = e.graphics || p.graphics;
    }
  }
}

void Reconciler::match_devices(RegionSample& s) const {
  if (gpu_ == nullptr) return;
  for (DeviceSample& d : s.devices) {
    d.gpu = -1;
    for (std::size_t g = 0; g < gpu_->devices.size(); ++g) {
      if (std::memcmp(gpu_->devices[g].uuid, d.uuid, sizeof d.uuid) == 0) {
        d.gpu = static_cast<int>(g);
        break;
      }
    }
  }
}

bool Reconciler::report(const std::string& key) {
  auto [it, inserted] = reported_.try_emplace(key, now_ns_);
  it->second = now_ns_;
  return inserted;
}

void Reconciler::compute(const std::vector<TrackedRegion*>& regions) {
  // pid namespace -> the one region whose processes live in it (nullptr when
  // several do: a pod sharing its namespace between containers; then an
  // unregistered process cannot be attributed).
  std::unordered_map<std::uint64_t, TrackedRegion*> by_ns;
  for (TrackedRegion* t : regions) {
    compute_region(*t);
    for (const SlotSample& s : t->sample.slots) {
      if (s.res.fate != Fate::alive || s.key.pidns_inode == 0) continue;
      auto [it, inserted] = by_ns.try_emplace(s.key.pidns_inode, t);
      if (!inserted && it->second != t) it->second = nullptr;
    }
  }
  if (gpu_ != nullptr) attribute_unregistered(by_ns);
  for (TrackedRegion* t : regions) {
    for (const DeviceSample& d : t->sample.devices) {
      DeviceStats& st = t->sample.stats[d.index];
      // The library's rounding rule (its own NVML source publishes alike).
      if (gpu_ != nullptr && d.gpu >= 0)
        st.util_permille = limiter::share_permille(st.util_busy_ns, gpu_->devices[d.gpu].util_window_ns);
    }
  }
  // Forget reports whose condition was not confirmed this cycle.
  for (auto it = reported_.begin(); it != reported_.end();) {
    it = it->second != now_ns_ ? reported_.erase(it) : std::next(it);
  }
}

void Reconciler::compute_region(TrackedRegion& t) {
  RegionSample& rs = t.sample;
  for (const DeviceSample& d : rs.devices) rs.stats[d.index] = DeviceStats{};
  for (SlotSample& s : rs.slots) {
    if (s.res.fate == Fate::alive && s.res.host_pid != 0) claimed_.insert(s.res.host_pid);
  }
  if (gpu_ == nullptr) return;
  for (const DeviceSample& d : rs.devices) {
    if (d.gpu < 0) continue;
    const GpuDevice& g = gpu_->devices[d.gpu];
    DeviceStats& st = rs.stats[d.index];
    st.nvml_known = g.processes_known;
    const auto& procs = procs_[d.gpu];
    for (SlotSample& s : rs.slots) {
      if (s.res.fate != Fate::alive || s.res.host_pid == 0) continue;
      if (g.util_known) {
        st.util_busy_ns += g.busy_ns_of(s.res.host_pid);
      }
      auto p = procs.find(s.res.host_pid);
      if (p == procs.end() || !p->second.used_known) continue;
      const std::uint64_t used = p->second.used_bytes;
      s.nvml_now_bytes[d.index] = used;
      st.nvml_bytes += used;
      const std::uint64_t accounted = s.committed_bytes[d.index];
      // A graphics API's memory (interop) is on the device with no CUDA call:
      // counted (agent_extra_bytes, below), never called a bypass.
      if (used > accounted && used - accounted > tolerance_ && !p->second.graphics) {
        ++st.suspected;
        const std::string key = "bypass:"s + t.rel + ":" + std::to_string(s.res.host_pid) + ":" +
                                std::to_string(s.key.start_time) + ":" + std::to_string(d.index);
        if (report(key)) {
          ++counters_.bypass_reports;
          log(LogLevel::warn,
              "container \"%s\" (region %s): process %u (host pid %u) holds %s on %s according to NVML but "
              "accounted for %s (tolerance %s): device memory allocated outside gpuslice (possible bypass)",
              printable(rs.container_name, sizeof rs.container_name).c_str(), t.rel.c_str(), s.key.pid, s.res.host_pid,
              format_bytes(used).c_str(), g.uuid_text.c_str(), format_bytes(accounted).c_str(),
              format_bytes(tolerance_).c_str());
        }
      }
    }
  }
}

void Reconciler::attribute_unregistered(const std::unordered_map<std::uint64_t, TrackedRegion*>& by_ns) {
  constexpr std::uint64_t kRecheckNs = 1'000'000'000;  // pid reuse: look again every second
  for (std::size_t g = 0; g < gpu_->devices.size(); ++g) {
    const GpuDevice& gpu = gpu_->devices[g];
    for (const auto& [host_pid, proc] : procs_[g]) {
      if (claimed_.count(host_pid) != 0) continue;
      auto [it, inserted] = ns_cache_.try_emplace(host_pid);
      NsCache& c = it->second;
      if (inserted || now_ns_ - c.checked_ns >= kRecheckNs) {
        ProcInfo info;
        c = read_proc_info(host_pid, false, &info)
                ? NsCache{info.facts.pidns_inode, info.facts.stat.start_time, now_ns_}
                : NsCache{0, 0, now_ns_};
      }
      // Our own (or the initial) namespace holds every process of the node
      // that is not in a container: nothing to attribute it to.
      if (c.pidns_inode == 0 || c.pidns_inode == own_pidns_ || c.pidns_inode == kInitPidNamespace) continue;
      auto owner = by_ns.find(c.pidns_inode);
      if (owner == by_ns.end() || owner->second == nullptr) continue;
      TrackedRegion& t = *owner->second;
      RegionSample& rs = t.sample;
      const DeviceSample* entry = nullptr;
      for (const DeviceSample& d : rs.devices) {
        if (d.gpu == static_cast<int>(g)) entry = &d;
      }
      const std::uint64_t used = proc.used_known ? proc.used_bytes : 0;
      if (entry != nullptr) {
        DeviceStats& st = rs.stats[entry->index];
        st.nvml_bytes += used;
        unregistered_.push_back({&t, static_cast<int>(g), host_pid, c.start_time, c.pidns_inode, used});
        ++st.unregistered;
        if (gpu.util_known) {
          st.util_busy_ns += gpu.busy_ns_of(host_pid);
        }
      }
      const std::string key = "unregistered:"s + t.rel + ":" + std::to_string(host_pid) + ":" +
                              std::to_string(c.start_time) + ":" + std::to_string(g);
      if (report(key)) {
        ++counters_.unregistered_reports;
        log(LogLevel::warn,
            "container \"%s\" (region %s): host pid %u of its pid namespace holds %s on %s without gpuslice "
            "(LD_PRELOAD removed, a static binary, raw ioctls?); %s",
            printable(rs.container_name, sizeof rs.container_name).c_str(), t.rel.c_str(), host_pid,
            format_bytes(used).c_str(), gpu.uuid_text.c_str(),
            entry != nullptr ? "counted against the container's quota"
                             : "the container has no quota entry for this device, so it is only reported");
      }
    }
  }
  for (auto it = ns_cache_.begin(); it != ns_cache_.end();) {
    it = now_ns_ - it->second.checked_ns > 10 * kRecheckNs ? ns_cache_.erase(it) : std::next(it);
  }
}

bool Reconciler::write(TrackedRegion& t, std::uint64_t now_ns) const {
  Region* r = t.map.get();
  const RegionSample& rs = t.sample;
  const bool have_nvml = gpu_ != nullptr;
  return guarded([&] {
    // The extra found was in force only if the agent that wrote it was still
    // beating (limiter/agent_extra.h): after a dead or stalled agent the
    // library admitted without it, so the same value is "more" again.
    const bool found_in_force =
        limiter::agent_extra_fresh(r->header.agent_heartbeat_ns.load(std::memory_order_relaxed), now_ns);
    // Before any extra: the library judges an extra by this heartbeat.
    r->header.agent_heartbeat_ns.store(now_ns, std::memory_order_relaxed);
    for (const SlotSample& s : rs.slots) {
      Slot& slot = r->slots[s.index];
      // The slot may have changed hands since we read it: only write to the
      // same process. (Stores only on change: the slot's first cache line
      // also holds the owner's seqlock word.)
      if (slot.pid.load(std::memory_order_relaxed) != s.key.pid ||
          slot.start_time.load(std::memory_order_relaxed) != s.key.start_time) {
        continue;
      }
      const std::uint32_t host = s.res.fate == Fate::alive ? s.res.host_pid : 0;
      if (host != s.recorded_host_pid) slot.host_pid.store(host, std::memory_order_relaxed);
      for (const DeviceSample& d : rs.devices) {
        if (d.gpu < 0 || !rs.stats[d.index].nvml_known) continue;
        if (s.nvml_now_bytes[d.index] != s.nvml_used_bytes[d.index]) {
          slot.nvml_used_bytes[d.index].store(s.nvml_now_bytes[d.index], std::memory_order_relaxed);
        }
      }
    }
    for (const DeviceSample& d : rs.devices) {
      DeviceState& dev = r->devices[d.index];
      const DeviceStats& st = rs.stats[d.index];
      if (!have_nvml) {
        // Nobody refreshes it without NVML: a stale value must not shrink the quota forever.
        if (d.agent_extra_bytes != 0) dev.agent_extra_bytes.store(0, std::memory_order_relaxed);
        continue;
      }
      if (d.gpu < 0) continue;
      const GpuDevice& g = gpu_->devices[d.gpu];
      if (st.nvml_known) {
        // The count around the NVML sample: the largest of the reads just
        // before and just after it (note_counted) and of this one. Anything
        // NVML saw that gpuslice counts before allocating is in the reads
        // after; memory counted only once measured after the driver call (a
        // context, a module) is in this late read more often. A free (driver
        // first, count after) ending after the sample is in NVML's figure but
        // may be gone from the reads after: the read before keeps it (a free
        // whose count part ended before that read had its driver part before
        // the sample, so NVML does not show it either). The price: a bypass
        // is undercounted, for one cycle, by at most what the container
        // freed since the sample began, or allocated since it ended.
        std::uint64_t used = counted_net(r, d.index);
        if (t.counted_at_nvml_known) used = std::max(used, t.counted_at_nvml[d.index]);
        const std::uint64_t extra = st.nvml_bytes > used ? st.nvml_bytes - used : 0;
        if (extra != d.agent_extra_bytes) dev.agent_extra_bytes.store(extra, std::memory_order_release);
        // Less left to admit: spare leases admitted before must not be spent past it.
        if (extra > (found_in_force ? d.agent_extra_bytes : 0)) limiter::invalidate_leases(r, d.index);
      }
      if (g.util_known) {
        dev.util_permille.store(st.util_permille, std::memory_order_relaxed);
        if (g.device_util_known) {
          dev.device_util_permille.store(g.device_util_permille, std::memory_order_relaxed);
        }
        // The end of NVML's window, not the start of our cycle: the limiter
        // and the tests line the samples up with the device timeline.
        dev.util_updated_ns.store(g.util_sampled_ns != 0 ? g.util_sampled_ns : now_ns, std::memory_order_release);
      }
    }
  });
}

}  // namespace gpuslice::agent
