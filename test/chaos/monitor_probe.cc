// monitor_probe: allocates MIB with cuMemAlloc in the primary context, holds
// it HOLD_MS, frees it, exits 0. Run without libgpuslice.so it is a program
// that bypasses gpuslice: the monitor must report it (chaos_test.cc).
//   monitor_probe MIB HOLD_MS [checkpoint]   (then fakecuda_monitor_checkpoint(), printed)
//   monitor_probe MIB HOLD_MS managed        (cuMemAllocManaged of MIB, then of 1 MiB more)
#include <cuda.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fakecuda_query.h"

int main(int argc, char **argv) {
  if (argc != 3 && argc != 4) return 64;
  const size_t bytes = static_cast<size_t>(std::strtoull(argv[1], nullptr, 10)) << 20;
  const unsigned hold_ms = static_cast<unsigned>(std::strtoul(argv[2], nullptr, 10));
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
    std::fprintf(stderr, "monitor_probe: setup failed\n");
    return 2;
  }
  CUdeviceptr p = 0;
  CUdeviceptr more = 0;
  const bool managed = argc == 4 && std::strcmp(argv[3], "managed") == 0;
  CUresult rc = managed ? cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL) : cuMemAlloc(&p, bytes);
  if (managed && rc == CUDA_SUCCESS) rc = cuMemAllocManaged(&more, 1 << 20, CU_MEM_ATTACH_GLOBAL);
  std::printf("alloc=%d\n", static_cast<int>(rc));
  std::fflush(stdout);
  if (argc == 4 && std::strcmp(argv[3], "checkpoint") == 0) std::printf("checkpoint=%d\n", fakecuda_monitor_checkpoint());
  std::fflush(stdout);
  usleep(hold_ms * 1000);
  if (p != 0) cuMemFree(p);
  if (more != 0) cuMemFree(more);
  cuDevicePrimaryCtxRelease(dev);
  return 0;
}
