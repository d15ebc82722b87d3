// Device memory shared between processes of one container, counted once
// (Region::shared, ABI v5; docs/memory-accounting.md, "Shared allocations").
//
// The exporter publishes an allocation it counted: its bytes move from its
// slot's committed_bytes to the entry's charged_bytes (both inside its
// bracket), so used_bytes = the slots' shares + every entry's charged_bytes,
// which is what the reaper's snapshot sums. Importers of the same container
// join the entry (a bit in their slot's shared_held) and are charged nothing.
// The last holder to leave releases the bytes; a dead holder is taken out by
// the reaper (shared_reap), and an entry whose every holder is dead is closed
// there, its bytes leaving used_bytes with the reaper's snapshot. Closing is
// elected by one CAS (ACTIVE -> CLOSING), then the holders are scanned again:
// a joiner sets its bit before it checks the state, the closer sets the state
// before it scans, so one of them sees the other (seq_cst). Nothing blocks on
// another process.
#pragma once
#include <cstdint>

#include "gpuslice/region.h"

namespace gpuslice::limiter {

// Moves `bytes` that `slot` holds on device entry `dev` into a new entry for
// `key`, held by `slot`. Returns the entry, or -1 (table full, key taken, the
// slot holds less): nothing moved, the bytes stay the slot's.
int shared_publish(Region* r, int slot, int dev, std::uint64_t key, std::uint64_t bytes) noexcept;
// Joins the active entry for `key` on `dev`. Returns it, or -1 (none).
int shared_join(Region* r, int slot, int dev, std::uint64_t key) noexcept;
// `slot` lets go of entry `e`. Returns the bytes released from used_bytes
// (0 while another live process of the container holds it).
std::uint64_t shared_leave(Region* r, int slot, int e) noexcept;
// Every entry `slot` holds (a clean exit).
void shared_leave_all(Region* r, int slot) noexcept;
// The reaper, before its snapshot: the slots in `dead` (a kMaxSlots bitmap)
// hold nothing; entries held by no live slot are closed (charged_bytes 0).
void shared_reap(Region* r, const std::uint64_t* dead) noexcept;
// Sum of charged_bytes on `dev` (the reaper's snapshot adds it to the slots').
std::uint64_t shared_charged(const Region* r, int dev) noexcept;
// Sum of charged_bytes on `dev` of the entries `slot` holds: memory NVML may
// show as that process's though no slot counts it (the agent's bypass check).
std::uint64_t shared_held_bytes(const Region* r, int slot, int dev) noexcept;

}  // namespace gpuslice::limiter
