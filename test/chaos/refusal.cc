// The invariant monitor's refusal check (monitor.h: monitor_request_begin,
// monitor_request_end, monitor_release_begin/end, monitor_pools; README.md,
// "The invariant monitor"): a refusal of a request while the container holds
// no more than the limit less the request and the documented conservative
// transients is a violation.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>

#include <gpuslice/region.h>

#include "fakecuda_query.h"
#include "limiter/agent_extra.h"
#include "platform/procfs.h"
#include "monitor.h"
#include "monitor_internal.h"

namespace gpuslice::chaos {
using namespace internal;

namespace {

// The calling thread's request in flight (monitor_request_begin): its bytes,
// and the container's processes as they were at its start.
struct Member {
  int slot;
  std::uint32_t generation;
  std::uint64_t freed;
  std::uint64_t release_ended;
  std::uint64_t unknown_ended;
  std::uint64_t request_ended;
  std::uint64_t reclaimed_ended;
};
constexpr int kMembers = 64;
thread_local std::uint64_t t_request = 0;
thread_local std::uint32_t t_request_dev = 0;
thread_local std::uint64_t t_request_ns = 0;
thread_local int t_request_slot = -1;
thread_local std::uint64_t t_request_reclaimed = 0;  // uncharged inside this thread's request in flight
thread_local int t_members = -1;                     // -1: too many to record (not judged)
thread_local Member t_member[kMembers];
// gpuslice's slots whose process was mid-exit at the request's start (the
// zombie-leader rule: see exiting_bytes), and the agent's figure then.
struct Exiting {
  std::uint32_t slot;
  std::uint32_t pid;
};
constexpr int kExitingMax = 16;
thread_local int t_exiting = 0;
thread_local Exiting t_exiting_at[kExitingMax];
thread_local std::uint64_t t_agent_beat = 0;
thread_local std::uint64_t t_agent_extra = 0;

// The documented conservative transients that may stand between what the
// container holds and what gpuslice counts when it refuses (README.md, "The
// invariant monitor"; docs/memory-accounting.md, "Chaos testing"). State
// lock held. Returns false when the refusal cannot be judged.
struct Slack {
  std::uint64_t freed = 0;       // freed by the container since the request began
  std::uint64_t requesting = 0;  // other threads' requests overlapping this one (reserved, maybe not granted)
  std::uint64_t releasing = 0;   // frees in flight at the refusal or since its start (freed, maybe still counted)
  std::uint64_t pools = 0;       // 2 MiB per pool in use: counted up to one chunk above its reserve
  std::uint64_t agent = 0;       // agent_extra_bytes while the agent's heartbeat is fresh
  std::uint64_t absorbed = 0;    // outside memory measured into a live object (monitor_absorbed)
  std::uint64_t reclaimed = 0;   // trimmed by the driver inside other requests overlapping this one
  std::uint64_t exiting = 0;     // counted for processes mid-exit or being reaped (exiting_bytes)
  std::uint64_t total() const {
    return freed + requesting + releasing + pools + agent + absorbed + reclaimed + exiting;
  }
};

// What gpuslice still counts for processes of the container that are mid-exit
// with their files closed: the leader a zombie while other threads of it
// still exit (a SIGKILL in progress), its slot's lock released, so the driver
// freed its memory at the last close. shm::judge_liveness keeps such a
// process alive (the zombie-leader rule: the lock's release cannot prove the
// device memory gone, docs/memory-accounting.md, "Reaping"), so its count
// stays until its last thread is gone: bounded by the rest of its exit.
// And what gpuslice counts for a slot being reaped (kSlotReaping: judged
// dead, its count not yet taken out of used_bytes): a refusal waits for
// another reaper at most 20 ms (limiter::wait_for_reaper), and a reap whose
// snapshot does not settle (allocations of the container's other processes
// meanwhile) leaves its slots so for the next reaper to finish; bounded by
// that reap (the agent's next cycle, the container's next refusal).
// A process the simulator still finds alive (its lock held: a pthread_exit
// in main) is in what the container holds, not here. State lock held.
// The judgement comes after the refusal: a process mid-exit at the request's
// start (t_exiting_at) whose exit ended before the judgement may have been
// mid-exit when gpuslice refused, so its slot, still counted, is here too;
// one already dead at the start is not (gpuslice reaps before it refuses).
bool held_by_simulator(std::uint32_t pid, std::uint32_t dev) {
  const int high = fakecuda_slots_high_locked();
  for (int i = 0; i < high; ++i) {
    fakecuda_slot_info info{};
    if (member_alive(i, dev, &info) && info.pid == pid) return true;  // its lock still held
  }
  return false;
}
// Mid-exit (platform::procfs::in_exit): a zombie leader whose other threads
// still exit, or a leader not yet a zombie that runs its exit (a SIGKILL's
// exit after its files closed; docs/log/2026-11-29-ci-flake.md).
bool mid_exit(std::uint32_t pid) {
  platform::procfs::Stat st;
  return platform::procfs::read_stat(pid, &st) == 0 && platform::procfs::in_exit(st);
}
bool was_mid_exit(std::uint32_t s, std::uint32_t pid) {
  for (int k = 0; k < t_exiting; ++k) {
    if (t_exiting_at[k].slot == s && t_exiting_at[k].pid == pid) return true;
  }
  return false;
}
std::uint64_t exiting_bytes(const Region& r, std::uint32_t dev, int rd) {
  std::uint64_t sum = 0;
  for (std::uint32_t s = 0; s < kMaxSlots; ++s) {
    const Slot& slot = r.slots[s];
    const std::uint32_t state = slot.state.load(std::memory_order_acquire);
    if (state != kSlotLive && state != kSlotReaping) continue;
    const std::uint32_t pid = slot.pid.load(std::memory_order_relaxed);
    if (pid == 0) continue;
    if (state == kSlotLive && !mid_exit(pid) && !was_mid_exit(s, pid)) continue;
    if (!held_by_simulator(pid, dev)) sum += slot.committed_bytes[rd].load(std::memory_order_relaxed);
  }
  return sum;
}
// At the request's start (state lock held): gpuslice's live slots whose
// process is mid-exit, and not held by the simulator.
void note_exiting(const Region& r, std::uint32_t dev) {
  t_exiting = 0;
  for (std::uint32_t s = 0; s < kMaxSlots && t_exiting < kExitingMax; ++s) {
    const Slot& slot = r.slots[s];
    if (slot.state.load(std::memory_order_acquire) != kSlotLive) continue;
    const std::uint32_t pid = slot.pid.load(std::memory_order_relaxed);
    if (pid == 0 || held_by_simulator(pid, dev) || !mid_exit(pid)) continue;
    t_exiting_at[t_exiting++] = {s, pid};
  }
}
// The agent's figure in force (limiter/agent_extra.h) and its heartbeat.
std::uint64_t fresh_extra(const Region& r, const DeviceState& d, std::uint64_t* beat) {
  *beat = r.header.agent_heartbeat_ns.load(std::memory_order_acquire);
  const std::uint64_t now = fakecuda_now_ns();
  // Fresh: written within the bound the library keeps an agent's extra in
  // force after its last cycle: a SIGKILLed agent's figure is a documented
  // transient for that long, and no longer. A heartbeat of 0 (no agent ever
  // wrote one) is never fresh here.
  if (*beat != 0 && now >= *beat && now - *beat <= limiter::kAgentExtraHoldNs)
    return d.agent_extra_bytes.load(std::memory_order_acquire);
  return 0;
}
bool refusal_slack(std::uint32_t dev, const DeviceState& d, const Region& r, Slack* out, const char** why) {
  for (int k = 0; k < t_members; ++k) {
    fakecuda_slot_info slot{};
    if (!member_alive(t_member[k].slot, dev, &slot) || slot.generation != t_member[k].generation) {
      *why = "a process of the container ended during the request";  // its memory left unseen
      return false;
    }
  }
  const int high = fakecuda_slots_high_locked();
  for (int i = 0; i < high; ++i) {
    fakecuda_slot_info slot{};
    if (!member_alive(i, dev, &slot)) continue;
    std::uint64_t freed = g_shared->freed[i][dev].load(std::memory_order_relaxed);
    // Frees overlapping the request: begun by now, not ended at its start.
    std::uint64_t releasing = g_shared->release_begun[i][dev].load(std::memory_order_relaxed);
    std::uint64_t unknown = g_shared->unknown_begun[i].load(std::memory_order_relaxed);
    // Requests overlapping this one: begun by now, not ended at its start
    // (this one is begun and not ended: taken out below).
    std::uint64_t requesting = g_shared->request_begun[i][dev].load(std::memory_order_relaxed);
    // Trims inside requests overlapping this one, as requests (this one's own
    // reclaim lowered its count before it refused: taken out below).
    std::uint64_t reclaimed = g_shared->reclaimed_begun[i][dev].load(std::memory_order_relaxed);
    for (int k = 0; k < t_members; ++k) {
      if (t_member[k].slot == i) {
        freed -= t_member[k].freed;
        releasing -= t_member[k].release_ended;
        unknown -= t_member[k].unknown_ended;
        requesting -= t_member[k].request_ended;
        reclaimed -= t_member[k].reclaimed_ended;
      }
    }
    if (i == g_slot) requesting -= t_request;
    if (i == g_slot) reclaimed -= t_request_reclaimed;
    if (unknown != 0) {
      *why = "a free of unknown size (arrays, contexts, modules) ran during the request";
      return false;
    }
    out->freed += freed;
    out->releasing += releasing;
    out->requesting += requesting;
    out->pools += std::uint64_t{g_shared->pools[i].load(std::memory_order_relaxed)} << 21;
    out->absorbed += g_shared->absorbed[i][dev].load(std::memory_order_relaxed);
    out->reclaimed += reclaimed;
  }
  out->exiting = exiting_bytes(r, dev, static_cast<int>(&d - r.devices));
  // The agent's figure gpuslice refused under: the one in force at the
  // request's start, or one its cycle then in progress wrote since (an agent
  // writes each device's extra once a cycle, after the heartbeat). A cycle
  // begun during the request may have written a figure that its next one
  // replaced before this judgement: not judged.
  std::uint64_t beat = 0;
  const std::uint64_t now_extra = fresh_extra(r, d, &beat);
  if (beat != t_agent_beat) {
    *why = "an agent cycle began during the request";
    return false;
  }
  out->agent = now_extra > t_agent_extra ? now_extra : t_agent_extra;
  return true;
}

}  // namespace

void monitor_pools(unsigned count) {
  if (g_config.on && g_slot >= 0) g_shared->pools[g_slot].store(count, std::memory_order_relaxed);
}

void internal::note_uncharge(unsigned dev, std::uint64_t bytes) {
  if (t_request == 0 || t_request_slot != g_slot || dev != t_request_dev) return;
  t_request_reclaimed += bytes;
  g_shared->reclaimed_begun[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);
}

void monitor_absorbed(unsigned dev, std::uint64_t bytes) {
  if (g_config.on && g_slot >= 0 && dev < g_devices)
    g_shared->absorbed[g_slot][dev].store(bytes, std::memory_order_relaxed);
}

thread_local std::uint64_t t_release = 0;
thread_local bool t_release_on = false;
thread_local std::uint32_t t_release_dev = 0;
thread_local int t_release_slot = -1;

void monitor_release_begin(unsigned dev, std::uint64_t bytes) {
  t_release_on = false;
  if (!g_config.on || g_slot < 0 || dev >= g_devices) return;
  t_release_on = true;
  t_release = bytes;
  t_release_dev = dev;
  t_release_slot = g_slot;
  // Unknown size (0): a refusal whose request overlaps it is not judged (the
  // count stays above the device by an amount the monitor cannot bound).
  if (bytes == 0) {
    g_shared->unknown_begun[g_slot].fetch_add(1, std::memory_order_release);
  } else {
    g_shared->release_begun[g_slot][dev].fetch_add(bytes, std::memory_order_release);
  }
}

void monitor_release_end() {
  if (!t_release_on || t_release_slot != g_slot) return void(t_release_on = false);
  t_release_on = false;
  if (t_release == 0) {
    g_shared->unknown_ended[g_slot].fetch_add(1, std::memory_order_release);
  } else {
    g_shared->release_ended[g_slot][t_release_dev].fetch_add(t_release, std::memory_order_release);
  }
}

void monitor_request_begin(unsigned dev, std::uint64_t bytes) {
  t_request = 0;
  if (!g_config.on || g_slot < 0 || dev >= g_devices || fakecuda_state_lock() == 0) return;
  t_members = 0;
  const int high = fakecuda_slots_high_locked();
  for (int i = 0; i < high; ++i) {
    fakecuda_slot_info slot{};
    if (!member_alive(i, dev, &slot)) continue;
    if (t_members == kMembers) {
      t_members = -1;
      break;
    }
    t_member[t_members++] = {i,
                             slot.generation,
                             g_shared->freed[i][dev].load(std::memory_order_relaxed),
                             g_shared->release_ended[i][dev].load(std::memory_order_relaxed),
                             g_shared->unknown_ended[i].load(std::memory_order_relaxed),
                             g_shared->request_ended[i][dev].load(std::memory_order_relaxed),
                             g_shared->reclaimed_ended[i][dev].load(std::memory_order_relaxed)};
  }
  t_exiting = 0;
  t_agent_beat = t_agent_extra = 0;
  if (const Region* r = region(); r != nullptr) {
    note_exiting(*r, dev);
    if (const int rd = region_device(dev, *r); rd >= 0) t_agent_extra = fresh_extra(*r, r->devices[rd], &t_agent_beat);
  }
  fakecuda_state_unlock();
  t_request = bytes;
  t_request_reclaimed = 0;
  t_request_dev = dev;
  t_request_slot = g_slot;
  t_request_ns = fakecuda_now_ns();
  g_shared->requesting[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);
  g_shared->request_begun[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);
}

int monitor_request_end(bool refused, const char* what) {
  if (t_request == 0 || t_request_slot != g_slot) return t_request = 0, 0;  // a forked child's copy: not its own
  const std::uint64_t bytes = t_request;
  const std::uint32_t dev = t_request_dev;
  g_shared->requesting[g_slot][dev].fetch_sub(bytes, std::memory_order_relaxed);
  struct Ended {  // after the judgement: t_request is this request's own share of request_begun
    std::uint64_t bytes;
    std::uint32_t dev;
    ~Ended() {
      t_request = 0;
      if (g_slot >= 0) g_shared->request_ended[g_slot][dev].fetch_add(bytes, std::memory_order_relaxed);
      if (g_slot >= 0 && t_request_reclaimed != 0)
        g_shared->reclaimed_ended[g_slot][dev].fetch_add(t_request_reclaimed, std::memory_order_relaxed);
      t_request_reclaimed = 0;
    }
  } ended{bytes, dev};
  if (!refused) return 0;
  if (!g_config.judge_refusals || t_members < 0 || fakecuda_state_lock() == 0) {
    g_shared->refusals_skipped.fetch_add(1, std::memory_order_relaxed);
    return 0;
  }
  struct Unlock {
    ~Unlock() { fakecuda_state_unlock(); }
  } unlock;
  const gpuslice::Region* r = region();
  const int rd = r != nullptr ? region_device(dev, *r) : -1;
  if (rd < 0) return 0;
  const DeviceState& d = r->devices[rd];
  std::uint64_t own = 0;
  const std::uint64_t total = container_total(dev, &own);
  std::uint64_t limit = d.quota_bytes.load(std::memory_order_acquire);
  std::uint64_t held = total;
  if (g_config.spill) {
    // The quota bounds device and spilled memory; the allowance only what is resident.
    const std::uint64_t in = d.spilled_in_bytes.load(std::memory_order_acquire);
    const std::uint64_t out = d.spilled_out_bytes.load(std::memory_order_acquire);
    held += in > out ? in - out : 0;
  } else {
    const std::uint64_t resident = d.resident_limit_bytes.load(std::memory_order_acquire);
    if (resident != 0 && resident < limit) limit = resident;
    if (g_config.resident_env < limit) limit = g_config.resident_env;
  }
  Watch* w = watch_for(dev, limit, total);
  const std::uint64_t now = fakecuda_now_ns();
  if (w == nullptr || limit == kUnlimited) return 0;
  note_limit(*w, limit, now);
  // A limit changed (gpuslice-smi set) shortly before or during the request:
  // the library may have judged it under the other one.
  const char* why = nullptr;
  Slack slack;
  if (w->grace_until_ns.load(std::memory_order_relaxed) >= t_request_ns) why = "the limit changed";
  if (why == nullptr) refusal_slack(dev, d, *r, &slack, &why);
  if (why != nullptr) {
    g_shared->refusals_skipped.fetch_add(1, std::memory_order_relaxed);
    return 0;
  }
  g_shared->refusals_judged.fetch_add(1, std::memory_order_relaxed);
  if (held + bytes + slack.total() > limit) return 0;
  // What gpuslice counts that the device does not hold, beyond the slack:
  // the bytes that made the difference (thread reserves, spare not taken...).
  const std::uint64_t count = resident_count(d) + (g_config.spill ? held - total : 0);
  const std::uint64_t beyond = count > held + slack.total() ? count - held - slack.total() : 0;
  char detail[896];
  std::snprintf(detail, sizeof(detail),
                "%s of %llu bytes refused (CUDA_ERROR_OUT_OF_MEMORY) while the container holds %llu: %llu + %llu + "
                "documented slack %llu (freed during the request %llu, other requests overlapping it %llu, frees in "
                "flight %llu, pools %llu, trimmed inside other requests %llu, outside memory measured into live "
                "objects %llu, counted for processes mid-exit %llu, fresh agent_extra_bytes %llu) <= limit %llu; "
                "gpuslice counts %llu bytes the device "
                "does not hold beyond that slack",
                what, static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(held),
                static_cast<unsigned long long>(held), static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(slack.total()), static_cast<unsigned long long>(slack.freed),
                static_cast<unsigned long long>(slack.requesting), static_cast<unsigned long long>(slack.releasing),
                static_cast<unsigned long long>(slack.pools), static_cast<unsigned long long>(slack.reclaimed),
                static_cast<unsigned long long>(slack.absorbed), static_cast<unsigned long long>(slack.exiting),
                static_cast<unsigned long long>(slack.agent), static_cast<unsigned long long>(limit),
                static_cast<unsigned long long>(beyond));
  Grant grant{bytes, false, false, what};
  report("refusal", detail, dev, rd, total, own, limit, d, &grant);
  return 1;
}

}  // namespace gpuslice::chaos
