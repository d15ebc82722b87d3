// Preloaded after libgpuslice.so, so its destructor runs after gpuslice's
// exit-time release: it tries to allocate 16 MiB and reports how much it got.
// cuMemCreate names its device: no current-context query, which the
// simulated driver cannot answer once its own statics are destroyed.
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>

__attribute__((destructor)) static void allocate_after_gpuslice_exit() {
  auto create = reinterpret_cast<CUresult (*)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                                              unsigned long long)>(dlsym(RTLD_DEFAULT, "cuMemCreate"));
  if (create == nullptr) return;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  int ok = 0;
  for (int i = 0; i < 8; ++i) {
    CUmemGenericAllocationHandle h = 0;
    if (create(&h, 2u << 20, &prop, 0) == CUDA_SUCCESS) ok += 2;
  }
  char line[64];
  int n = std::snprintf(line, sizeof line, "late ok_mib=%d\n", ok);
  ssize_t ignored = write(1, line, static_cast<size_t>(n));
  (void)ignored;
}
