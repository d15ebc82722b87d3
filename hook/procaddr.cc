// cuGetProcAddress: how the CUDA runtime (12/13), cudaGetDriverEntryPoint,
// cuda-python, Triton and NCCL reach the driver. We never guess from names:
// the real resolver runs with the caller's exact (symbol, version, flags), and
// if the pointer it returns is one we hook, the caller gets our wrapper for
// that very entry point. Every versioned name and every _ptsz/_ptds variant
// therefore maps to the wrapper with the ABI the caller asked for, and the
// runtime fetching cuGetProcAddress itself through cuGetProcAddress gets ours.
#include <cuda.h>

#include "hook/wrap.h"

using namespace gpuslice::hook;

namespace {

CUresult redirect(CUresult rc, void** pfn) noexcept {
  if (rc == CUDA_SUCCESS && pfn != nullptr) {
    if (void* wrapper = wrapper_for_real(*pfn)) *pfn = wrapper;
  }
  return rc;
}

}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                                     CUdriverProcAddressQueryResult* status) {
  // Resolution works before cuInit and must not depend on our configuration:
  // only the driver has to be loaded. The wrappers handed out fail closed.
  if (!load_driver() || real_cuGetProcAddress_v2 == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return redirect(real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status), pfn);
}

GPUSLICE_EXPORT CUresult CUDAAPI cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags) {
  if (!load_driver()) return CUDA_ERROR_NOT_INITIALIZED;
  if (real_cuGetProcAddress != nullptr) return redirect(real_cuGetProcAddress(symbol, pfn, cudaVersion, flags), pfn);
  if (real_cuGetProcAddress_v2 == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return redirect(real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, nullptr), pfn);
}
