// The bytes of simulated memory: every device allocation (linear, pitched,
// pool, VMM) has contents, kept in an anonymous MAP_NORESERVE mapping made at
// its first access, so multi-GiB allocations cost nothing until touched.
// Managed memory is host memory at the address the application gets (as on a
// real system, the host can read and write it). Contents are per process (an
// IPC/VMM importer in another process does not see them: README "Bytes").
// Copies and sets, synchronous and stream-ordered. Kernels do not compute.
#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

// Managed allocations take host addresses in [1 TiB, 16 TiB) where they can:
// below every device window (which starts at 16 TiB), above the legacy 32-bit
// range (managed_map says what happens where that range is taken).
constexpr std::uint64_t kManagedBase = std::uint64_t{1} << 40;
constexpr std::uint64_t kManagedEnd = std::uint64_t{1} << 44;
constexpr std::uint64_t kPage = 4096;
std::uint64_t g_next_managed = kManagedBase;  // runtime mutex

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

void* anonymous(std::uint64_t bytes) {
  void* p =
      mmap(nullptr, round_up(bytes, kPage), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// Where the bytes [ptr, ptr+len) live in this process. `cuda_only`: the
// pointer must be CUDA memory (device, managed, VMM-mapped, or page-locked
// host memory, whose device address is its host address under UVA);
// otherwise an unknown pointer is pageable host memory (cuMemcpy's unified
// addressing). Runtime mutex held.
CUresult locate_locked(CUdeviceptr ptr, std::uint64_t len, bool cuda_only, unsigned char** out) {
  CUdeviceptr base = 0;
  if (Allocation* a = find_allocation_locked(ptr, &base); a != nullptr) {
    if (ptr - base > a->size || len > a->size - (ptr - base)) return CUDA_ERROR_INVALID_VALUE;
    if (a->host == nullptr) {
      a->host = anonymous(std::max<std::uint64_t>(a->size, 1));
      if (a->host == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = static_cast<unsigned char*>(a->host) + (ptr - base);
    return CUDA_SUCCESS;
  }
  if (CUresult rc = vmm_bytes_locked(ptr, len, out); rc != CUDA_ERROR_NOT_FOUND) return rc;
  std::uintptr_t hbase = 0;
  std::uint64_t hsize = 0;
  unsigned flags = 0;
  bool registered = false;
  if (host_range_find_locked(reinterpret_cast<void*>(ptr), &hbase, &hsize, &flags, &registered)) {
    if (len > hsize - (ptr - hbase)) return CUDA_ERROR_INVALID_VALUE;
    *out = reinterpret_cast<unsigned char*>(ptr);
    return CUDA_SUCCESS;
  }
  if (cuda_only || ptr == 0) return CUDA_ERROR_INVALID_VALUE;
  *out = reinterpret_cast<unsigned char*>(ptr);
  return CUDA_SUCCESS;
}

// How a copy is ordered: synchronous copies wait for the work already
// submitted to the current context's legacy stream (they are issued on it);
// stream-ordered ones validate their stream and run at the call, which is a
// valid order since kernels do not write memory here (README "Bytes").
struct Order {
  CUstream stream = nullptr;
  bool async = false;
  bool ptsz = false;
};

CUresult begin(const Order& order) {
  if (!initialized()) return uninitialized_error();
  CUstream_st* stream = nullptr;
  if (order.async) {
    if (CUresult rc = resolve_stream(order.stream, order.ptsz, &stream); rc != CUDA_SUCCESS) return rc;
    if (stream->capture.load(std::memory_order_acquire) != nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return CUDA_SUCCESS;
  }
  if (CUresult rc = resolve_stream(nullptr, order.ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  stream_wait_idle(stream);
  return CUDA_SUCCESS;
}

enum class Side { host, cuda, unified };

CUresult copy(CUdeviceptr dst, Side dst_side, CUdeviceptr src, Side src_side, std::uint64_t bytes, const Order& order) {
  if (CUresult rc = begin(order); rc != CUDA_SUCCESS) return rc;
  if (bytes == 0) return CUDA_SUCCESS;
  unsigned char* to = nullptr;
  const unsigned char* from = nullptr;
  {
    std::lock_guard guard(runtime().mu);
    unsigned char* s = nullptr;
    if (dst_side == Side::host) {
      to = reinterpret_cast<unsigned char*>(dst);
    } else if (CUresult rc = locate_locked(dst, bytes, dst_side == Side::cuda, &to); rc != CUDA_SUCCESS) {
      return rc;
    }
    if (src_side == Side::host) {
      s = reinterpret_cast<unsigned char*>(src);
    } else if (CUresult rc = locate_locked(src, bytes, src_side == Side::cuda, &s); rc != CUDA_SUCCESS) {
      return rc;
    }
    from = s;
  }
  if (to == nullptr || from == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::memmove(to, from, bytes);
  return CUDA_SUCCESS;
}

template <typename T>
CUresult set(CUdeviceptr dst, std::uint64_t pitch, T value, std::uint64_t width, std::uint64_t height,
             const Order& order) {
  if (dst % sizeof(T) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (height > 1 && (pitch < width * sizeof(T) || pitch % sizeof(T) != 0)) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult rc = begin(order); rc != CUDA_SUCCESS) return rc;
  if (width == 0 || height == 0) return CUDA_SUCCESS;
  const std::uint64_t span = (height - 1) * pitch + width * sizeof(T);
  unsigned char* to = nullptr;
  {
    std::lock_guard guard(runtime().mu);
    if (CUresult rc = locate_locked(dst, span, true, &to); rc != CUDA_SUCCESS) return rc;
  }
  for (std::uint64_t y = 0; y < height; ++y) {
    unsigned char* row = to + y * pitch;
    if (sizeof(T) == 1) {
      std::memset(row, static_cast<int>(value), width);
    } else {
      for (std::uint64_t x = 0; x < width; ++x) std::memcpy(row + x * sizeof(T), &value, sizeof(T));
    }
  }
  return CUDA_SUCCESS;
}

// One side of a 2D/3D copy.
struct Side3 {
  CUmemorytype type;
  const void* host;
  CUdeviceptr device;
  CUarray array;
  std::uint64_t x, y, z, pitch, height;
};

CUresult side_pointer_locked(const Side3& s, std::uint64_t width, std::uint64_t height, std::uint64_t depth,
                             unsigned char** out) {
  if (s.type == CU_MEMORYTYPE_ARRAY) return CUDA_ERROR_NOT_SUPPORTED;  // arrays hold no bytes (README)
  const std::uint64_t pitch = s.pitch != 0 ? s.pitch : width;
  if ((height > 1 || depth > 1) && pitch < width + s.x) return CUDA_ERROR_INVALID_VALUE;
  const std::uint64_t rows = depth > 1 ? s.height : height;
  if (depth > 1 && rows < height + s.y) return CUDA_ERROR_INVALID_VALUE;
  const std::uint64_t first = (s.z * rows + s.y) * pitch + s.x;
  const std::uint64_t span = ((depth - 1) * rows + (height - 1)) * pitch + width;
  switch (s.type) {
    case CU_MEMORYTYPE_HOST:
      if (s.host == nullptr) return CUDA_ERROR_INVALID_VALUE;
      *out = const_cast<unsigned char*>(static_cast<const unsigned char*>(s.host)) + first;
      return CUDA_SUCCESS;
    case CU_MEMORYTYPE_DEVICE: return locate_locked(s.device + first, span, true, out);
    case CU_MEMORYTYPE_UNIFIED: return locate_locked(s.device + first, span, false, out);
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult copy3d(const Side3& src, const Side3& dst, std::uint64_t width, std::uint64_t height, std::uint64_t depth,
                const Order& order) {
  if (CUresult rc = begin(order); rc != CUDA_SUCCESS) return rc;
  if (width == 0 || height == 0 || depth == 0) return CUDA_SUCCESS;
  unsigned char* from = nullptr;
  unsigned char* to = nullptr;
  {
    std::lock_guard guard(runtime().mu);
    if (CUresult rc = side_pointer_locked(src, width, height, depth, &from); rc != CUDA_SUCCESS) return rc;
    if (CUresult rc = side_pointer_locked(dst, width, height, depth, &to); rc != CUDA_SUCCESS) return rc;
  }
  const std::uint64_t sp = src.pitch != 0 ? src.pitch : width;
  const std::uint64_t dp = dst.pitch != 0 ? dst.pitch : width;
  const std::uint64_t srows = depth > 1 ? src.height : height;
  const std::uint64_t drows = depth > 1 ? dst.height : height;
  for (std::uint64_t z = 0; z < depth; ++z) {
    for (std::uint64_t y = 0; y < height; ++y) {
      std::memmove(to + (z * drows + y) * dp, from + (z * srows + y) * sp, width);
    }
  }
  return CUDA_SUCCESS;
}

CUresult copy2d(const CUDA_MEMCPY2D* p, const Order& order) {
  if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Side3 src{p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes, p->srcY, 0, p->srcPitch, 0};
  Side3 dst{p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes, p->dstY, 0, p->dstPitch, 0};
  return copy3d(src, dst, p->WidthInBytes, p->Height, 1, order);
}

CUresult copy3d_desc(const CUDA_MEMCPY3D* p, const Order& order) {
  if (p == nullptr || p->srcLOD != 0 || p->dstLOD != 0) return CUDA_ERROR_INVALID_VALUE;
  Side3 src{p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes,
            p->srcY,          p->srcZ,    p->srcPitch,  p->srcHeight};
  Side3 dst{p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes,
            p->dstY,          p->dstZ,    p->dstPitch,  p->dstHeight};
  return copy3d(src, dst, p->WidthInBytes, p->Height, p->Depth, order);
}

CUresult copy3d_peer(const CUDA_MEMCPY3D_PEER* p, const Order& order) {
  if (p == nullptr || p->srcLOD != 0 || p->dstLOD != 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!alive(p->srcContext) || !alive(p->dstContext)) return CUDA_ERROR_INVALID_CONTEXT;
  Side3 src{p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcXInBytes,
            p->srcY,          p->srcZ,    p->srcPitch,  p->srcHeight};
  Side3 dst{p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstXInBytes,
            p->dstY,          p->dstZ,    p->dstPitch,  p->dstHeight};
  return copy3d(src, dst, p->WidthInBytes, p->Height, p->Depth, order);
}

CUresult peer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t bytes,
              const Order& order) {
  if (!initialized()) return uninitialized_error();
  if (!alive(dst_ctx) || !alive(src_ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  return copy(dst, Side::cuda, src, Side::cuda, bytes, order);
}

constexpr Order kSync{};
constexpr Order kSyncPtds{nullptr, false, true};
Order async(CUstream s, bool ptsz = false) { return Order{s, true, ptsz}; }

}  // namespace

namespace gpuslice::fakecuda {

void* managed_map(std::uint64_t bytes) {
  const std::uint64_t span = round_up(std::max<std::uint64_t>(bytes, 1), 2 << 20);
  constexpr int kFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  // The window can be taken: a sanitizer's shadow memory covers [1 TiB,
  // 16 TiB) under ASan and TSan. A few refusals in a row and the window is
  // given up for the process (not walked 2 MiB at a time across 15 TiB):
  // managed memory then lives where the kernel puts it, a host address all
  // the same (device windows are never mapped, so it cannot be one of theirs
  // on a machine with fewer than 7 simulated devices).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  static int refusals = 8;  // the sanitizers' shadow memory is there
#else
  static int refusals = 0;  // runtime mutex
#endif
  while (refusals < 8 && g_next_managed + span <= kManagedEnd) {
    void* hint = reinterpret_cast<void*>(g_next_managed);
    void* p = mmap(hint, span, PROT_READ | PROT_WRITE, kFlags | MAP_FIXED_NOREPLACE, -1, 0);
    g_next_managed += span;
    if (p == hint) {
      refusals = 0;
      return p;
    }
    if (p != MAP_FAILED) munmap(p, span);  // a kernel that ignored the flag placed it elsewhere
    ++refusals;
  }
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, kFlags, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void release_bytes(const Allocation& allocation) {
  if (allocation.host == nullptr) return;
  const std::uint64_t unit = allocation.kind == AllocKind::managed ? (2 << 20) : kPage;
  munmap(allocation.host, round_up(std::max<std::uint64_t>(allocation.size, 1), unit));
}

}  // namespace gpuslice::fakecuda

// --- linear copies ---
extern "C" CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy(dst, Side::unified, src, Side::unified, n, kSync);
}
extern "C" CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy(dst, Side::unified, src, Side::unified, n, kSyncPtds);
}
extern "C" CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return copy(dst, Side::unified, src, Side::unified, n, async(s));
}
extern "C" CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return copy(dst, Side::unified, src, Side::unified, n, async(s, true));
}
extern "C" CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  return copy(dst, Side::cuda, reinterpret_cast<CUdeviceptr>(src), Side::host, n, kSync);
}
extern "C" CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void* src, size_t n) {
  return copy(dst, Side::cuda, reinterpret_cast<CUdeviceptr>(src), Side::host, n, kSyncPtds);
}
extern "C" CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  return copy(reinterpret_cast<CUdeviceptr>(dst), Side::host, src, Side::cuda, n, kSync);
}
extern "C" CUresult cuMemcpyDtoH_v2_ptds(void* dst, CUdeviceptr src, size_t n) {
  return copy(reinterpret_cast<CUdeviceptr>(dst), Side::host, src, Side::cuda, n, kSyncPtds);
}
extern "C" CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy(dst, Side::cuda, src, Side::cuda, n, kSync);
}
extern "C" CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  return copy(dst, Side::cuda, src, Side::cuda, n, kSyncPtds);
}
extern "C" CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  return copy(dst, Side::cuda, reinterpret_cast<CUdeviceptr>(src), Side::host, n, async(s));
}
extern "C" CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
  return copy(dst, Side::cuda, reinterpret_cast<CUdeviceptr>(src), Side::host, n, async(s, true));
}
extern "C" CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
  return copy(reinterpret_cast<CUdeviceptr>(dst), Side::host, src, Side::cuda, n, async(s));
}
extern "C" CUresult cuMemcpyDtoHAsync_v2_ptsz(void* dst, CUdeviceptr src, size_t n, CUstream s) {
  return copy(reinterpret_cast<CUdeviceptr>(dst), Side::host, src, Side::cuda, n, async(s, true));
}
extern "C" CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return copy(dst, Side::cuda, src, Side::cuda, n, async(s));
}
extern "C" CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  return copy(dst, Side::cuda, src, Side::cuda, n, async(s, true));
}
extern "C" CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n) {
  return peer(dst, dc, src, sc, n, kSync);
}
extern "C" CUresult cuMemcpyPeer_ptds(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n) {
  return peer(dst, dc, src, sc, n, kSyncPtds);
}
extern "C" CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                      CUstream s) {
  return peer(dst, dc, src, sc, n, async(s));
}
extern "C" CUresult cuMemcpyPeerAsync_ptsz(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n,
                                           CUstream s) {
  return peer(dst, dc, src, sc, n, async(s, true));
}

// --- 2D / 3D ---
extern "C" CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D* p) { return copy2d(p, kSync); }
extern "C" CUresult cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D* p) { return copy2d(p, kSyncPtds); }
extern "C" CUresult cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D* p) { return copy2d(p, kSync); }
extern "C" CUresult cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D* p) { return copy2d(p, kSyncPtds); }
extern "C" CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* p, CUstream s) { return copy2d(p, async(s)); }
extern "C" CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D* p, CUstream s) { return copy2d(p, async(s, true)); }
extern "C" CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D* p) { return copy3d_desc(p, kSync); }
extern "C" CUresult cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D* p) { return copy3d_desc(p, kSyncPtds); }
extern "C" CUresult cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D* p, CUstream s) { return copy3d_desc(p, async(s)); }
extern "C" CUresult cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D* p, CUstream s) {
  return copy3d_desc(p, async(s, true));
}
extern "C" CUresult cuMemcpy3DPeer(const CUDA_MEMCPY3D_PEER* p) { return copy3d_peer(p, kSync); }
extern "C" CUresult cuMemcpy3DPeer_ptds(const CUDA_MEMCPY3D_PEER* p) { return copy3d_peer(p, kSyncPtds); }
extern "C" CUresult cuMemcpy3DPeerAsync(const CUDA_MEMCPY3D_PEER* p, CUstream s) { return copy3d_peer(p, async(s)); }
extern "C" CUresult cuMemcpy3DPeerAsync_ptsz(const CUDA_MEMCPY3D_PEER* p, CUstream s) {
  return copy3d_peer(p, async(s, true));
}

// --- sets ---
#define FAKECUDA_MEMSET(bits, type)                                                                                   \
  extern "C" CUresult cuMemsetD##bits##_v2(CUdeviceptr d, type v, size_t n) {                                         \
    return set<type>(d, 0, v, n, 1, kSync);                                                                           \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD##bits##_v2_ptds(CUdeviceptr d, type v, size_t n) {                                    \
    return set<type>(d, 0, v, n, 1, kSyncPtds);                                                                       \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD##bits##Async(CUdeviceptr d, type v, size_t n, CUstream s) {                           \
    return set<type>(d, 0, v, n, 1, async(s));                                                                        \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD##bits##Async_ptsz(CUdeviceptr d, type v, size_t n, CUstream s) {                      \
    return set<type>(d, 0, v, n, 1, async(s, true));                                                                  \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD2D##bits##_v2(CUdeviceptr d, size_t pitch, type v, size_t w, size_t h) {               \
    return set<type>(d, pitch, v, w, h, kSync);                                                                       \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD2D##bits##_v2_ptds(CUdeviceptr d, size_t pitch, type v, size_t w, size_t h) {          \
    return set<type>(d, pitch, v, w, h, kSyncPtds);                                                                   \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD2D##bits##Async(CUdeviceptr d, size_t pitch, type v, size_t w, size_t h, CUstream s) { \
    return set<type>(d, pitch, v, w, h, async(s));                                                                    \
  }                                                                                                                   \
  extern "C" CUresult cuMemsetD2D##bits##Async_ptsz(CUdeviceptr d, size_t pitch, type v, size_t w, size_t h,          \
                                                    CUstream s) {                                                     \
    return set<type>(d, pitch, v, w, h, async(s, true));                                                              \
  }
FAKECUDA_MEMSET(8, unsigned char)
FAKECUDA_MEMSET(16, unsigned short)
FAKECUDA_MEMSET(32, unsigned int)
#undef FAKECUDA_MEMSET
