// CUDA arrays (arrays.cc): counted at creation, released at destroy.
#pragma once

namespace gpuslice::hook {

// After the driver freed memory implicitly: release every counted array the
// driver no longer knows (memory.cc's sweep_implicitly_freed calls it).
void sweep_implicitly_freed_arrays() noexcept;

}  // namespace gpuslice::hook
