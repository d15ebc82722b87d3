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

}  // namespace gpuslice::hook
