// Reserve / release / charge: the allocation hot path.
//
// Every read-modify-write below is sequentially consistent: the reaper's
// snapshot argument (docs/memory-accounting.md) is made in the single total
// order of these operations. On x86-64 and AArch64 an RMW costs the same
// whatever its order, and the fast path has no seq_cst store.
#include "limiter/memory_accounting.h"
#include "shm/clock.h"

#include <sched.h>
#include <time.h>

namespace gpuslice::limiter {
namespace {

bool valid(const Region* r, int slot, int dev) {
  return r != nullptr && static_cast<unsigned>(slot) < kMaxSlots && static_cast<unsigned>(dev) < kMaxDevices;
}

// Seqlock bracket: operations in flight are counted in the low bits (threads
// of one process share the slot); the end bumps the generation, so the value
// a reaper reads twice is unchanged only if no operation started or ended.
class Bracket {
 public:
  explicit Bracket(Slot& s) : seq_(s.seq) { seq_.fetch_add(1); }
  ~Bracket() { seq_.fetch_add(shm::kSeqGeneration - 1); }
  Bracket(const Bracket&) = delete;
  Bracket& operator=(const Bracket&) = delete;

 private:
  std::atomic<std::uint64_t>& seq_;
};

void raise_peak(DeviceState& d, std::uint64_t used) {
  std::uint64_t peak = d.peak_used_bytes.load(std::memory_order_relaxed);
  while (used > peak && !d.peak_used_bytes.compare_exchange_weak(peak, used, std::memory_order_relaxed)) {
  }
}

// What may be reserved: the quota less what the agent sees beyond our count.
std::uint64_t admissible(const DeviceState& d, std::uint64_t quota) {
  const std::uint64_t extra = d.agent_extra_bytes.load(std::memory_order_relaxed);
  return extra >= quota ? 0 : quota - extra;
}

bool admit(Region* r, int slot, int dev, std::uint64_t bytes) {
  DeviceState& d = r->devices[dev];
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  const std::uint64_t quota = d.quota_bytes.load(std::memory_order_relaxed);
  std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
  std::uint64_t next;
  if (quota == kUnlimited) {
    do {
      next = used + bytes;
      if (next < used) return false;
    } while (!d.used_bytes.compare_exchange_weak(used, next));
  } else {
    const std::uint64_t limit = admissible(d, quota);
    do {
      if (bytes > limit || used > limit - bytes) return false;
      next = used + bytes;
    } while (!d.used_bytes.compare_exchange_weak(used, next));
  }
  s.committed_bytes[dev].fetch_add(bytes);
  raise_peak(d, next);
  return true;
}

using shm::monotonic_ns;

// Another process is reaping (microseconds of work): give it a moment, bounded.
void wait_for_reaper(const Region* r) {
  const std::uint64_t deadline = monotonic_ns() + 20'000'000;
  while (r->header.reaper_lock.load(std::memory_order_relaxed) != 0 && monotonic_ns() < deadline) sched_yield();
}

[[gnu::noinline, gnu::cold]] bool reserve_slow(Region* r, int slot, int dev, std::uint64_t bytes,
                                               const shm::ProcessIdentity& self) {
  DeviceState& d = r->devices[dev];
  const std::uint64_t quota = d.quota_bytes.load(std::memory_order_relaxed);
  // Larger than the whole quota: no reaping can help.
  if (quota == kUnlimited || bytes <= admissible(d, quota)) {
    if (reap_dead(r, self) == kReapBusy) wait_for_reaper(r);
    if (admit(r, slot, dev, bytes)) return true;
  }
  d.oom_refusals.fetch_add(1, std::memory_order_relaxed);
  return false;
}

}  // namespace

bool try_reserve(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  return valid(r, slot, dev) && admit(r, slot, dev, bytes);
}

bool reserve(Region* r, int slot, int dev, std::uint64_t bytes, const shm::ProcessIdentity& self) noexcept {
  if (!valid(r, slot, dev)) [[unlikely]]
    return false;
  if (admit(r, slot, dev, bytes)) [[likely]]
    return true;
  return reserve_slow(r, slot, dev, bytes, self);
}

void release(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev) || bytes == 0) [[unlikely]]
    return;
  DeviceState& d = r->devices[dev];
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  // committed first: a process killed between the two steps holds
  // committed + take in used_bytes, which the reaper's snapshot recovers.
  std::uint64_t committed = s.committed_bytes[dev].load(std::memory_order_relaxed);
  std::uint64_t take;
  do {
    take = committed < bytes ? committed : bytes;
  } while (!s.committed_bytes[dev].compare_exchange_weak(committed, committed - take));
  if (take != bytes) [[unlikely]]
    d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
  if (take == 0) return;
  std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
  std::uint64_t sub;
  do {
    sub = used < take ? used : take;
  } while (!d.used_bytes.compare_exchange_weak(used, used - sub));
  if (sub != take) [[unlikely]]
    d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
}

void release_all(Region* r, int slot) noexcept {
  if (!valid(r, slot, 0)) return;
  Slot& s = r->slots[slot];
  for (std::uint32_t dev = 0; dev < kMaxDevices; ++dev) {
    if (s.committed_bytes[dev].load(std::memory_order_relaxed) == 0) continue;
    DeviceState& d = r->devices[dev];
    Bracket bracket(s);
    const std::uint64_t take = s.committed_bytes[dev].exchange(0);
    std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
    std::uint64_t sub;
    do {
      sub = used < take ? used : take;
    } while (!d.used_bytes.compare_exchange_weak(used, used - sub));
    if (sub != take) d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
    s.context_bytes[dev].store(0, std::memory_order_relaxed);
    drop_slot_spilled(r, s, static_cast<int>(dev));  // part of what was just released
  }
}

namespace {
void sub_clamped(std::atomic<std::uint64_t>& word, std::uint64_t bytes) noexcept {
  std::uint64_t cur = word.load(std::memory_order_relaxed);
  while (!word.compare_exchange_weak(cur, cur > bytes ? cur - bytes : 0, std::memory_order_acq_rel)) {
  }
}
}  // namespace

void count_spilled(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev)) return;
  r->devices[dev].spilled_bytes.fetch_add(bytes, std::memory_order_acq_rel);
  r->devices[dev].spills.fetch_add(1, std::memory_order_relaxed);
  r->slots[slot].spilled_bytes[dev].fetch_add(bytes, std::memory_order_acq_rel);
}

void uncount_spilled(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev)) return;
  sub_clamped(r->devices[dev].spilled_bytes, bytes);
  sub_clamped(r->slots[slot].spilled_bytes[dev], bytes);
}

void drop_slot_spilled(Region* r, Slot& s, int dev) noexcept {
  if (const std::uint64_t sp = s.spilled_bytes[dev].exchange(0, std::memory_order_acq_rel); sp != 0)
    sub_clamped(r->devices[dev].spilled_bytes, sp);
}

bool charge(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev)) return false;
  DeviceState& d = r->devices[dev];
  Slot& s = r->slots[slot];
  std::uint64_t next;
  {
    Bracket bracket(s);
    std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
    do {
      next = used + bytes;
      if (next < used) {
        d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
    } while (!d.used_bytes.compare_exchange_weak(used, next));
    s.committed_bytes[dev].fetch_add(bytes);
  }
  raise_peak(d, next);
  const std::uint64_t quota = d.quota_bytes.load(std::memory_order_relaxed);
  return quota == kUnlimited || next <= admissible(d, quota);
}

std::uint64_t used_bytes(const Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return 0;
  const DeviceState& d = r->devices[dev];
  const std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
  const std::uint64_t extra = d.agent_extra_bytes.load(std::memory_order_relaxed);
  return used + extra < used ? kUnlimited : used + extra;
}

std::uint64_t quota_bytes(const Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return kUnlimited;
  return r->devices[dev].quota_bytes.load(std::memory_order_relaxed);
}

}  // namespace gpuslice::limiter
