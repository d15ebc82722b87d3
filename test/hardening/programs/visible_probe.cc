// visible_probe ORDINAL HOLD_BYTES: what one process of a multi-GPU container
// sees under its own CUDA_VISIBLE_DEVICES (visible_devices_test.cc). Prints
//   count n=N                       CUDA's device count
//   uuid ordinal=I uuid=GPU-...     each CUDA ordinal's UUID
//   hold rc=R                       HOLD_BYTES allocated on ORDINAL, kept
//   fill bytes=B                    then 1 MiB blocks until refused, freed
//   nvml index=I uuid=... total=T used=U   NVML (all GPUs), through the preload
#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "nvml_abi.h"

namespace {

void print_nvml() {
  using Init = nvmlReturn_t (*)();
  using Count = nvmlReturn_t (*)(unsigned int*);
  using Handle = nvmlReturn_t (*)(unsigned int, nvmlDevice_t*);
  using Uuid = nvmlReturn_t (*)(nvmlDevice_t, char*, unsigned int);
  using Info = nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*);
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) return;
  auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
  auto count = reinterpret_cast<Count>(dlsym(lib, "nvmlDeviceGetCount_v2"));
  auto handle = reinterpret_cast<Handle>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  auto uuid = reinterpret_cast<Uuid>(dlsym(lib, "nvmlDeviceGetUUID"));
  auto info = reinterpret_cast<Info>(dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo"));  // the preload's first
  unsigned n = 0;
  if (init == nullptr || count == nullptr || handle == nullptr || uuid == nullptr || info == nullptr ||
      init() != NVML_SUCCESS || count(&n) != NVML_SUCCESS)
    return;
  for (unsigned i = 0; i < n; ++i) {
    nvmlDevice_t dev{};
    char text[96] = {};
    nvmlMemory_t m{};
    if (handle(i, &dev) != NVML_SUCCESS || uuid(dev, text, sizeof text) != NVML_SUCCESS) continue;
    nvmlReturn_t rc = info(dev, &m);
    std::printf("nvml index=%u uuid=%s rc=%d total=%llu used=%llu\n", i, text, rc,
                static_cast<unsigned long long>(m.total), static_cast<unsigned long long>(m.used));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const int ordinal = std::atoi(argv[1]);
  const std::size_t hold = std::strtoull(argv[2], nullptr, 10);
  CUresult rc = cuInit(0);
  std::printf("init rc=%d\n", rc);
  if (rc != CUDA_SUCCESS) return 0;
  int n = 0;
  cuDeviceGetCount(&n);
  std::printf("count n=%d\n", n);
  for (int i = 0; i < n; ++i) {
    CUuuid u{};
    cuDeviceGetUuid_v2(&u, i);
    const auto* b = reinterpret_cast<const unsigned char*>(u.bytes);
    std::printf("uuid ordinal=%d uuid=GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", i,
                b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  }
  CUcontext ctx = nullptr;
  if (cuDevicePrimaryCtxRetain(&ctx, ordinal) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return 3;
  CUdeviceptr kept = 0;
  std::printf("hold rc=%d\n", hold == 0 ? 0 : static_cast<int>(cuMemAlloc(&kept, hold)));
  std::vector<CUdeviceptr> blocks;
  for (CUdeviceptr p = 0; blocks.size() < 100000 && cuMemAlloc(&p, 1 << 20) == CUDA_SUCCESS;) blocks.push_back(p);
  std::printf("fill bytes=%zu\n", blocks.size() << 20);
  for (CUdeviceptr p : blocks) cuMemFree(p);
  print_nvml();
  return 0;
}
