// Memory oversubscription (GPUSLICE_OVERSUBSCRIBE, GPUSLICE_MEMORY_RESIDENT;
// docs/memory.md): what an allocation that fits the container's quota gets
// when the device is full, or when the container already holds its
// device-resident allowance on it:
//   fail   CUDA_ERROR_OUT_OF_MEMORY (the default, as without the option);
//   spill  cuMemAlloc / cuMemAllocPitch / cuMemAllocManaged are served as
//          managed memory that prefers host residence, counted as spilled
//          (still within the quota);
//   wait   the call sleeps (futex on the region, woken by frees of the
//          container, and every 20 ms for frees elsewhere) until the memory is
//          there or GPUSLICE_OVERSUBSCRIBE_WAIT passes, then fails; after a
//          wait it also needs the container within the quota in force
//          (gpuslice-smi set may have lowered it meanwhile).
// Pool, VMM and IPC paths cannot be served by managed memory: over the
// allowance they fail (or wait). With neither option set, all of this costs
// one predictable branch per allocation. A free wakes the waiters
// (hook/account.h, wake_oversub_waiters).
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "hook/account.h"
#include "limiter/alloc_table.h"

namespace gpuslice::hook {

// Whether oversubscription is on: oversubscribing() (hook/config.h).

// Would the container hold more than its device-resident allowance on `entry`
// once `bytes` (already reserved against the quota) are resident? The live
// agent's extra (agent_extra_bytes) counts as resident.
bool over_allowance(int entry) noexcept;

// The whole allocation under the policy, for an allocation already reserved
// against the quota in `r`: tries `real_alloc` (unless over the allowance);
// on device out-of-memory fails, spills (when `spill` is given: it allocates
// the managed stand-in) or waits. Commits the record in `table` on success,
// returns the reservation on failure.
using RealAllocFn = CUresult (*)(void* ctx) noexcept;
CUresult alloc_oversubscribed(limiter::AllocTable& table, const Reservation& r, std::uint64_t* key,
                              limiter::AllocKind kind, RealAllocFn real_alloc, RealAllocFn spill, void* ctx) noexcept;

// For paths that cannot spill (pools, VMM): false when the allocation must be
// refused (over the allowance under `fail`, or after a wait timed out).
// !may_wait: refused at once under `wait` too (memory already on the device).
bool resident_admits(int entry, bool may_wait = true) noexcept;

}  // namespace gpuslice::hook
