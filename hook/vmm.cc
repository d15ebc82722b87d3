// Virtual memory management (cuMemCreate): what PyTorch's expandable segments,
// vLLM's allocator and NCCL use. The physical allocation is counted from
// cuMemCreate until the driver really lets it go — when the handle has been
// released AND every mapping of it unmapped (the driver keeps mapped memory
// alive after cuMemRelease; releasing right after mapping is a common idiom).
#include <cuda.h>

#include <map>
#include <mutex>
#include <unordered_map>

#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

struct Physical {
  std::uint64_t bytes;
  int entry;
  int refs;  // 1 while the handle is unreleased, +1 per live mapping
};
struct Mapping {
  std::size_t size;
  CUmemGenericAllocationHandle handle;
};

// VMM calls cost microseconds in the driver; a process-local mutex here is
// never shared with another process and never held across a driver call.
NoDestroy<std::mutex> g_mu;
NoDestroy<std::unordered_map<CUmemGenericAllocationHandle, Physical>> g_physical;
NoDestroy<std::map<CUdeviceptr, Mapping>> g_mappings;

// Drop one reference; the bytes go back to the budget with the last one.
void unref_locked(CUmemGenericAllocationHandle h) noexcept {
  auto it = g_physical->find(h);
  if (it == g_physical->end()) return;
  if (--it->second.refs == 0) {
    release(it->second.entry, it->second.bytes);
    g_physical->erase(it);
  }
}

}  // namespace
}  // namespace gpuslice::hook

using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                             const CUmemAllocationProp* prop, unsigned long long flags) {
  // Only device-resident physical memory counts; host-located VMM does not use the card.
  if (handle == nullptr || prop == nullptr || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    CUresult rc = ensure_ready();
    return rc != CUDA_SUCCESS ? rc : real_cuMemCreate(handle, size, prop, flags);
  }
  Reservation r;
  CUresult rc = reserve_on_ordinal(prop->location.id, size, &r);
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemCreate(handle, size, prop, flags);
  if (rc != CUDA_SUCCESS) {
    release(r.entry, r.bytes);
    return rc;
  }
  try {
    std::lock_guard<std::mutex> lock(*g_mu);
    (*g_physical)[*handle] = Physical{r.bytes, r.entry, 1};
  } catch (...) {
    // Out of host memory for our bookkeeping: undo rather than lose track.
    real_cuMemRelease(*handle);
    release(r.entry, r.bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemRelease(handle);
  if (rc == CUDA_SUCCESS) {
    std::lock_guard<std::mutex> lock(*g_mu);
    unref_locked(handle);
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                          CUmemGenericAllocationHandle handle, unsigned long long flags) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemMap(ptr, size, offset, handle, flags);
  if (rc == CUDA_SUCCESS) {
    std::lock_guard<std::mutex> lock(*g_mu);
    auto it = g_physical->find(handle);
    if (it != g_physical->end()) {
      try {
        (*g_mappings)[ptr] = Mapping{size, handle};
        ++it->second.refs;
      } catch (...) {
        // Without the mapping record the handle's release frees the bytes
        // early; the agent's reconciliation would still see what the device holds.
      }
    }
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemUnmap(ptr, size);
  if (rc == CUDA_SUCCESS) {
    // One unmap may cover several adjacent mappings.
    std::lock_guard<std::mutex> lock(*g_mu);
    auto it = g_mappings->lower_bound(ptr);
    while (it != g_mappings->end() && it->first < ptr + size) {
      unref_locked(it->second.handle);
      it = g_mappings->erase(it);
    }
  }
  return rc;
}
