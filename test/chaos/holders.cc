// The violation report's processes (monitor_internal.h: append_processes):
// who holds what the count misses. A count check reads what each process of
// the container holds (container_total, under the state lock); its report
// comes later, and a free (the driver's uncharge: no lock) may land in
// between, so the report prints both: what the check read (g_seen) and what
// it reads now. Per process: gpuslice's slot with its pid (in any state: a
// slot the library or the agent reaped, or one its own exit released, is
// gone, its pid cleared), the kernel's view (/proc/<pid>/stat: state,
// threads, PF_EXITING, read as shm::judge_liveness reads it), and whether
// the region's ring of departed processes records its exit. Then the
// holders the count misses, by name: a process the check counted with no
// live gpuslice slot, or holding more than its slot counts (spilled bytes
// left out) and its excuses (issue 32, seed 1,086,451: 14 MiB on the device
// beyond every live slot listed, its holder unnamed). With none named, the
// count (used_bytes) may stand below what the live slots themselves count:
// bytes out of used_bytes before (or without) leaving a slot, or a slot's
// release landing between the check's reads of it and of the count (seeds
// 2,100,015 and 2,100,342: 16 and 15 MiB, every process within its slot).
// The report then says by how much, and every member writes its operations.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <gpuslice/region.h>

#include "fakecuda_query.h"
#include "limiter/lease.h"
#include "monitor_internal.h"
#include "platform/procfs.h"

namespace gpuslice::chaos::internal {

Seen g_seen[kSimSlots];
std::uint64_t g_seen_serial = 0;
std::uint64_t g_seen_report = 0;

namespace {
int g_region_slot[kSimSlots];  // simulator slot -> its process's region slot + 1 (0: not looked up)
}  // namespace

long long slot_counted(std::uint32_t sim_slot, std::uint32_t pid, int rd, std::uint64_t* word) {
  *word = 0;
  const Region* r = region();
  if (r == nullptr || rd < 0 || sim_slot >= kSimSlots) return -1;
  const auto is_live = [&](std::uint32_t k) {
    return r->slots[k].state.load(std::memory_order_acquire) == kSlotLive &&
           r->slots[k].pid.load(std::memory_order_acquire) == pid;
  };
  int k = g_region_slot[sim_slot] - 1;
  if (k < 0 || !is_live(static_cast<std::uint32_t>(k))) {
    k = -1;
    for (std::uint32_t j = 0; j < kMaxSlots && k < 0; ++j) {
      if (is_live(j)) k = static_cast<int>(j);
    }
    g_region_slot[sim_slot] = k + 1;
    if (k < 0) return -1;
  }
  // For released_excused: the slot whose file lock stands for this process (calls.cc).
  g_shared->region_slot_pid[sim_slot].store(pid, std::memory_order_relaxed);
  g_shared->region_slot_plus1[sim_slot].store(static_cast<std::uint32_t>(k) + 1, std::memory_order_relaxed);
  // Its share of used_bytes is committed less what a thief took back (OWED,
  // limiter/lease.h), as the reaper reads it; of that, spilled bytes are host memory.
  const Slot& s = r->slots[k];
  const std::uint64_t committed = s.committed_bytes[rd].load(std::memory_order_acquire);
  *word = s.lease[rd].word.load(std::memory_order_acquire);
  const std::uint64_t owed = limiter::lease_owed(*word);
  const std::uint64_t spilled = s.spilled_bytes[rd].load(std::memory_order_acquire);
  const std::uint64_t share = committed > owed ? committed - owed : 0;
  return static_cast<long long>(share > spilled ? share - spilled : 0);
}

bool region_lock_still_held(int sim_slot, std::uint32_t pid) {
  const Region* r = region();
  const int fd = region_fd();
  const std::uint32_t plus1 = g_shared->region_slot_plus1[sim_slot].load(std::memory_order_relaxed);
  if (r == nullptr || fd < 0 || plus1 == 0 || plus1 > kMaxSlots ||
      g_shared->region_slot_pid[sim_slot].load(std::memory_order_relaxed) != pid)
    return false;
  // Claimed again since (a claim takes the slot before its lock): the lock is
  // the new owner's, and tells nothing of this process.
  const Slot& s = r->slots[plus1 - 1];
  const std::uint32_t state = s.state.load(std::memory_order_acquire);
  if (state != kSlotFree && state != kSlotReaping) return false;
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = static_cast<off_t>(sizeof(Region) + (plus1 - 1));  // shm::lock_slot_file's byte
  lock.l_len = 1;
  const bool held = fcntl(fd, F_OFD_GETLK, &lock) == 0 && lock.l_type != F_UNLCK;
  return held && s.state.load(std::memory_order_acquire) == state;
}

namespace {

const char* slot_state_name(std::uint32_t state) {
  switch (state) {
    case kSlotFree: return "free";
    case kSlotClaiming: return "claiming";
    case kSlotLive: return "live";
    case kSlotReaping: return "reaping";
    default: return "unknown";
  }
}

// gpuslice's slot with this pid: a live one first, else any other state
// (claiming, reaping). A freed slot's pid is cleared: none then.
struct RegionSlot {
  const Slot* slot = nullptr;
  std::uint32_t state = kSlotFree;
  int others = 0;  // more slots with the pid (a pid reused, or a slot being reaped)
};
RegionSlot find_slot(const Region& r, std::uint32_t pid) {
  RegionSlot found;
  for (std::uint32_t k = 0; k < kMaxSlots; ++k) {
    const Slot& gs = r.slots[k];
    const std::uint32_t st = gs.state.load(std::memory_order_acquire);
    if (st == kSlotFree || gs.pid.load(std::memory_order_relaxed) != pid) continue;
    if (found.slot != nullptr && (found.state == kSlotLive || st != kSlotLive)) {
      ++found.others;
      continue;
    }
    if (found.slot != nullptr) ++found.others;
    found.slot = &gs;
    found.state = st;
  }
  return found;
}

// The region's ring of departed processes records this pid (its exit ran
// gpuslice's exit path with the compute feedback on: the pid as NVML says it).
bool departed(const Region& r, std::uint32_t pid) {
  for (const DepartedProcess& d : r.departed) {
    if ((d.seq.load(std::memory_order_acquire) & 1u) == 0 && d.pid.load(std::memory_order_acquire) == pid) return true;
  }
  return false;
}

// The kernel's view of the process, as the liveness rule reads it.
void describe_proc(std::uint32_t pid, char* out, std::size_t len) {
  platform::procfs::Stat st;
  const int err = platform::procfs::read_stat(pid, &st);
  if (err != 0) {
    std::snprintf(out, len, "gone (/proc: errno %d)", err);
    return;
  }
  std::snprintf(out, len, "state %c, %llu threads, flags 0x%llx%s%s", st.state,
                static_cast<unsigned long long>(st.num_threads), static_cast<unsigned long long>(st.flags),
                (st.flags & 0x4) != 0 ? " PF_EXITING" : "", platform::procfs::in_exit(st) ? ", in its exit" : "");
}

constexpr int kHolderOps = 96;  // of the simulator's ring of 256: the holder's sampler writes them up to 5 ms later

int append(std::size_t len, int used, int m) {
  if (m < 0 || static_cast<std::size_t>(used + m) >= len) return -1;
  return used + m;
}

}  // namespace

bool answer_dump_request() {
  if (g_shared == nullptr || g_slot < 0) return false;
  const std::uint32_t asker = g_shared->dump_asked[g_slot].exchange(0, std::memory_order_acq_rel);
  if (asker == 0) return false;
  static char text[20480];  // the sampler's thread only
  int used = std::snprintf(text, sizeof(text),
                           "fakecuda-monitor: holder pid %d (named by the report of pid %u), its last %d operations, "
                           "oldest first:\n",
                           static_cast<int>(getpid()), asker, kHolderOps);
  if (used < 0) return false;
  fakecuda_recent_operations(text + used, sizeof(text) - static_cast<std::size_t>(used), kHolderOps);
  used = static_cast<int>(std::strlen(text));
  // What the device holds for it now, object by object (a refusal's report
  // names a process counting more than that: the object it is of).
  const int m = std::snprintf(text + used, sizeof(text) - static_cast<std::size_t>(used),
                              "  holder pid %d, its holdings:\n", static_cast<int>(getpid()));
  if (m > 0 && static_cast<std::size_t>(used + m) < sizeof(text)) {
    used += m;
    fakecuda_holdings(text + used, sizeof(text) - static_cast<std::size_t>(used));
    used = static_cast<int>(std::strlen(text));
  }
  const int fd = open(g_config.report, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  const bool written = write(fd, text, static_cast<std::size_t>(used)) == used;
  close(fd);
  return written;
}

int append_processes(char* text, std::size_t len, int used, std::uint32_t dev, int region_dev) {
  if (g_slot < 0 || used < 0 || static_cast<std::size_t>(used) >= len) return used;
  const Region* r = region();
  const int high = fakecuda_slots_high_locked();
  // The holders the count misses, gathered for the closing line.
  char missed[1024] = "";
  int missed_len = 0;
  int checked = 0;
  std::uint64_t slots_count = 0;  // the check's resident counts of the live slots, summed
  bool others[kSimSlots] = {};    // members alive but this process: each may write its operations
  for (int i = 0; i < high; ++i) {
    fakecuda_slot_info slot{};
    const bool is_member = member(i, dev, &slot);
    const Seen& seen = g_seen[i];
    const bool counted = g_seen_report != 0 && seen.serial == g_seen_report;  // by the check that reports
    if (counted) ++checked;
    if (!is_member && !counted) continue;
    const std::uint32_t pid = is_member ? slot.pid : seen.pid;
    const bool alive = is_member && (i == g_slot || fakecuda_slot_alive(i) != 0);
    const unsigned long long held = is_member ? slot.held_bytes : 0;
    RegionSlot rs;
    if (r != nullptr) rs = find_slot(*r, pid);
    long long committed = -1;
    std::uint64_t spilled = 0, word = 0;
    if (rs.slot != nullptr && region_dev >= 0) {
      committed = static_cast<long long>(rs.slot->committed_bytes[region_dev].load(std::memory_order_relaxed));
      spilled = rs.slot->spilled_bytes[region_dev].load(std::memory_order_relaxed);
      word = rs.slot->lease[region_dev].word.load(std::memory_order_relaxed);
    }
    char proc[128];
    describe_proc(pid, proc, sizeof(proc));
    char at_check[192] = "";
    if (g_seen_report == 0) {
      // Not a count check's report: nothing read before.
    } else if (!counted) {
      std::snprintf(at_check, sizeof(at_check), ", not counted by the check");
    } else {
      char counted_then[96] = "no live slot";
      if (seen.counted >= 0)
        std::snprintf(counted_then, sizeof(counted_then), "counted %lld, lease spare %llu owed %llu", seen.counted,
                      static_cast<unsigned long long>(limiter::lease_spare(seen.lease_word)),
                      static_cast<unsigned long long>(limiter::lease_owed(seen.lease_word)));
      std::snprintf(at_check, sizeof(at_check), " (at the check: held %llu, %s%s)",
                    static_cast<unsigned long long>(seen.held), counted_then,
                    !is_member || seen.generation != slot.generation ? "; its simulator slot since given back" : "");
    }
    char gslot[96];
    if (rs.slot == nullptr) {
      std::snprintf(gslot, sizeof(gslot), "none in any state%s",
                    r != nullptr && departed(*r, pid) ? "; its exit is in the departed ring" : "");
    } else {
      std::snprintf(gslot, sizeof(gslot), "%s%s", slot_state_name(rs.state),
                    rs.others > 0 ? " (and more slots with this pid)" : "");
    }
    Excused ex;
    count_excused(i, dev, held, &ex);
    const int m = std::snprintf(
        text + used, len - used,
        "  process pid %u%s (%s): device holds %llu%s; gpuslice slot %s, committed %lld (spilled %llu; lease: spare "
        "%llu, owed %llu%s%s); excused: in calls %llu, outside CUDA %llu, measured short %llu%s\n",
        pid, alive ? "" : " (dead)", proc, held, at_check, gslot, committed < 0 ? 0 : committed,
        static_cast<unsigned long long>(spilled), static_cast<unsigned long long>(limiter::lease_spare(word)),
        static_cast<unsigned long long>(limiter::lease_owed(word)), limiter::lease_stale(word) ? ", stale" : "",
        (word & limiter::kLeaseClosed) != 0 ? ", closed" : "", static_cast<unsigned long long>(ex.calls),
        static_cast<unsigned long long>(ex.outside), static_cast<unsigned long long>(ex.measured_short),
        ex.exiting != 0 ? ", exiting" : "");
    const int next = append(len, used, m);
    if (next < 0) return used;
    used = next;
    // Missed by the count: what the check read of it beyond its live slot's
    // count now (spilled bytes are host memory) and its excuses then.
    if (!counted) continue;
    const std::uint64_t counts = seen.counted > 0 ? static_cast<std::uint64_t>(seen.counted) : 0;
    slots_count += counts;
    others[i] = i != g_slot && is_member && alive;
    if (seen.held <= counts + seen.excused) continue;
    const int k = std::snprintf(missed + missed_len, sizeof(missed) - static_cast<std::size_t>(missed_len),
                                " pid %u %llu bytes (%s);", pid,
                                static_cast<unsigned long long>(seen.held - counts - seen.excused),
                                seen.counted >= 0 ? "beyond its live slot" : "no live gpuslice slot");
    if (k > 0 && static_cast<std::size_t>(missed_len + k) < sizeof(missed)) missed_len += k;
    // Its own last operations (another process's ring): its sampler writes them.
    if (i != g_slot && is_member && alive)
      g_shared->dump_asked[i].store(static_cast<std::uint32_t>(getpid()), std::memory_order_release);
  }
  if (g_seen_report == 0) return used;
  const int m = std::snprintf(
      text + used, len - used,
      "  holders the count misses (what the check read of each: held less its live slot's resident count "
      "and its excuses):%s%s\n",
      missed_len > 0 ? missed : " none named", checked == 0 ? " (no count check read the processes)" : "");
  const int next = append(len, used, m);
  if (next >= 0) used = next;
  if (missed_len == 0 && checked > 0 && slots_count > g_check_count) {
    const int k = std::snprintf(
        text + used, len - used,
        "  the count at the check stood %llu bytes below what the live slots counted then (%llu): bytes out of "
        "used_bytes before (or without) leaving a slot, or a slot's release between the check's reads of it and "
        "of the count; every process writes its operations\n",
        static_cast<unsigned long long>(slots_count - g_check_count), static_cast<unsigned long long>(slots_count));
    const int after = append(len, used, k);
    if (after >= 0) used = after;
    for (int i = 0; i < high; ++i) {
      if (others[i]) g_shared->dump_asked[i].store(static_cast<std::uint32_t>(getpid()), std::memory_order_release);
    }
  }
  if (r != nullptr) {
    const int k = std::snprintf(text + used, len - used, "  region: %u live slots, %llu slots reaped so far%s\n",
                                r->header.live_slots.load(std::memory_order_relaxed),
                                static_cast<unsigned long long>(r->header.slots_reaped.load(std::memory_order_relaxed)),
                                r->header.reaper_lock.load(std::memory_order_relaxed) != 0 ? ", a reaper at work" : "");
    const int after = append(len, used, k);
    if (after >= 0) used = after;
  }
  return used;
}

int append_overcounters(char* text, std::size_t len, int used, std::uint32_t dev, int region_dev) {
  if (g_slot < 0 || used < 0 || static_cast<std::size_t>(used) >= len || region_dev < 0) return used;
  char named[1024] = "";
  int named_len = 0;
  const int high = fakecuda_slots_high_locked();
  for (int i = 0; i < high; ++i) {
    fakecuda_slot_info slot{};
    if (!member_alive(i, dev, &slot)) continue;
    std::uint64_t word = 0;
    const long long counted = slot_counted(static_cast<std::uint32_t>(i), slot.pid, region_dev, &word);
    if (counted < 0 || static_cast<std::uint64_t>(counted) <= slot.held_bytes) continue;
    const int k =
        std::snprintf(named + named_len, sizeof(named) - static_cast<std::size_t>(named_len),
                      " pid %u %llu bytes (counted %lld, held %llu%s);", slot.pid,
                      static_cast<unsigned long long>(static_cast<std::uint64_t>(counted) - slot.held_bytes), counted,
                      static_cast<unsigned long long>(slot.held_bytes), i == g_slot ? ", this process" : "");
    if (k > 0 && static_cast<std::size_t>(named_len + k) < sizeof(named)) named_len += k;
    // Its own last operations and holdings (another process's ring): its sampler writes them.
    if (i != g_slot) g_shared->dump_asked[i].store(static_cast<std::uint32_t>(getpid()), std::memory_order_release);
  }
  const int m = std::snprintf(text + used, len - used,
                              "  processes counting more than the device holds for them (a live slot's resident "
                              "count less what it holds; each other one writes its last operations and holdings "
                              "here):%s\n",
                              named_len > 0 ? named : " none");
  const int next = append(len, used, m);
  return next < 0 ? used : next;
}

}  // namespace gpuslice::chaos::internal
