// Per-kernel attributes of library kernels (cuKernelGetAttribute /
// cuKernelSetAttribute, per device) and the occupancy calculator. Occupancy
// model (as cuOccupancyMaxActiveBlocksPerMultiprocessor already used): 64
// resident warps and 32 resident blocks per SM, 228 KiB of shared memory per
// SM and at most 227 KiB per block (an H100's limits); registers are not a
// limit (every kernel reports 32 per thread).
#include <algorithm>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

constexpr int kWarpsPerSm = 64;
constexpr int kBlocksPerSm = 32;
constexpr std::size_t kSharedPerSm = 233472;
constexpr std::size_t kSharedPerBlock = 232448;

int blocks_per_sm(int block_size, std::size_t dynamic_shared) {
  if (dynamic_shared > kSharedPerBlock) return 0;
  int warps = (block_size + 31) / 32;
  int blocks = std::min(kBlocksPerSm, kWarpsPerSm / warps);
  if (dynamic_shared > 0) blocks = std::min<int>(blocks, static_cast<int>(kSharedPerSm / dynamic_shared));
  return blocks;
}

CUresult check_device(CUdevice dev) {
  if (!initialized()) return uninitialized_error();
  return valid_device(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

}  // namespace

extern "C" CUresult cuKernelGetAttribute(int* pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev) {
  if (CUresult rc = check_device(dev); rc != CUDA_SUCCESS) return rc;
  return cuFuncGetAttribute(pi, attrib, reinterpret_cast<CUfunction>(kernel));
}

// cuda.h lists the settable attributes; the others are read-only (INVALID_VALUE).
extern "C" CUresult cuKernelSetAttribute(CUfunction_attribute attrib, int val, CUkernel kernel, CUdevice dev) {
  if (CUresult rc = check_device(dev); rc != CUDA_SUCCESS) return rc;
  auto* function = reinterpret_cast<CUfunc_st*>(kernel);
  if (!alive(function)) return CUDA_ERROR_INVALID_HANDLE;
  switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: return cuFuncSetAttribute(function, attrib, val);
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
      return val >= -1 && val <= 100 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
      return val >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

extern "C" CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice dev) {
  if (CUresult rc = check_device(dev); rc != CUDA_SUCCESS) return rc;
  if (config < CU_FUNC_CACHE_PREFER_NONE || config > CU_FUNC_CACHE_PREFER_EQUAL) return CUDA_ERROR_INVALID_VALUE;
  return alive(reinterpret_cast<CUfunc_st*>(kernel)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

extern "C" CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* numBlocks, CUfunction func, int blockSize,
                                                                         size_t dynamicSMemSize, unsigned int flags) {
  if (flags != CU_OCCUPANCY_DEFAULT && flags != CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE) return CUDA_ERROR_INVALID_VALUE;
  CUresult rc = cuOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks, func, blockSize, dynamicSMemSize);
  if (rc == CUDA_SUCCESS) *numBlocks = std::min(*numBlocks, blocks_per_sm(blockSize, dynamicSMemSize));
  return rc;
}

// The largest block size (a multiple of 32, at most blockSizeLimit or 1024)
// reaching the best occupancy; minGridSize fills every SM at that occupancy.
extern "C" CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int* minGridSize, int* blockSize, CUfunction func,
                                                              CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                              size_t dynamicSMemSize, int blockSizeLimit,
                                                              unsigned int flags) {
  if (minGridSize == nullptr || blockSize == nullptr || blockSizeLimit < 0) return CUDA_ERROR_INVALID_VALUE;
  if (flags != CU_OCCUPANCY_DEFAULT && flags != CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(func)) return CUDA_ERROR_INVALID_HANDLE;
  const int limit = blockSizeLimit == 0 ? 1024 : std::min(blockSizeLimit, 1024);
  int best_size = 0, best_warps = -1, best_blocks = 0;
  for (int size = 32; size <= limit; size += 32) {
    std::size_t shared = blockSizeToDynamicSMemSize != nullptr ? blockSizeToDynamicSMemSize(size) : dynamicSMemSize;
    int blocks = blocks_per_sm(size, shared);
    int warps = blocks * (size / 32);
    if (warps >= best_warps) {
      best_warps = warps;
      best_size = size;
      best_blocks = blocks;
    }
  }
  if (best_size == 0) return CUDA_ERROR_INVALID_VALUE;  // blockSizeLimit below one warp
  *blockSize = best_size;
  *minGridSize = best_blocks * static_cast<int>(state().header().sms);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuOccupancyMaxPotentialBlockSize(int* minGridSize, int* blockSize, CUfunction func,
                                                     CUoccupancyB2DSize blockSizeToDynamicSMemSize,
                                                     size_t dynamicSMemSize, int blockSizeLimit) {
  return cuOccupancyMaxPotentialBlockSizeWithFlags(minGridSize, blockSize, func, blockSizeToDynamicSMemSize,
                                                   dynamicSMemSize, blockSizeLimit, CU_OCCUPANCY_DEFAULT);
}

extern "C" CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* dynamicSmemSize, CUfunction func, int numBlocks,
                                                            int blockSize) {
  if (dynamicSmemSize == nullptr || numBlocks <= 0 || blockSize <= 0 || blockSize > 1024) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!initialized()) return uninitialized_error();
  if (!alive(func)) return CUDA_ERROR_INVALID_HANDLE;
  if (numBlocks > blocks_per_sm(blockSize, 0)) {
    *dynamicSmemSize = 0;
    return CUDA_SUCCESS;
  }
  *dynamicSmemSize = std::min(kSharedPerBlock, kSharedPerSm / static_cast<std::size_t>(numBlocks));
  return CUDA_SUCCESS;
}
