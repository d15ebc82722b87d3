// A program that carries its own copy of the driver, as a statically linked
// application or one with a private loader does: it loads libcuda.so.1 into
// a new link-map namespace (dlmopen), where LD_PRELOAD does not apply, so
// gpuslice's wrappers never see its calls even though the library is
// preloaded into the process. For agent_backstop_test.cc: only the driver's
// own wall can stop it.
//
//   own_driver GO_FILE STEP_MIB     waits for GO_FILE, then allocates STEP_MIB
//                                   at a time on device 0 until refused;
//                                   prints "fill bytes=B rc=R" (R: the refusal)
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace {

template <typename F>
F entry(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: own_driver GO_FILE STEP_MIB\n");
    return 64;
  }
  for (int i = 0; i < 30000 && access(argv[1], F_OK) != 0; ++i) usleep(1000);
  void* lib = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "own_driver: dlmopen: %s\n", dlerror());
    return 2;
  }
  auto init = entry<CUresult (*)(unsigned)>(lib, "cuInit");
  auto get = entry<CUresult (*)(CUdevice*, int)>(lib, "cuDeviceGet");
  auto retain = entry<CUresult (*)(CUcontext*, CUdevice)>(lib, "cuDevicePrimaryCtxRetain");
  auto set = entry<CUresult (*)(CUcontext)>(lib, "cuCtxSetCurrent");
  auto alloc = entry<CUresult (*)(CUdeviceptr*, size_t)>(lib, "cuMemAlloc_v2");
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (init == nullptr || get == nullptr || retain == nullptr || set == nullptr || alloc == nullptr ||
      init(0) != CUDA_SUCCESS || get(&dev, 0) != CUDA_SUCCESS || retain(&ctx, dev) != CUDA_SUCCESS ||
      set(ctx) != CUDA_SUCCESS) {
    std::fprintf(stderr, "own_driver: the driver's set-up failed\n");
    return 2;
  }
  const size_t step = static_cast<size_t>(std::strtoull(argv[2], nullptr, 10)) << 20;
  unsigned long long bytes = 0;
  CUresult rc = CUDA_SUCCESS;
  for (int i = 0; i < 100000; ++i) {
    CUdeviceptr p = 0;
    rc = alloc(&p, step);
    if (rc != CUDA_SUCCESS) break;
    bytes += step;
  }
  std::printf("fill bytes=%llu rc=%d\n", bytes, static_cast<int>(rc));
  return 0;
}
