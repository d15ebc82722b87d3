// Process slots and device entries of the region: lock-free claims.
#include <sched.h>
#include <time.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "platform/clock.h"
#include "platform/ofd_lock.h"
#include "shm/region_file.h"

namespace gpuslice::shm {

int claim_slot(Region* r, const ProcessIdentity& self) noexcept {
  if (r == nullptr) return -1;
  // Start where this pid hashes so that hundreds of processes starting at once
  // do not all fight over slot 0.
  const std::uint32_t first = self.pid % kMaxSlots;
  for (std::uint32_t k = 0; k < kMaxSlots; ++k) {
    Slot& s = r->slots[(first + k) % kMaxSlots];
    if (s.state.load(std::memory_order_relaxed) != kSlotFree) continue;
    std::uint32_t expected = kSlotFree;
    if (!s.state.compare_exchange_strong(expected, kSlotClaiming)) continue;
    // The reaper judges a claiming slot once its pid is written, last, when
    // the identity is complete: a claimer killed before that (three stores)
    // leaks this slot, never memory.
    // A new claim generation tags this claim's lease words (limiter/lease.h):
    // a stale thread of a previous owner holds another tag, so its CAS fails.
    std::uint32_t generation = s.claim_generation.load() + 1;
    if ((generation & 0xffffu) == 0) ++generation;
    s.claim_generation.store(generation);
    for (std::atomic<std::uint16_t>& waiting : s.oversub_waiting) waiting.store(0);
    for (Slot::Lease& lease : s.lease) {
      lease.cap_bytes.store(0);
      lease.word.store(static_cast<std::uint64_t>(generation & 0xffffu) << 48);
    }
    s.host_pid.store(0);
    s.start_time.store(self.start_time);
    s.pidns_inode.store(self.pidns_inode);
    s.pid.store(self.pid);
    expected = kSlotClaiming;
    if (s.state.compare_exchange_strong(expected, kSlotLive)) {
      r->header.live_slots.fetch_add(1, std::memory_order_relaxed);
      return static_cast<int>((first + k) % kMaxSlots);
    }
    // Somebody judged us dead and reclaimed the slot in between (only an
    // observer with wrong information can): take another.
  }
  return -1;
}

void release_slot(Region* r, int slot) noexcept {
  if (r == nullptr || slot < 0 || slot >= static_cast<int>(kMaxSlots)) return;
  Slot& s = r->slots[slot];
  if (s.state.load() != kSlotLive) return;
  // Memory still counted, or an operation in flight: leave the slot live. The
  // reaper removes exactly what it holds once the process has exited.
  if ((s.seq.load() & kSeqInflightMask) != 0) return;
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    if (s.committed_bytes[d].load() != 0) return;
  }
  for (std::uint32_t d = 0; d < kMaxDevices; ++d) {
    s.context_bytes[d].store(0);
    s.nvml_used_bytes[d].store(0);
    s.lease[d].word.store(0);  // closed by release_all: nothing spare or owed left
    s.lease[d].cap_bytes.store(0);
  }
  r->header.lease_holders[slot / 64].fetch_and(~(std::uint64_t{1} << (slot % 64)));
  // Clear the identity before the slot becomes free, so that a new owner's
  // identity is never overwritten.
  s.start_time.store(0);
  s.pidns_inode.store(0);
  s.pid.store(0);
  s.host_pid.store(0);
  std::uint32_t expected = kSlotLive;
  if (s.state.compare_exchange_strong(expected, kSlotFree)) {
    r->header.live_slots.fetch_sub(1, std::memory_order_relaxed);
  }
}

namespace {

// Past the region's bytes: the locks never cover data anybody reads.
bool slot_lock_byte(int slot, std::uint64_t* byte) noexcept {
  if (slot < 0 || slot >= static_cast<int>(kMaxSlots)) return false;
  *byte = sizeof(Region) + static_cast<std::uint64_t>(slot);
  return true;
}

}  // namespace

bool lock_slot_file(int fd, int slot) noexcept {
  std::uint64_t byte = 0;
  return slot_lock_byte(slot, &byte) && platform::ofd_lock::take(fd, platform::ofd_lock::Kind::write, byte, 1);
}

void unlock_slot_file(int fd, int slot) noexcept {
  std::uint64_t byte = 0;
  if (slot_lock_byte(slot, &byte)) platform::ofd_lock::drop(fd, byte, 1);
}

Join begin_attach(int fd) noexcept {
  if (platform::ofd_lock::take(fd, platform::ofd_lock::Kind::read, kJoinLockByte, 1)) return Join::held;
  return platform::ofd_lock::probe(fd, kJoinLockByte, 1) == platform::ofd_lock::Probe::unknown ? Join::no_locks
                                                                                               : Join::removing;
}

void end_attach(int fd) noexcept {
  if (fd >= 0) platform::ofd_lock::drop(fd, kJoinLockByte, 1);
}

bool lock_for_removal(int fd) noexcept {
  // Only the lock held (or no OFD locks at all) lets the remover go on. A
  // take refused, then a probe that finds the byte free, is a joiner that let
  // go in between: not a lock (the next joiner would join and claim unseen
  // while the region is renamed away). Take again, a few times; else the next
  // cycle does.
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (platform::ofd_lock::take(fd, platform::ofd_lock::Kind::write, kJoinLockByte, 1)) return true;
    switch (platform::ofd_lock::probe(fd, kJoinLockByte, 1)) {
      case platform::ofd_lock::Probe::held: return false;
      case platform::ofd_lock::Probe::unknown: return true;  // no OFD locks here: as without the lock
      case platform::ofd_lock::Probe::free: break;
    }
  }
  return false;
}

void unlock_for_removal(int fd) noexcept { platform::ofd_lock::drop(fd, kJoinLockByte, 1); }

SlotLock probe_slot_lock(int region_fd, int slot) noexcept {
  std::uint64_t byte = 0;
  if (!slot_lock_byte(slot, &byte)) return SlotLock::unknown;
  // A lock of another open file description only: never our own slot's, nor
  // (in a forked child) one we share with our parent — the child opens its
  // own descriptor before it judges anybody.
  switch (platform::ofd_lock::probe(region_fd, byte, 1)) {
    case platform::ofd_lock::Probe::held: return SlotLock::held;
    case platform::ofd_lock::Probe::free: return SlotLock::free;
    case platform::ofd_lock::Probe::unknown: break;
  }
  return SlotLock::unknown;
}

int device_index(Region* r, const std::uint8_t uuid[16], std::uint64_t quota_bytes_if_new,
                 std::uint32_t sm_limit_pct_if_new, SmPolicy policy_if_new, std::uint64_t claim_timeout_ns) noexcept {
  if (r == nullptr || uuid == nullptr) return -1;
  // Entries are claimed lowest-free-first and an entry being written is waited
  // for, so two processes can never publish the same UUID twice. A round is
  // restarted only when our own claim was abandoned by a waiter (we stalled).
  for (int round = 0; round < 4; ++round) {
    bool restart = false;
    for (std::uint32_t i = 0; i < kMaxDevices && !restart; ++i) {
      DeviceState& d = r->devices[i];
      std::uint64_t wait_start = 0;
      for (;;) {
        std::uint32_t state = d.uuid_state.load(std::memory_order_acquire);
        if (state == kDevicePublished) {
          if (std::memcmp(d.uuid, uuid, sizeof d.uuid) == 0) return static_cast<int>(i);
          break;
        }
        if (state == kDeviceWriting) {
          const std::uint64_t now = platform::monotonic_ns();
          if (wait_start == 0) wait_start = now;
          if (now - wait_start < claim_timeout_ns) {
            sched_yield();
            continue;
          }
          // The writer died or stalled mid-claim: retire the entry (a stalled
          // writer's publish then fails and it rescans).
          d.uuid_state.compare_exchange_strong(state, kDeviceAbandoned);
          continue;
        }
        if (state != kDeviceFree) break;  // abandoned (or garbage): never reuse
        if (!d.uuid_state.compare_exchange_strong(state, kDeviceWriting)) continue;
        std::memcpy(d.uuid, uuid, sizeof d.uuid);
        d.quota_bytes.store(quota_bytes_if_new);
        d.sm_limit_pct.store(sm_limit_pct_if_new);
        d.sm_policy.store(static_cast<std::uint32_t>(policy_if_new));
        d.cost_scale_ppm.store(1'000'000);
        std::uint32_t writing = kDeviceWriting;
        if (d.uuid_state.compare_exchange_strong(writing, kDevicePublished, std::memory_order_acq_rel)) {
          return static_cast<int>(i);
        }
        restart = true;
        break;
      }
    }
    if (!restart) return -1;
  }
  return -1;
}

int device_index(Region* r, const std::uint8_t uuid[16], std::uint64_t quota_bytes_if_new,
                 std::uint32_t sm_limit_pct_if_new, SmPolicy policy_if_new) noexcept {
  return device_index(r, uuid, quota_bytes_if_new, sm_limit_pct_if_new, policy_if_new, kDeviceClaimTimeoutNs);
}

}  // namespace gpuslice::shm
