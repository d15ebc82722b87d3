// Stream-ordered allocation (cuMemAllocAsync, memory pools: what RAPIDS and
// cudaMallocAsync use). A pool keeps memory reserved after a free until a
// synchronisation point trims it to the pool's release threshold, so the
// device holds the pool's *reserve*, not the sum of live allocations. Each
// pool is counted at or above its reserve (pool_state.h has the model,
// docs/memory.md the reasoning):
//  - an allocation that fits in what is already counted for its pool is one
//    atomic add on this process's pool record, the driver call, one read of
//    the pool's reserve (the driver may grow it all the same) and the record
//    of the pointer: no lock, no region operation;
//  - one that does not fit reserves the growth first (2 MiB chunks), under
//    the pool's mutex, and settles on the reserve the driver reports after
//    (pool_state.cc: every lock is there; this file takes none);
//  - a free returns bytes to the pool, not to the container;
//  - synchronisation, cuMemPoolTrimTo and any refusal bring the count down
//    (or up) to the reserve the driver reports.
// The device of a stream-ordered allocation is the pool's: a pool created,
// or looked up (cuDeviceGetMemPool / cuDeviceGetDefaultMemPool), on a device
// is remembered with it; cuMemAllocAsync uses the current pool of the
// *stream's* device, never simply the current context's.
// cuMemPoolDestroy with allocations outstanding returns at once, but the
// driver frees the pool only when the last of them is freed (cuda.h), so the
// pool stays counted until then.
// gpuslice: hot path (no heap, no locks)
#include <cuda.h>

#include <type_traits>

#include "hook/launch_streams.h"
#include "hook/measure.h"
#include "hook/memory.h"
#include "hook/pool_state.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

using pools::PoolState;

// A destroyed pool named by the caller (cuMemAllocFromPoolAsync) gets the
// driver's own error.
template <class RealAlloc>
CUresult forward(RealAlloc& real_alloc) noexcept {
  return real_alloc();
}

// A sweep of implicitly freed records (a context destroyed) ran while this
// allocation was in the driver: it found the address known before the pool
// record held it, and may have put a stale linear record back there (a
// record of nothing while this allocation lives). The address is a pool
// allocation of ours now: a linear record at it is stale. As cuMemAlloc
// settles its own address (hook/memory.h, the freed-behind word). Or an
// untracked free (a program's stale pointer) freed this allocation in the
// driver before it was recorded: its record is settled too.
[[gnu::cold, gnu::noinline]] CUresult settle_behind(CUresult rc, const CUdeviceptr* dptr, std::uint64_t mark) noexcept {
  if (rc == CUDA_SUCCESS && g_freed_behind.load(std::memory_order_seq_cst) != mark) {
    release_stale_linear(*dptr);
    pools::settle_freed_behind(*dptr);
  }
  return rc;
}

// `destroyed(real_alloc)`: the pool is destroyed (never a host pool).
template <class RealAlloc, class Destroyed = CUresult (*)(RealAlloc&) noexcept>
CUresult alloc_from(PoolState& st, std::uint64_t bytes, CUdeviceptr* dptr, CUstream stream, bool per_thread,
                    RealAlloc&& real_alloc, Destroyed destroyed = forward<RealAlloc>) noexcept {
  // Host-located pools hold nothing on a device.
  if (__builtin_expect((st.host.load(std::memory_order_relaxed) | st.destroyed.load(std::memory_order_relaxed)) != 0,
                       0))
    return st.host.load(std::memory_order_relaxed) != 0 ? real_alloc() : destroyed(real_alloc);
  const std::uint64_t mark = freed_behind_mark();  // before the driver call
  st.outstanding.fetch_add(bytes, std::memory_order_seq_cst);
  pools::mark_dirty(st);
  // What is outstanding is read again *after* the count, not taken from the
  // add: a growth for an allocation added after this one reserves that
  // allocation's own chunks only (grow_locked), and judged by the sum at its
  // add this one could take them too (the pool then held more than counted).
  // Read after the count, the sum holds every allocation the count was grown
  // for. (A size no device has goes the slow way too, where nothing wraps.)
  const std::uint64_t limit = st.counted.load(std::memory_order_seq_cst);
  if (__builtin_expect(st.outstanding.load(std::memory_order_seq_cst) > limit || bytes > pools::kHugeBytes, 0)) {
    using Fn = std::remove_reference_t<RealAlloc>;
    bool gone = false;  // destroyed while the growth waited for the pool's mutex
    const CUresult rc = pools::alloc_growing(
        st, bytes, dptr, stream, per_thread, [](void* c) noexcept { return (*static_cast<Fn*>(c))(); }, &real_alloc,
        &gone);
    return gone ? destroyed(real_alloc) : settle_behind(rc, dptr, mark);
  }
  const CUresult rc = real_alloc();
  if (__builtin_expect(rc != CUDA_SUCCESS, 0)) {
    // Taken back as a free is (pools::freed): a growth meanwhile may have
    // counted it (in `outstanding`) and its reconciliation kept the count
    // for it, unmarked; the pool is marked, and reconciled if it was left
    // above its reserve. The last of a destroyed pool frees the pool.
    pools::freed(st, bytes);
    return rc;
  }
  // The driver may grow the reserve though the allocation fits in what is
  // counted (fragmentation, a reuse policy): looked at before the pointer is
  // handed out or recorded, and settled under the pool's mutex if it did.
  if (__builtin_expect(pools::grew_past_count(st), 0))
    return settle_behind(pools::settle_fast_growth(st, bytes, dptr, stream, per_thread), dptr, mark);
  if (__builtin_expect(!pools::record(*dptr, st, bytes), 0)) pools::record_failed();
  if (__builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0)) return settle_behind(rc, dptr, mark);
  return rc;
}

// Registered with the runtime: before refusing any allocation, trim this
// process's pools and take back what they returned to the driver, and let
// other threads' reclaims finish (the pools they were trimming, ours skipped).
// A pool skipped because a growing thread held it while reclaiming is looked
// at once more after the other reclaims ended: its grower brings it down
// before refusing (alloc_growing), and this reclaim must not refuse on the
// count it had before.
void reclaim() noexcept {
  if (pools::g_slots_used.load(std::memory_order_relaxed) == 0) return;
  const bool skipped = pools::reclaim_all();
  pools::await_other_reclaims();
  if (skipped) pools::reclaim_all();
}
struct RegisterReclaim {
  RegisterReclaim() noexcept { set_pool_reclaim(reclaim); }
} g_register_reclaim;

CUresult alloc_async(CUdeviceptr* dptr, size_t bytes, CUstream stream, bool per_thread) noexcept {
  auto real = [&] {
    return per_thread ? real_cuMemAllocAsync_ptsz(dptr, bytes, stream) : real_cuMemAllocAsync(dptr, bytes, stream);
  };
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (dptr == nullptr) return real();
  // From the look at the current pool to the driver call: cuDeviceSetMemPool
  // waits for it (and it for cuDeviceSetMemPool), so the pool charged is the
  // pool the driver allocates from.
  CountingOp op;
  // The current pool of the stream's device (a stream of device 1 while
  // device 0's context is current allocates on device 1).
  int ordinal = launch::stream_ordinal(stream, per_thread);
  if (ordinal < 0) {
    CUdevice dev = 0;
    if ((rc = real_cuCtxGetDevice(&dev)) != CUDA_SUCCESS) return rc;
    ordinal = dev;
  }
  PoolState* st = pools::current_pool(ordinal, &rc);
  if (st == nullptr) return rc;
  // A destroyed pool is no device's current pool (the driver made the
  // default pool current again): the allocation is never forwarded
  // uncounted, the current pool is looked up again.
  return alloc_from(*st, bytes, dptr, stream, per_thread, real, [&](auto& again) noexcept {
    PoolState* now = pools::current_pool_after_destroy(ordinal, &rc);
    return now == nullptr ? rc : alloc_from(*now, bytes, dptr, stream, per_thread, again, [](auto&) noexcept {
      return CUDA_ERROR_OUT_OF_MEMORY;  // destroyed again meanwhile: refused, never uncounted
    });
  });
}

// A pool we never saw created or looked up (imported, or created before the
// library was loaded): its memory is on the stream's device.
template <class RealAlloc>
[[gnu::noinline, gnu::cold]] CUresult alloc_from_unknown_pool(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool,
                                                              CUstream stream, bool per_thread,
                                                              RealAlloc& real) noexcept {
  CUresult rc = CUDA_SUCCESS;
  const int ordinal = launch::stream_ordinal(stream, per_thread);
  const int entry = ordinal >= 0 ? device_entry(ordinal) : current_device_entry(&rc);
  if (entry < 0) return rc != CUDA_SUCCESS ? rc : real();
  cuuint64_t reserved = 0;
  if (real_cuMemPoolGetAttribute == nullptr ||
      real_cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
    return real();  // not a pool the driver knows: its error, nothing to count
  PoolState* st = pools::track(pool, entry, false);
  if (st == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  return alloc_from(*st, bytes, dptr, stream, per_thread, real);
}

CUresult alloc_from_pool_async(CUdeviceptr* dptr, size_t bytes, CUmemoryPool pool, CUstream stream,
                               bool per_thread) noexcept {
  auto real = [&] {
    return per_thread ? real_cuMemAllocFromPoolAsync_ptsz(dptr, bytes, pool, stream)
                      : real_cuMemAllocFromPoolAsync(dptr, bytes, pool, stream);
  };
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (pool == nullptr || dptr == nullptr) return real();  // the driver's CUDA_ERROR_INVALID_VALUE; nothing to count
  CountingOp op;  // a growth changes the device's usage (the fast path, as the driver may, too)
  PoolState* st = pools::find(pool);
  if (__builtin_expect(st == nullptr, 0)) return alloc_from_unknown_pool(dptr, bytes, pool, stream, per_thread, real);
  return alloc_from(*st, bytes, dptr, stream, per_thread, real);
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
GPUSLICE_EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool,
                                                              CUstream hStream) {
  return alloc_from_pool_async(dptr, bytesize, pool, hStream, true);
}

namespace {
// Inlined into the free's two paths (GCC's size heuristics alone would call it).
template <class RealFree>
[[gnu::always_inline]] inline CUresult free_pool_pointer(CUdeviceptr dptr, PoolState& st, std::uint64_t bytes,
                                                         RealFree& real_free) noexcept {
  const std::uint64_t mark = freed_behind_mark();
  release_stale_linear(dptr);  // while the allocation still holds the address (hook/memory.h)
  // Marked before the driver call too: a synchronisation of another thread
  // between the driver's free and pools::freed() trims the freed memory,
  // and its reconciliation must not skip the pool as unused since its last
  // (it keeps the count for this allocation, still outstanding, and leaves
  // the pool above its reserve: freed() then reconciles it).
  pools::mark_dirty(st);
  const CUresult rc = real_free();
  if (rc == CUDA_SUCCESS) {
    pools::freed(st, bytes);
    // A sweep that held a stale record of this address out of the table
    // meanwhile put it back while this free was in the driver (the address
    // known then): settled now, as cuMemFree does (limiter::settle_record).
    if (__builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0)) freed_untracked(dptr);
  } else {
    pools::record(dptr, st, bytes);  // the driver refused: the allocation is still live
    // Unless a free without a record (another thread's; a stale pointer at
    // the address) freed it in the driver while the record was out: the
    // record put back is settled, as an allocation's is (settle_behind).
    if (__builtin_expect(g_freed_behind.load(std::memory_order_relaxed) != mark, 0)) pools::settle_freed_behind(dptr);
  }
  return rc;
}

// A stream-ordered free of pool memory returns it to the pool, not to the
// device: the count moves only when the driver trims the pool. The record is
// taken before the driver call (exactly once), so an address the driver hands
// out again at once is never confused with this one. A stream-ordered free
// of cuMemAlloc memory frees it (the driver accepts any device pointer):
// released like cuMemFree.
template <class RealFree>
CUresult free_async(CUdeviceptr dptr, RealFree&& real_free) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (pools::g_slots_used.load(std::memory_order_relaxed) != 0) {
    PoolState* st = nullptr;
    std::uint64_t bytes = 0;
    if (__builtin_expect(pools::take_record(dptr, &st, &bytes), 1)) {
      if (__builtin_expect(st->destroyed.load(std::memory_order_relaxed) != 0, 0)) {
        CountingOp op;  // the last free of a destroyed pool frees the pool
        return free_pool_pointer(dptr, *st, bytes, real_free);
      }
      return free_pool_pointer(dptr, *st, bytes, real_free);
    }
  }
  return free_counted(linear_table(), dptr, real_free, pointer_gone);
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
  if (entry >= 0) pools::track(*pool, entry, false);
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
// cuMemAllocAsync allocates from the device's current pool, which this
// changes: no cuMemAllocAsync may be between its look at the cached current
// pool and its driver call meanwhile (it would charge the old pool while the
// driver grows the new one). The gate of counting operations (measure.h)
// holds new ones back and waits for those in flight (bounded: kDrainNs).
GPUSLICE_EXPORT CUresult CUDAAPI cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  struct Args {
    CUdevice dev;
    CUmemoryPool pool;
  } args{dev, pool};
  rc = gated_call(
      "cuDeviceSetMemPool",
      [](void* c) noexcept {
        const Args& a = *static_cast<Args*>(c);
        const CUresult r = real_cuDeviceSetMemPool(a.dev, a.pool);
        if (r == CUDA_SUCCESS) {  // before the gate opens
          pools::forget_current(a.dev);
          // Its destroy will change the device's current pool too (cuMemPoolDestroy).
          const int entry = device_entry(a.dev);
          if (PoolState* st = entry >= 0 ? pools::track(a.pool, entry, false) : nullptr)
            st->made_current.store(1, std::memory_order_seq_cst);
        }
        return r;
      },
      &args);
  remember_pool(rc, &pool, dev);
  return rc;
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* props) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuMemPoolCreate(pool, props);
  if (rc != CUDA_SUCCESS || props == nullptr || pool == nullptr) return rc;
  if (props->location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    const int entry = device_entry(props->location.id);
    if (entry >= 0) pools::track(*pool, entry, false);
  } else {
    // Host-located (CUDA 13: HOST, HOST_NUMA, HOST_NUMA_CURRENT): its memory
    // is not on any device, and allocations from it are never charged.
    pools::track(*pool, -1, true);
  }
  return rc;
}

// Destroying a device's current pool makes its default pool current again: a
// change of the current pool like cuDeviceSetMemPool's, made under the gate
// when the pool was ever made current (a cuMemAllocAsync between its look at
// the current pool and its driver call would charge the destroyed pool while
// the driver grows the default one). The flag is read inside a counting
// operation: a cuDeviceSetMemPool that sets it either finished before (seen)
// or waits for this destroy to end.
GPUSLICE_EXPORT CUresult CUDAAPI cuMemPoolDestroy(CUmemoryPool pool) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  {
    CountingOp op;  // releases the pool's reserve: no measurement may overlap it
    PoolState* st = pools::find(pool);
    if (st == nullptr) return real_cuMemPoolDestroy(pool);
    if (st->made_current.load(std::memory_order_seq_cst) == 0) return pools::destroy(*st, pool);
  }
  return gated_call(
      "cuMemPoolDestroy",
      [](void* c) noexcept {
        const CUmemoryPool p = static_cast<CUmemoryPool>(c);
        PoolState* st = pools::find(p);
        return st == nullptr ? real_cuMemPoolDestroy(p) : pools::destroy(*st, p);
      },
      pool);
}

GPUSLICE_EXPORT CUresult CUDAAPI cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CountingOp op;  // releases reserve: no measurement may overlap it
  rc = real_cuMemPoolTrimTo(pool, minBytesToKeep);
  if (rc != CUDA_SUCCESS) return rc;
  if (PoolState* st = pools::find(pool)) pools::reconcile_now(*st);
  return rc;
}

// Synchronisation points: where the driver trims pools to their release
// threshold. A trim lowers the device's usage: a synchronisation is a counting
// operation, so no measurement of implicit memory (measure.h) overlaps one.
namespace {
template <class Sync>
CUresult sync_then_reconcile(Sync&& sync) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CountingOp op;
  rc = sync();
  if (pools::g_slots_used.load(std::memory_order_relaxed) != 0) pools::reconcile_dirty();
  return rc;
}
}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
  return sync_then_reconcile([&] { return real_cuStreamSynchronize(hStream); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream hStream) {
  return sync_then_reconcile([&] { return real_cuStreamSynchronize_ptsz(hStream); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxSynchronize(void) {
  return sync_then_reconcile([] { return real_cuCtxSynchronize(); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
  return sync_then_reconcile([&] { return real_cuEventSynchronize(hEvent); });
}
// CUDA 12.5+: synchronises a given context (or the current one).
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxSynchronize_v2(CUcontext ctx) {
  return sync_then_reconcile([&] {
    return real_cuCtxSynchronize_v2 != nullptr ? real_cuCtxSynchronize_v2(ctx) : CUDA_ERROR_NOT_FOUND;  // older driver
  });
}
