// Page-locked host memory: cuMemAllocHost / cuMemHostAlloc (allocated here) and
// cuMemHostRegister (the caller's memory). It is host memory, charged to no
// device; under unified addressing its device pointer is its host address.
#include <sys/mman.h>

#include <algorithm>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

struct HostRange {
  std::uint64_t size = 0;
  unsigned flags = 0;
  bool registered = false;  // cuMemHostRegister (else allocated by the driver)
};
std::map<std::uintptr_t, HostRange> g_host;  // base -> range; runtime mutex

constexpr std::uint64_t kPage = 4096;
std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

bool overlaps_locked(std::uintptr_t p, std::uint64_t size) {
  auto it = g_host.lower_bound(p);
  if (it != g_host.end() && it->first < p + size) return true;
  if (it != g_host.begin()) {
    --it;
    if (it->first + it->second.size > p) return true;
  }
  return false;
}

CUresult host_alloc(void** pp, std::uint64_t bytesize, unsigned flags) {
  if (pp == nullptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  constexpr unsigned kKnown = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if ((flags & ~kKnown) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  void* p = mmap(nullptr, round_up(bytesize, kPage), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard guard(runtime().mu);
  g_host[reinterpret_cast<std::uintptr_t>(p)] = HostRange{bytesize, flags, false};
  *pp = p;
  return CUDA_SUCCESS;
}

}  // namespace

namespace gpuslice::fakecuda {

bool host_range_find_locked(const void* p, std::uintptr_t* base, std::uint64_t* size, unsigned* flags,
                            bool* registered) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  auto it = g_host.upper_bound(addr);
  if (it == g_host.begin()) return false;
  --it;
  if (addr - it->first >= it->second.size) return false;
  *base = it->first;
  *size = it->second.size;
  *flags = it->second.flags;
  *registered = it->second.registered;
  return true;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuMemAllocHost_v2(void** pp, size_t bytesize) { return host_alloc(pp, bytesize, 0); }
extern "C" CUresult cuMemAllocHost(void** pp, unsigned int bytesize) { return host_alloc(pp, bytesize, 0); }
extern "C" CUresult cuMemHostAlloc(void** pp, size_t bytesize, unsigned int Flags) {
  return host_alloc(pp, bytesize, Flags);
}

// Only what cuMemAllocHost/cuMemHostAlloc returned (not registered memory).
extern "C" CUresult cuMemFreeHost(void* p) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  auto it = g_host.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == g_host.end() || it->second.registered) return CUDA_ERROR_INVALID_VALUE;
  munmap(p, round_up(it->second.size, kPage));
  g_host.erase(it);
  return CUDA_SUCCESS;
}

// cuda.h: page-locks [p, p+bytesize); a range overlapping one already
// registered is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED. IOMEMORY (memory of
// a third-party PCIe device) is not modelled.
extern "C" CUresult cuMemHostRegister_v2(void* p, size_t bytesize, unsigned int Flags) {
  constexpr unsigned kKnown = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |
                              CU_MEMHOSTREGISTER_READ_ONLY;
  if (p == nullptr || bytesize == 0 || (Flags & ~kKnown) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if ((Flags & CU_MEMHOSTREGISTER_IOMEMORY) != 0) return CUDA_ERROR_NOT_SUPPORTED;
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (overlaps_locked(addr, bytesize)) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  g_host[addr] = HostRange{bytesize, Flags, true};
  return CUDA_SUCCESS;
}
extern "C" CUresult cuMemHostRegister(void* p, size_t bytesize, unsigned int Flags) {
  return cuMemHostRegister_v2(p, bytesize, Flags);
}

extern "C" CUresult cuMemHostUnregister(void* p) {
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  auto it = g_host.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == g_host.end() || !it->second.registered) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  g_host.erase(it);
  return CUDA_SUCCESS;
}

// Unified addressing: the device pointer of page-locked memory is its address.
extern "C" CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* pdptr, void* p, unsigned int Flags) {
  if (pdptr == nullptr || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  std::uintptr_t base = 0;
  std::uint64_t size = 0;
  unsigned flags = 0;
  bool registered = false;
  if (!host_range_find_locked(p, &base, &size, &flags, &registered)) return CUDA_ERROR_INVALID_VALUE;
  *pdptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}
extern "C" CUresult cuMemHostGetDevicePointer(CUdeviceptr_v1* pdptr, void* p, unsigned int Flags) {
  if (pdptr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr wide = 0;
  CUresult rc = cuMemHostGetDevicePointer_v2(&wide, p, Flags);
  if (rc == CUDA_SUCCESS) {
    if (wide > 0xFFFFFFFFull) return CUDA_ERROR_INVALID_VALUE;  // not addressable through the 32-bit ABI
    *pdptr = static_cast<CUdeviceptr_v1>(wide);
  }
  return rc;
}

extern "C" CUresult cuMemHostGetFlags(unsigned int* pFlags, void* p) {
  if (pFlags == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  std::uintptr_t base = 0;
  std::uint64_t size = 0;
  unsigned flags = 0;
  bool registered = false;
  if (!host_range_find_locked(p, &base, &size, &flags, &registered)) return CUDA_ERROR_INVALID_VALUE;
  *pFlags = flags;
  return CUDA_SUCCESS;
}
