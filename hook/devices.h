// The container's device ordinals against a process's own (devices.cc):
// per-device limits name the container's GPUs, whatever a worker's
// CUDA_VISIBLE_DEVICES renumbers them to.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace gpuslice::hook {

// The container's ordinal (the GPUs as its runtime exposed them, before this
// process's CUDA_VISIBLE_DEVICES) of this process's `ordinal`, whose UUID the
// driver reports as `uuid`; -1 when it cannot be told (a MIG UUID, no NVML).
int container_ordinal(CUdevice ordinal, const std::uint8_t uuid[16]) noexcept;
// The configured limits of container ordinal `container`; for -1 the
// smallest configured for any device.
void container_limits(int container, std::uint64_t* memory, std::uint32_t* sm) noexcept;
// The container's index of the GPU `uuid` in NVML's enumeration (which
// CUDA_VISIBLE_DEVICES does not change), or -1.
int nvml_index_of(const std::uint8_t uuid[16]) noexcept;

}  // namespace gpuslice::hook
