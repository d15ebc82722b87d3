// Exact cross-process device-memory accounting on the shared region.
//
// Every byte is reserved in DeviceState::used_bytes (with the quota check)
// *before* the real allocation, and mirrored in the owning slot's
// committed_bytes, inside a seqlock bracket on Slot::seq. A dead process's
// share is recovered exactly by the reaper from a consistent snapshot, whatever
// instruction it died at. See docs/memory-accounting.md.
//
// Quota leases (limiter/lease.h): the forms taking a lease `tag` keep a spare
// lease inside the slot's committed bytes, so that most allocations and frees
// are one CAS on the slot's own cache line. The forms without a tag are exact
// (no lease taken) and lease-aware. Nothing here blocks on another process.
#pragma once

#include <cstdint>

#include "gpuslice/region.h"
#include "shm/region_file.h"

namespace gpuslice::limiter {

// Admits `bytes` on device entry `dev` for process slot `slot`, before the real
// allocation. On refusal, reaps dead slots once and retries once; if still
// refused, counts DeviceState::oom_refusals and returns false. `self` judges
// the others' slots when it reaps (its region descriptor probes their file
// locks: shm::Observer).
bool reserve(Region* r, int slot, int dev, std::uint64_t bytes, const shm::Observer& self) noexcept;
// The same with quota leases: `tag` is lease_tag(r, slot) read when the
// process claimed the slot (a stale thread of a previous owner then never
// touches a new owner's lease). Before refusing, also takes every other live
// slot's spare lease back into the budget: a refusal means really full.
bool reserve(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes, const shm::Observer& self) noexcept;
// Admission only, without the reap-and-retry slow path (and without counting
// the refusal): for callers that want to free caches first and retry.
bool try_reserve(Region* r, int slot, int dev, std::uint64_t bytes) noexcept;
// Undoes one successful reserve or charge (a free, or the real allocation
// failed). Releasing more than the slot holds is clamped (never underflows)
// and counted in DeviceState::accounting_errors.
void release(Region* r, int slot, int dev, std::uint64_t bytes) noexcept;
// The same with quota leases: the bytes become spare lease when they fit.
void release(Region* r, int slot, std::uint64_t tag, int dev, std::uint64_t bytes) noexcept;
// Releases everything the slot holds on every device (exactly once per byte
// as long as the caller's own records are not released again afterwards),
// and closes its leases: no fast path and no theft on them afterwards.
void release_all(Region* r, int slot) noexcept;
// Charges without a quota check (memory the driver already holds). Returns
// false if the device is now above its quota; the caller decides.
bool charge(Region* r, int slot, int dev, std::uint64_t bytes) noexcept;

// Reaping of dead slots, exact under SIGKILL at any instruction (of the dead
// process or of a reaper). Marks every dead slot kSlotLive->kSlotReaping, then
// per device takes a snapshot in which every other slot is quiescent and
// unchanged, and CASes used_bytes from the snapshot's value D to S = the sum of
// the other slots' committed - owed bytes; then zeroes and frees the dead slots.
// Reapers exclude each other through RegionHeader::reaper_lock, whose holder a
// stalled reaper never loses and a dead one does (see reaper_token).
// Returns the number of slots freed (>= 0), or kReapBusy when another live
// reaper holds the lock or the snapshot did not settle (bounded retries): the
// dead slots then stay kSlotReaping and the next reaper finishes them.
inline constexpr int kReapBusy = -1;
// Dead slots are those shm::judge_liveness finds dead, seen from observer:
// its /proc, and each slot's file lock through its own region descriptor.
int reap_dead(Region* r, const shm::Observer& observer) noexcept;
// A bounded sweep (a process's start, issue 35): judges at most `budget` live
// slots among the 64 from `first` on, whatever the number of live processes,
// and reaps those it finds dead exactly as reap_dead does (the snapshot still
// covers every slot). Other dead slots wait for the next sweep, the agent, an
// allocation above the quota, a claim that finds no free slot or a process's
// first cuMemGetInfo (reap_dead).
int reap_sweep(Region* r, const shm::Observer& observer, std::uint32_t first, std::uint32_t budget) noexcept;
// The agent's form: is_dead decides each live slot (it knows host pids),
// given the slot's file lock seen through the observer's region descriptor
// (shm::probe_slot_lock; unknown without one, and when the reaper asks
// about the reaper lock's holder: the process alone). The reaper lock needs
// an identity: the observer's (read_identity(0)).
using DeadPredicate = bool (*)(const Slot& s, shm::SlotLock lock, void* ctx);
int reap_slots(Region* r, DeadPredicate is_dead, void* ctx) noexcept;
int reap_slots(Region* r, const shm::Observer& observer, DeadPredicate is_dead, void* ctx) noexcept;

// Packs an identity into the reaper lock word: pid (22 bits, the Linux
// maximum), low 21 bits of the pid-namespace inode and of the start time.
std::uint64_t reaper_token(const shm::ProcessIdentity& id) noexcept;

// Spilled bytes (GPUSLICE_OVERSUBSCRIBE=spill): a part of committed bytes,
// mirrored per device and per slot. Subtractions are clamped at zero (the
// reaper or the exit path may have recovered a slot's share meanwhile).
void count_spilled(Region* r, int slot, int dev, std::uint64_t bytes) noexcept;
void uncount_spilled(Region* r, int slot, int dev, std::uint64_t bytes) noexcept;
// The exit release (inside its bracket): the slot's spilled share on `dev`
// leaves the device's totals with it.
void drop_slot_spilled(Region* r, Slot& s, int dev) noexcept;
// Device-resident bytes of the container on `dev`: used_bytes - spilled,
// read so that it is never below the true amount at some instant of the call
// (DeviceState::spilled_in_bytes / spilled_out_bytes). Spare quota leases
// count as resident: devices with a resident allowance take none.
std::uint64_t resident_bytes(const Region* r, int dev) noexcept;

// A limit changed so that admitted spare leases on `dev` may no longer fit
// (gpuslice-smi set lowered the quota, the agent raised agent_extra_bytes, a
// resident allowance was published): bumps DeviceState::lease_epoch and marks
// every lease word STALE. Moves no share: callable without a slot (smi, the
// agent). From its return no spare admitted before it is spent: the next
// allocation of each process admits again under the new limits.
void invalidate_leases(Region* r, int dev) noexcept;
// The same, then takes every other slot's spare back into used_bytes inside
// `slot`'s bracket (for a process that publishes a resident allowance: spare
// leases must not count as resident). Returns whether any was taken.
bool revoke_leases(Region* r, int slot, int dev) noexcept;

// Allocations waiting for device memory (GPUSLICE_OVERSUBSCRIBE=wait), per
// slot and device: the reaper takes a dead waiter out of the device's count.
void begin_wait(Region* r, int slot, int dev) noexcept;
void end_wait(Region* r, int slot, int dev) noexcept;
void sub_clamped32(std::atomic<std::uint32_t>& word, std::uint32_t n) noexcept;

// For display: used_bytes - live spare leases (a racy sum) + the agent extra in force
// (saturating). Admission never uses it.
std::uint64_t used_bytes(const Region* r, int dev) noexcept;
std::uint64_t quota_bytes(const Region* r, int dev) noexcept;  // kUnlimited = none

}  // namespace gpuslice::limiter
