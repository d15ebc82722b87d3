// A library whose constructor makes the process's first CUDA calls, before
// main() and possibly before the preload library saw anything else.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstdio>

extern "C" {
int ctor_alloc_rc = -1;
int ctor_oversize_rc = -1;
}

__attribute__((constructor)) static void first_cuda_calls() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW);
  if (h == nullptr) return;
  auto gpa = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(h, "cuGetProcAddress_v2"));
  void *init = nullptr, *retain = nullptr, *set = nullptr, *alloc = nullptr;
  gpa("cuInit", &init, 2000, 0, nullptr);
  gpa("cuDevicePrimaryCtxRetain", &retain, 7000, 0, nullptr);
  gpa("cuCtxSetCurrent", &set, 4000, 0, nullptr);
  gpa("cuMemAlloc", &alloc, 3020, 0, nullptr);
  reinterpret_cast<PFN_cuInit_v2000>(init)(0);
  CUcontext ctx = nullptr;
  reinterpret_cast<PFN_cuDevicePrimaryCtxRetain_v7000>(retain)(&ctx, 0);
  reinterpret_cast<PFN_cuCtxSetCurrent_v4000>(set)(ctx);
  CUdeviceptr p = 0;
  ctor_oversize_rc = reinterpret_cast<PFN_cuMemAlloc_v3020>(alloc)(&p, 9ull << 20);
  ctor_alloc_rc = reinterpret_cast<PFN_cuMemAlloc_v3020>(alloc)(&p, 1ull << 20);
}
