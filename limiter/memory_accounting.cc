// Reserve / release / charge: the allocation hot path, and quota leases.
//
// Every read-modify-write inside a bracket is sequentially consistent: the
// reaper's snapshot argument (docs/memory-accounting.md) is made in the
// single total order of these operations. On x86-64 and AArch64 an RMW costs
// the same whatever its order. The lease fast path (limiter/lease.h) moves
// bytes only inside one slot's lease word and needs no order at all.
#include "limiter/agent_extra.h"
#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "platform/clock.h"

#include <sched.h>
#include <time.h>

namespace gpuslice::limiter {
namespace {

using lease_steps::Stop;

bool valid(const Region* r, int slot, int dev) {
  return r != nullptr && static_cast<unsigned>(slot) < kMaxSlots && static_cast<unsigned>(dev) < kMaxDevices;
}

// Seqlock bracket: operations in flight are counted in the low bits (threads
// of one process share the slot); the end bumps the generation, so the value
// a reaper reads twice is unchanged only if no operation started or ended.
// release() leaves it open: a test hook's simulated SIGKILL.
class Bracket {
 public:
  explicit Bracket(Slot& s) : seq_(&s.seq) { seq_->fetch_add(1); }
  ~Bracket() {
    if (seq_ != nullptr) seq_->fetch_add(shm::kSeqGeneration - 1);
  }
  void release() { seq_ = nullptr; }
  Bracket(const Bracket&) = delete;
  Bracket& operator=(const Bracket&) = delete;

 private:
  std::atomic<std::uint64_t>* seq_;
};

void raise_peak(DeviceState& d, std::uint64_t used) {
  std::uint64_t peak = d.peak_used_bytes.load(std::memory_order_relaxed);
  while (used > peak && !d.peak_used_bytes.compare_exchange_weak(peak, used, std::memory_order_relaxed)) {}
}

// What may be reserved: the quota less what a live agent sees beyond our
// count (limiter/agent_extra.h).
std::uint64_t admissible(const Region* r, const DeviceState& d, std::uint64_t quota) {
  const std::uint64_t extra = agent_extra_in_force(r, d);
  return extra >= quota ? 0 : quota - extra;
}

// Leases stay off where device-resident bytes are limited separately
// (GPUSLICE_OVERSUBSCRIBE): that path reads used_bytes as resident memory.
bool leases_allowed(const DeviceState& d) {
  const std::uint64_t resident = d.resident_limit_bytes.load(std::memory_order_relaxed);
  return resident == 0 || resident == kUnlimited;
}

// Lease size for headroom `head` after this allocation: a share of it, capped.
std::uint64_t lease_for(std::uint64_t head) {
  const std::uint64_t share = head / kLeaseHeadroomShare;
  return share < kLeaseMaxBytes ? share : kLeaseMaxBytes;
}

// used -= bytes, clamped at zero (counted: it means damaged counters).
void uncount_used(DeviceState& d, std::uint64_t bytes) {
  if (bytes == 0) return;
  std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
  std::uint64_t sub;
  do {
    sub = used < bytes ? used : bytes;
  } while (!d.used_bytes.compare_exchange_weak(used, used - sub));
  if (sub != bytes) [[unlikely]]
    d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
}

// committed -= up to `bytes`, never below `floor`; returns what was taken.
std::uint64_t take_committed(Slot& s, int dev, std::uint64_t bytes, std::uint64_t floor) {
  std::uint64_t committed = s.committed_bytes[dev].load(std::memory_order_relaxed);
  std::uint64_t take;
  do {
    const std::uint64_t held = committed > floor ? committed - floor : 0;
    take = held < bytes ? held : bytes;
  } while (take != 0 && !s.committed_bytes[dev].compare_exchange_weak(committed, committed - take));
  return take;
}

// Inside the owner's bracket: `bytes` of committed go back to used_bytes,
// exactly what is still in committed (an exit release racing with us may
// already have returned the rest, used_bytes included).
void return_to_used(DeviceState& d, Slot& s, int dev, std::uint64_t bytes) {
  uncount_used(d, take_committed(s, dev, bytes, 0));
}

// Inside the owner's bracket: an OWED word of this claim is settled. The
// stolen bytes x left used_bytes with the thief but are still in committed;
// settling takes them out of committed. Share-neutral in three steps, each
// leaving used_bytes at or above the sum of the shares (never below, where
// another process could be admitted past the quota):
//   1. used += x (the word still says OWED x: used is x high, conservative);
//   2. CAS word OWED x -> open 0 (the share is committed again: exact);
//   3. committed -= x, used -= what was taken (x high until the second RMW).
// A racing exit release of ours that closes the word before step 2 returns
// committed - x and our CAS fails: step 1 is undone. One that closes it after
// step 2 returns all of committed, x included, which used_bytes holds again
// since step 1: step 3 then takes nothing. So the stolen bytes leave
// used_bytes exactly once and the exit release never clamps on them.
// A STALE word stays STALE (only a refill reopens it).
std::uint64_t settle_locked(DeviceState& d, Slot& s, int dev, std::uint64_t tag, Bracket* bracket = nullptr,
                            Stop stop = Stop::none, void (*between)(void*) = nullptr, void* ctx = nullptr) {
  std::atomic<std::uint64_t>& word = s.lease[dev].word;
  std::uint64_t cur = word.load();
  std::uint64_t owed;
  for (;;) {
    if ((cur & (kLeaseTagMask & ~kLeaseStale)) != (tag | kLeaseOwed)) return 0;
    owed = lease_amount(cur);
    d.used_bytes.fetch_add(owed);
    if (word.compare_exchange_strong(cur, tag | (cur & kLeaseStale))) break;
    uncount_used(d, owed);  // settled by another thread of ours, closed by our exit, or marked STALE: look again
  }
  if (stop == Stop::after_clear) {
    bracket->release();
    return owed;
  }
  if (between != nullptr) between(ctx);
  uncount_used(d, take_committed(s, dev, owed, 0));
  return owed;
}

// Inside the owner's bracket: takes the whole spare of this claim's open
// word, STALE or not (a STALE word stays STALE).
std::uint64_t take_spare(Slot& s, int dev, std::uint64_t tag) {
  std::atomic<std::uint64_t>& word = s.lease[dev].word;
  std::uint64_t cur = word.load();
  while ((cur & (kLeaseTagMask & ~kLeaseStale)) == tag && lease_amount(cur) != 0) {
    if (word.compare_exchange_weak(cur, cur & ~kLeaseAmountMask)) return lease_amount(cur);
  }
  return 0;
}

// Inside the owner's bracket, before a refill admits: a STALE word's spare
// goes back to used_bytes and the word reopens empty, with no room for frees
// (cap 0) until the refill grants a lease under the present limits.
void reopen_stale(DeviceState& d, Slot& s, int dev, std::uint64_t tag) {
  std::atomic<std::uint64_t>& word = s.lease[dev].word;
  if ((word.load() & (kLeaseTagMask & ~kLeaseStale)) != tag || !lease_stale(word.load())) return;
  return_to_used(d, s, dev, take_spare(s, dev, tag));
  s.lease[dev].cap_bytes.store(0, std::memory_order_relaxed);
  std::uint64_t cur = tag | kLeaseStale;
  word.compare_exchange_strong(cur, tag);  // a free of ours cannot fill it meanwhile: frees skip STALE words
}

// Inside the owner's bracket: `bytes` of committed become spare, if this
// claim's word is open and stays under the lease cap; else back to used_bytes.
void give_spare(DeviceState& d, Slot& s, int dev, std::uint64_t tag, std::uint64_t bytes) {
  if (bytes == 0) return;
  std::atomic<std::uint64_t>& word = s.lease[dev].word;
  const std::uint64_t cap = s.lease[dev].cap_bytes.load(std::memory_order_relaxed);
  std::uint64_t cur = word.load();
  while ((cur & kLeaseTagMask) == tag && bytes <= cap && lease_amount(cur) <= cap - bytes) {
    if (word.compare_exchange_weak(cur, cur + bytes)) return;
  }
  return_to_used(d, s, dev, bytes);
}

// Marks the slot as a lease holder (before it can hold any spare: a thief or
// a display that finds the bit clear finds no spare either).
void mark_lease_holder(Region* r, int slot) {
  std::atomic<std::uint64_t>& word = r->header.lease_holders[slot / 64];
  const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
  if ((word.load() & bit) == 0) word.fetch_or(bit);
}

// Inside the owner's bracket. CAS used -> used + bytes (+ a lease sized by the
// headroom left, when `lease`), then committed += both; the lease becomes
// spare. False, with nothing changed, if `bytes` does not fit.
bool admit_locked(Region* r, int slot, int dev, std::uint64_t bytes, bool lease, std::uint64_t tag,
                  void (*between)(void*) = nullptr, void* ctx = nullptr) {
  DeviceState& d = r->devices[dev];
  Slot& s = r->slots[slot];
  const std::uint64_t quota = d.quota_bytes.load(std::memory_order_relaxed);
  lease = lease && leases_allowed(d);
  std::uint64_t used = d.used_bytes.load(std::memory_order_relaxed);
  std::uint64_t want;
  std::uint64_t next;
  if (quota == kUnlimited) {
    do {
      if (used + bytes < used) return false;
      want = lease && used + bytes + kLeaseMaxBytes > used + bytes ? kLeaseMaxBytes : 0;
      next = used + bytes + want;
    } while (!d.used_bytes.compare_exchange_weak(used, next));
  } else {
    const std::uint64_t limit = admissible(r, d, quota);
    do {
      if (bytes > limit || used > limit - bytes) return false;
      want = lease ? lease_for(limit - used - bytes) : 0;
      next = used + bytes + want;
    } while (!d.used_bytes.compare_exchange_weak(used, next));
  }
  if (between != nullptr) between(ctx);
  s.committed_bytes[dev].fetch_add(bytes + want);
  if (lease) {
    if (want != 0) mark_lease_holder(r, slot);
    // Frees may keep twice the lease: an alloc+free pair right after a refill
    // stays on the fast path. At the quota the lease and the cap are 0.
    s.lease[dev].cap_bytes.store(2 * want, std::memory_order_relaxed);
    give_spare(d, s, dev, tag, want);
  }
  raise_peak(d, next - want);
  return true;
}

// Inside the thief's bracket: takes `victim`'s spare on `dev` back into
// used_bytes. The victim's word becomes OWED(x) in the same CAS that empties
// it (its share of used_bytes is committed - x from that instant); then
// used_bytes drops by x. A victim judged dead (kSlotReaping) is left to the
// reaper: checking kSlotLive inside our bracket means no reaper snapshot can
// settle before we finish, so the reaper sees either all of the theft or none.
std::uint64_t steal_locked(Region* r, int victim, int dev, Bracket* bracket = nullptr, Stop stop = Stop::none) {
  Slot& v = r->slots[victim];
  if (v.state.load() != kSlotLive) return 0;
  std::atomic<std::uint64_t>& word = v.lease[dev].word;
  std::uint64_t cur = word.load();
  do {
    if ((cur & (kLeaseOwed | kLeaseClosed)) != 0 || lease_amount(cur) == 0) return 0;
  } while (!word.compare_exchange_weak(cur, cur | kLeaseOwed));
  const std::uint64_t stolen = lease_amount(cur);
  if (stop == Stop::after_mark) {
    bracket->release();
    return stolen;
  }
  uncount_used(r->devices[dev], stolen);
  if (stop == Stop::after_uncount) bracket->release();
  return stolen;
}

std::uint64_t steal_all(Region* r, int slot, int dev) {
  std::uint64_t stolen = 0;
  for (std::uint32_t w = 0; w < kMaxSlots / 64; ++w) {
    for (std::uint64_t bits = r->header.lease_holders[w].load(); bits != 0; bits &= bits - 1) {
      const int victim = static_cast<int>(w * 64 + static_cast<std::uint32_t>(__builtin_ctzll(bits)));
      if (victim != slot) stolen += steal_locked(r, victim, dev);
    }
  }
  return stolen;
}

// Exact admission of `bytes` (no lease taken), after this slot's own spare
// and, when `steal`, every other live slot's spare went back into used_bytes:
// a refusal then means the container is really full.
bool admit_reclaiming(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes, bool steal) {
  DeviceState& d = r->devices[dev];
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  settle_locked(d, s, dev, tag);
  if (admit_locked(r, slot, dev, bytes, false, tag)) return true;
  // Our own spare goes back first and the request is admitted exactly
  // against the present limits: a spare admitted under a higher quota (or
  // refilled by frees since) is never spent without that check.
  const std::uint64_t own = take_spare(s, dev, tag);
  return_to_used(d, s, dev, own);
  if (own != 0 && admit_locked(r, slot, dev, bytes, false, tag)) return true;
  return steal && steal_all(r, slot, dev) != 0 && admit_locked(r, slot, dev, bytes, false, tag);
}

// Inside the owner's bracket: releases `bytes` exactly, never into the spare
// or owed part of committed (a release of bytes never reserved is clamped).
// The floor (spare + owed) comes from the lease word, read before committed.
// Another thread of ours that moves bytes out of the word into used_bytes
// (take_spare then return_to_used; a settle) changes the word first and
// committed after: a floor read before its word change beside a committed
// read after its committed change is high by those bytes, and the take comes
// out short though the bytes are ours. A short take is therefore tried again
// while the word moved meanwhile, with the floor read afresh (what the other
// thread left is then consistent); a take short under a word that did not
// move is a release of bytes never reserved, counted as an error (so is one
// still short after kReleaseTries floors, a bound no schedule should reach).
// Every piece that was taken leaves used_bytes at once: never short.
constexpr int kReleaseTries = 64;

void release_locked(DeviceState& d, Slot& s, int dev, std::uint64_t tag, std::uint64_t bytes,
                    void (*between)(void*) = nullptr, void* ctx = nullptr) {
  settle_locked(d, s, dev, tag);
  std::atomic<std::uint64_t>& word = s.lease[dev].word;
  std::uint64_t left = bytes;
  std::uint64_t floor_word = word.load();
  for (int tries = 1;; ++tries) {
    if (between != nullptr && tries == 1) between(ctx);
    const std::uint64_t take = take_committed(s, dev, left, lease_spare(floor_word) + lease_owed(floor_word));
    uncount_used(d, take);
    left -= take;
    if (left == 0) return;
    const std::uint64_t now = word.load();
    if (now == floor_word || tries == kReleaseTries) break;
    floor_word = now;
  }
  d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
}

// The exact release of `bytes` under the slot's current claim, in its bracket
// (`between`: lease_steps::release's test hook).
void release_bracketed(Region* r, int slot, int dev, std::uint64_t bytes, void (*between)(void*) = nullptr,
                       void* ctx = nullptr) {
  if (!valid(r, slot, dev) || bytes == 0) [[unlikely]]
    return;
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  release_locked(r->devices[dev], s, dev, lease_tag(r, slot), bytes, between, ctx);
}

using platform::monotonic_ns;

// Another process is reaping (microseconds of work): give it a moment, bounded.
void wait_for_reaper(const Region* r) {
  const std::uint64_t deadline = platform::monotonic_ns() + 20'000'000;
  while (r->header.reaper_lock.load(std::memory_order_relaxed) != 0 && platform::monotonic_ns() < deadline)
    sched_yield();
}

// Bytes in used_bytes that no lease word shows yet, which admit_reclaiming
// cannot take: another thread of this slot inside its bracket (a refill's
// lease between its admission and give_spare, a release between taking
// committed and used_bytes; issue 32: a preempted refill's 13 MiB lease
// refused 8 MiB with 20 MiB of room), and a refill of another process between
// the same two steps (chaos `fill`, 2 processes: 8 MiB refused, the container
// 5 MiB short of it, a 5 MiB lease in flight). Before refusing, wait (yielding, at most kQuietWaitNs)
// for a try that none of them overlapped, and try again: a try inside which
// our slot's sequence moved by our own bracket alone, and before which no
// other lease holder had a refill in flight and after which none had started
// or ended one (Slot::refills), is exact. A refill counts itself before its
// admission and uncounts itself after its lease is in the word (seq_cst), so
// one whose admission preceded our try's last admission is either seen in
// flight or seen ended (its lease then in the word before our theft pass, or
// the try is not exact). Only refills delay a refusal, not other brackets: a
// refusal beside busy processes that do not refill waits not at all.
constexpr std::uint64_t kQuietWaitNs = 100'000'000;

struct RefillsSeen {
  std::uint64_t holders[kMaxSlots / 64];
  std::uint64_t sum;  // each slot's count only grows (mod 2^32): equal sums, equal counts
  bool in_flight;
};

RefillsSeen refills_seen(const Region* r, int slot) {
  RefillsSeen seen{{}, 0, false};
  for (std::uint32_t w = 0; w < kMaxSlots / 64; ++w) {
    seen.holders[w] = r->header.lease_holders[w].load();
    for (std::uint64_t bits = seen.holders[w]; bits != 0; bits &= bits - 1) {
      const int other = static_cast<int>(w * 64 + static_cast<std::uint32_t>(__builtin_ctzll(bits)));
      if (other == slot) continue;
      const std::uint32_t refills = r->slots[other].refills.load();
      seen.sum += refills;
      seen.in_flight |= (refills & kRefillsInFlightMask) != 0;
    }
  }
  return seen;
}

bool same_refills(const RefillsSeen& before, const RefillsSeen& after) {
  for (std::uint32_t w = 0; w < kMaxSlots / 64; ++w) {
    if (before.holders[w] != after.holders[w]) return false;
  }
  return before.sum == after.sum && !after.in_flight;
}

bool admit_when_quiet(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes) {
  const std::atomic<std::uint64_t>& seq = r->slots[slot].seq;
  const std::uint64_t deadline = platform::monotonic_ns() + kQuietWaitNs;
  for (;;) {
    const std::uint64_t before = seq.load();
    if ((before & (shm::kSeqGeneration - 1)) == 0) {
      const RefillsSeen others = refills_seen(r, slot);
      if (!others.in_flight) {
        if (admit_reclaiming(r, slot, tag, dev, bytes, true)) return true;
        // An acquire read of what the try read (every write of used_bytes is
        // an RMW: a refill's admission it saw is in this read's release
        // sequence), so that refill's count is seen below (no fence: TSan).
        (void)r->devices[dev].used_bytes.load();
        if (seq.load() == before + shm::kSeqGeneration && same_refills(others, refills_seen(r, slot))) return false;
      }
    }
    if (platform::monotonic_ns() >= deadline) return false;
    sched_yield();
  }
}

[[gnu::noinline, gnu::cold]] bool reserve_slow(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes,
                                               const shm::Observer& self) {
  DeviceState& d = r->devices[dev];
  const std::uint64_t quota = d.quota_bytes.load(std::memory_order_relaxed);
  // Larger than the whole quota: no reclaiming can help.
  if (quota == kUnlimited || bytes <= admissible(r, d, quota)) {
    if (admit_reclaiming(r, slot, tag, dev, bytes, true)) return true;
    if (reap_dead(r, self) == kReapBusy) wait_for_reaper(r);
    if (admit_reclaiming(r, slot, tag, dev, bytes, true)) return true;
    if (admit_when_quiet(r, slot, tag, dev, bytes)) return true;
  }
  d.oom_refusals.fetch_add(1, std::memory_order_relaxed);
  return false;
}

// A refill admits `bytes` and a new lease under the limits it reads after
// the lease epoch. If the epoch moved meanwhile (a limit changed, which
// marked every lease word it could see STALE), the lease it just took may be
// one that change did not see: it goes back at once. Either the change's
// sweep came after our lease was in the word (and marked it), or our second
// read sees the new epoch: both are seq_cst, in one total order.
[[gnu::noinline]] bool reserve_refill(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes,
                                      void (*between)(void*) = nullptr, void* ctx = nullptr) {
  DeviceState& d = r->devices[dev];
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  settle_locked(d, s, dev, tag);
  const std::uint64_t epoch = d.lease_epoch.load();
  reopen_stale(d, s, dev, tag);
  // Seen by other processes' refusals (admit_when_quiet) from before the
  // admission until the lease is in the word; a holder before it is counted.
  const bool lease = leases_allowed(d);
  if (lease) {
    mark_lease_holder(r, slot);
    s.refills.fetch_add(1);
  }
  const bool admitted = admit_locked(r, slot, dev, bytes, lease, tag, between, ctx);
  if (admitted && d.lease_epoch.load() != epoch) [[unlikely]]
    return_to_used(d, s, dev, take_spare(s, dev, tag));
  if (lease) s.refills.fetch_add(kRefillsGeneration - 1);
  return admitted;
}

}  // namespace

bool try_reserve(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  return valid(r, slot, dev) && admit_reclaiming(r, slot, lease_tag(r, slot), dev, bytes, false);
}

bool reserve(Region* r, int slot, int dev, std::uint64_t bytes, const shm::Observer& self) noexcept {
  if (!valid(r, slot, dev)) [[unlikely]]
    return false;
  const std::uint64_t tag = lease_tag(r, slot);
  {
    Bracket bracket(r->slots[slot]);
    if (admit_locked(r, slot, dev, bytes, false, tag)) [[likely]]
      return true;
  }
  return reserve_slow(r, slot, tag, dev, bytes, self);
}

bool reserve(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes, const shm::Observer& self) noexcept {
  if (!valid(r, slot, dev)) [[unlikely]]
    return false;
  if (lease_alloc(r, slot, tag, dev, bytes)) [[likely]]
    return true;
  if (reserve_refill(r, slot, tag, dev, bytes)) return true;
  return reserve_slow(r, slot, tag, dev, bytes, self);
}

void release(Region* r, int slot, int dev, std::uint64_t bytes) noexcept { release_bracketed(r, slot, dev, bytes); }

void release(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev) || bytes == 0) [[unlikely]]
    return;
  if (lease_free(r, slot, tag, dev, bytes)) [[likely]]
    return;
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  release_locked(r->devices[dev], s, dev, tag, bytes);
}

// Closes every lease word (no fast path after this; a thief's CAS fails), then
// returns committed - owed: the owed part already left used_bytes with the thief.
void release_all(Region* r, int slot) noexcept {
  if (!valid(r, slot, 0)) return;
  Slot& s = r->slots[slot];
  for (std::uint32_t dev = 0; dev < kMaxDevices; ++dev) {
    std::atomic<std::uint64_t>& word = s.lease[dev].word;
    if (s.committed_bytes[dev].load(std::memory_order_relaxed) == 0 && word.load(std::memory_order_relaxed) == 0)
      continue;
    DeviceState& d = r->devices[dev];
    Bracket bracket(s);
    std::uint64_t cur = word.load();
    while (!word.compare_exchange_weak(cur, (cur & ~(kLeaseAmountMask | kLeaseOwed | kLeaseStale)) | kLeaseClosed)) {}
    const std::uint64_t owed = lease_owed(cur);
    // Spilled bytes leave the spilled total before used_bytes drops: resident
    // memory (used - spilled) is never understated on the way.
    drop_slot_spilled(r, s, static_cast<int>(dev));
    const std::uint64_t held = s.committed_bytes[dev].exchange(0);
    if (held < owed) d.accounting_errors.fetch_add(1, std::memory_order_relaxed);
    uncount_used(d, held > owed ? held - owed : 0);
    s.lease[dev].cap_bytes.store(0, std::memory_order_relaxed);
    s.context_bytes[dev].store(0, std::memory_order_relaxed);
  }
}

std::uint64_t spare_lease_bytes(const Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return 0;
  std::uint64_t sum = 0;
  for (std::uint32_t w = 0; w < kMaxSlots / 64; ++w) {
    for (std::uint64_t bits = r->header.lease_holders[w].load(std::memory_order_relaxed); bits != 0; bits &= bits - 1) {
      const Slot& s = r->slots[w * 64 + static_cast<std::uint32_t>(__builtin_ctzll(bits))];
      sum += lease_spare(s.lease[dev].word.load(std::memory_order_relaxed));
    }
  }
  return sum;
}

namespace lease_steps {

std::uint64_t steal(Region* r, int slot, int victim, int dev, Stop stop) noexcept {
  if (!valid(r, slot, dev) || !valid(r, victim, dev)) return 0;
  Bracket bracket(r->slots[slot]);
  if (stop == Stop::after_bracket) {
    bracket.release();
    return 0;
  }
  return steal_locked(r, victim, dev, &bracket, stop);
}

std::uint64_t settle(Region* r, int slot, int dev, Stop stop, void (*between)(void*), void* ctx) noexcept {
  if (!valid(r, slot, dev)) return 0;
  Slot& s = r->slots[slot];
  Bracket bracket(s);
  if (stop == Stop::after_bracket) {
    bracket.release();
    return 0;
  }
  return settle_locked(r->devices[dev], s, dev, lease_tag(r, slot), &bracket, stop, between, ctx);
}

bool refill(Region* r, int slot, int dev, std::uint64_t bytes, void (*between)(void*), void* ctx) noexcept {
  return valid(r, slot, dev) && reserve_refill(r, slot, lease_tag(r, slot), dev, bytes, between, ctx);
}

void release(Region* r, int slot, int dev, std::uint64_t bytes, void (*between)(void*), void* ctx) noexcept {
  release_bracketed(r, slot, dev, bytes, between, ctx);
}

}  // namespace lease_steps

namespace {
void sub_clamped(std::atomic<std::uint64_t>& word, std::uint64_t bytes) noexcept {
  std::uint64_t cur = word.load(std::memory_order_relaxed);
  while (!word.compare_exchange_weak(cur, cur > bytes ? cur - bytes : 0, std::memory_order_acq_rel)) {}
}
}  // namespace

void sub_clamped32(std::atomic<std::uint32_t>& word, std::uint32_t n) noexcept {
  std::uint32_t cur = word.load();
  while (cur != 0 && !word.compare_exchange_weak(cur, cur > n ? cur - n : 0)) {}
}

// Spilled bytes move inside the owner's bracket, like used_bytes: the
// reaper's snapshot then sees the slot's spilled share and the device's
// totals consistently and takes a dead slot's share out exactly.
void count_spilled(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev)) return;
  DeviceState& d = r->devices[dev];
  Bracket bracket(r->slots[slot]);
  r->slots[slot].spilled_bytes[dev].fetch_add(bytes);
  d.spilled_in_bytes.fetch_add(bytes);
  d.spilled_bytes.fetch_add(bytes, std::memory_order_acq_rel);  // display
  d.spills.fetch_add(1, std::memory_order_relaxed);
}

void uncount_spilled(Region* r, int slot, int dev, std::uint64_t bytes) noexcept {
  if (!valid(r, slot, dev)) return;
  DeviceState& d = r->devices[dev];
  Bracket bracket(r->slots[slot]);
  std::atomic<std::uint64_t>& mine = r->slots[slot].spilled_bytes[dev];
  std::uint64_t cur = mine.load();
  std::uint64_t take;
  do {
    take = cur < bytes ? cur : bytes;  // the exit release may have taken it already
  } while (take != 0 && !mine.compare_exchange_weak(cur, cur - take));
  if (take == 0) return;
  d.spilled_out_bytes.fetch_add(take);
  sub_clamped(d.spilled_bytes, take);
}

void drop_slot_spilled(Region* r, Slot& s, int dev) noexcept {
  if (const std::uint64_t sp = s.spilled_bytes[dev].exchange(0); sp != 0) {
    r->devices[dev].spilled_out_bytes.fetch_add(sp);
    sub_clamped(r->devices[dev].spilled_bytes, sp);
  }
}

std::uint64_t resident_bytes(const Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return 0;
  const DeviceState& d = r->devices[dev];
  // `in` before used_bytes, `out` after: both only grow, so in - out is at
  // most the spilled amount at the instant used_bytes was read, and the
  // result at least the resident amount then (spilled bytes are counted
  // after they are reserved and uncounted before they are released).
  const std::uint64_t in = d.spilled_in_bytes.load();
  const std::uint64_t used = d.used_bytes.load();
  const std::uint64_t out = d.spilled_out_bytes.load();
  const std::uint64_t spilled = in > out ? in - out : 0;
  return used > spilled ? used - spilled : 0;
}

void invalidate_leases(Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return;
  r->devices[dev].lease_epoch.fetch_add(1);
  for (std::uint32_t w = 0; w < kMaxSlots / 64; ++w) {
    for (std::uint64_t bits = r->header.lease_holders[w].load(); bits != 0; bits &= bits - 1) {
      Slot& s = r->slots[w * 64 + static_cast<std::uint32_t>(__builtin_ctzll(bits))];
      std::atomic<std::uint64_t>& word = s.lease[dev].word;
      std::uint64_t cur = word.load();
      // Open or OWED words of a claim (a free slot's word is 0; a closed one
      // has nothing to spend). OWED ones too: their settle must not reopen
      // a word that frees could refill and allocations spend.
      while (cur != 0 && (cur & (kLeaseClosed | kLeaseStale)) == 0 &&
             !word.compare_exchange_weak(cur, cur | kLeaseStale)) {}
    }
  }
}

bool revoke_leases(Region* r, int slot, int dev) noexcept {
  if (!valid(r, slot, dev)) return false;
  invalidate_leases(r, dev);
  Bracket bracket(r->slots[slot]);
  return steal_all(r, slot, dev) != 0;
}

void begin_wait(Region* r, int slot, int dev) noexcept {
  if (!valid(r, slot, dev)) return;
  // The slot first: a waiter killed between the two leaves the device's
  // count low by one (the reaper subtracts the slot's), never high forever.
  r->slots[slot].oversub_waiting[dev].fetch_add(1);
  r->devices[dev].oversub_waiting.fetch_add(1);
}

void end_wait(Region* r, int slot, int dev) noexcept {
  if (!valid(r, slot, dev)) return;
  sub_clamped32(r->devices[dev].oversub_waiting, 1);
  std::atomic<std::uint16_t>& mine = r->slots[slot].oversub_waiting[dev];
  std::uint16_t cur = mine.load();
  while (cur != 0 && !mine.compare_exchange_weak(cur, static_cast<std::uint16_t>(cur - 1))) {}
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
  return quota == kUnlimited || next <= admissible(r, d, quota);
}

std::uint64_t used_bytes(const Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return 0;
  const DeviceState& d = r->devices[dev];
  const std::uint64_t counted = d.used_bytes.load(std::memory_order_relaxed);
  const std::uint64_t spare = spare_lease_bytes(r, dev);  // admitted, not allocated: never shown as used
  const std::uint64_t used = counted > spare ? counted - spare : 0;
  const std::uint64_t extra = agent_extra_in_force(r, d);
  return used + extra < used ? kUnlimited : used + extra;
}

std::uint64_t quota_bytes(const Region* r, int dev) noexcept {
  if (r == nullptr || static_cast<unsigned>(dev) >= kMaxDevices) return kUnlimited;
  return r->devices[dev].quota_bytes.load(std::memory_order_relaxed);
}

}  // namespace gpuslice::limiter
