// Whether the driver still knows a device address: the one question that
// releases a record of memory freed behind gpuslice's back, for the linear
// table (memory.cc) and the pools' (pool_state.cc) alike.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "hook/real.h"

namespace gpuslice::hook {

// Only "no such allocation" means freed; any other error (no current
// context, ...) keeps the count: never release what may still be held.
inline bool address_gone(std::uint64_t key) noexcept {
  if (real_cuMemGetAddressRange_v2 == nullptr) return false;
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult rc = real_cuMemGetAddressRange_v2(&base, &size, key);
  return rc == CUDA_ERROR_NOT_FOUND || rc == CUDA_ERROR_INVALID_VALUE;
}

}  // namespace gpuslice::hook
