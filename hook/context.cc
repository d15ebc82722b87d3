// Contexts hold device memory of their own (hundreds of MiB on a real GPU).
// It is counted against the quota from creation to destruction. The driver
// does not say how much a context holds, so we measure it: this process's
// device usage as NVML reports it, just before and just after creation. Where
// NVML cannot see this process (no NVML, or a pid namespace hiding the host
// pid) the context is counted as 0 and the node agent's reconciliation adds
// what NVML shows for the container (docs/memory.md).
//
// The difference is exact only if nothing else in this process allocated or
// freed device memory meanwhile. Creations are serialised, and every counting
// operation (CountingOp, measure.h) is bracketed: a measurement that no
// operation overlapped is exact and remembered per device; an overlapped one
// uses the remembered size of a context on that device, or, for the first,
// the difference corrected by what this process's counted allocations moved.
// A process's first context on a device is measured once per configuration
// in the container and counted at that size afterwards (first_context_key).
// A green context (CUDA 12.4+) retains its device's primary context inside
// the driver: its creation and destruction count as that retain and release.
// Destroying a context (or the last release / reset of a primary context)
// frees everything it owned; the counted allocations the driver no longer
// knows are then released (memory.cc sweep_implicitly_freed).
#include <cuda.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "hook/launch_streams.h"
#include "hook/log.h"
#include "hook/measure.h"
#include "hook/memory.h"
#include "hook/modules.h"
#include "hook/oversub.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

using limiter::Counted;

constinit NoDestroy<platform::PointerTable<Counted>> g_contexts;  // CUcontext -> what was charged for it
struct Primary {
  int refs = 0;
  Counted counted{-1, 0};
  CUcontext handle = nullptr;  // for the limits charged in it
};
// Device memory a context's resource limits made the driver reserve
// (cuCtxSetLimit), keyed by limit_key(): released with the context.
constinit NoDestroy<platform::PointerTable<Counted>> g_limits;
std::uint64_t limit_key(CUcontext ctx, unsigned limit) noexcept {
  return (reinterpret_cast<std::uint64_t>(ctx) << 4) | (limit & 15u);
}
void release_limits(CUcontext ctx) noexcept {
  if (ctx == nullptr) return;
  for (unsigned l = 0; l < 16; ++l) {
    Counted c{};
    if (g_limits->erase(limit_key(ctx, l), &c) && c.bytes != 0) release(c.entry, c.bytes);
  }
}
Primary g_primary[kMaxDevices];
// The slot's context_bytes (gpuslice/region.h: the part of committed_bytes
// held by contexts), kept beside each count and release of a context (cold:
// creations and destructions only), so a count can be told apart from what
// the device holds by its parts.
void note_context(const Counted& c, bool counted) noexcept {
  Slot* const slot = owner_page().slot.load(std::memory_order_acquire);
  if (slot == nullptr || c.entry < 0 || static_cast<unsigned>(c.entry) >= kMaxDevices || c.bytes == 0) return;
  if (counted)
    slot->context_bytes[c.entry].fetch_add(c.bytes, std::memory_order_relaxed);
  else
    slot->context_bytes[c.entry].fetch_sub(c.bytes, std::memory_order_relaxed);
}
NoDestroy<std::mutex> g_primary_mu;  // held across primary retain/release so refcounts match the driver's
std::atomic<std::uint64_t> g_context_size[kMaxDevices];  // last exact measurement per device, 0 = none

// A process's first context on a device (issue 35): the driver takes the
// same memory for it whenever the device, the driver and what configures a
// context are the same: its creation flags and the environment variables the
// driver reads when it creates one. So its size is measured exactly once per
// such configuration in the container and kept in the region
// (DeviceState::first_context, key << 40 | bytes); a later process's first
// context of that key is reserved and counted at it without a measurement: a
// start asks NVML for no process list (O(processes on the device) on a GPU).
// Every other context (the process's second on the device, green contexts,
// contexts created with affinity or parameters, a primary context already
// active) is measured. The agent's reconciliation bounds any difference
// (agent_extra_bytes), as for every measurement.
constexpr unsigned kFirstKeyShift = 40;
constexpr std::uint64_t kFirstBytesMask = (std::uint64_t{1} << kFirstKeyShift) - 1;
constexpr std::int64_t kNotCacheable = -1;
std::atomic<bool> g_had_context[kMaxDevices];  // this process created a context on the ordinal once

// What the driver reads from the environment when it creates a context and
// that changes what the context holds (work queues, launch queues, MPS,
// eagerly loaded modules and libraries).
const char* const kContextEnv[] = {
    "CUDA_DEVICE_MAX_CONNECTIONS",       "CUDA_SCALE_LAUNCH_QUEUES",        "CUDA_MODULE_LOADING",
    "CUDA_MODULE_DATA_LOADING",          "CUDA_FORCE_PRELOAD_LIBRARIES",    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"};

// The 24-bit key (never 0) of a first context created with `flags`.
std::uint64_t first_context_key(unsigned flags) noexcept {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](const void* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  };
  int version = 0;
  if (real_cuDriverGetVersion != nullptr) real_cuDriverGetVersion(&version);
  mix(&flags, sizeof(flags));
  mix(&version, sizeof(version));
  for (const char* name : kContextEnv) {
    const char* v = std::getenv(name);
    const char absent = 1;
    if (v == nullptr)
      mix(&absent, 1);
    else
      mix(v, std::strlen(v) + 1);
  }
  // An MPS client's contexts are not a plain process's: whether the MPS
  // control daemon's pipe is there (the default directory without the variable).
  const char* mps = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  char control[256];
  std::snprintf(control, sizeof(control), "%s/control", mps != nullptr ? mps : "/tmp/nvidia-mps");
  const char served = access(control, F_OK) == 0 ? 1 : 0;
  mix(&served, 1);
  const std::uint64_t key = (h ^ (h >> 24) ^ (h >> 48)) & 0xFFFFFF;
  return key != 0 ? key : 1;
}

// The key of the context about to be created on `ordinal` when it is the
// process's first there and its kind is cached (`flags` not kNotCacheable),
// on a device with a quota; else 0.
std::uint64_t first_key(CUdevice ordinal, std::int64_t flags) noexcept {
  if (flags == kNotCacheable || ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices ||
      g_had_context[ordinal].load(std::memory_order_relaxed))
    return 0;
  const int entry = device_entry(ordinal);
  if (entry < 0 || g_process.region->devices[entry].quota_bytes.load(std::memory_order_relaxed) == kUnlimited) return 0;
  return first_context_key(static_cast<unsigned>(flags));
}

// Whether a size is kept for first contexts of `key` on `ordinal` (*bytes:
// it; 0 is a size: a context NVML saw take nothing).
bool first_context_size(CUdevice ordinal, std::uint64_t key, std::uint64_t* bytes) noexcept {
  *bytes = 0;
  const int entry = key != 0 ? device_entry(ordinal) : -1;
  if (entry < 0) return false;
  const std::uint64_t v = g_process.region->devices[entry].first_context.load(std::memory_order_relaxed);
  if ((v >> kFirstKeyShift) != key) return false;
  *bytes = v & kFirstBytesMask;
  return true;
}

// The size to reserve before creating a context on `ordinal`: the last exact
// measurement of this process there, else of any process of the container
// (DeviceState::context_size_bytes), else 0 (the first context of the
// container on the device: measured after, as before).
std::uint64_t expected_context_size(CUdevice ordinal, int entry) noexcept {
  if (entry < 0 || ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) return 0;
  if (const std::uint64_t own = g_context_size[ordinal].load(std::memory_order_relaxed); own != 0) return own;
  return g_process.region->devices[entry].context_size_bytes.load(std::memory_order_relaxed);
}

// Before a context is created on `ordinal`: reserves the size it is expected
// to take against the quota, and (oversubscription on) against the
// device-resident allowance, waiting under GPUSLICE_OVERSUBSCRIBE=wait
// (with no lock of ours held: frees of this process must go on meanwhile).
// A context that does not fit is never created: CUDA_ERROR_OUT_OF_MEMORY.
// *reserved gets what was reserved (0 when nothing is known yet).
// `known`: a size is kept for it (first_context_size): `kept`.
CUresult reserve_context(CUdevice ordinal, std::uint64_t* reserved, bool known, std::uint64_t kept) noexcept {
  *reserved = 0;
  const int entry = device_entry(ordinal);
  if (entry < 0 || g_process.region->devices[entry].quota_bytes.load(std::memory_order_relaxed) == kUnlimited)
    return CUDA_SUCCESS;  // nothing measured there either (nvml_usage)
  const std::uint64_t bytes = known ? kept : expected_context_size(ordinal, entry);
  if (bytes == 0) return CUDA_SUCCESS;
  bool fits = false;
  {
    // Like any allocation's: reserve() may trim this process's idle pool
    // reserves before it refuses (set_pool_reclaim), which changes the
    // device's memory and must not overlap a measurement.
    CountingOp op;
    fits = reserve(entry, bytes);
  }
  if (!fits) {
    GPUSLICE_LOG(info, "a context on device %d needs %llu bytes beyond the container's quota", ordinal,
                 static_cast<unsigned long long>(bytes));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (oversubscribing() && !resident_admits(entry)) {
    release(entry, bytes);
    GPUSLICE_LOG(info, "a context on device %d does not fit the container's device-resident allowance", ordinal);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *reserved = bytes;
  return CUDA_SUCCESS;
}

// Counts a context just created on `ordinal`, for which `reserved` bytes were
// reserved before (reserve_context): settles the count to its measured size
// (never below the reservation when the measurement is not exact or sees
// nothing: conservative); over the quota, or over the resident allowance,
// destroys it through `destroy` and reports CUDA_ERROR_OUT_OF_MEMORY (the
// reservation is returned either way). *over_allowance says which. `key`:
// a first context's (first_key), whose exact size is kept for its key.
template <class Destroy>
CUresult count_new_context(CUdevice ordinal, const Measure& m, std::uint64_t reserved, std::uint64_t key, Counted* out,
                           bool* over_resident, Destroy&& destroy) noexcept {
  out->entry = device_entry(ordinal);
  out->bytes = 0;
  *over_resident = false;
  if (out->entry < 0 || ordinal < 0 || static_cast<unsigned>(ordinal) >= kMaxDevices) return CUDA_SUCCESS;
  bool exact = false;
  std::uint64_t bytes = measured_bytes(ordinal, out->entry, m, &g_context_size[ordinal], &exact, reserved);
  if (exact && key != 0 && bytes <= kFirstBytesMask)
    g_process.region->devices[out->entry].first_context.store((key << kFirstKeyShift) | bytes,
                                                              std::memory_order_relaxed);
  if (exact && bytes != 0) {
    g_process.region->devices[out->entry].context_size_bytes.store(bytes, std::memory_order_relaxed);
  } else if (bytes < reserved) {
    bytes = reserved;  // not seen exactly: what a context took before, never less
  }
  bool fits = true;
  if (bytes > reserved) {
    fits = charge(out->entry, bytes - reserved);
  } else if (bytes < reserved) {
    release(out->entry, reserved - bytes);
  }
  out->bytes = bytes;
  if (fits && bytes > reserved && oversubscribing() && over_allowance(out->entry)) {
    fits = false;
    *over_resident = true;
  }
  if (!fits) {
    release(out->entry, bytes);
    out->bytes = 0;
    destroy();
    GPUSLICE_LOG(info, "context on device %d needs %llu bytes beyond the container's %s", ordinal,
                 static_cast<unsigned long long>(bytes), *over_resident ? "device-resident allowance" : "quota");
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

// A first context of unknown size refused over the resident allowance under
// `wait` (count_new_context): tried once more, now that its size is known,
// reserved first and waiting for the allowance.
bool retry_reserved(CUdevice dev, bool over_resident, std::uint64_t reserved, int attempt) noexcept {
  return over_resident && reserved == 0 && attempt == 0 &&
         config().options.oversubscribe == options::kOversubscribeWait &&
         expected_context_size(dev, device_entry(dev)) != 0;
}

// A context was created on `dev`; `kept`: the size it was counted at
// unmeasured (first_context_size), remembered as this process's exact size
// there, as a measurement would be (0: none).
void had_context(CUdevice dev, std::uint64_t kept) noexcept {
  if (dev < 0 || static_cast<unsigned>(dev) >= kMaxDevices) return;
  g_had_context[dev].store(true, std::memory_order_relaxed);
  if (kept != 0) g_context_size[dev].store(kept, std::memory_order_relaxed);
}

// `flags`: the creation flags of a context whose first one on a device is
// counted at its kept size (first_context_key), else kNotCacheable.
template <class Create>
CUresult create_context(CUcontext* pctx, CUdevice dev, std::int64_t flags, Create&& create) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  // A first context of unknown size that lands over the resident allowance
  // under `wait` is destroyed and tried once more, now that its size is
  // known: the second attempt reserves it first and waits for the allowance.
  for (int attempt = 0;; ++attempt) {
    const std::uint64_t key = first_key(dev, flags);
    std::uint64_t kept = 0;
    const bool known = first_context_size(dev, key, &kept);
    std::uint64_t reserved = 0;
    if ((rc = reserve_context(dev, &reserved, known, kept)) != CUDA_SUCCESS) return rc;
    // Held without a measurement too: no measurement of another thread may overlap the creation.
    std::unique_lock<MeasureMutex> creating(measure_mutex());
    const Measure m = known ? Measure{} : measure_before(dev);
    rc = create();
    if (rc != CUDA_SUCCESS || pctx == nullptr) {
      if (reserved != 0) release(device_entry(dev), reserved);
      return rc;
    }
    had_context(dev, known ? kept : 0);
    Counted c{};
    CUcontext ctx = *pctx;
    bool over_resident = false;
    if (known)
      c = Counted{device_entry(dev), reserved};  // reserved at its kept size, admitted before the call
    else
      rc = count_new_context(dev, m, reserved, key, &c, &over_resident, [&] { real_cuCtxDestroy_v2(ctx); });
    if (rc != CUDA_SUCCESS) {
      creating.unlock();
      if (retry_reserved(dev, over_resident, reserved, attempt)) continue;
      *pctx = nullptr;
      return rc;
    }
    kernels_context_created();
    if (c.bytes == 0) return rc;
    // A handle value still recorded is a context destroyed behind our back
    // (the driver reuses handles): what it held went with it.
    if (!platform::record(*g_contexts, reinterpret_cast<std::uint64_t>(ctx), c, [](const Counted& stale) {
          note_context(stale, false);
          if (stale.bytes != 0) release(stale.entry, stale.bytes);
        })) {
      release(c.entry, c.bytes);  // cannot track it: do not hold budget we could never return
    } else {
      note_context(c, true);
    }
    return rc;
  }
}

template <class Destroy>
CUresult destroy_context(CUcontext ctx, Destroy&& destroy) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CountingOp op;  // the device's usage drops: no measurement may overlap it
  // Until its sweep is done: allocations meanwhile check their address (hook/memory.h).
  FreeingBehind freeing;
  PlacedParts placed;  // its copies of libraries go with it
  PlacementDrop drop;  // no use of a library found placed in it is in the driver meanwhile
  library_placements_take(ctx, &placed);
  rc = destroy();
  library_placements_put(ctx, placed, rc == CUDA_SUCCESS);
  Counted c{};
  if (rc == CUDA_SUCCESS && g_contexts->erase(reinterpret_cast<std::uint64_t>(ctx), &c)) {
    note_context(c, false);
    release(c.entry, c.bytes);
  }
  if (rc == CUDA_SUCCESS) release_limits(ctx);
  if (rc == CUDA_SUCCESS) sweep_implicitly_freed();      // what the context owned went with it
  if (rc == CUDA_SUCCESS) launch::forget_all_streams();  // its streams too: their handles may come back
  if (rc == CUDA_SUCCESS) kernels_context_destroyed();   // no library is placed in the next context of this handle
  return rc;
}

template <class Release>
CUresult primary_drop(CUdevice dev, bool reset, Release&& real_release) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (dev < 0 || static_cast<unsigned>(dev) >= kMaxDevices) return real_release();
  std::lock_guard<std::mutex> lock(*g_primary_mu);
  CountingOp op;  // after the lock: a retain measuring under it must not wait for us
  // Until its sweep is done: allocations meanwhile check their address (hook/memory.h).
  FreeingBehind freeing;
  Primary& p = g_primary[dev];
  // The last release or a reset destroys it: its copies of libraries go with it.
  PlacedParts placed;
  const CUcontext handle = p.handle;
  const bool dropping = p.refs > 0 && (reset || p.refs == 1);
  PlacementDrop drop(dropping);  // no use of a library found placed in it is in the driver meanwhile
  if (dropping) library_placements_take(handle, &placed);
  rc = real_release();
  library_placements_put(handle, placed, rc == CUDA_SUCCESS);
  if (rc == CUDA_SUCCESS && p.refs > 0) {
    p.refs = reset ? 0 : p.refs - 1;
    if (p.refs == 0) kernels_context_destroyed();
    if (p.refs == 0 && p.counted.bytes != 0) {
      note_context(p.counted, false);
      release(p.counted.entry, p.counted.bytes);
      p.counted = Counted{-1, 0};
    }
    if (p.refs == 0) release_limits(p.handle);
  }
  // A reset, or the last release, destroys the primary context and all it owned.
  if (rc == CUDA_SUCCESS && (reset || p.refs == 0)) sweep_implicitly_freed();
  if (rc == CUDA_SUCCESS && (reset || p.refs == 0)) launch::forget_all_streams();
  return rc;
}

// A retain of `dev`'s primary context by `retain` (cuDevicePrimaryCtxRetain,
// or cuGreenCtxCreate, which retains it inside the driver); `undo` gives it
// back when the context it created is over the quota. `handle` is the primary
// context's handle when the call returns it (the limits charged in it).
// `green`: a green context's creation (never counted at a kept size).
template <class Retain, class Undo>
CUresult retain_primary(CUdevice dev, CUcontext* handle, bool green, Retain&& retain, Undo&& undo) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (dev < 0 || static_cast<unsigned>(dev) >= kMaxDevices) return retain();
  std::lock_guard<std::mutex> lock(*g_primary_mu);
  Primary& p = g_primary[dev];
  const bool first = p.refs == 0;
  // The first retain creates the context: reserved before, as cuCtxCreate
  // (create_context); waiting for the allowance under g_primary_mu only
  // holds back this process's other primary retains and releases.
  for (int attempt = 0;; ++attempt) {
    // A primary context the driver already holds active (retained behind
    // our back) takes nothing now: measured, never counted at a kept size.
    unsigned flags = 0;
    int active = 1;
    const bool cacheable = first && !green && real_cuDevicePrimaryCtxGetState != nullptr &&
                           real_cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS && active == 0;
    const std::uint64_t key = first_key(dev, cacheable ? std::int64_t{flags} : kNotCacheable);
    std::uint64_t kept = 0;
    const bool known = first_context_size(dev, key, &kept);
    std::uint64_t reserved = 0;
    if (first && (rc = reserve_context(dev, &reserved, known, kept)) != CUDA_SUCCESS) return rc;
    std::unique_lock<MeasureMutex> creating(measure_mutex(), std::defer_lock);
    Measure m{};
    if (first) {
      creating.lock();  // without a measurement too: none of another thread may overlap the creation
      if (!known) m = measure_before(dev);
    }
    rc = retain();
    if (rc != CUDA_SUCCESS) {
      if (reserved != 0) release(device_entry(dev), reserved);
      return rc;
    }
    if (first) {
      had_context(dev, known ? kept : 0);
      Counted c{};
      bool over_resident = false;
      if (known)
        c = Counted{device_entry(dev), reserved};  // reserved at its kept size, admitted before the call
      else
        rc = count_new_context(dev, m, reserved, key, &c, &over_resident, undo);
      if (rc != CUDA_SUCCESS) {
        creating.unlock();
        if (retry_reserved(dev, over_resident, reserved, attempt)) continue;
        return rc;
      }
      p.counted = c;
      note_context(c, true);
      if (handle != nullptr) p.handle = *handle;
      kernels_context_created();
    }
    ++p.refs;
    return rc;
  }
}

// Green contexts (CUDA 12.4+) by the device they retain the primary context of.
constinit NoDestroy<platform::PointerTable<Counted>> g_greens;  // CUgreenCtx -> {ordinal, 0}

}  // namespace

}  // namespace gpuslice::hook

using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  return create_context(pctx, dev, std::int64_t{flags}, [&] { return real_cuCtxCreate_v2(pctx, flags, dev); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* params, int n, unsigned int flags,
                                                CUdevice dev) {
  return create_context(pctx, dev, kNotCacheable, [&] { return real_cuCtxCreate_v3(pctx, params, n, flags, dev); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxCreate_v4(CUcontext* pctx, CUctxCreateParams* params, unsigned int flags,
                                                CUdevice dev) {
  return create_context(pctx, dev, kNotCacheable, [&] { return real_cuCtxCreate_v4(pctx, params, flags, dev); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxCreate(CUcontext*, unsigned int, CUdevice) {
  return refuse_legacy("cuCtxCreate");
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxDestroy_v2(CUcontext ctx) {
  return destroy_context(ctx, [&] { return real_cuCtxDestroy_v2(ctx); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxDestroy(CUcontext ctx) {
  return destroy_context(ctx, [&] { return real_cuCtxDestroy(ctx); });
}

GPUSLICE_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  return retain_primary(
      dev, pctx, false, [&] { return real_cuDevicePrimaryCtxRetain(pctx, dev); },
      [&] { real_cuDevicePrimaryCtxRelease_v2(dev); });
}

// A green context retains its device's primary context and releases it when
// destroyed (cuda.h, cuGreenCtxCreate/Destroy): counted as that retain and
// release, so the primary context the driver creates for it is counted once.
// Memory allocated while its CUcontext (cuCtxFromGreenCtx) is current is
// counted on its device by the allocation wrappers, its streams' launches by
// the launch layer (cuStreamGetDevice), like any context's.
GPUSLICE_EXPORT CUresult CUDAAPI cuGreenCtxCreate(CUgreenCtx* phCtx, CUdevResourceDesc desc, CUdevice dev,
                                                  unsigned int flags) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGreenCtxCreate == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  rc = retain_primary(
      dev, nullptr, true, [&] { return real_cuGreenCtxCreate(phCtx, desc, dev, flags); },
      [&] { real_cuGreenCtxDestroy(*phCtx); });
  if (rc == CUDA_SUCCESS && phCtx != nullptr &&
      !gpuslice::platform::record(*g_greens, reinterpret_cast<std::uint64_t>(*phCtx), Counted{dev, 0},
                                  [](const Counted&) {})) {
    GPUSLICE_LOG(warn, "cannot track green context %p: its primary context stays counted", static_cast<void*>(*phCtx));
  }
  return rc;
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGreenCtxDestroy(CUgreenCtx hCtx) {
  const CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuGreenCtxDestroy == nullptr) return CUDA_ERROR_NOT_FOUND;  // older driver
  Counted g{};
  if (!g_greens->find(reinterpret_cast<std::uint64_t>(hCtx), &g)) return real_cuGreenCtxDestroy(hCtx);
  const CUresult dropped = primary_drop(g.entry, false, [&] { return real_cuGreenCtxDestroy(hCtx); });
  if (dropped == CUDA_SUCCESS) g_greens->erase(reinterpret_cast<std::uint64_t>(hCtx), &g);
  return dropped;
}
GPUSLICE_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  return primary_drop(dev, false, [&] { return real_cuDevicePrimaryCtxRelease_v2(dev); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  return primary_drop(dev, false, [&] { return real_cuDevicePrimaryCtxRelease(dev); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  return primary_drop(dev, true, [&] { return real_cuDevicePrimaryCtxReset_v2(dev); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) {
  return primary_drop(dev, true, [&] { return real_cuDevicePrimaryCtxReset(dev); });
}

// A resource limit may make the driver reserve device memory at once (the
// malloc heap, the stack, the device runtime's sync depth and pending
// launches; cuda.h: such reservations failing make this call return
// CUDA_ERROR_OUT_OF_MEMORY). Measured like a context: what the process's
// usage grew by across the call is charged to the current context until it is
// destroyed; over the quota, or (oversubscription on) over the device-resident
// allowance (the reservation is resident memory: it cannot spill, and its size
// is known only once made, so it is not waited for), the previous limit is set
// again and the call fails with CUDA_ERROR_OUT_OF_MEMORY. A limit lowered
// later is not given back before the context goes (conservative).
GPUSLICE_EXPORT CUresult CUDAAPI cuCtxSetLimit(CUlimit limit, size_t value) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CUcontext ctx = nullptr;
  CUdevice dev = -1;
  if (real_cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
      dev < 0 || static_cast<unsigned>(dev) >= gpuslice::kMaxDevices || static_cast<unsigned>(limit) >= 16)
    return real_cuCtxSetLimit(limit, value);  // the driver's answer
  const int entry = device_entry(dev);
  if (entry < 0) return real_cuCtxSetLimit(limit, value);
  size_t previous = 0;
  const bool restorable = real_cuCtxGetLimit != nullptr && real_cuCtxGetLimit(&previous, limit) == CUDA_SUCCESS;
  std::lock_guard<MeasureMutex> measuring(measure_mutex());
  const Measure m = measure_before(dev);
  rc = real_cuCtxSetLimit(limit, value);
  if (rc != CUDA_SUCCESS) return rc;
  const std::uint64_t bytes = measured_bytes(dev, entry, m, nullptr);
  if (bytes == 0) return rc;
  if (!charge(entry, bytes) || (oversubscribing() && over_allowance(entry))) {
    release(entry, bytes);
    if (restorable) real_cuCtxSetLimit(limit, previous);
    GPUSLICE_LOG(info,
                 "cuCtxSetLimit(%d) on device %d needs %llu bytes beyond the container's quota or device-resident "
                 "allowance",
                 static_cast<int>(limit), dev, static_cast<unsigned long long>(bytes));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const Counted add{entry, bytes};
  if (!g_limits->upsert(limit_key(ctx, static_cast<unsigned>(limit)), add, [&](Counted& v, bool fresh) {
        if (!fresh) v.bytes += bytes;
      }))
    release(entry, bytes);  // cannot track it: do not hold budget we could never return
  return rc;
}
