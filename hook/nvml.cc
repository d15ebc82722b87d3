// NVML memory queries, so nvidia-smi and pynvml inside the container show the
// quota as the card's memory and the container's usage as what is used. A
// device this process has not mapped to a CUDA ordinal is mapped through
// CUDA first; one CUDA cannot see (CUDA_VISIBLE_DEVICES) is found among the
// container's GPUs by its UUID (hook/devices.cc) and keeps its own quota.
#include <cuda.h>

#include <algorithm>
#include <cstring>

#include "hook/wrap.h"
#include "limiter/memory_accounting.h"
#include "platform/uuid.h"

using namespace gpuslice;
using namespace gpuslice::hook;

namespace {

// Region entry of an NVML device, or -1 when CUDA does not see it.
int entry_of(nvmlDevice_t device) noexcept {
  if (real_nvmlDeviceGetUUID == nullptr) return -1;
  char text[96] = {};
  std::uint8_t want[16];
  if (real_nvmlDeviceGetUUID(device, text, sizeof text) != NVML_SUCCESS || !platform::parse_uuid(text, want)) return -1;
  // NVML does not need cuInit, but ordinals do; cuInit is idempotent.
  if (real_cuInit(0) != CUDA_SUCCESS) return -1;
  int count = 0;
  if (real_cuDeviceGetCount(&count) != CUDA_SUCCESS) return -1;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    CUuuid u{};
    if (real_cuDeviceGetUuid_v2(&u, ordinal) == CUDA_SUCCESS && std::memcmp(u.bytes, want, 16) == 0)
      return device_entry(ordinal);
  }
  // Hidden from CUDA by this process's CUDA_VISIBLE_DEVICES: still one of the
  // container's GPUs, with its own quota and count.
  return device_entry_of_uuid(want);
}

// Container view of (total, used) when a quota applies; false otherwise.
bool container_view(nvmlDevice_t device, std::uint64_t real_total, std::uint64_t* total, std::uint64_t* used) noexcept {
  const int entry = entry_of(device);
  if (entry < 0) return false;
  const std::uint64_t quota = limiter::quota_bytes(g_process.region, entry);
  if (quota == kUnlimited) return false;
  *total = std::min(quota, real_total);
  *used = limiter::used_bytes(g_process.region, entry);
  return true;
}

}  // namespace

GPUSLICE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
  if (!load_nvml() || real_nvmlDeviceGetMemoryInfo == nullptr) return NVML_ERROR_UNINITIALIZED;
  if (ensure_ready() != CUDA_SUCCESS) return NVML_ERROR_UNINITIALIZED;  // fail closed, as CUDA does
  nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo(device, memory);
  if (rc != NVML_SUCCESS || memory == nullptr) return rc;
  std::uint64_t total = 0, used = 0;
  if (container_view(device, memory->total, &total, &used)) {
    memory->total = total;
    memory->used = std::min(used, total);
    memory->free = total - memory->used;
  }
  return rc;
}

GPUSLICE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t* memory) {
  if (!load_nvml() || real_nvmlDeviceGetMemoryInfo_v2 == nullptr) return NVML_ERROR_UNINITIALIZED;
  if (ensure_ready() != CUDA_SUCCESS) return NVML_ERROR_UNINITIALIZED;  // fail closed, as CUDA does
  nvmlReturn_t rc = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
  if (rc != NVML_SUCCESS || memory == nullptr) return rc;
  std::uint64_t total = 0, used = 0;
  if (container_view(device, memory->total, &total, &used)) {
    memory->total = total;
    memory->reserved = 0;  // driver-reserved memory is outside the container's slice
    memory->used = std::min(used, total);
    memory->free = total - memory->used;
  }
  return rc;
}
