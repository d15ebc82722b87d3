// CUDA arrays and mipmapped arrays: opaque device memory of
// width * max(height,1) * max(depth,1) * NumChannels * element size bytes
// (mipmapped: the sum over levels), charged to the current context's device.
// A mipmapped array's levels (cuMipmappedArrayGetLevel) are arrays it owns:
// views of its memory (charged once, with it), gone with it.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "driver.h"

struct CUarray_st {
  static constexpr std::uint32_t kAlive = 0xA7A7A7A7;
  CUctx_st* ctx = nullptr;
  std::uint32_t device = 0;
  std::uint64_t bytes = 0;  // 0 for a mipmapped array's level: its owner holds the memory
  CUDA_ARRAY3D_DESCRIPTOR desc{};
  CUmipmappedArray_st* owner = nullptr;  // the mipmapped array this is a level of
};

struct CUmipmappedArray_st {
  static constexpr std::uint32_t kAlive = 0xB7B7B7B7;
  CUctx_st* ctx = nullptr;
  std::uint32_t device = 0;
  std::uint64_t bytes = 0;
  unsigned int levels = 0;
  CUDA_ARRAY3D_DESCRIPTOR desc{};
  CUarray_st* level[64] = {};  // made at the first cuMipmappedArrayGetLevel of each
};

using namespace gpuslice::fakecuda;

namespace {

HandlePool<CUarray_st> g_arrays;  // runtime mutex
HandlePool<CUmipmappedArray_st> g_mipmapped;

// 0 = a format the simulator does not size (video and block-compressed formats).
std::uint64_t element_size(CUarray_format format) {
  switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
  }
}

CUresult level_bytes(const CUDA_ARRAY3D_DESCRIPTOR& d, std::uint64_t* bytes) {
  if (d.Width == 0) return CUDA_ERROR_INVALID_VALUE;
  if (d.NumChannels != 1 && d.NumChannels != 2 && d.NumChannels != 4) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t element = element_size(d.Format);
  if (element == 0) return CUDA_ERROR_NOT_SUPPORTED;
  *bytes = std::uint64_t{d.Width} * std::max<std::uint64_t>(d.Height, 1) * std::max<std::uint64_t>(d.Depth, 1) *
           d.NumChannels * element;
  return CUDA_SUCCESS;
}

CUresult create_array(CUarray* pHandle, const CUDA_ARRAY3D_DESCRIPTOR& desc) {
  if (!initialized()) return uninitialized_error();
  std::uint64_t bytes = 0;
  if (CUresult rc = level_bytes(desc, &bytes); rc != CUDA_SUCCESS) return rc;
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  if (CUresult rc = charge_device(ctx->device, bytes); rc != CUDA_SUCCESS) return rc;
  CUarray_st* array = g_arrays.make();
  array->ctx = memory_owner(ctx);
  array->device = ctx->device;
  array->bytes = bytes;
  array->desc = desc;
  *pHandle = array;
  return CUDA_SUCCESS;
}

// Test knob (README, "Test knobs"): microseconds a successful array or
// mipmapped array creation sleeps before it returns, the array made (a
// reset or destroy of its context may free it before the caller records
// the handle), read once (delay_knob); 0 = none.
CUresult delayed_return(CUresult rc) {
  static const unsigned us = gpuslice::fakecuda::delay_knob("FAKECUDA_ARRAY_RETURN_DELAY_US");
  if (rc == CUDA_SUCCESS && us != 0) usleep(us);
  return rc;
}

}  // namespace

namespace gpuslice::fakecuda {

void arrays_release_context_locked(CUctx_st* ctx) {
  g_arrays.for_each_live([&](CUarray_st* array) {
    if (array->ctx != ctx) return;
    uncharge_device(array->device, array->bytes);
    g_arrays.retire(array);
  });
  g_mipmapped.for_each_live([&](CUmipmappedArray_st* array) {
    if (array->ctx != ctx) return;
    uncharge_device(array->device, array->bytes);
    g_mipmapped.retire(array);
  });
}

// The levels of a mipmapped array being destroyed go with it (runtime mutex
// held). A level retired already (its context released) may have been made
// again as another array: only a live one still owned by `m` is retired.
void retire_levels_locked(CUmipmappedArray_st* m) {
  for (CUarray_st*& level : m->level) {
    if (level != nullptr && alive(level) && level->owner == m) g_arrays.retire(level);
    level = nullptr;
  }
}

void holdings_arrays_locked(std::string* out) {
  char line[160];
  g_arrays.for_each_live([&](CUarray_st* a) {
    if (a->bytes == 0) return;
    std::snprintf(line, sizeof(line), "    array %p held %llu dev%u ctx %llu\n", static_cast<void*>(a),
                  static_cast<unsigned long long>(a->bytes), a->device,
                  static_cast<unsigned long long>(a->ctx != nullptr ? a->ctx->id : 0));
    *out += line;
  });
  g_mipmapped.for_each_live([&](CUmipmappedArray_st* a) {
    std::snprintf(line, sizeof(line), "    mipmapped %p held %llu dev%u ctx %llu\n", static_cast<void*>(a),
                  static_cast<unsigned long long>(a->bytes), a->device,
                  static_cast<unsigned long long>(a->ctx != nullptr ? a->ctx->id : 0));
    *out += line;
  });
}
}  // namespace gpuslice::fakecuda

extern "C" CUresult cuArrayCreate_v2(CUarray* pHandle, const CUDA_ARRAY_DESCRIPTOR* pAllocateArray) {
  if (pHandle == nullptr || pAllocateArray == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUDA_ARRAY3D_DESCRIPTOR desc{};
  desc.Width = pAllocateArray->Width;
  desc.Height = pAllocateArray->Height;
  desc.Format = pAllocateArray->Format;
  desc.NumChannels = pAllocateArray->NumChannels;
  return delayed_return(create_array(pHandle, desc));
}

extern "C" CUresult cuArray3DCreate_v2(CUarray* pHandle, const CUDA_ARRAY3D_DESCRIPTOR* pAllocateArray) {
  if (pHandle == nullptr || pAllocateArray == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return delayed_return(create_array(pHandle, *pAllocateArray));
}

extern "C" CUresult cuArrayDestroy(CUarray hArray) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hArray)) return CUDA_ERROR_INVALID_HANDLE;
  uncharge_device(hArray->device, hArray->bytes);
  g_arrays.retire(hArray);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR* pArrayDescriptor, CUarray hArray) {
  if (pArrayDescriptor == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hArray)) return CUDA_ERROR_INVALID_HANDLE;
  if (hArray->desc.Depth != 0) return CUDA_ERROR_INVALID_VALUE;  // a 3D array: use cuArray3DGetDescriptor
  pArrayDescriptor->Width = hArray->desc.Width;
  pArrayDescriptor->Height = hArray->desc.Height;
  pArrayDescriptor->Format = hArray->desc.Format;
  pArrayDescriptor->NumChannels = hArray->desc.NumChannels;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR* pArrayDescriptor, CUarray hArray) {
  if (pArrayDescriptor == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hArray)) return CUDA_ERROR_INVALID_HANDLE;
  *pArrayDescriptor = hArray->desc;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMipmappedArrayCreate(CUmipmappedArray* pHandle,
                                           const CUDA_ARRAY3D_DESCRIPTOR* pMipmappedArrayDesc,
                                           unsigned int numMipmapLevels) {
  if (pHandle == nullptr || pMipmappedArrayDesc == nullptr || numMipmapLevels == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  const CUDA_ARRAY3D_DESCRIPTOR& base = *pMipmappedArrayDesc;
  std::uint64_t largest = std::max({base.Width, base.Height, base.Depth});
  unsigned int max_levels = 1;
  while ((largest >> max_levels) != 0) ++max_levels;
  if (numMipmapLevels > max_levels) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t total = 0;
  for (unsigned int level = 0; level < numMipmapLevels; ++level) {
    // Each level halves every present dimension, never below 1; absent ones stay 0.
    CUDA_ARRAY3D_DESCRIPTOR d = base;
    d.Width = std::max<std::size_t>(base.Width >> level, 1);
    d.Height = base.Height == 0 ? 0 : std::max<std::size_t>(base.Height >> level, 1);
    d.Depth = base.Depth == 0 ? 0 : std::max<std::size_t>(base.Depth >> level, 1);
    std::uint64_t bytes = 0;
    if (CUresult rc = level_bytes(d, &bytes); rc != CUDA_SUCCESS) return rc;
    total += bytes;
  }
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  {
    std::lock_guard guard(runtime().mu);
    if (CUresult rc = charge_device(ctx->device, total); rc != CUDA_SUCCESS) return rc;
    CUmipmappedArray_st* array = g_mipmapped.make();
    array->ctx = memory_owner(ctx);
    array->device = ctx->device;
    array->bytes = total;
    array->levels = numMipmapLevels;
    array->desc = base;
    *pHandle = array;
  }
  return delayed_return(CUDA_SUCCESS);
}

extern "C" CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hMipmappedArray)) return CUDA_ERROR_INVALID_HANDLE;
  uncharge_device(hMipmappedArray->device, hMipmappedArray->bytes);
  retire_levels_locked(hMipmappedArray);
  g_mipmapped.retire(hMipmappedArray);
  return CUDA_SUCCESS;
}

// The array of one level (CUDA driver API: CUDA_ERROR_INVALID_HANDLE for a
// handle that is not a live mipmapped array, CUDA_ERROR_INVALID_VALUE for a
// level past its last). The same array for the same level each time.
extern "C" CUresult cuMipmappedArrayGetLevel(CUarray* pLevelArray, CUmipmappedArray hMipmappedArray,
                                             unsigned int level) {
  if (pLevelArray == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(hMipmappedArray)) return CUDA_ERROR_INVALID_HANDLE;
  CUmipmappedArray_st* m = hMipmappedArray;
  if (level >= m->levels || level >= std::size(m->level)) return CUDA_ERROR_INVALID_VALUE;
  CUarray_st*& a = m->level[level];
  if (a == nullptr || !alive(a) || a->owner != m) {
    a = g_arrays.make();
    a->ctx = m->ctx;
    a->device = m->device;
    a->owner = m;
    a->desc = m->desc;
    a->desc.Width = std::max<std::size_t>(m->desc.Width >> level, 1);
    a->desc.Height = m->desc.Height == 0 ? 0 : std::max<std::size_t>(m->desc.Height >> level, 1);
    a->desc.Depth = m->desc.Depth == 0 ? 0 : std::max<std::size_t>(m->desc.Depth >> level, 1);
  }
  *pLevelArray = a;
  return CUDA_SUCCESS;
}
