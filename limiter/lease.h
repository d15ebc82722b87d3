// Per-slot quota leases: the allocation fast path (docs/memory-accounting.md).
//
// A slot's committed_bytes[d] may include a spare lease: bytes already
// admitted into DeviceState::used_bytes that no allocation uses yet. The
// lease word Slot::lease[d].word holds that spare amount, tagged with the
// slot's claim generation. An allocation that fits in the spare and a free
// that keeps it under cap_bytes move bytes between "in use" and "spare" with
// one CAS on the slot's own line: committed_bytes and used_bytes do not move,
// so no seqlock bracket is needed and the reaper's snapshot is unaffected.
// Everything else (taking a lease, returning one, stealing another slot's,
// settling a theft) runs inside the bracket in memory_accounting.cc.
//
// Word: bits 63..48 claim tag, bit 47 OWED, bit 46 CLOSED, bit 45 STALE,
// bits 44..0 amount.
//   open   (tag, 0, 0, 0, a): a bytes of spare.
//   OWED   (tag, 1, 0, s, x): a thief took x spare bytes back into used_bytes;
//          committed_bytes still holds them until the owner settles (its
//          share of used_bytes is committed - x meanwhile).
//   CLOSED (tag, 0, 1, 0, 0): the exit release ran; no fast path any more.
//   STALE  (tag, o, 0, 1, a): the limits the lease was admitted under changed
//          (a lower quota, more agent_extra_bytes, a resident allowance):
//          still spare and still counted, but only the owner's refill, which
//          admits again under the new limits, reopens the word
//          (invalidate_leases in memory_accounting.h). Setting STALE moves no
//          share, so it needs no bracket: smi and the agent can do it.
// The fast path accepts only the word of its own claim with no flag set, so a
// stale word costs it nothing: the same one compare.
#pragma once

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"

namespace gpuslice::limiter {

inline constexpr int kLeaseAmountBits = 45;
inline constexpr std::uint64_t kLeaseAmountMask = (std::uint64_t{1} << kLeaseAmountBits) - 1;
inline constexpr std::uint64_t kLeaseStale = std::uint64_t{1} << 45;
inline constexpr std::uint64_t kLeaseClosed = std::uint64_t{1} << 46;
inline constexpr std::uint64_t kLeaseOwed = std::uint64_t{1} << 47;
inline constexpr std::uint64_t kLeaseTagMask = ~kLeaseAmountMask;  // tag and flags
inline constexpr int kLeaseTagShift = 48;
// Largest lease taken at once, and the share of the remaining headroom a
// lease may take (1/kLeaseHeadroomShare), so leases shrink to 0 at the quota.
inline constexpr std::uint64_t kLeaseMaxBytes = std::uint64_t{32} << 20;
inline constexpr std::uint64_t kLeaseHeadroomShare = 8;
// Slot::refills: refills in flight (low 16 bits) and a generation that each
// refill's end bumps (the rest), as Slot::seq counts brackets.
inline constexpr std::uint32_t kRefillsInFlightMask = 0xffffu;
inline constexpr std::uint32_t kRefillsGeneration = 0x10000u;

// The tag of a claim generation (what an open lease word of it carries).
constexpr std::uint64_t lease_tag_of(std::uint32_t claim_generation) noexcept {
  return static_cast<std::uint64_t>(claim_generation & 0xffffu) << kLeaseTagShift;
}
// The tag of the slot's current claim: only for the slot's owner, which read
// it when it claimed the slot (a stale thread must use the value it cached).
inline std::uint64_t lease_tag(const Region* r, int slot) noexcept {
  return lease_tag_of(r->slots[slot].claim_generation.load(std::memory_order_acquire));
}

// Spare amount of a word, and what it owes (x for OWED words, else 0).
constexpr std::uint64_t lease_amount(std::uint64_t word) noexcept { return word & kLeaseAmountMask; }
constexpr std::uint64_t lease_owed(std::uint64_t word) noexcept {
  return (word & kLeaseOwed) != 0 ? word & kLeaseAmountMask : 0;
}
// Spare bytes, spendable or STALE: admitted, not allocated.
constexpr std::uint64_t lease_spare(std::uint64_t word) noexcept {
  return (word & (kLeaseOwed | kLeaseClosed)) != 0 ? 0 : word & kLeaseAmountMask;
}
constexpr bool lease_stale(std::uint64_t word) noexcept { return (word & kLeaseStale) != 0; }

// Allocation from the slot's spare lease: one CAS, or false (slow path).
// Caller guarantees slot < kMaxSlots and dev < kMaxDevices.
inline bool lease_alloc(Slot::Lease& lease, std::uint64_t tag, std::uint64_t bytes) noexcept {
  std::atomic<std::uint64_t>& word = lease.word;
  std::uint64_t cur = word.load(std::memory_order_relaxed), next;
  do {
    // cur ^ tag: the amount when the word is of this claim with no flag set
    // (a tag has no bit below kLeaseTagShift), else above kLeaseAmountMask.
    const std::uint64_t spare = cur ^ tag;
    // (The subtract's borrow is the test: one instruction fewer than a
    // compare, then the subtract.)
    if ((spare >> kLeaseAmountBits) != 0 || __builtin_sub_overflow(spare, bytes, &next)) return false;
    next ^= tag;  // cur - bytes: the amount less bytes, below the tag's bits
  } while (!word.compare_exchange_weak(cur, next, std::memory_order_relaxed));
  return true;
}
inline bool lease_alloc(Slot& s, std::uint64_t tag, int dev, std::uint64_t bytes) noexcept {
  return lease_alloc(s.lease[dev], tag, bytes);
}
inline bool lease_alloc(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes) noexcept {
  return lease_alloc(r->slots[slot], tag, dev, bytes);
}

// The most spare a free may leave the slot's word holding: the lease cap,
// never more than the slot holds (committed_bytes), so that a release of
// bytes never reserved is not kept. Plain loads.
inline std::uint64_t lease_room(const Slot& s, int dev) noexcept {
  const std::uint64_t cap = s.lease[dev].cap_bytes.load(std::memory_order_relaxed);
  const std::uint64_t committed = s.committed_bytes[dev].load(std::memory_order_relaxed);
  return cap < committed ? cap : committed;
}

// A free kept as spare: one CAS, or false (slow path) when the spare would
// exceed the lease cap or the bytes this slot holds (a release of bytes never
// reserved then takes the clamped slow path).
// (`room`: lease_room() of the word's slot and device.)
inline bool lease_free(Slot::Lease& lease, std::uint64_t room, std::uint64_t tag, std::uint64_t bytes) noexcept {
  std::atomic<std::uint64_t>& word = lease.word;
  std::uint64_t cur = word.load(std::memory_order_relaxed);
  do {
    const std::uint64_t spare = cur ^ tag;  // as in lease_alloc
    if ((spare >> kLeaseAmountBits) != 0 || bytes > room || spare > room - bytes) return false;
  } while (!word.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  return true;
}
inline bool lease_free(Slot& s, std::uint64_t tag, int dev, std::uint64_t bytes) noexcept {
  return lease_free(s.lease[dev], lease_room(s, dev), tag, bytes);
}
inline bool lease_free(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes) noexcept {
  return lease_free(r->slots[slot], tag, dev, bytes);
}

// The bytes of live slots' spare leases on `dev`: admitted, not allocated.
// A racy sum, for display (cuMemGetInfo, NVML, smi, agent); enforcement
// never depends on it.
std::uint64_t spare_lease_bytes(const Region* r, int dev) noexcept;

// Test hooks: the steps of a steal and of a settle, each able to stop where a
// SIGKILL would (the bracket then stays open, as a dead process leaves it).
// Not for production callers.
namespace lease_steps {
enum class Stop { none, after_bracket, after_mark, after_uncount, after_clear };
// Thief `slot` takes `victim`'s spare on `dev` (returns the bytes taken).
std::uint64_t steal(Region* r, int slot, int victim, int dev, Stop stop) noexcept;
// Owner `slot` settles an OWED word on `dev` (returns the bytes settled).
// `between`, if given, runs after the word is reopened and before
// committed_bytes drops (another thread's exit release, in a test).
std::uint64_t settle(Region* r, int slot, int dev, Stop stop, void (*between)(void*) = nullptr,
                     void* ctx = nullptr) noexcept;
// A refill of `bytes` on `dev` that runs `between` after it read the lease
// epoch and before it admits (a limit change racing it, in a test).
bool refill(Region* r, int slot, int dev, std::uint64_t bytes, void (*between)(void*), void* ctx) noexcept;
// A release of `bytes` on `dev` (the slow path) that runs `between` after it
// read the lease word it takes its floor from and before it takes the bytes
// out of committed_bytes (another thread of the slot settling or returning
// its spare, in a test).
void release(Region* r, int slot, int dev, std::uint64_t bytes, void (*between)(void*), void* ctx) noexcept;
}  // namespace lease_steps

}  // namespace gpuslice::limiter
