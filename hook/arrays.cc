// CUDA arrays and mipmapped arrays hold device memory sized by their
// descriptor. We reserve the descriptor's size before creation (in bytes, not
// bits — vCUDA's 8x error), then settle on what the driver reports through
// cu*GetMemoryRequirements when it can tell us.
// gpuslice: hot path (no heap, no locks)
#include "hook/arrays.h"

#include <cuda.h>

#include "hook/freed_behind.h"
#include "hook/oversub.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

constinit NoDestroy<limiter::AllocTable> g_arrays;  // CUarray / CUmipmappedArray handle -> counted bytes

// Bytes of one element of one channel; block-compressed and planar video
// formats are costed by their densest case so the reservation is an upper bound.
std::uint64_t format_bytes(CUarray_format f) noexcept {
  switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
    case CU_AD_FORMAT_UNORM_INT8X1:
    case CU_AD_FORMAT_SNORM_INT8X1:
    case CU_AD_FORMAT_NV12:
    case CU_AD_FORMAT_BC1_UNORM:
    case CU_AD_FORMAT_BC1_UNORM_SRGB:
    case CU_AD_FORMAT_BC2_UNORM:
    case CU_AD_FORMAT_BC2_UNORM_SRGB:
    case CU_AD_FORMAT_BC3_UNORM:
    case CU_AD_FORMAT_BC3_UNORM_SRGB:
    case CU_AD_FORMAT_BC4_UNORM:
    case CU_AD_FORMAT_BC4_SNORM:
    case CU_AD_FORMAT_BC5_UNORM:
    case CU_AD_FORMAT_BC5_SNORM:
    case CU_AD_FORMAT_BC6H_UF16:
    case CU_AD_FORMAT_BC6H_SF16:
    case CU_AD_FORMAT_BC7_UNORM:
    case CU_AD_FORMAT_BC7_UNORM_SRGB: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
    case CU_AD_FORMAT_UNORM_INT8X2:
    case CU_AD_FORMAT_SNORM_INT8X2:
    case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1:
    case CU_AD_FORMAT_P010:
    case CU_AD_FORMAT_P016:
    case CU_AD_FORMAT_NV16:
    case CU_AD_FORMAT_YUY2: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
    case CU_AD_FORMAT_UNORM_INT8X4:
    case CU_AD_FORMAT_SNORM_INT8X4:
    case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X2:
    case CU_AD_FORMAT_UNORM_INT_101010_2:
    case CU_AD_FORMAT_P210:
    case CU_AD_FORMAT_P216:
    case CU_AD_FORMAT_Y210:
    case CU_AD_FORMAT_Y216:
    case CU_AD_FORMAT_AYUV:
    case CU_AD_FORMAT_Y410:
    case CU_AD_FORMAT_Y444_PLANAR8:
    case CU_AD_FORMAT_Y444_PLANAR10: return 4;
    default: return 8;  // UNORM/SNORM_INT16X4, Y416 and formats newer than this build
  }
}

std::uint64_t mul_sat(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out;
  return __builtin_mul_overflow(a, b, &out) ? ~std::uint64_t{0} : out;
}

std::uint64_t extent(std::uint64_t v) noexcept { return v == 0 ? 1 : v; }

std::uint64_t array_bytes(std::uint64_t w, std::uint64_t h, std::uint64_t d, CUarray_format f,
                          unsigned channels) noexcept {
  return mul_sat(mul_sat(mul_sat(extent(w), extent(h)), extent(d)), mul_sat(channels, format_bytes(f)));
}

std::uint64_t mipmapped_bytes(const CUDA_ARRAY3D_DESCRIPTOR& d, unsigned levels) noexcept {
  std::uint64_t total = 0;
  for (unsigned l = 0; l < levels && l < 64; ++l) {
    std::uint64_t w = d.Width >> l, h = d.Height >> l, z = d.Depth >> l;
    if (w == 0) w = 1;
    if (d.Height != 0 && h == 0) h = 1;
    if (d.Depth != 0 && z == 0) z = 1;
    std::uint64_t level = array_bytes(w, h, z, d.Format, d.NumChannels);
    if (__builtin_add_overflow(total, level, &total)) return ~std::uint64_t{0};
  }
  return total;
}

// Replace the descriptor estimate by the driver's own figure when available.
template <class Query>
CUresult settle(Reservation& r, Query&& query, auto destroy) noexcept {
  CUDA_ARRAY_MEMORY_REQUIREMENTS req{};
  CUdevice dev = ordinal_of_entry(r.entry);
  if (dev < 0 || query(&req, dev) != CUDA_SUCCESS || req.size == 0 || req.size == r.bytes) return CUDA_SUCCESS;
  if (req.size < r.bytes) {
    release(r.entry, r.bytes - req.size);
  } else if (!reserve(r.entry, req.size - r.bytes)) {
    destroy();
    release(r.entry, r.bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
  } else if (!resident_admits(r.entry)) {  // the driver's figure no longer fits the resident allowance
    destroy();
    release(r.entry, req.size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  r.bytes = req.size;
  return CUDA_SUCCESS;
}

// Arrays live on the device and cannot spill: over the device-resident
// allowance they fail, or wait under GPUSLICE_OVERSUBSCRIBE=wait
// (docs/memory.md). One predictable branch without the options.
CUresult admit_resident(const Reservation& r) noexcept {
  if (resident_admits(r.entry)) return CUDA_SUCCESS;
  release(r.entry, r.bytes);
  return CUDA_ERROR_OUT_OF_MEMORY;
}

bool array_gone(std::uint64_t key, const limiter::AllocRecord& rec) noexcept;

// An array made while its context was reset or destroyed (hook/freed_behind.h,
// g_freed_behind: the word changed between the mark read before the driver
// call and the record made after it): the driver may have freed it before
// its record existed, unseen by the sweep after the reset. Its record is
// settled as the sweep settles one (issue 32, chaos seed 2,001,044). Cold.
[[gnu::cold, gnu::noinline]] void settle_array_behind(std::uint64_t key, limiter::AllocKind kind) noexcept {
  limiter::settle_record(*g_arrays, key, limiter::AllocRecord{0, -1, kind}, array_gone,
                         [](const limiter::AllocRecord& r) { release_record(r); });
}
inline void recheck_array(CUresult rc, std::uint64_t mark, std::uint64_t key, limiter::AllocKind kind) noexcept {
  if (rc == CUDA_SUCCESS && __builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0))
    settle_array_behind(key, kind);
}
// A destroy of a handle with no record went through the driver: a handle a
// reset freed, which the driver may have given to another thread's array
// not yet recorded (the program's error, as a stale cuMemFree): the word
// moves (note_freed_untracked, as cuMemFree's), so that creation settles its record.
CUresult destroyed_untracked(CUresult rc) noexcept {
  if (rc == CUDA_SUCCESS) note_freed_untracked();
  return rc;
}

// A counting operation (measure.h), as every allocation: the driver call takes
// device memory, and reserve() may trim this process's idle pool reserves
// before it refuses (the pool reclaim): neither may overlap a measurement of
// a context, module or library (measure.h), which would take the trimmed
// reserve for its own shrinkage and count it short.
CUresult create_array(CUarray* handle, std::uint64_t bytes, auto&& real_create) noexcept {
  CountingOp op;
  Reservation r;
  CUresult rc = reserve_on_current(bytes, &r);
  if (rc != CUDA_SUCCESS) return rc;
  if ((rc = admit_resident(r)) != CUDA_SUCCESS) return rc;
  const std::uint64_t mark = freed_behind_mark();
  rc = real_create();
  if (rc == CUDA_SUCCESS && real_cuArrayGetMemoryRequirements != nullptr) {
    CUarray a = *handle;
    rc = settle(
        r,
        [&](CUDA_ARRAY_MEMORY_REQUIREMENTS* req, CUdevice dev) {
          return real_cuArrayGetMemoryRequirements(req, a, dev);
        },
        [&] { real_cuArrayDestroy(a); });
    if (rc != CUDA_SUCCESS) return rc;
  }
  const std::uint64_t key = rc == CUDA_SUCCESS ? reinterpret_cast<std::uint64_t>(*handle) : 0;
  commit(*g_arrays, rc, r, key, limiter::AllocKind::array);
  recheck_array(rc, mark, key, limiter::AllocKind::array);
  return rc;
}

// The question about a mipmapped array (below) makes its level 0 if it had
// none: an array the driver may put in the handle of an array gone (with
// its context) whose record the sweep has not asked about yet; asked then,
// the level would answer "known" and the dead array stay counted (issue 32,
// chaos seed 1,051,629). A level is no array the application created: an
// array record at its handle is of memory gone, released here once the
// driver still gives that level after the record was taken (else it goes
// back, and is settled as limiter::settle_record settles one it put back:
// the array there may have been destroyed while its record was out, its
// destroy finding none). Cold: the sweep's.
[[gnu::cold, gnu::noinline]] void release_displaced_by_level(CUmipmappedArray m, CUarray level) noexcept {
  const auto key = reinterpret_cast<std::uint64_t>(level);
  limiter::AllocRecord taken{};
  if (!g_arrays->erase(key, &taken)) return;
  CUarray again = nullptr;
  if (taken.kind == limiter::AllocKind::array && real_cuMipmappedArrayGetLevel(&again, m, 0) == CUDA_SUCCESS &&
      again == level)
    return release_record(taken);
  bool newer = false;  // an array made at the handle since and committed: ours is of memory gone
  if (!g_arrays->upsert(key, taken, [&](limiter::AllocRecord&, bool inserted) { newer = !inserted; })) return;
  if (newer) return release_record(taken);
  limiter::settle_record(*g_arrays, key, taken, array_gone, [](const limiter::AllocRecord& r) { release_record(r); });
}

// Whether the driver no longer knows the array (or mipmapped array) `key`.
// Only "no such handle" answers say so; any other error keeps the count.
bool array_gone(std::uint64_t key, const limiter::AllocRecord& rec) noexcept {
  if (real_cuArray3DGetDescriptor_v2 == nullptr || real_cuMipmappedArrayGetLevel == nullptr) return false;
  CUresult rc;
  if (rec.kind == limiter::AllocKind::mipmapped) {
    CUarray level = nullptr;
    rc = real_cuMipmappedArrayGetLevel(&level, reinterpret_cast<CUmipmappedArray>(key), 0);
    if (rc == CUDA_SUCCESS && level != nullptr)
      release_displaced_by_level(reinterpret_cast<CUmipmappedArray>(key), level);
  } else {
    CUDA_ARRAY3D_DESCRIPTOR d{};
    rc = real_cuArray3DGetDescriptor_v2(&d, reinterpret_cast<CUarray>(key));
  }
  return rc == CUDA_ERROR_INVALID_HANDLE || rc == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

}  // namespace
// After a context was destroyed: arrays it owned went with it. Only "no such
// handle" answers release a count; any other error keeps it.
void sweep_implicitly_freed_arrays() noexcept {
  if (real_cuArray3DGetDescriptor_v2 == nullptr || real_cuMipmappedArrayGetLevel == nullptr) return;
  sweep_table(*g_arrays, array_gone);
}

}  // namespace gpuslice::hook

using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuArrayCreate_v2(CUarray* pHandle, const CUDA_ARRAY_DESCRIPTOR* d) {
  if (pHandle == nullptr || d == nullptr) return CUDA_ERROR_INVALID_VALUE;  // as the driver, loaded or not
  return create_array(pHandle, array_bytes(d->Width, d->Height, 1, d->Format, d->NumChannels),
                      [&] { return real_cuArrayCreate_v2(pHandle, d); });
}

GPUSLICE_EXPORT CUresult CUDAAPI cuArray3DCreate_v2(CUarray* pHandle, const CUDA_ARRAY3D_DESCRIPTOR* d) {
  if (pHandle == nullptr || d == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return create_array(pHandle, array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels),
                      [&] { return real_cuArray3DCreate_v2(pHandle, d); });
}

GPUSLICE_EXPORT CUresult CUDAAPI cuArrayDestroy(CUarray hArray) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  return free_counted(
      *g_arrays, reinterpret_cast<std::uint64_t>(hArray), [&] { return real_cuArrayDestroy(hArray); },
      [&] { return destroyed_untracked(real_cuArrayDestroy(hArray)); }, array_gone);
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMipmappedArrayCreate(CUmipmappedArray* pHandle, const CUDA_ARRAY3D_DESCRIPTOR* d,
                                                        unsigned int numLevels) {
  if (pHandle == nullptr || d == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CountingOp op;  // as create_array's
  Reservation r;
  CUresult rc = reserve_on_current(mipmapped_bytes(*d, numLevels), &r);
  if (rc != CUDA_SUCCESS) return rc;
  if ((rc = admit_resident(r)) != CUDA_SUCCESS) return rc;
  const std::uint64_t mark = freed_behind_mark();
  rc = real_cuMipmappedArrayCreate(pHandle, d, numLevels);
  if (rc == CUDA_SUCCESS && real_cuMipmappedArrayGetMemoryRequirements != nullptr) {
    CUmipmappedArray m = *pHandle;
    rc = settle(
        r,
        [&](CUDA_ARRAY_MEMORY_REQUIREMENTS* req, CUdevice dev) {
          return real_cuMipmappedArrayGetMemoryRequirements(req, m, dev);
        },
        [&] { real_cuMipmappedArrayDestroy(m); });
    if (rc != CUDA_SUCCESS) return rc;
  }
  const std::uint64_t key = rc == CUDA_SUCCESS ? reinterpret_cast<std::uint64_t>(*pHandle) : 0;
  commit(*g_arrays, rc, r, key, gpuslice::limiter::AllocKind::mipmapped);
  recheck_array(rc, mark, key, gpuslice::limiter::AllocKind::mipmapped);
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMipmappedArrayDestroy(CUmipmappedArray h) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  return free_counted(
      *g_arrays, reinterpret_cast<std::uint64_t>(h), [&] { return real_cuMipmappedArrayDestroy(h); },
      [&] { return destroyed_untracked(real_cuMipmappedArrayDestroy(h)); }, array_gone);
}

GPUSLICE_EXPORT CUresult CUDAAPI cuArrayCreate(CUarray*, const CUDA_ARRAY_DESCRIPTOR_v1*) {
  return refuse_legacy("cuArrayCreate");
}

GPUSLICE_EXPORT CUresult CUDAAPI cuArray3DCreate(CUarray*, const CUDA_ARRAY3D_DESCRIPTOR_v1*) {
  return refuse_legacy("cuArray3DCreate");
}
