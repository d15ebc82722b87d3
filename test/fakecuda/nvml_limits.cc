// NVML's per-cgroup device-memory limits (R615 and later): the two calls and
// the partition's view of nvmlDeviceGetMemoryInfo_v2 (cgroup_limits.h;
// README "Per-cgroup memory limits" lists what the documentation leaves open
// and how the simulator answers it).
#include <linux/capability.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "cgroup_limits.h"
#include "nvml_internal.h"

using namespace gpuslice::fakecuda;

namespace {

// CAP_SYS_ADMIN in the effective set (capget: no libcap at run time).
bool privileged() {
  if (geteuid() == 0) return true;
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_SYS_ADMIN / 32].effective & (1u << (CAP_SYS_ADMIN % 32))) != 0;
}

// The inode of the cgroup v2 directory `name_space` names: an absolute path
// on the cgroup v2 mount. 0 (with *rc) if it names none.
std::uint64_t name_space_ino(const char* name_space, nvmlReturn_t* rc) {
  *rc = NVML_ERROR_INVALID_ARGUMENT;
  if (name_space == nullptr || name_space[0] != '/') return 0;
  const char* root = cgroup_root();
  const std::size_t n = std::strlen(root);
  if (std::strncmp(name_space, root, n) != 0 || (name_space[n] != '/' && name_space[n] != '\0')) return 0;
  struct stat st {};
  if (stat(name_space, &st) != 0 || !S_ISDIR(st.st_mode)) {
    *rc = NVML_ERROR_NOT_FOUND;
    return 0;
  }
  *rc = NVML_SUCCESS;
  return st.st_ino;
}

// Common checks: the state, the device, the driver branch, cgroup v2.
nvmlReturn_t limits_usable(nvmlDevice_t device, State** state, std::uint32_t* dev) {
  if (nvmlReturn_t rc = nvml_check_device(device, state, dev); rc != NVML_SUCCESS) return rc;
  if ((*state)->header().driver_branch < kCgroupLimitsBranch) return NVML_ERROR_NOT_SUPPORTED;
  if (*cgroup_root() == '\0') return NVML_ERROR_NOT_SUPPORTED;  // no cgroup v2 there
  return NVML_SUCCESS;
}

}  // namespace

namespace gpuslice::fakecuda {

void partition_memory(std::uint32_t dev, std::uint64_t* total, std::uint64_t* used, std::uint64_t* free) {
  State* state = nvml_attached();
  if (state == nullptr || state->header().driver_branch < kCgroupLimitsBranch) return;
  const std::uint64_t ino = own_cgroup_ino();
  if (ino == 0) return;
  State::Lock lock(*state);
  if (!lock.ok()) return;
  const CgroupLimit* e = cgroup_limit_locked(*state, ino);
  if (e == nullptr || (e->limited.load(std::memory_order_relaxed) & (1u << dev)) == 0) return;
  const std::uint64_t hard = e->hard[dev].load(std::memory_order_relaxed);
  const std::uint64_t mine = cgroup_used_locked(*state, ino, dev);
  const std::uint64_t left = mine < hard ? hard - mine : 0;
  *total = hard;
  *used = mine;
  *free = left < *free ? left : *free;
}

}  // namespace gpuslice::fakecuda

extern "C" {

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t* limits) {
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = limits_usable(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  if (limits == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (!privileged()) return NVML_ERROR_NO_PERMISSION;
  nvmlReturn_t rc = NVML_SUCCESS;
  const std::uint64_t ino = name_space_ino(limits->nameSpace, &rc);
  if (ino == 0) return rc;
  const bool clear = limits->softLimit == 0 && limits->hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX;
  if (!clear && limits->softLimit > limits->hardLimit) return NVML_ERROR_INVALID_ARGUMENT;
  State::Lock lock(*state);
  if (!lock.ok()) return NVML_ERROR_UNKNOWN;
  if (!cgroup_set_locked(*state, ino, dev, limits->softLimit, limits->hardLimit, clear))
    return NVML_ERROR_INSUFFICIENT_RESOURCES;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t* limits) {
  State* state = nullptr;
  std::uint32_t dev = 0;
  if (nvmlReturn_t rc = limits_usable(device, &state, &dev); rc != NVML_SUCCESS) return rc;
  if (limits == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  nvmlReturn_t rc = NVML_SUCCESS;
  const std::uint64_t ino = name_space_ino(limits->nameSpace, &rc);
  if (ino == 0) return rc;
  State::Lock lock(*state);
  if (!lock.ok()) return NVML_ERROR_UNKNOWN;
  state->reap_locked(-1);  // dead processes' memory is gone
  const CgroupLimit* e = cgroup_limit_locked(*state, ino);
  const bool limited = e != nullptr && (e->limited.load(std::memory_order_relaxed) & (1u << dev)) != 0;
  limits->softLimit = limited ? e->soft[dev].load(std::memory_order_relaxed) : 0;
  limits->hardLimit = limited ? e->hard[dev].load(std::memory_order_relaxed) : NVML_DEVICE_MEMORY_LIMIT_MAX;
  limits->currentUsed = cgroup_used_locked(*state, ino, dev);
  return NVML_SUCCESS;
}

}  // extern "C"
