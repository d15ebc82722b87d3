// Linear device memory: cuMemAlloc (and its 32-bit ancestor), pitched and
// managed allocations, frees, address ranges and cuMemGetInfo. Every byte is
// charged to the device in the shared state, so all processes see one capacity.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

// Address windows: each device gets 16 TiB of UVA space; the 32-bit legacy ABI
// gets addresses below 4 GiB (never reused). A freed device range is reused by
// the next allocation that fits in it, as the real driver reuses addresses.
constexpr std::uint64_t kDeviceWindow = std::uint64_t{1} << 44;
constexpr std::uint64_t kLegacyBase = 0x10000000ull;
constexpr std::uint64_t kLegacyEnd = 0xF0000000ull;

std::map<CUdeviceptr, Allocation> g_allocations;  // runtime mutex
std::uint64_t g_next_address[kMaxDevices] = {};
std::multimap<std::uint64_t, CUdeviceptr> g_free_ranges[kMaxDevices];  // span -> base; runtime mutex
std::uint64_t g_next_legacy = kLegacyBase;

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

// Every allocation gets a buffer id never reused in the process (cuda.h,
// CU_POINTER_ATTRIBUTE_BUFFER_ID), unlike its address.
void insert_locked(CUdeviceptr base, Allocation allocation) {
  allocation.buffer_id = next_object_id_locked();
  g_allocations[base] = allocation;
}

// The range an allocation took from reserve_address (linear: `held`, pool: `size`).
void release_address_locked(CUdeviceptr base, const Allocation& allocation) {
  release_bytes(allocation);
  if (allocation.kind == AllocKind::legacy32) return;
  if (allocation.kind == AllocKind::managed) return;  // a host address (managed_map), unmapped
  std::uint64_t bytes = allocation.kind == AllocKind::pool || allocation.held == 0 ? allocation.size : allocation.held;
  g_free_ranges[allocation.device].emplace(round_up(bytes, 512), base);
}

CUresult alloc_common(CUdeviceptr* dptr, std::uint64_t held, std::uint64_t size, AllocKind kind) {
  if (dptr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  if (held == 0) return CUDA_ERROR_INVALID_VALUE;
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  CUdeviceptr base = 0;
  if (kind == AllocKind::legacy32) {
    std::uint64_t span = round_up(held, 512);
    if (span > kLegacyEnd - g_next_legacy) return CUDA_ERROR_OUT_OF_MEMORY;
    if (CUresult rc = charge_device(ctx->device, held); rc != CUDA_SUCCESS) return rc;
    base = g_next_legacy;
    g_next_legacy += span;
  } else {
    if (CUresult rc = charge_device(ctx->device, held); rc != CUDA_SUCCESS) return rc;
    base = reserve_address(ctx->device, held, 512);
    if (base == 0) {
      uncharge_device(ctx->device, held);
      return CUDA_ERROR_OUT_OF_MEMORY;
    }
  }
  Allocation allocation;
  allocation.size = size;
  allocation.held = held;
  allocation.device = ctx->device;
  allocation.ctx = memory_owner(ctx);
  allocation.kind = kind;
  insert_locked(base, allocation);
  *dptr = base;
  return CUDA_SUCCESS;
}

CUresult free_common(CUdeviceptr dptr) {
  if (!initialized()) return uninitialized_error();
  if (dptr == 0) return CUDA_SUCCESS;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  Allocation allocation;
  // Only the exact base of a live allocation: an interior or unknown pointer is an error.
  if (!remove_allocation_locked(dptr, &allocation)) return CUDA_ERROR_INVALID_VALUE;
  if (allocation.kind == AllocKind::pool) {
    pool_return_locked(allocation.pool, allocation.size);
  } else {
    uncharge_device(allocation.device, allocation.held, allocation.kind == AllocKind::managed);
  }
  return CUDA_SUCCESS;
}

CUresult get_info(std::uint64_t* free_bytes, std::uint64_t* total_bytes) {
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  Runtime& r = runtime();
  State::Lock lock(*r.state);
  if (!lock.ok()) return CUDA_ERROR_UNKNOWN;
  r.state->reap_locked(r.slot);
  std::uint64_t total = r.state->header().memory_bytes;
  std::uint64_t used = r.state->device_used_locked(ctx->device);
  *free_bytes = used < total ? total - used : 0;
  *total_bytes = total;
  return CUDA_SUCCESS;
}

bool find_containing_locked(CUdeviceptr ptr, CUdeviceptr* base, std::uint64_t* size) {
  auto it = g_allocations.upper_bound(ptr);
  if (it != g_allocations.begin()) {
    --it;
    std::uint64_t span = std::max<std::uint64_t>(it->second.size, 1);
    if (ptr - it->first < span) {
      *base = it->first;
      *size = it->second.size;
      return true;
    }
  }
  if (vmm_find_mapping_locked(ptr, base, size)) return true;
  // Page-locked host memory is in the unified address space too.
  std::uintptr_t host_base = 0;
  unsigned flags = 0;
  bool registered = false;
  if (!host_range_find_locked(reinterpret_cast<void*>(ptr), &host_base, size, &flags, &registered)) return false;
  *base = host_base;
  return true;
}

}  // namespace

namespace gpuslice::fakecuda {

CUresult charge_device(std::uint32_t dev, std::uint64_t bytes, bool managed) {
  Runtime& r = runtime();
  State::Lock lock(*r.state);
  if (!lock.ok()) return CUDA_ERROR_UNKNOWN;
  // Reap before deciding: memory of dead processes is free, as on a real device.
  r.state->reap_locked(r.slot);
  const bool ok =
      managed ? r.state->charge_managed_locked(r.slot, dev, bytes) : r.state->charge_locked(r.slot, dev, bytes, false);
  return ok ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

void uncharge_device(std::uint32_t dev, std::uint64_t bytes, bool managed) {
  Runtime& r = runtime();
  if (managed) {
    r.state->uncharge_managed(r.slot, dev, bytes);
    return;
  }
  r.state->uncharge(r.slot, dev, bytes, false);
}

CUdeviceptr reserve_address(std::uint32_t dev, std::uint64_t bytes, std::uint64_t alignment) {
  std::uint64_t span = round_up(bytes, 512);
  // Smallest freed range that fits (best fit); its tail goes back to the list.
  auto& free_ranges = g_free_ranges[dev];
  for (auto it = free_ranges.lower_bound(span); it != free_ranges.end(); ++it) {
    CUdeviceptr base = it->second;
    if (base % std::max<std::uint64_t>(alignment, 512) != 0) continue;
    std::uint64_t rest = it->first - span;
    free_ranges.erase(it);
    if (rest > 0) free_ranges.emplace(rest, base + span);
    return base;
  }
  std::uint64_t window = kDeviceWindow * (dev + 1);
  std::uint64_t& next = g_next_address[dev];
  if (next == 0) next = window;
  std::uint64_t base = round_up(next, std::max<std::uint64_t>(alignment, 512));
  if (base + span > window + kDeviceWindow) return 0;
  next = base + span;
  return base;
}

void register_allocation_locked(CUdeviceptr base, const Allocation& allocation) { insert_locked(base, allocation); }

Allocation* find_allocation_locked(CUdeviceptr ptr, CUdeviceptr* base) {
  auto it = g_allocations.upper_bound(ptr);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  if (ptr - it->first >= std::max<std::uint64_t>(it->second.size, 1)) return nullptr;
  *base = it->first;
  return &it->second;
}

bool remove_allocation_locked(CUdeviceptr base, Allocation* out) {
  auto it = g_allocations.find(base);
  if (it == g_allocations.end()) return false;
  *out = it->second;
  release_address_locked(it->first, it->second);
  g_allocations.erase(it);
  return true;
}

void memory_release_context_locked(CUctx_st* ctx) {
  for (auto it = g_allocations.begin(); it != g_allocations.end();) {
    if (it->second.ctx == ctx && it->second.kind != AllocKind::pool) {
      uncharge_device(it->second.device, it->second.held, it->second.kind == AllocKind::managed);
      release_address_locked(it->first, it->second);
      it = g_allocations.erase(it);
    } else {
      ++it;
    }
  }
}

void holdings_allocations_locked(std::string* out) {
  static const char* const kKinds[] = {"linear", "pitch", "managed", "legacy32", "pool"};
  char line[200];
  for (const auto& [base, a] : g_allocations) {
    std::snprintf(
        line, sizeof(line), "    %s 0x%llx size %llu held %llu dev%u ctx %llu%s\n",
        kKinds[static_cast<int>(a.kind) < 5 ? static_cast<int>(a.kind) : 0], static_cast<unsigned long long>(base),
        static_cast<unsigned long long>(a.size), static_cast<unsigned long long>(a.held), a.device,
        static_cast<unsigned long long>(a.ctx != nullptr ? a.ctx->id : 0), a.pool != nullptr ? " (pool)" : "");
    *out += line;
  }
}
}  // namespace gpuslice::fakecuda

namespace {
// Test knob (README, "Test knobs"): microseconds a successful cuMemAlloc_v2
// sleeps before it returns, read once (delay_knob); 0 = none.
unsigned alloc_return_delay_us() {
  static const unsigned us = gpuslice::fakecuda::delay_knob("FAKECUDA_ALLOC_RETURN_DELAY_US");
  return us;
}
// Test knob (README, "Test knobs"): microseconds a successful cuMemFree_v2
// sleeps before it returns, read once (delay_knob); 0 = none.
unsigned free_return_delay_us() {
  static const unsigned us = gpuslice::fakecuda::delay_knob("FAKECUDA_FREE_RETURN_DELAY_US");
  return us;
}
// Test knob (README, "Test knobs"): microseconds cuMemGetAddressRange_v2
// sleeps before it looks the address up, and again after (its answer stale
// both ways, as a preempted caller's); 0 = none.
unsigned address_range_delay_us() {
  static const unsigned us = gpuslice::fakecuda::delay_knob("FAKECUDA_ADDRESS_RANGE_DELAY_US");
  return us;
}
}  // namespace

extern "C" CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  const CUresult rc = alloc_common(dptr, bytesize, bytesize, AllocKind::linear);
  // Test knob (README, "Test knobs"): the allocation is made and another
  // thread may free it, as a caller preempted before it records the pointer.
  if (rc == CUDA_SUCCESS && alloc_return_delay_us() != 0) usleep(alloc_return_delay_us());
  return rc;
}

extern "C" CUresult cuMemAlloc(CUdeviceptr_v1* dptr, unsigned int bytesize) {
  if (dptr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUdeviceptr wide = 0;
  CUresult rc = alloc_common(&wide, bytesize, bytesize, AllocKind::legacy32);
  if (rc == CUDA_SUCCESS) *dptr = static_cast<CUdeviceptr_v1>(wide);
  return rc;
}

extern "C" CUresult cuMemAllocPitch_v2(CUdeviceptr* dptr, size_t* pPitch, size_t WidthInBytes, size_t Height,
                                       unsigned int ElementSizeBytes) {
  if (pPitch == nullptr || WidthInBytes == 0 || Height == 0) return CUDA_ERROR_INVALID_VALUE;
  if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t pitch = round_up(WidthInBytes, 512);
  if (Height > ~std::uint64_t{0} / pitch) return CUDA_ERROR_OUT_OF_MEMORY;
  CUresult rc = alloc_common(dptr, pitch * Height, pitch * Height, AllocKind::pitch);
  if (rc == CUDA_SUCCESS) *pPitch = pitch;
  return rc;
}

extern "C" CUresult cuMemAllocPitch(CUdeviceptr_v1* dptr, unsigned int* pPitch, unsigned int WidthInBytes,
                                    unsigned int Height, unsigned int ElementSizeBytes) {
  if (dptr == nullptr || pPitch == nullptr || WidthInBytes == 0 || Height == 0) return CUDA_ERROR_INVALID_VALUE;
  if (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t pitch = round_up(WidthInBytes, 512);
  CUdeviceptr wide = 0;
  CUresult rc = alloc_common(&wide, pitch * Height, pitch * Height, AllocKind::legacy32);
  if (rc == CUDA_SUCCESS) {
    *dptr = static_cast<CUdeviceptr_v1>(wide);
    *pPitch = static_cast<unsigned int>(pitch);
  }
  return rc;
}

// Managed memory is backed by host memory and migrates to the device on
// demand; the driver lets it exceed the device's memory (CUDA programming
// guide, "Unified Memory: oversubscription", compute capability 6.x+). The
// simulator has no page-touch model: a managed allocation is held on the
// device of the allocating context where it fits (as if touched there), the
// rest stays on the host (charged nowhere); cuMemAdvise(SET_PREFERRED_LOCATION,
// host) moves it to the host.
std::uint64_t device_free_now(std::uint32_t dev) {
  Runtime& r = runtime();
  State::Lock lock(*r.state);
  if (!lock.ok()) return 0;
  r.state->reap_locked(r.slot);
  const std::uint64_t total = r.state->header().memory_bytes;
  const std::uint64_t used = r.state->device_used_locked(dev);
  return used < total ? total - used : 0;
}

extern "C" CUresult cuMemAllocManaged(CUdeviceptr* dptr, size_t bytesize, unsigned int flags) {
  if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) return CUDA_ERROR_INVALID_VALUE;
  if (dptr == nullptr || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  CUctx_st* ctx = nullptr;
  if (CUresult rc = current_context(&ctx); rc != CUDA_SUCCESS) return rc;
  const std::uint64_t free_bytes = device_free_now(ctx->device);
  const std::uint64_t resident = bytesize < free_bytes ? bytesize : free_bytes;
  // The address is host memory (managed memory is host-accessible, as on a
  // real system); the device holds what fits, the rest stays on the host.
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  if (resident > 0) {
    if (CUresult rc = charge_device(ctx->device, resident, true); rc != CUDA_SUCCESS) return rc;
  }
  void* host = managed_map(bytesize);
  if (host == nullptr) {
    if (resident > 0) uncharge_device(ctx->device, resident, true);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(host);
  Allocation allocation;
  allocation.size = bytesize;
  allocation.held = resident;
  allocation.device = ctx->device;
  allocation.ctx = memory_owner(ctx);
  allocation.kind = AllocKind::managed;
  allocation.host = host;
  insert_locked(base, allocation);
  *dptr = base;
  return CUDA_SUCCESS;
}

// Advice on managed memory. SET_PREFERRED_LOCATION to the host moves a whole
// managed allocation's pages to the host (no longer held by the device); other
// advice changes nothing the simulator models.
extern "C" CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUmemLocation location) {
  if (!initialized()) return uninitialized_error();
  if (count == 0) return CUDA_ERROR_INVALID_VALUE;
  Runtime& r = runtime();
  std::lock_guard guard(r.mu);
  auto it = g_allocations.find(devPtr);
  if (it == g_allocations.end() || it->second.kind != AllocKind::managed) return CUDA_ERROR_INVALID_VALUE;
  const bool host = location.type == CU_MEM_LOCATION_TYPE_HOST || location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
                    location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT;
  if (advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION && host && count >= it->second.size && it->second.held != 0) {
    uncharge_device(it->second.device, it->second.held, true);
    it->second.held = 0;
  }
  return CUDA_SUCCESS;
}

extern "C" CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device) {
  CUmemLocation location{};
  location.type = device == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
  location.id = device == CU_DEVICE_CPU ? 0 : device;
  return cuMemAdvise_v2(devPtr, count, advice, location);
}

extern "C" CUresult cuMemFree_v2(CUdeviceptr dptr) {
  const CUresult rc = free_common(dptr);
  // Test knob (README, "Test knobs"): the free is made, the caller not yet
  // back (another thread's synchronisation may trim what it returned to a
  // pool meanwhile).
  if (rc == CUDA_SUCCESS && free_return_delay_us() != 0) usleep(free_return_delay_us());
  return rc;
}
extern "C" CUresult cuMemFree(CUdeviceptr_v1 dptr) { return free_common(dptr); }

extern "C" CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
  if (free == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t f = 0;
  std::uint64_t t = 0;
  CUresult rc = get_info(&f, &t);
  if (rc == CUDA_SUCCESS) {
    *free = f;
    *total = t;
  }
  return rc;
}

extern "C" CUresult cuMemGetInfo(unsigned int* free, unsigned int* total) {
  if (free == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t f = 0;
  std::uint64_t t = 0;
  CUresult rc = get_info(&f, &t);
  if (rc == CUDA_SUCCESS) {
    *free = static_cast<unsigned int>(std::min<std::uint64_t>(f, UINT_MAX));
    *total = static_cast<unsigned int>(std::min<std::uint64_t>(t, UINT_MAX));
  }
  return rc;
}

extern "C" CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr dptr) {
  if (!initialized()) return uninitialized_error();
  if (address_range_delay_us() != 0) usleep(address_range_delay_us());
  CUresult rc = CUDA_SUCCESS;
  {
    std::lock_guard guard(runtime().mu);
    CUdeviceptr base = 0;
    std::uint64_t size = 0;
    if (!find_containing_locked(dptr, &base, &size)) {
      rc = CUDA_ERROR_NOT_FOUND;
    } else {
      if (pbase != nullptr) *pbase = base;
      if (psize != nullptr) *psize = size;
    }
  }
  // A return point (README, "Chaos points"): the answer is given, and another
  // thread may free or allocate at this address before the caller acts on it.
  chaos_point("cuMemGetAddressRange_v2");
  if (address_range_delay_us() != 0) usleep(address_range_delay_us());
  return rc;
}

extern "C" CUresult cuMemGetAddressRange(CUdeviceptr_v1* pbase, unsigned int* psize, CUdeviceptr_v1 dptr) {
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult rc = cuMemGetAddressRange_v2(&base, &size, dptr);
  if (rc != CUDA_SUCCESS) return rc;
  if (pbase != nullptr) *pbase = static_cast<CUdeviceptr_v1>(base);
  if (psize != nullptr) *psize = static_cast<unsigned int>(size);
  return CUDA_SUCCESS;
}
