// Exact reclamation of dead processes' slots (docs/memory-accounting.md).
//
// Invariant: used_bytes[d] = sum over slots of what each slot added to it.
// A slot with no operation in flight added exactly its committed_bytes[d]; a
// dead one may have died between its two updates, so its share is unknown.
// In a window where every other slot is quiescent and unchanged, used_bytes
// cannot move except through the (frozen) dead slots, so one snapshot gives
// D = used and S = sum of the others' committed - owed (quota leases: what a
// thief took back but the owner has not settled), and the dead slots' share is
// exactly D - S. The reaper CASes used D -> S: idempotent (a second reaper
// finishing an interrupted one sets the same value) and immune to ABA (used
// back at D means live slots' net change since the snapshot is zero).
// Reapers exclude each other with the reaper lock; only a dead holder loses it.
#include <sched.h>

#include "limiter/lease.h"
#include "limiter/memory_accounting.h"
#include "limiter/shared_allocs.h"

namespace gpuslice::limiter {
namespace {

constexpr std::uint64_t kPidBits = 22;
constexpr std::uint64_t kLow21 = (std::uint64_t{1} << 21) - 1;
constexpr int kSnapshotTries = 64;
constexpr std::uint32_t kSweepWindow = 64;

struct SlotIdentity {
  std::uint32_t pid;
  std::uint64_t pidns_inode;
  std::uint64_t start_time;
  bool operator==(const SlotIdentity&) const = default;
};

SlotIdentity identity_of(const Slot& s) { return {s.pid.load(), s.pidns_inode.load(), s.start_time.load()}; }

bool slot_holds_token(const Slot& s, std::uint64_t token) {
  const SlotIdentity id = identity_of(s);
  return id.pid != 0 && reaper_token({id.pid, id.pidns_inode, id.start_time}) == token;
}

shm::Liveness holder_liveness(std::uint64_t token, const shm::ProcessIdentity& self) {
  const auto pid = static_cast<std::uint32_t>(token & ((std::uint64_t{1} << kPidBits) - 1));
  const std::uint64_t ns_bits = (token >> kPidBits) & kLow21;
  const std::uint64_t start_bits = token >> (kPidBits + 21);
  if (ns_bits == 0 || self.pidns_inode == 0 || ns_bits != (self.pidns_inode & kLow21)) return shm::Liveness::unknown;
  return shm::identity_liveness(pid, self.pidns_inode, start_bits, self, kLow21);
}

class Reaper {
 public:
  // candidates: when given, only these live slots are judged (a bounded
  // sweep's finds); slots an earlier reaper left kSlotReaping are adopted all
  // the same, and the snapshot covers every slot.
  Reaper(Region* r, const shm::Observer& self, DeadPredicate is_dead, void* ctx,
         const std::uint64_t* candidates = nullptr)
      : r_(r), self_(self), token_(reaper_token(self)), is_dead_(is_dead), ctx_(ctx), candidates_(candidates) {}

  int run() {
    if (!lock()) return kReapBusy;
    const int result = reap_locked();
    std::uint64_t mine = token_;
    r_->header.reaper_lock.compare_exchange_strong(mine, 0);
    return result;
  }

 private:
  bool lock() {
    std::atomic<std::uint64_t>& lock = r_->header.reaper_lock;
    for (int attempt = 0; attempt < 4; ++attempt) {
      std::uint64_t held = lock.load();
      if (held == 0) {
        if (lock.compare_exchange_strong(held, token_)) return true;
        continue;
      }
      if (held == token_) return false;  // another thread of this process is reaping
      if (!holder_dead(held)) return false;
      if (lock.compare_exchange_strong(held, token_)) return true;  // the holder died mid-reap: take over
    }
    return false;
  }

  bool holder_dead(std::uint64_t held) {
    const shm::Liveness l = holder_liveness(held, self_);
    if (l != shm::Liveness::unknown) return l == shm::Liveness::dead;
    // Another pid namespace: ask the caller's predicate about the holder's
    // slot, if it has one (the agent maps namespaces; a process does not).
    // The process alone: a child it forked holds its memory, not this lock.
    for (const Slot& s : r_->slots) {
      if (s.state.load() == kSlotLive && slot_holds_token(s, held)) return is_dead_(s, shm::SlotLock::unknown, ctx_);
    }
    return false;
  }

  bool reaping(std::uint32_t i) const { return (reaping_[i / 64] >> (i % 64)) & 1; }

  // Marks dead slots kSlotReaping (each by exactly one reaper: a CAS) and
  // adopts those an earlier reaper left behind.
  int mark() {
    int count = 0;
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      Slot& s = r_->slots[i];
      std::uint32_t state = s.state.load();
      // A claiming slot is judged once its pid is written (its owner may have
      // died between claiming and publishing it).
      if (state == kSlotLive || (state == kSlotClaiming && s.pid.load() != 0)) {
        if (candidates_ != nullptr && ((candidates_[i / 64] >> (i % 64)) & 1) == 0) continue;
        const SlotIdentity before = identity_of(s);
        if (before.pid == 0) continue;
        // Its process may be gone while a child it forked still holds the
        // driver's files, and with them its device memory: the slot's file
        // lock, seen through our own description of the file, tells.
        if (!is_dead_(s, shm::probe_slot_lock(self_.region_fd, static_cast<int>(i)), ctx_)) continue;
        const std::uint32_t was = state;
        if (!s.state.compare_exchange_strong(state, kSlotReaping)) continue;
        // The slot may have changed hands between our reads (its owner
        // released it and another process claimed it): then give it back.
        if (!(identity_of(s) == before)) {
          std::uint32_t ours = kSlotReaping;
          s.state.compare_exchange_strong(ours, was);
          continue;
        }
      } else if (state != kSlotReaping) {
        continue;
      }
      reaping_[i / 64] |= std::uint64_t{1} << (i % 64);
      ++count;
    }
    return count;
  }

  // One snapshot attempt; fixes the devices in `pending` it can.
  void snapshot(std::uint32_t& pending) {
    // Pass 1: every other slot quiescent. Seqs only grow, so equal sums
    // before and after mean no operation started or ended in between.
    std::uint64_t sum_before = 0;
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      if (reaping(i)) continue;
      const std::uint64_t seq = r_->slots[i].seq.load();
      if ((seq & shm::kSeqInflightMask) != 0) return;
      sum_before += seq;
    }
    std::uint64_t used[kMaxDevices] = {};
    std::uint64_t others[kMaxDevices] = {};
    std::uint64_t spill_in[kMaxDevices] = {};
    std::uint64_t spill_out[kMaxDevices] = {};
    std::uint64_t others_spilled[kMaxDevices] = {};
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (pending & (1u << d)) {
        used[d] = r_->devices[d].used_bytes.load();
        spill_in[d] = r_->devices[d].spilled_in_bytes.load();
        spill_out[d] = r_->devices[d].spilled_out_bytes.load();
      }
    }
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      if (reaping(i)) continue;
      const Slot& s = r_->slots[i];
      for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
        // A slot's share is committed - owed: a thief already took the owed
        // bytes out of used_bytes (limiter/lease.h). Both move only inside
        // brackets (the owner's, or the thief's, which holds ours open).
        if (pending & (1u << d)) {
          const std::uint64_t committed = s.committed_bytes[d].load();
          const std::uint64_t owed = lease_owed(s.lease[d].word.load());
          others[d] += committed > owed ? committed - owed : 0;
          others_spilled[d] += s.spilled_bytes[d].load();
        }
      }
    }
    // Shared allocations hold their bytes in no slot (limiter/shared_allocs.h).
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (pending & (1u << d)) others[d] += shared_charged(r_, static_cast<int>(d));
    }
    std::uint64_t sum_after = 0;
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      if (!reaping(i)) sum_after += r_->slots[i].seq.load();
    }
    if (sum_after != sum_before) return;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (!(pending & (1u << d))) continue;
      DeviceState& dev = r_->devices[d];
      // The dead slots' spilled share (in - out - the others'), taken out of
      // the spilled total first: resident memory (used - spilled) is never
      // understated between the two fixes. Moves of `out` by live slots
      // after the snapshot make the CAS fail (retry); moves of `in` do not
      // change the dead share. Idempotent like the fix of used_bytes.
      const std::uint64_t spilled = spill_in[d] > spill_out[d] ? spill_in[d] - spill_out[d] : 0;
      if (others_spilled[d] > spilled) dev.accounting_errors.fetch_add(1, std::memory_order_relaxed);
      if (spilled > others_spilled[d]) {
        std::uint64_t expected = spill_out[d];
        if (!dev.spilled_out_bytes.compare_exchange_strong(expected, spill_out[d] + spilled - others_spilled[d]))
          continue;
      }
      if (used[d] == others[d]) {
        pending &= ~(1u << d);
        continue;
      }
      // Dead slots never hold a negative share; if the snapshot says so the
      // counters were damaged (e.g. by hand): the live truth wins, say so.
      if (others[d] > used[d]) dev.accounting_errors.fetch_add(1, std::memory_order_relaxed);
      std::uint64_t expected = used[d];
      if (dev.used_bytes.compare_exchange_strong(expected, others[d])) pending &= ~(1u << d);
    }
  }

  void free_slot(Slot& s) {
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      s.committed_bytes[d].store(0);
      s.lease[d].word.store(0);  // a stale thread's tag never matches 0 or the next claim's
      s.lease[d].cap_bytes.store(0);
      // Spilled totals were fixed by the snapshot; the display total follows.
      if (const std::uint64_t sp = s.spilled_bytes[d].exchange(0); sp != 0) {
        std::atomic<std::uint64_t>& shown = r_->devices[d].spilled_bytes;
        std::uint64_t cur = shown.load();
        while (!shown.compare_exchange_weak(cur, cur > sp ? cur - sp : 0)) {}
      }
      // A process killed while it waited for memory is no longer waiting.
      if (const std::uint16_t waiting = s.oversub_waiting[d].exchange(0); waiting != 0)
        sub_clamped32(r_->devices[d].oversub_waiting, waiting);
      s.context_bytes[d].store(0);
      s.nvml_used_bytes[d].store(0);
    }
    const auto index = static_cast<std::uint32_t>(&s - r_->slots);
    r_->header.lease_holders[index / 64].fetch_and(~(std::uint64_t{1} << (index % 64)));
    s.start_time.store(0);
    s.pidns_inode.store(0);
    s.pid.store(0);
    s.host_pid.store(0);
    // Nothing in flight for the next owner, and the value still grows.
    s.seq.store((s.seq.load() | shm::kSeqInflightMask) + 1);
    s.refills.store((s.refills.load() | kRefillsInFlightMask) + 1);  // nor refills (a refusal waits for those)
    s.state.store(kSlotFree);
  }

  int reap_locked() {
    if (mark() == 0) return 0;
    shared_reap(r_, reaping_);  // dead holders out; entries no live process holds closed
    std::uint32_t pending = 0;
    for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
      if (r_->devices[d].uuid_state.load() != shm::kDeviceFree) pending |= 1u << d;
    }
    for (int attempt = 0; attempt < kSnapshotTries && pending != 0; ++attempt) {
      if (attempt != 0) sched_yield();
      snapshot(pending);
    }
    // Not settled (a storm of allocations): the slots stay kSlotReaping and
    // whoever reaps next finishes them; nobody waits for us.
    if (pending != 0) return kReapBusy;
    int freed = 0;
    std::uint32_t live = 0;
    for (std::uint32_t i = 0; i < kMaxSlots; ++i) {
      if (reaping(i)) {
        free_slot(r_->slots[i]);
        ++freed;
      } else if (r_->slots[i].state.load(std::memory_order_relaxed) == kSlotLive) {
        ++live;
      }
    }
    r_->header.live_slots.store(live, std::memory_order_relaxed);
    r_->header.slots_reaped.fetch_add(static_cast<std::uint64_t>(freed), std::memory_order_relaxed);
    return freed;
  }

  Region* r_;
  shm::Observer self_;
  std::uint64_t token_;
  DeadPredicate is_dead_;
  void* ctx_;
  const std::uint64_t* candidates_;
  std::uint64_t reaping_[kMaxSlots / 64] = {};
};

bool dead_by_observer(const Slot& s, shm::SlotLock lock, void* ctx) {
  return shm::slot_liveness(s, *static_cast<const shm::Observer*>(ctx), lock) == shm::Liveness::dead;
}

}  // namespace

std::uint64_t reaper_token(const shm::ProcessIdentity& id) noexcept {
  return (id.pid & ((std::uint64_t{1} << kPidBits) - 1)) | ((id.pidns_inode & kLow21) << kPidBits) |
         ((id.start_time & kLow21) << (kPidBits + 21));
}

int reap_dead(Region* r, const shm::Observer& observer) noexcept {
  if (r == nullptr) return 0;
  shm::Observer copy = observer;
  return Reaper(r, observer, dead_by_observer, &copy).run();
}

int reap_sweep(Region* r, const shm::Observer& observer, std::uint32_t first, std::uint32_t budget) noexcept {
  if (r == nullptr) return 0;
  shm::Observer copy = observer;
  std::uint64_t dead[kMaxSlots / 64] = {};
  bool any = false;
  std::uint32_t judged = 0;
  // At most kSweepWindow slots looked at (loads), at most `budget` judged as
  // the reaper judges (a lock probe each; a /proc read for those not held).
  for (std::uint32_t k = 0; k < kSweepWindow && judged < budget; ++k) {
    const std::uint32_t i = (first + k) % kMaxSlots;
    const Slot& s = r->slots[i];
    const std::uint32_t state = s.state.load(std::memory_order_acquire);
    if (state == kSlotReaping) any = true;  // an interrupted reaper's: finish it
    if (state != kSlotLive || s.pid.load(std::memory_order_relaxed) == 0) continue;
    ++judged;
    if (dead_by_observer(s, shm::probe_slot_lock(observer.region_fd, static_cast<int>(i)), &copy)) {
      dead[i / 64] |= std::uint64_t{1} << (i % 64);
      any = true;
    }
  }
  if (!any) return 0;
  return Reaper(r, observer, dead_by_observer, &copy, dead).run();
}

int reap_slots(Region* r, const shm::Observer& observer, DeadPredicate is_dead, void* ctx) noexcept {
  if (r == nullptr || is_dead == nullptr) return 0;
  return Reaper(r, observer, is_dead, ctx).run();
}

int reap_slots(Region* r, DeadPredicate is_dead, void* ctx) noexcept {
  shm::ProcessIdentity self{};
  shm::read_identity(0, &self);
  return reap_slots(r, self, is_dead, ctx);
}

}  // namespace gpuslice::limiter
