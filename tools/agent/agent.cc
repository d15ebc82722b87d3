#include "agent.h"

#include <time.h>

#include <algorithm>

#include "limiter/memory_accounting.h"
#include "log.h"
#include "metrics.h"
#include "region_io.h"

using namespace std::string_literals;

namespace gpuslice::agent {
namespace {

std::uint64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(ts.tv_nsec);
}

// The reaper asks about each live slot: dead only if this cycle found its
// process dead, the slot still holds that same process, and the library's
// rule, given the slot's file lock, agrees (shm::judge_liveness: a child it
// forked that still holds the driver's files keeps its memory on the device).
struct DeadSlots {
  const Region* region;
  const std::vector<const SlotSample*>* dead;
};

bool slot_is_dead(const Slot& s, shm::SlotLock lock, void* ctx) {
  const auto* d = static_cast<const DeadSlots*>(ctx);
  const std::ptrdiff_t index = &s - d->region->slots;
  if (index < 0 || index >= static_cast<std::ptrdiff_t>(kMaxSlots)) return false;
  const SlotSample* sample = (*d->dead)[static_cast<std::size_t>(index)];
  if (sample == nullptr) return false;
  const ProcessKey& k = sample->key;
  if (s.pid.load() != k.pid || s.pidns_inode.load() != k.pidns_inode || s.start_time.load() != k.start_time)
    return false;
  return shm::judge_liveness(sample->res.facts, k.pidns_inode, k.start_time, lock) == shm::Liveness::dead;
}

std::vector<RegionRoot> region_roots(const AgentConfig& c) {
  std::vector<RegionRoot> roots{{c.region_dir, Layout::gpuslice}};
  if (!c.hami_root.empty()) {
    roots.push_back({c.hami_root + "/containers", Layout::hami_containers});
    roots.push_back({c.hami_root + "/claims", Layout::hami_claims});
  }
  return roots;
}

std::vector<std::string> root_dirs(const AgentConfig& c) {
  std::vector<std::string> dirs;
  for (const RegionRoot& r : region_roots(c)) dirs.push_back(r.dir);
  return dirs;
}

}  // namespace

Agent::Agent(AgentConfig config)
    : config_(std::move(config)),
      regions_(region_roots(config_), config_.max_regions),
      reconciler_(config_.bypass_tolerance_bytes, pidmap_.own_pidns()),
      tamper_(root_dirs(config_)),
      enforcer_(config_.enforce, config_.bypass_tolerance_bytes, config_.enforce_cycles),
      backstop_(config_.driver_backstop),
      dead_(kMaxSlots, nullptr) {
  shm::read_identity(0, &self_);
  pidmap_.set_unseen_grace_ns(config_.unseen_grace_ns);
  install_fault_guard();
}

Agent::~Agent() = default;

void Agent::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!config_.use_nvml) {
    log(LogLevel::info,
        "running without NVML (--no-nvml): reaping and metrics only; no utilisation feedback, "
        "no memory reconciliation");
    return;
  }
  std::string why;
  if (!nvml_.open(config_.nvml_library, &why)) {
    log(LogLevel::warn,
        "running without NVML (%s): reaping and metrics only; no utilisation feedback, no memory "
        "reconciliation",
        why.c_str());
    return;
  }
  log(LogLevel::info, "NVML loaded from %s: %zu device(s)", config_.nvml_library.c_str(), nvml_.device_count());
  stats_.nvml_available = true;
  stats_.nvml_devices = nvml_.device_count();
}

void Agent::cycle() { timed_cycle(nullptr, true); }

void Agent::cycle_with(const GpuSample* gpu) { timed_cycle(gpu, false); }

void Agent::note_counts() {
  std::lock_guard<std::mutex> lock(mu_);
  note_counts_locked();
}

void Agent::note_counts_locked() {
  for (auto& t : regions_.regions()) {
    t->counted_at_nvml_known = !t->dropped && note_counted(*t);
  }
}

void Agent::timed_cycle(const GpuSample* given, bool sample_nvml) {
  const std::uint64_t cpu0 = thread_cpu_ns();
  const std::uint64_t t0 = monotonic_ns();
  std::lock_guard<std::mutex> lock(mu_);
  const GpuSample* gpu = given;
  if (sample_nvml && nvml_.available()) {
    note_counts_locked();
    nvml_.sample(&gpu_);
    note_counts_locked();
    gpu = &gpu_;
  }
  run_cycle(gpu, t0);
  const std::uint64_t t1 = monotonic_ns();
  stats_.last_cycle_ns = t1 - t0;
  stats_.max_cycle_ns = std::max(stats_.max_cycle_ns, stats_.last_cycle_ns);
  stats_.last_cycle_cpu_ns = thread_cpu_ns() - cpu0;
  stats_.total_cycle_cpu_ns += stats_.last_cycle_cpu_ns;
  last_cycle_end_ns_.store(t1, std::memory_order_relaxed);
}

void Agent::run_cycle(const GpuSample* gpu, std::uint64_t now) {
  if (!rescanned_ || now - last_rescan_ns_ >= config_.rescan_ns) {
    regions_.rescan();
    rescanned_ = true;
    last_rescan_ns_ = now;
    if (config_.grace_ns != 0) {
      timespec wall{};
      clock_gettime(CLOCK_REALTIME, &wall);
      const std::uint64_t wall_ns =
          static_cast<std::uint64_t>(wall.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(wall.tv_nsec);
      stats_.board_files_removed += clean_priority_board(config_.priority_board, wall_ns, config_.grace_ns).removed;
    }
  }
  const bool verify = now - last_verify_ns_ >= config_.verify_ns;
  if (verify) last_verify_ns_ = now;

  // 1. Read every region (after the NVML sample: see Reconciler::write).
  reconciler_.begin(gpu, now);
  pidmap_.begin_cycle(now);
  active_.clear();
  for (auto& t : regions_.regions()) {
    if (t->dropped) continue;
    if (!read_region(*t, now)) {
      ++stats_.regions_dropped_truncated;
      regions_.drop(*t, "the file was truncated under us (SIGBUS); it is reopened if it becomes valid again");
      continue;
    }
    reconciler_.match_devices(t->sample);
    for (const SlotSample& s : t->sample.slots) pidmap_.want(s.key);
    active_.push_back(t.get());
  }

  // 2. Host pids and liveness of every registered process.
  pidmap_.resolve(now, verify);
  for (TrackedRegion* t : active_) {
    for (SlotSample& s : t->sample.slots) {
      s.res = pidmap_.get(s.key);
      if (s.key.pidns_inode == 0) {
        log_once(LogLevel::warn, "no-ns:"s + t->rel,
                 "region %s: process %u registered without its pid namespace (no /proc in the container?): the agent "
                 "cannot map or reap it",
                 t->rel.c_str(), s.key.pid);
      }
    }
  }

  // 3. Reconcile with NVML and write the results.
  reconciler_.compute(active_);
  for (TrackedRegion* t : active_) {
    if (!reconciler_.write(*t, now)) {
      ++stats_.regions_dropped_truncated;
      regions_.drop(*t, "the file was truncated under us (SIGBUS)");
    }
  }
  for (auto& t : regions_.regions()) t->counted_at_nvml_known = false;  // one cycle's
  // Limits the container rewrote are put back; a container over its quota is
  // reported or has a process killed (tamper.h, enforce.h).
  tamper_.run(active_, now);
  enforcer_.run(active_, reconciler_.unregistered(), gpu, now);

  // The driver's wall behind each quota (backstop.h); where there is none,
  // the agent is the backstop when it enforces (--enforce=kill).
  backstop_.cycle(active_, nvml_.available() ? &nvml_ : nullptr, config_.enforce == EnforceMode::kill, now);

  // 4. Reap dead processes' slots; remove regions unused for the grace period.
  for (TrackedRegion* t : active_) {
    if (t->dropped) continue;
    const int freed = reap(*t);
    const RegionSample& s = t->sample;
    const bool empty = s.busy_slots == 0 || (freed > 0 && s.busy_slots == static_cast<std::uint32_t>(freed));
    regions_.lifecycle(*t, empty, now, config_.grace_ns);
  }
  // Emptied pod directories: checked at once, then while still mounted every
  // --grace, between 1 s and 30 s (mounts.h reads every mount namespace).
  const std::uint64_t recheck = std::clamp<std::uint64_t>(config_.grace_ns, 1'000'000'000, 30'000'000'000);
  regions_.release_dirs(now, recheck);
  pidmap_.end_cycle();
  regions_.sweep();

  device_util_.clear();
  if (gpu != nullptr) {
    for (const GpuDevice& g : gpu->devices) {
      device_util_.push_back(
          {g.uuid_text, g.device_util_known ? g.device_util_pct : 0, static_cast<std::uint32_t>(g.processes.size())});
    }
  }
  ++stats_.cycles;
  stats_.regions = regions_.regions().size();
  stats_.invalid_files = regions_.invalid_files();
  stats_.regions_unwatched = regions_.unwatched();
  stats_.regions_max = regions_.max_regions();
  stats_.log_suppressed = regions_.log_suppressed();
  stats_.regions_removed = regions_.removed_total();
  stats_.pid_scans = pidmap_.full_scans();
  stats_.bypass_reports = reconciler_.counters().bypass_reports;
  stats_.unregistered_reports = reconciler_.counters().unregistered_reports;
  stats_.backstop_limits_set = backstop_.limits_set();
  stats_.backstop_limits_cleared = backstop_.limits_cleared();
  stats_.backstop_errors = backstop_.errors();
  stats_.enforce = enforcer_.counters();
  stats_.tamper = tamper_.counters();
}

bool Agent::read_region(TrackedRegion& t, std::uint64_t now) {
  const Region* r = t.map.get();
  std::uint32_t live = 0;
  auto header_live = [&] { return guarded([&] { live = r->header.live_slots.load(std::memory_order_acquire); }); };
  auto reread = [&] {
    if (!header_live() || !t.slots.reread(t.map.fd(), live, now, t.map.inode(), &slot_buffer_)) return false;
    ++stats_.slot_rereads;
    t.map.map_slots(t.slots.busy());
    return true;
  };
  // Before the region may be renamed away or unlinked (RegionSet::lifecycle),
  // its slots are read afresh: a process that just attached keeps it.
  const bool removal_due =
      t.removing || (config_.grace_ns != 0 && t.empty_since_ns != 0 && now - t.empty_since_ns >= config_.grace_ns);
  const bool fresh = t.slots.due(now) || removal_due;
  if (fresh && !reread()) return false;
  if (!header_live() || !read_sample(r, t.slots.busy(), &t.sample, &scratch_)) return false;
  if (fresh || !t.slots.stale(t.sample.busy_slots, live)) return true;
  // A claim or a release since the index was read: read it again now.
  return reread() && read_sample(r, t.slots.busy(), &t.sample, &scratch_);
}

int Agent::reap(TrackedRegion& t) {
  bool any = t.sample.reaping_slots != 0;  // a reaper died mid-way: finish its work
  for (const SlotSample& s : t.sample.slots) {
    if (s.res.fate == Fate::dead) {
      dead_[static_cast<std::size_t>(s.index)] = &s;
      any = true;
    }
  }
  if (!any) return 0;
  DeadSlots ctx{t.map.get(), &dead_};
  // Our own description of the region file shows the slots' file locks.
  const shm::Observer observer(self_, t.map.fd());
  int freed = 0;
  if (!guarded([&] { freed = limiter::reap_slots(t.map.get(), observer, slot_is_dead, &ctx); })) {
    ++stats_.regions_dropped_truncated;
    regions_.drop(t, "the file was truncated under us (SIGBUS)");
    freed = 0;
  }
  // The reaper walked every slot: give their pages back, and read the states
  // it changed afresh next cycle.
  t.map.release_slot_pages();
  t.slots.invalidate();
  for (const SlotSample& s : t.sample.slots) dead_[static_cast<std::size_t>(s.index)] = nullptr;
  if (freed > 0) {
    stats_.slots_reaped += static_cast<std::uint64_t>(freed);
    log(LogLevel::info, "region %s: reclaimed %d slot(s) of exited processes", t.rel.c_str(), freed);
  }
  return freed > 0 ? freed : 0;
}

std::string Agent::metrics_text() const {
  MetricsSnapshot snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    MetricsInput in;
    in.stats = stats_;
    in.basic = config_.metrics_basic;
    for (const auto& t : regions_.regions()) {
      if (!t->dropped) in.regions.push_back(t.get());
    }
    for (const DeviceUtil& d : device_util_) in.devices.push_back({d.uuid, d.util_pct, d.processes});
    in.enforce_kills = enforcer_.kills_by_region();
    in.tamper_repairs = tamper_.repairs_by_region();
    snapshot = read_metrics(in);
  }
  return render_metrics(std::move(snapshot));
}

bool Agent::healthy() const {
  const std::uint64_t last = last_cycle_end_ns_.load(std::memory_order_relaxed);
  if (last == 0) return false;
  const std::uint64_t limit = std::max<std::uint64_t>(3 * config_.interval_ns, 2'000'000'000);
  return monotonic_ns() - last <= limit;
}

AgentStats Agent::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace gpuslice::agent
