// Which of the container's devices a process's CUDA ordinal is. Per-device
// limits (GPUSLICE_MEMORY_LIMIT=0=8Gi,1=4Gi, GPUSLICE_SM_LIMIT) are written
// with the container's ordinals: the GPUs as its runtime exposed them, before
// a process's own CUDA_VISIBLE_DEVICES (docs/deploy.md, "Device ordinals").
// A launcher that gives each worker its own CUDA_VISIBLE_DEVICES (Ray,
// torchrun-style runners) renumbers the worker's devices; this file turns the
// worker's ordinal back into the container's, so that every process gives a
// physical GPU the same limits. Cold: once per device and process.
#include "hook/devices.h"

#include <cuda.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "hook/config.h"
#include "hook/real.h"
#include "platform/uuid.h"

namespace gpuslice::hook {

int nvml_index_of(const std::uint8_t uuid[16]) noexcept {
  // NVML initialised once for this (its reference count is the program's own).
  static std::atomic<int> ready{0};  // 0 = not tried, 1 = usable, -1 = not
  if (ready.load(std::memory_order_acquire) == 0) {
    const bool ok = load_nvml() && real_nvmlInit_v2 != nullptr && real_nvmlDeviceGetCount_v2 != nullptr &&
                    real_nvmlDeviceGetHandleByIndex_v2 != nullptr && real_nvmlDeviceGetUUID != nullptr &&
                    real_nvmlInit_v2() == NVML_SUCCESS;
    int expected = 0;  // a racing thread's outcome stands (at worst one more reference)
    ready.compare_exchange_strong(expected, ok ? 1 : -1, std::memory_order_acq_rel);
  }
  if (ready.load(std::memory_order_acquire) != 1) return -1;
  unsigned count = 0;
  if (real_nvmlDeviceGetCount_v2(&count) != NVML_SUCCESS) return -1;
  for (unsigned i = 0; i < count && i < kMaxDevices; ++i) {
    nvmlDevice_t device{};
    char text[96] = {};
    std::uint8_t got[16];
    if (real_nvmlDeviceGetHandleByIndex_v2(i, &device) == NVML_SUCCESS &&
        real_nvmlDeviceGetUUID(device, text, sizeof text) == NVML_SUCCESS && platform::parse_uuid(text, got) &&
        std::memcmp(got, uuid, 16) == 0)
      return static_cast<int>(i);
  }
  return -1;
}

int container_ordinal(CUdevice ordinal, const std::uint8_t uuid[16]) noexcept {
  // What the driver read at cuInit (a program may set it before then, never after).
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || ordinal < 0) return ordinal >= 0 && ordinal < static_cast<int>(kMaxDevices) ? ordinal : -1;
  // The process's ordinal-th entry: the driver enumerates them in order.
  const char* p = visible;
  for (int i = 0; i < ordinal && p != nullptr; ++i) {
    p = std::strchr(p, ',');
    if (p != nullptr) ++p;
  }
  if (p == nullptr) return -1;
  const char* end = std::strchr(p, ',');
  const std::size_t len = end == nullptr ? std::strlen(p) : static_cast<std::size_t>(end - p);
  bool digits = len > 0 && len <= 4;
  int index = 0;
  for (std::size_t i = 0; digits && i < len; ++i) {
    digits = p[i] >= '0' && p[i] <= '9';
    index = index * 10 + (p[i] - '0');
  }
  // An index names the container's device itself; a UUID (or prefix) is the
  // GPU whose UUID the driver reported, found in NVML's enumeration. A MIG
  // UUID's device is a MIG instance, not one of NVML's GPUs: unknown.
  if (digits) return index < static_cast<int>(kMaxDevices) ? index : -1;
  return uuid == nullptr ? -1 : nvml_index_of(uuid);
}

void container_limits(int container, std::uint64_t* memory, std::uint32_t* sm) noexcept {
  const options::Options& o = config().options;
  if (container >= 0 && container < static_cast<int>(kMaxDevices)) {
    *memory = o.memory_limit[container];
    *sm = o.sm_limit[container];
    return;
  }
  // Unknown: the smallest limits configured for any device (the safe side).
  *memory = o.memory_limit[0];
  *sm = o.sm_limit[0];
  for (std::uint32_t d = 1; d < kMaxDevices; ++d) {
    if (o.memory_limit[d] < *memory) *memory = o.memory_limit[d];
    if (o.sm_limit[d] < *sm) *sm = o.sm_limit[d];
  }
}

}  // namespace gpuslice::hook
