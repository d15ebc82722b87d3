// cuInit (where a bad configuration fails closed) and the memory queries a
// container sees: the quota is the size of the card, usage is the
// container's. Frameworks size their caches from these (vLLM, PyTorch), so
// they never fail merely because usage is above the quota.
#include <cuda.h>

#include <algorithm>

#include "hook/wrap.h"
#include "limiter/memory_accounting.h"

using namespace gpuslice;
using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuInit(unsigned int flags) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  return real_cuInit(flags);
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t* free, size_t* total) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemGetInfo_v2(free, total);  // the driver's own NULL/context checks first
  if (rc != CUDA_SUCCESS) return rc;
  // A driver that answers with an output NULL: its answer, never a dereference.
  if (free == nullptr || total == nullptr) return rc;
  CUresult ignored = CUDA_SUCCESS;
  const int entry = current_device_entry(&ignored);
  if (entry < 0) return rc;
  const std::uint64_t quota = limiter::quota_bytes(g_process.region, entry);
  if (quota == kUnlimited) return rc;
  reap_before_first_query();  // the dead's memory is not in the first answer
  const std::uint64_t real_total = *total;
  const std::uint64_t used = limiter::used_bytes(g_process.region, entry);
  const std::uint64_t shown_total = std::min<std::uint64_t>(quota, real_total);
  const std::uint64_t headroom = used >= shown_total ? 0 : shown_total - used;
  *total = shown_total;
  *free = std::min<std::uint64_t>(headroom, *free);
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuDeviceTotalMem_v2(bytes, dev);
  if (rc != CUDA_SUCCESS) return rc;
  const int entry = device_entry(dev);
  if (entry < 0) return rc;
  const std::uint64_t quota = limiter::quota_bytes(g_process.region, entry);
  if (quota != kUnlimited) *bytes = std::min<std::uint64_t>(quota, *bytes);
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemGetInfo(unsigned int*, unsigned int*) { return refuse_legacy("cuMemGetInfo"); }
GPUSLICE_EXPORT CUresult CUDAAPI cuDeviceTotalMem(unsigned int*, CUdevice) { return refuse_legacy("cuDeviceTotalMem"); }
