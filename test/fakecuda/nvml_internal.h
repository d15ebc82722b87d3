// What the NVML sources share (nvml.cc, nvml_limits.cc).
#pragma once

#include <cstdint>

#include "nvml_abi.h"
#include "state.h"

namespace gpuslice::fakecuda {

// The state while NVML is initialised, else nullptr.
State* nvml_attached();
// Validates a handle: NVML_SUCCESS with the state and the device's index.
nvmlReturn_t nvml_check_device(nvmlDevice_t device, State** state, std::uint32_t* index);
// nvmlDeviceGetMemoryInfo_v2 in a cgroup with a hard limit on `dev`: the
// limit as total, the cgroup's use as used, free bounded by the device's.
void partition_memory(std::uint32_t dev, std::uint64_t* total, std::uint64_t* used, std::uint64_t* free);

}  // namespace gpuslice::fakecuda
