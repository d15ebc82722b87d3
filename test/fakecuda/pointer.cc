// Pointer attributes (cuPointerGetAttribute[s], cuPointerSetAttribute) for
// every kind of memory the simulator knows: linear/pool device allocations,
// managed memory (host-accessible), VMM mappings and page-locked host memory.
#include <cstring>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

struct PointerInfo {
  CUmemorytype type = static_cast<CUmemorytype>(0);
  CUctx_st* ctx = nullptr;
  int device = -2;
  CUdeviceptr base = 0;
  std::uint64_t size = 0;
  bool managed = false;
  bool host_accessible = false;
  bool mapped = false;
  std::uint64_t buffer_id = 0;
  CUmemoryPool pool = nullptr;
};

// Runtime mutex held. false: not CUDA memory.
bool classify_locked(CUdeviceptr ptr, PointerInfo* info) {
  CUdeviceptr base = 0;
  if (const Allocation* a = find_allocation_locked(ptr, &base); a != nullptr) {
    info->type = CU_MEMORYTYPE_DEVICE;
    info->ctx = a->ctx;
    info->device = static_cast<int>(a->device);
    info->base = base;
    info->size = a->size;
    info->managed = a->kind == AllocKind::managed;
    info->host_accessible = info->managed;
    info->mapped = true;
    info->buffer_id = a->buffer_id;
    info->pool = a->kind == AllocKind::pool ? a->pool : nullptr;
    return true;
  }
  std::uint64_t size = 0;
  if (vmm_find_mapping_locked(ptr, &base, &size)) {
    info->type = CU_MEMORYTYPE_DEVICE;
    CUctx_st* ctx = nullptr;
    if (current_context(&ctx) == CUDA_SUCCESS) {
      info->ctx = ctx;
      info->device = static_cast<int>(ctx->device);
    }
    info->base = base;
    info->size = size;
    info->mapped = true;
    info->buffer_id = base;  // a mapping's base is unique while it is mapped
    return true;
  }
  std::uintptr_t hbase = 0;
  unsigned flags = 0;
  bool registered = false;
  if (host_range_find_locked(reinterpret_cast<void*>(ptr), &hbase, &size, &flags, &registered)) {
    info->type = CU_MEMORYTYPE_HOST;
    CUctx_st* ctx = nullptr;
    if (current_context(&ctx) == CUDA_SUCCESS) {
      info->ctx = ctx;
      info->device = static_cast<int>(ctx->device);
    }
    info->base = hbase;
    info->size = size;
    info->host_accessible = true;
    info->mapped = true;
    info->buffer_id = hbase;
    return true;
  }
  return false;
}

template <typename T>
void put(void* data, T value) {
  std::memcpy(data, &value, sizeof(T));
}

// One attribute of a known pointer.
CUresult attribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr, const PointerInfo& info) {
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: put<CUcontext>(data, info.ctx); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: put<unsigned>(data, info.type); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: put<CUdeviceptr>(data, ptr); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      if (!info.host_accessible) return CUDA_ERROR_INVALID_VALUE;
      put<void*>(data, reinterpret_cast<void*>(ptr));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: put<int>(data, 1); return CUDA_SUCCESS;  // copies here always synchronise
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: put<unsigned long long>(data, info.buffer_id); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: put<int>(data, info.managed ? 1 : 0); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      put<int>(data, device_ordinal(static_cast<std::uint32_t>(info.device)));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: put<int>(data, 0); return CUDA_SUCCESS;  // IPC not modelled
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: put<CUdeviceptr>(data, info.base); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: put<size_t>(data, info.size); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED: put<int>(data, info.mapped ? 1 : 0); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: put<unsigned long long>(data, 0); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: put<int>(data, 0); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
      put<unsigned long long>(data, CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE);
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: put<CUmemoryPool>(data, info.pool); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: put<size_t>(data, info.size); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
      put<void*>(data, reinterpret_cast<void*>(info.base));
      return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: put<unsigned long long>(data, info.buffer_id); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE: put<int>(data, 0); return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS: return CUDA_ERROR_NOT_SUPPORTED;  // nv-p2p.h tokens: no kernel module here
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

}  // namespace

extern "C" CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attr, CUdeviceptr ptr) {
  if (data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  PointerInfo info;
  {
    std::lock_guard guard(runtime().mu);
    if (!classify_locked(ptr, &info)) return CUDA_ERROR_INVALID_VALUE;
  }
  if (attr == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) {
    CUctx_st* ctx = nullptr;
    if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return CUDA_ERROR_INVALID_CONTEXT;
  }
  return attribute(data, attr, ptr, info);
}

// cuda.h: unlike cuPointerGetAttribute, a pointer that is not CUDA memory is
// not an error: every attribute gets its default (zero/NULL) value.
extern "C" CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute* attributes, void** data,
                                           CUdeviceptr ptr) {
  if (numAttributes == 0 || attributes == nullptr || data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  PointerInfo info;
  bool known = false;
  {
    std::lock_guard guard(runtime().mu);
    known = classify_locked(ptr, &info);
  }
  for (unsigned i = 0; i < numAttributes; ++i) {
    if (data[i] == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!known) {
      // Sizes as cuPointerGetAttribute documents each attribute's type.
      switch (attributes[i]) {
        case CU_POINTER_ATTRIBUTE_CONTEXT: put<CUcontext>(data[i], nullptr); break;
        case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: put<CUdeviceptr>(data[i], 0); break;
        case CU_POINTER_ATTRIBUTE_HOST_POINTER: put<void*>(data[i], nullptr); break;
        case CU_POINTER_ATTRIBUTE_BUFFER_ID: put<unsigned long long>(data[i], 0); break;
        case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: put<CUdeviceptr>(data[i], 0); break;
        case CU_POINTER_ATTRIBUTE_RANGE_SIZE: put<size_t>(data[i], 0); break;
        case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: put<int>(data[i], -2); break;
        default: put<unsigned>(data[i], 0); break;
      }
      continue;
    }
    CUresult rc = attribute(data[i], attributes[i], ptr, info);
    if (rc == CUDA_ERROR_INVALID_VALUE && attributes[i] == CU_POINTER_ATTRIBUTE_HOST_POINTER) {
      put<void*>(data[i], nullptr);  // device memory has no host pointer
    } else if (rc != CUDA_SUCCESS) {
      return rc;
    }
  }
  return CUDA_SUCCESS;
}

// Only SYNC_MEMOPS can be set (cuda.h); copies here are always synchronous
// with respect to it, so setting it changes nothing observable.
extern "C" CUresult cuPointerSetAttribute(const void* value, CUpointer_attribute attr, CUdeviceptr ptr) {
  if (value == nullptr || attr != CU_POINTER_ATTRIBUTE_SYNC_MEMOPS) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  PointerInfo info;
  if (!classify_locked(ptr, &info)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}
