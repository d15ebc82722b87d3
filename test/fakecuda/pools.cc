// Stream-ordered allocation and memory pools. The model: a pool reserves device
// memory in growth steps (charged to the device; 2 MiB, or
// FAKECUDA_POOL_GROWTH_BYTES: the driver's step is implementation-defined);
// allocations use the reserve; a trim releases whole steps no allocation uses;
// a free returns bytes to the pool, which keeps them reserved; at a
// synchronisation point (stream/context/event synchronize) each pool of the
// device trims its unused reserve down to its release threshold (default 0);
// cuMemPoolTrimTo trims on request. Stream order itself is not modelled: an
// allocation or free takes effect when the call is made. A pool whose reuse
// attributes forbid reuse across streams without a dependency
// (CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC and
// ..._REUSE_ALLOW_INTERNAL_DEPENDENCIES both 0; events are not modelled, so
// ..._REUSE_FOLLOW_EVENT_DEPENDENCIES adds none) keeps what cuMemFreeAsync
// freed for the freeing stream: an allocation on another stream grows the
// reserve though the pool has that much unused (the driver "may" reuse
// memory across streams only as these attributes allow). Until a
// synchronisation observes the free (cuStreamSynchronize of its stream, or
// of its context's legacy stream; cuCtxSynchronize) a trim keeps it, as
// cuMemPoolTrimTo says such frees "can count as outstanding"; then a trim
// releases it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "driver.h"

struct CUmemPoolHandle_st {
  static constexpr std::uint32_t kAlive = 0x9B9B9B9B;
  std::uint32_t device = 0;
  bool is_default = false;
  bool host = false;             // CU_MEM_LOCATION_TYPE_HOST[_NUMA]: holds no device memory
  bool destroy_pending = false;  // destroyed with allocations outstanding
  std::uint64_t reserved = 0;
  std::uint64_t reserved_high = 0;
  std::uint64_t used = 0;
  std::uint64_t used_high = 0;
  std::uint64_t release_threshold = 0;
  std::uint64_t max_size = 0;  // 0 = the device's capacity
  std::uint64_t outstanding = 0;
  int reuse_follow_event_dependencies = 1;
  int reuse_allow_opportunistic = 1;
  int reuse_allow_internal_dependencies = 1;
  // Unused reserve only its freeing stream may reuse (no cross-stream reuse):
  // frees not yet observed by a synchronisation, and those observed.
  struct Bound {
    std::uint64_t pending = 0, observed = 0;
  };
  std::map<const void*, Bound> stream_bound;
  std::uint64_t bound = 0;    // their sum: used + bound <= reserved
  std::uint64_t pending = 0;  // of which not observed (a trim keeps them)
};

using namespace gpuslice::fakecuda;

namespace {

constexpr std::uint64_t kChunk = std::uint64_t{2} << 20;

HandlePool<CUmemPoolHandle_st> g_pools;  // runtime mutex
CUmemPoolHandle_st* g_default_pool[kMaxDevices] = {};
CUmemPoolHandle_st* g_current_pool[kMaxDevices] = {};

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

// The step a pool's reserve grows and is trimmed by (README, "Test knobs"):
// a multiple of 2 MiB, read once (under the runtime mutex).
std::uint64_t growth_step() {
  static std::uint64_t step = 0;
  if (step != 0) return step;
  step = kChunk;
  if (const char* text = std::getenv("FAKECUDA_POOL_GROWTH_BYTES"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(text, &end, 10);
    if (*end != '\0' || v == 0 || v % kChunk != 0 || v > (std::uint64_t{1} << 40))
      std::fprintf(stderr, "fakecuda: FAKECUDA_POOL_GROWTH_BYTES=%s: expected a multiple of 2 MiB; ignored\n", text);
    else
      step = v;
  }
  return step;
}

CUmemPoolHandle_st* default_pool_locked(std::uint32_t dev) {
  if (g_default_pool[dev] == nullptr) {
    CUmemPoolHandle_st* pool = g_pools.make();
    pool->device = dev;
    pool->is_default = true;
    g_default_pool[dev] = pool;
  }
  if (g_current_pool[dev] == nullptr) g_current_pool[dev] = g_default_pool[dev];
  return g_default_pool[dev];
}

// Releases whole growth steps of unused reserve while the reserve is above
// `keep` (a step an allocation uses stays).
void trim_locked(CUmemPoolHandle_st* pool, std::uint64_t keep) {
  if (keep >= pool->reserved) return;
  const std::uint64_t step = growth_step();
  std::uint64_t target = std::max(round_up(pool->used + pool->pending, step), round_up(keep, step));
  if (target >= pool->reserved) return;
  if (!pool->host) uncharge_device(pool->device, pool->reserved - target);
  pool->reserved = target;
  // What the trim released came out of the observed stream-bound reserve too.
  for (auto it = pool->stream_bound.begin(); it != pool->stream_bound.end() && pool->used + pool->bound > target;) {
    const std::uint64_t drop = std::min(it->second.observed, pool->used + pool->bound - target);
    it->second.observed -= drop;
    pool->bound -= drop;
    it = it->second.pending + it->second.observed == 0 ? pool->stream_bound.erase(it) : std::next(it);
  }
}

// A destroyed pool's last allocation is gone: its whole reserve goes, stream
// frees observed or not.
void retire_locked(CUmemPoolHandle_st* pool) {
  for (auto& entry : pool->stream_bound) {
    entry.second.observed += entry.second.pending;
    entry.second.pending = 0;
  }
  pool->pending = 0;
  trim_locked(pool, 0);
  g_pools.retire(pool);
}

bool cross_stream_reuse(const CUmemPoolHandle_st* pool) {
  return pool->reuse_allow_opportunistic != 0 || pool->reuse_allow_internal_dependencies != 0;
}

// Unused reserve an allocation on `stream` may use.
std::uint64_t reusable(const CUmemPoolHandle_st* pool, const void* stream) {
  const auto it = pool->stream_bound.find(stream);
  return pool->reserved - pool->used - pool->bound +
         (it != pool->stream_bound.end() ? it->second.pending + it->second.observed : 0);
}

void trim_device_pools_locked(std::uint32_t dev, bool to_used) {
  g_pools.for_each_live([&](CUmemPoolHandle_st* pool) {
    // A destroyed pool keeps its reserve until its last allocation is freed.
    if (pool->device == dev && !pool->destroy_pending) trim_locked(pool, to_used ? 0 : pool->release_threshold);
  });
}

CUresult pool_alloc_locked(CUmemPoolHandle_st* pool, std::uint64_t size, CUctx_st* ctx, const void* stream,
                           CUdeviceptr* out) {
  if (size > reusable(pool, stream)) {
    // A whole step, or (where a step passes the pool's limit) 2 MiB chunks.
    std::uint64_t grow = round_up(size - reusable(pool, stream), growth_step());
    std::uint64_t limit = pool->max_size != 0 ? pool->max_size : state().header().memory_bytes;
    if (pool->reserved + grow > limit) grow = round_up(size - reusable(pool, stream), kChunk);
    if (pool->reserved + grow > limit) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = pool->host ? CUDA_SUCCESS : charge_device(pool->device, grow);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      // Like the driver, give back the unused reserve of this process's pools
      // on the device before failing.
      trim_device_pools_locked(pool->device, true);
      grow = size > reusable(pool, stream) ? round_up(size - reusable(pool, stream), growth_step()) : 0;
      if (pool->reserved + grow > limit) grow = round_up(size - reusable(pool, stream), kChunk);
      rc = grow == 0 ? CUDA_SUCCESS : charge_device(pool->device, grow);
    }
    if (rc != CUDA_SUCCESS) return rc;
    pool->reserved += grow;
    pool->reserved_high = std::max(pool->reserved_high, pool->reserved);
  }
  CUdeviceptr base = reserve_address(pool->device, size, 512);
  if (base == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  // The stream's own freed memory is used first.
  if (const auto it = pool->stream_bound.find(stream); it != pool->stream_bound.end()) {
    const std::uint64_t from_observed = std::min(it->second.observed, size);
    const std::uint64_t from_pending = std::min(it->second.pending, size - from_observed);
    it->second.observed -= from_observed;
    it->second.pending -= from_pending;
    pool->pending -= from_pending;
    pool->bound -= from_observed + from_pending;
    if (it->second.pending + it->second.observed == 0) pool->stream_bound.erase(it);
  }
  pool->used += size;
  pool->used_high = std::max(pool->used_high, pool->used);
  ++pool->outstanding;
  Allocation allocation;
  allocation.size = size;
  allocation.held = 0;
  allocation.device = pool->device;
  allocation.ctx = memory_owner(ctx);
  allocation.kind = AllocKind::pool;
  allocation.pool = pool;
  register_allocation_locked(base, allocation);
  *out = base;
  return CUDA_SUCCESS;
}

// Test knobs that widen a race window (README, "Test knobs"): microseconds
// slept, outside the driver's lock, before a stream-ordered allocation looks
// at the device's current pool, after a pool's reserve is read for
// cuMemPoolGetAttribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), and before and
// after a cuMemFreeAsync takes effect. 0 = none.
// (Parsed by delay_knob, below.)
// The knob is read once; threads that race to read it first each store the
// same value (an atomic: TSan saw two first calls write a plain one at once).
void knob_sleep(const char* name, std::atomic<unsigned>* cached, std::atomic<int>* read) {
  if (read->load(std::memory_order_acquire) == 0) {
    cached->store(delay_knob(name), std::memory_order_relaxed);
    read->store(1, std::memory_order_release);
  }
  const unsigned us = cached->load(std::memory_order_relaxed);
  if (us != 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}
std::atomic<unsigned> g_alloc_delay_us{0}, g_query_delay_us{0}, g_free_delay_us{0}, g_free_return_delay_us{0};
std::atomic<int> g_alloc_delay_read{0}, g_query_delay_read{0}, g_free_delay_read{0}, g_free_return_delay_read{0};

CUresult alloc_async(CUdeviceptr* dptr, size_t bytesize, CUmemPoolHandle_st* pool, CUstream hStream, bool ptsz) {
  if (dptr == nullptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (pool == nullptr) knob_sleep("FAKECUDA_ALLOC_ASYNC_DELAY_US", &g_alloc_delay_us, &g_alloc_delay_read);
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  std::lock_guard guard(runtime().mu);
  if (pool == nullptr) {
    default_pool_locked(stream->ctx->device);
    pool = g_current_pool[stream->ctx->device];
  } else if (!alive(pool) || pool->destroy_pending) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  return pool_alloc_locked(pool, bytesize, stream->ctx, stream, dptr);
}

CUresult free_async(CUdeviceptr dptr, CUstream hStream, bool ptsz) {
  if (!initialized()) return uninitialized_error();
  knob_sleep("FAKECUDA_FREE_ASYNC_DELAY_US", &g_free_delay_us, &g_free_delay_read);  // the address still allocated
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(hStream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  {
    std::lock_guard guard(runtime().mu);
    Allocation allocation;
    if (!remove_allocation_locked(dptr, &allocation)) return CUDA_ERROR_INVALID_VALUE;
    if (allocation.kind == AllocKind::pool) {
      CUmemPoolHandle_st* pool = allocation.pool;
      const bool bind = !cross_stream_reuse(pool) && !pool->destroy_pending;
      pool_return_locked(pool, allocation.size);
      if (bind) {
        pool->stream_bound[stream].pending += allocation.size;
        pool->bound += allocation.size;
        pool->pending += allocation.size;
      }
    } else {
      uncharge_device(allocation.device, allocation.held);  // a cuMemAlloc pointer may be freed this way too
    }
  }
  // The free made, the caller not yet back (a synchronisation of another
  // thread may trim what it returned to the pool meanwhile).
  knob_sleep("FAKECUDA_FREE_ASYNC_RETURN_DELAY_US", &g_free_return_delay_us, &g_free_return_delay_read);
  return CUDA_SUCCESS;
}

}  // namespace

namespace gpuslice::fakecuda {

unsigned delay_knob(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const unsigned long v = std::strtoul(text, &end, 10);
  if (*end != '\0' || v > 10'000'000) {
    std::fprintf(stderr, "fakecuda: %s=%s: expected microseconds, 0 to 10000000; ignored\n", name, text);
    return 0;
  }
  return static_cast<unsigned>(v);
}

void pool_return_locked(CUmemPoolHandle_st* pool, std::uint64_t size) {
  pool->used -= size;
  --pool->outstanding;
  if (pool->destroy_pending && pool->outstanding == 0) {
    retire_locked(pool);
  }
}

void pools_observe_frees(std::uint32_t dev, const void* stream) {
  std::lock_guard guard(runtime().mu);
  g_pools.for_each_live([&](CUmemPoolHandle_st* pool) {
    if (pool->device != dev || pool->pending == 0) return;
    for (auto& [key, b] : pool->stream_bound) {
      if (stream != nullptr && key != stream) continue;
      b.observed += b.pending;
      pool->pending -= b.pending;
      b.pending = 0;
    }
  });
}

void pools_trim_at_sync(std::uint32_t dev) {
  std::lock_guard guard(runtime().mu);
  trim_device_pools_locked(dev, false);
}

void holdings_pools_locked(std::string* out) {
  char line[200];
  g_pools.for_each_live([&](CUmemPoolHandle_st* p) {
    if (p->host || p->reserved == 0) return;
    std::snprintf(line, sizeof(line), "    pool %p%s reserved %llu used %llu dev%u\n", static_cast<void*>(p),
                  p->is_default ? " (default)" : "", static_cast<unsigned long long>(p->reserved),
                  static_cast<unsigned long long>(p->used), p->device);
    *out += line;
  });
}
}  // namespace gpuslice::fakecuda

extern "C" CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  return alloc_async(dptr, bytesize, nullptr, hStream, false);
}
extern "C" CUresult cuMemAllocAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUstream hStream) {
  return alloc_async(dptr, bytesize, nullptr, hStream, true);
}
extern "C" CUresult cuMemAllocFromPoolAsync(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return alloc_async(dptr, bytesize, pool, hStream, false);
}
extern "C" CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr* dptr, size_t bytesize, CUmemoryPool pool,
                                                 CUstream hStream) {
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return alloc_async(dptr, bytesize, pool, hStream, true);
}
extern "C" CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, false); }
extern "C" CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, true); }

extern "C" CUresult cuMemPoolCreate(CUmemoryPool* pool, const CUmemPoolProps* poolProps) {
  if (pool == nullptr || poolProps == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
  // Host-located pools (pinned host memory, CUDA 12.2+) hold no device memory.
  const CUmemLocationType where = poolProps->location.type;
  const bool host = where == CU_MEM_LOCATION_TYPE_HOST || where == CU_MEM_LOCATION_TYPE_HOST_NUMA;
  if (!host && where != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
  if (!host && !valid_device(poolProps->location.id)) return CUDA_ERROR_INVALID_VALUE;
  if (where == CU_MEM_LOCATION_TYPE_HOST_NUMA && poolProps->location.id < 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard guard(runtime().mu);
  CUmemPoolHandle_st* created = g_pools.make();
  created->host = host;
  created->device = host ? 0 : physical_device(poolProps->location.id);
  created->max_size = poolProps->maxSize;
  *pool = created;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(pool) || pool->destroy_pending || pool->is_default) return CUDA_ERROR_INVALID_VALUE;
  if (!pool->host && g_current_pool[pool->device] == pool) g_current_pool[pool->device] = g_default_pool[pool->device];
  // Documented: with allocations outstanding the call returns at once and the
  // pool's resources (its whole reserve) go when the last allocation is freed
  // (pool_return_locked); the handle is invalid from now on.
  pool->destroy_pending = true;
  if (pool->outstanding == 0) {
    retire_locked(pool);
  }
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool_out, CUdevice dev) {
  if (pool_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard guard(runtime().mu);
  *pool_out = default_pool_locked(physical_device(dev));
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice dev) {
  if (pool == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard guard(runtime().mu);
  default_pool_locked(physical_device(dev));
  *pool = g_current_pool[physical_device(dev)];
  return CUDA_SUCCESS;
}

extern "C" CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
  if (!initialized()) return uninitialized_error();
  if (!valid_device(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard guard(runtime().mu);
  if (!alive(pool) || pool->destroy_pending || pool->host || pool->device != physical_device(dev)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  default_pool_locked(physical_device(dev));
  g_current_pool[physical_device(dev)] = pool;
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(pool) || pool->destroy_pending) return CUDA_ERROR_INVALID_VALUE;
  trim_locked(pool, minBytesToKeep);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(pool) || pool->destroy_pending) return CUDA_ERROR_INVALID_VALUE;  // a destroyed handle
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
      pool->reuse_follow_event_dependencies = *static_cast<int*>(value);
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
      pool->reuse_allow_opportunistic = *static_cast<int*>(value);
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      pool->reuse_allow_internal_dependencies = *static_cast<int*>(value);
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
      pool->release_threshold = *static_cast<cuuint64_t*>(value);
      return CUDA_SUCCESS;
    // The high watermarks can only be reset, by writing 0.
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      pool->reserved_high = pool->reserved;
      return CUDA_SUCCESS;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      if (*static_cast<cuuint64_t*>(value) != 0) return CUDA_ERROR_INVALID_VALUE;
      pool->used_high = pool->used;
      return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult pool_get_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value);

extern "C" CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  const CUresult rc = pool_get_attribute(pool, attr, value);
  if (rc == CUDA_SUCCESS && attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    knob_sleep("FAKECUDA_POOL_QUERY_DELAY_US", &g_query_delay_us, &g_query_delay_read);
  return rc;
}

CUresult pool_get_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void* value) {
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  std::lock_guard guard(runtime().mu);
  if (!alive(pool) || pool->destroy_pending) return CUDA_ERROR_INVALID_VALUE;  // a destroyed handle
  auto* as_int = static_cast<int*>(value);
  auto* as_u64 = static_cast<cuuint64_t*>(value);
  switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: *as_int = pool->reuse_follow_event_dependencies; break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: *as_int = pool->reuse_allow_opportunistic; break;
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *as_int = pool->reuse_allow_internal_dependencies; break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *as_u64 = pool->release_threshold; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *as_u64 = pool->reserved; break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *as_u64 = pool->reserved_high; break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *as_u64 = pool->used; break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *as_u64 = pool->used_high; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
