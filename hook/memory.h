// Linear, pitched and managed allocations (memory.cc): their table, which
// cuMemFreeAsync (pools.cc) frees from too, and the sweep after the driver
// freed memory implicitly.
#pragma once

#include "limiter/alloc_table.h"

namespace gpuslice::hook {

// The table of linear/pitched/managed allocations: cuMemFreeAsync frees
// those too.
limiter::AllocTable& linear_table() noexcept;
// After the driver freed memory implicitly (context destroyed, primary context
// reset or released for the last time): release every counted allocation the
// driver no longer knows (arrays included: hook/arrays.h).
void sweep_implicitly_freed() noexcept;
// Whether the driver no longer knows the allocation at `key` (a counted
// pointer): "no such allocation". Any other answer (no current context, ...)
// says nothing: the count is kept. For free_counted (hook/wrap.h) and the sweep.
// A pool allocation of ours holding `key` makes a record of this table at
// `key` stale too (the driver handed the address out again after the memory
// went with a context: between the tables what platform::record's
// stale-record rule is within one).
bool pointer_gone(std::uint64_t key, const limiter::AllocRecord& = {}) noexcept;
// Before a pool allocation of ours at `key` is freed (the address still
// its): a record of this table at `key` is stale, released (issue 32).
void release_stale_linear(std::uint64_t key) noexcept;

}  // namespace gpuslice::hook
