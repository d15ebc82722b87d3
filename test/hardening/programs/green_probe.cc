// green_probe: green contexts (CUDA 12.4+) under gpuslice (green_context_test.cc).
//   green_probe memory DEV CHUNK_MIB   a green context on DEV with no primary context
//                                      active, then CHUNK_MIB allocations in it until refused:
//     green rc=R                       cuGreenCtxCreate
//     created counted=C held=H         gpuslice's count (cuMemGetInfo) and the device's
//     alloc succeeded=N last_rc=R counted=C held=H
//     after-destroy rc=R counted=C held=H   the primary retained, the green context destroyed
//     released held=H                  the primary released too
//   green_probe launch DEV US COUNT SECONDS   spin_<US>us launches on a green context's
//                                      stream for SECONDS (at most COUNT): probe launches=N pid=P
// GREEN_VIA_PROCADDR=1: cuGreenCtxCreate/Destroy resolved through cuGetProcAddress.
#include <cuda.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fakecuda_query.h"

namespace {

using Create = CUresult (*)(CUgreenCtx*, CUdevResourceDesc, CUdevice, unsigned int);
using Destroy = CUresult (*)(CUgreenCtx);
Create g_create = cuGreenCtxCreate;
Destroy g_destroy = cuGreenCtxDestroy;

void resolve() {
  const char* via = std::getenv("GREEN_VIA_PROCADDR");
  if (via == nullptr || std::strcmp(via, "1") != 0) return;
  void* p = nullptr;
  CUdriverProcAddressQueryResult q{};
  if (cuGetProcAddress_v2("cuGreenCtxCreate", &p, 12040, 0, &q) == CUDA_SUCCESS && p != nullptr)
    g_create = reinterpret_cast<Create>(p);
  if (cuGetProcAddress_v2("cuGreenCtxDestroy", &p, 12040, 0, &q) == CUDA_SUCCESS && p != nullptr)
    g_destroy = reinterpret_cast<Destroy>(p);
}

CUresult make_green(CUdevice dev, CUgreenCtx* green) {
  CUdevResource all{};
  CUresult rc = cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
  if (rc != CUDA_SUCCESS) return rc;
  CUdevResource part{};
  unsigned n = 1;
  if ((rc = cuDevSmResourceSplitByCount(&part, &n, &all, nullptr, 0, 8)) != CUDA_SUCCESS) return rc;
  CUdevResourceDesc desc = nullptr;
  if ((rc = cuDevResourceGenerateDesc(&desc, &part, 1)) != CUDA_SUCCESS) return rc;
  return g_create(green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
}

unsigned long long counted() {
  size_t free = 0, total = 0;
  if (cuMemGetInfo(&free, &total) != CUDA_SUCCESS) return ~0ull;
  return total - free;
}

unsigned long long held(CUdevice dev) { return fakecuda_process_used_bytes(dev, 0); }

int memory(CUdevice dev, unsigned long long chunk) {
  CUgreenCtx green = nullptr;
  const CUresult rc = make_green(dev, &green);
  std::printf("green rc=%d\n", rc);
  if (rc != CUDA_SUCCESS) {
    std::printf("refused held=%llu\n", held(dev));
    return 0;
  }
  CUcontext ctx = nullptr;
  if (cuCtxFromGreenCtx(&ctx, green) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return 3;
  std::printf("created counted=%llu held=%llu\n", counted(), held(dev));
  std::vector<CUdeviceptr> chunks;
  CUresult last = CUDA_SUCCESS;
  for (CUdeviceptr p = 0; chunks.size() < 4096 && (last = cuMemAlloc(&p, chunk)) == CUDA_SUCCESS;) chunks.push_back(p);
  std::printf("alloc succeeded=%zu last_rc=%d counted=%llu held=%llu\n", chunks.size(), last, counted(), held(dev));
  for (CUdeviceptr p : chunks) cuMemFree(p);
  CUcontext primary = nullptr;
  if (cuDevicePrimaryCtxRetain(&primary, dev) != CUDA_SUCCESS) return 3;
  cuCtxSetCurrent(primary);
  const CUresult destroyed = g_destroy(green);
  std::printf("after-destroy rc=%d counted=%llu held=%llu\n", destroyed, counted(), held(dev));
  cuCtxSetCurrent(nullptr);
  cuDevicePrimaryCtxRelease(dev);
  std::printf("released held=%llu\n", held(dev));
  return 0;
}

double now_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

int launch(CUdevice dev, int us, long count, double seconds) {
  CUgreenCtx green = nullptr;
  CUresult rc = make_green(dev, &green);
  if (rc != CUDA_SUCCESS) {
    std::printf("green rc=%d\n", rc);
    return 3;
  }
  CUcontext ctx = nullptr;
  CUstream s = nullptr;
  if (cuCtxFromGreenCtx(&ctx, green) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
      cuGreenCtxStreamCreate(&s, green, CU_STREAM_NON_BLOCKING, 0) != CUDA_SUCCESS)
    return 3;
  const std::string name = "spin_" + std::to_string(us) + "us";
  const std::string image = "// fake PTX\n.entry " + name + "\n";
  CUmodule mod = nullptr;
  CUfunction f = nullptr;
  if (cuModuleLoadData(&mod, image.c_str()) != CUDA_SUCCESS ||
      cuModuleGetFunction(&f, mod, name.c_str()) != CUDA_SUCCESS)
    return 3;
  // Another device's context current while launching: the stream decides.
  CUcontext other = nullptr;
  if (cuDevicePrimaryCtxRetain(&other, dev == 0 ? 1 : 0) != CUDA_SUCCESS || cuCtxSetCurrent(other) != CUDA_SUCCESS)
    return 3;
  long launches = 0;
  const double end = now_s() + seconds;
  while (launches < count && now_s() < end) {
    if ((rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr)) != CUDA_SUCCESS) {
      std::printf("launch rc=%d\n", rc);
      return 3;
    }
    ++launches;
  }
  std::printf("probe launches=%ld pid=%ld\n", launches, static_cast<long>(getpid()));
  cuStreamSynchronize(s);
  cuStreamDestroy(s);
  cuCtxSetCurrent(nullptr);
  g_destroy(green);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || cuInit(0) != CUDA_SUCCESS) return 2;
  resolve();
  const std::string mode = argv[1];
  const CUdevice dev = std::atoi(argv[2]);
  if (mode == "memory" && argc == 4) return memory(dev, std::strtoull(argv[3], nullptr, 10) << 20);
  if (mode == "launch" && argc == 6) return launch(dev, std::atoi(argv[3]), std::atol(argv[4]), std::atof(argv[5]));
  return 2;
}
