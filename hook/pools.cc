// Stream-ordered allocation (cuMemAllocAsync, memory pools: what RAPIDS and
// cudaMallocAsync use). A pool keeps memory reserved after a free until a
// synchronisation point trims it to the pool's release threshold, so the
// device holds the pool's *reserve*, not the sum of live allocations. We count
// each pool at the reserve the driver reports (RESERVED_MEM_CURRENT):
//  - before an allocation, reserve the growth it can cause (what does not fit
//    in the pool's unused reserve, rounded up to the pool's 2 MiB chunk);
//  - after it, and after every synchronisation, trim or free, settle the
//    count on the reserve the driver reports.
// So the quota bounds what pools hold, frees return memory when the driver
// really lets it go, and nothing underflows (docs/memory.md).
// The device of a stream-ordered allocation is the pool's: a pool created,
// or looked up (cuDeviceGetMemPool / cuDeviceGetDefaultMemPool), on a device
// is remembered with it; cuMemAllocAsync uses the current pool of the
// *stream's* device, never simply the current context's.
// cuMemPoolDestroy with allocations outstanding returns at once, but the
// driver frees the pool only when the last of them is freed (cuda.h), so the
// pool stays counted until then.
#include <cuda.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "hook/launch.h"
#include "hook/log.h"
#include "hook/oversub.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

constexpr std::uint64_t kPoolChunk = 2ull << 20;

struct PoolCount {
  int entry;
  std::uint64_t counted;      // bytes this process holds in the region for the pool
  std::uint64_t outstanding;  // allocations made through us and not yet freed
  bool destroyed;             // cuMemPoolDestroy returned; freed with the last allocation
};

NoDestroy<std::recursive_mutex> g_mu;  // process-local; re-entered by the reclaim hook
NoDestroy<std::unordered_map<CUmemoryPool, PoolCount>> g_pools;
NoDestroy<std::unordered_map<CUdeviceptr, CUmemoryPool>> g_pool_pointers;  // live allocations -> their pool
NoDestroy<std::unordered_set<CUmemoryPool>> g_host_pools;  // host-located pools: never charged
std::atomic<int> g_pool_count{0};
[[gnu::tls_model("initial-exec")]] thread_local bool t_allocating = false;

bool pool_attr(CUmemoryPool pool, CUmemPool_attribute attr, std::uint64_t* out) noexcept {
  cuuint64_t v = 0;
  if (real_cuMemPoolGetAttribute == nullptr || real_cuMemPoolGetAttribute(pool, attr, &v) != CUDA_SUCCESS)
    return false;
  *out = v;
  return true;
}

// Settle a pool's count on the reserve the driver reports now.
bool settle_locked(CUmemoryPool pool, PoolCount& pc) noexcept {
  if (pc.destroyed) return true;  // the handle is gone; the count goes with the last allocation
  std::uint64_t reserved = 0;
  if (!pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved)) return false;
  if (reserved < pc.counted) {
    release(pc.entry, pc.counted - reserved);
  } else if (reserved > pc.counted && !charge(pc.entry, reserved - pc.counted)) {
    GPUSLICE_WARN_CAPPED(3, "a memory pool grew beyond what was reserved for it; the container is over "
                            "its quota until the pool is trimmed");
  }
  pc.counted = reserved;
  return true;
}

PoolCount* track_locked(CUmemoryPool pool, int entry) noexcept {
  try {
    auto [it, inserted] = g_pools->try_emplace(pool, PoolCount{entry, 0, 0, false});
    if (inserted) g_pool_count.fetch_add(1, std::memory_order_relaxed);
    return &it->second;
  } catch (...) {
    return nullptr;
  }
}

void settle_all() noexcept {
  if (g_pool_count.load(std::memory_order_relaxed) == 0 || t_allocating) return;
  std::lock_guard<std::recursive_mutex> lock(*g_mu);
  for (auto& [pool, pc] : *g_pools) settle_locked(pool, pc);
}

// A pointer from a pool was freed (by any free entry point): a destroyed pool
// goes with its last allocation.
void pointer_freed_locked(CUdeviceptr dptr) noexcept {
  auto p = g_pool_pointers->find(dptr);
  if (p == g_pool_pointers->end()) return;
  const CUmemoryPool pool = p->second;
  g_pool_pointers->erase(p);
  auto it = g_pools->find(pool);
  if (it == g_pools->end()) return;
  PoolCount& pc = it->second;
  if (pc.outstanding > 0) --pc.outstanding;
  if (pc.destroyed && pc.outstanding == 0) {
    release(pc.entry, pc.counted);
    g_pools->erase(it);
    g_pool_count.fetch_sub(1, std::memory_order_relaxed);
  }
}

template <class RealAlloc>
CUresult alloc_from(CUmemoryPool pool, int entry, std::uint64_t bytes, CUdeviceptr* dptr,
                    RealAlloc&& real_alloc) noexcept {
  CountingOp op;
  std::lock_guard<std::recursive_mutex> lock(*g_mu);
  PoolCount* pc = track_locked(pool, entry);
  if (pc == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  if (pc->destroyed) return real_alloc();  // the driver's own error for a destroyed pool
  const std::uint64_t counted_before = pc->counted;
  std::uint64_t used = 0, reserved = 0;
  std::uint64_t growth = bytes;
  if (pool_attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) &&
      pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved)) {
    growth = used + bytes > reserved ? used + bytes - reserved : 0;
  }
  growth = (growth + kPoolChunk - 1) / kPoolChunk * kPoolChunk;
  if (growth != 0) {
    t_allocating = true;
    bool ok = reserve(pc->entry, growth);
    t_allocating = false;
    if (!ok) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!resident_admits(pc->entry)) {  // over the device-resident allowance: pool memory cannot spill
      release(pc->entry, growth);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pc->counted += growth;
  }
  CUresult rc = real_alloc();
  if (!settle_locked(pool, *pc) && rc != CUDA_SUCCESS) {
    // Not a pool the driver knows (destroyed, foreign): nothing was allocated,
    // so nothing stays counted.
    release(pc->entry, pc->counted - counted_before);
    pc->counted = counted_before;
    if (pc->counted == 0 && pc->outstanding == 0) {
      g_pools->erase(pool);
      g_pool_count.fetch_sub(1, std::memory_order_relaxed);
    }
    return rc;
  }
  if (rc == CUDA_SUCCESS && dptr != nullptr) {
    try {
      if (g_pool_pointers->insert_or_assign(*dptr, pool).second) ++pc->outstanding;
    } catch (...) {
      // Without the record a destroy of this pool releases it early; the agent's
      // reconciliation still sees what the device holds.
    }
  }
  return rc;
}

// Registered with the runtime: before refusing any allocation, take back what
// pools have returned to the driver since we last looked.
struct RegisterReclaim {
  RegisterReclaim() noexcept { set_pool_reclaim(settle_all); }
} g_register_reclaim;

CUresult alloc_async(CUdeviceptr* dptr, size_t bytes, CUstream stream, bool per_thread) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (dptr == nullptr) {
    return per_thread ? real_cuMemAllocAsync_ptsz(dptr, bytes, stream) : real_cuMemAllocAsync(dptr, bytes, stream);
  }
  // The current pool of the stream's device (a stream of device 1 while
  // device 0's context is current allocates on device 1).
  CUdevice dev = launch::stream_ordinal(stream, per_thread);
  if (dev < 0 && (rc = real_cuCtxGetDevice(&dev)) != CUDA_SUCCESS) return rc;
  int entry = device_entry(dev);
  CUmemoryPool pool = nullptr;
  if (entry < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if ((rc = real_cuDeviceGetMemPool(&pool, dev)) != CUDA_SUCCESS) return rc;
  return alloc_from(pool, entry, bytes, dptr, [&] {
    return per_thread ? real_cuMemAllocAsync_ptsz(dptr, bytes, stream) : real_cuMemAllocAsync(dptr, bytes, stream);
  });
}

CUresult alloc_from_pool_async(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream stream,
                               bool per_thread) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  auto real = [&] {
    return per_thread ? real_cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, stream)
                      : real_cuMemAllocFromPoolAsync(dptr, bytes, pool, stream);
  };
  if (pool == nullptr || dptr == nullptr) return real();  // the driver's CUDA_ERROR_INVALID_VALUE; nothing to count
  int entry = -1;
  {
    std::lock_guard<std::recursive_mutex> lock(*g_mu);
    if (g_host_pools->count(pool) != 0) return real();  // host memory: nothing on a device
    auto it = g_pools->find(pool);
    if (it != g_pools->end()) entry = it->second.entry;
  }
  if (entry < 0) {
    // A pool we never saw created or looked up (e.g. imported): its memory is
    // on the stream's device unless the driver says otherwise.
    const int ordinal = launch::stream_ordinal(stream, per_thread);
    entry = ordinal >= 0 ? device_entry(ordinal) : current_device_entry(&rc);
    if (entry < 0) return rc != CUDA_SUCCESS ? rc : real();
  }
  return alloc_from(pool, entry, bytes, dptr, [&] {
    return per_thread ? real_cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, stream)
                      : real_cuMemAllocFromPoolAsync(dptr, bytes, pool, stream);
  });
}

}  // namespace
}  // namespace gpuslice::hook

using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  return alloc_async(dptr, bytesize, hStream, false);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  return alloc_async(dptr, bytesize, hStream, true);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool,
                                                         CUstream hStream) {
  return alloc_from_pool_async(dptr, bytesize, pool, hStream, false);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytesize,
                                                              CUmemoryPool pool, CUstream hStream) {
  return alloc_from_pool_async(dptr, bytesize, pool, hStream, true);
}

namespace gpuslice::hook {
void pool_pointer_freed(CUdeviceptr dptr) noexcept {
  if (g_pool_count.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::recursive_mutex> lock(*g_mu);
  pointer_freed_locked(dptr);
}
}  // namespace gpuslice::hook

namespace {
// A stream-ordered free of pool memory returns it to the pool, not to the
// device: the count moves only when the driver trims the pool (settled at sync
// points). A stream-ordered free of cuMemAlloc memory frees it (the driver
// accepts any device pointer): released like cuMemFree.
template <class RealFree>
CUresult free_async(CUdeviceptr dptr, RealFree&& real_free) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = free_counted(linear_table(), dptr, real_free);
  if (rc == CUDA_SUCCESS) pool_pointer_freed(dptr);
  return rc;
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
  return free_async(dptr, [&] { return real_cuMemFreeAsync(dptr, hStream); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
  return free_async(dptr, [&] { return real_cuMemFreeAsync_ptsz(dptr, hStream); });
}

// Pools looked up on a device belong to it.
namespace {
void remember_pool(CUresult rc, CUmemoryPool* pool, CUdevice dev) noexcept {
  if (rc != CUDA_SUCCESS || pool == nullptr || *pool == nullptr) return;
  const int entry = device_entry(dev);
  if (entry < 0) return;
  std::lock_guard<std::recursive_mutex> lock(*g_mu);
  track_locked(*pool, entry);
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice dev) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuDeviceGetDefaultMemPool(pool, dev);
  remember_pool(rc, pool, dev);
  return rc;
}
GPUSLICE_EXPORT CUresult CUDAAPI cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice dev) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuDeviceGetMemPool(pool, dev);
  remember_pool(rc, pool, dev);
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemPoolCreate(pool, props);
  if (rc != CUDA_SUCCESS || props == nullptr || pool == nullptr) return rc;
  if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    int entry = device_entry(props->location.id);
    if (entry >= 0) {
      std::lock_guard<std::recursive_mutex> lock(*g_mu);
      track_locked(*pool, entry);
    }
  } else {
    // Host-located (CUDA 13: HOST, HOST_NUMA, HOST_NUMA_CURRENT): its memory
    // is not on any device, and allocations from it are never charged.
    try {
      std::lock_guard<std::recursive_mutex> lock(*g_mu);
      g_host_pools->insert(*pool);
    } catch (...) {
    }
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  std::lock_guard<std::recursive_mutex> lock(*g_mu);
  auto it = g_pools->find(pool);
  if (it != g_pools->end()) settle_locked(pool, it->second);  // last look at its reserve
  rc = real_cuMemPoolDestroy(pool);
  if (rc == CUDA_SUCCESS) g_host_pools->erase(pool);
  if (rc == CUDA_SUCCESS && it != g_pools->end()) {
    if (it->second.outstanding == 0) {
      release(it->second.entry, it->second.counted);
      g_pools->erase(it);
      g_pool_count.fetch_sub(1, std::memory_order_relaxed);
    } else {
      it->second.destroyed = true;  // freed by the driver with its last allocation
    }
  }
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemPoolTrimTo(pool, minBytesToKeep);
  if (rc == CUDA_SUCCESS) settle_all();
  return rc;
}

// Synchronisation points: where the driver trims pools to their release threshold.
namespace {
template <class Sync>
CUresult sync_then_settle(Sync&& sync) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = sync();
  settle_all();
  return rc;
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  return sync_then_settle([&] { return real_cuStreamSynchronize(hStream); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream hStream) {
  return sync_then_settle([&] { return real_cuStreamSynchronize_ptsz(hStream); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
  return sync_then_settle([] { return real_cuCtxSynchronize(); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  return sync_then_settle([&] { return real_cuEventSynchronize(hEvent); });
}
