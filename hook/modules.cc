// Modules and libraries hold device memory for their code and `__device__`
// globals. Its size is not knowable before the driver loads the image (it
// depends on the architecture the driver picks and on relocation), so it is
// measured like a context's: this process's NVML usage across the load
// (measure.h), charged when the load returns and released at unload. A load
// that does not fit the quota (or, oversubscription on, the device-resident
// allowance) is undone and fails with CUDA_ERROR_OUT_OF_MEMORY.
//
// A library loaded with no context current (what the CUDA 12+ runtime does;
// lazy loading is the default since 12.2) is placed in a context at its first
// use there. The placement points are measured the same way, once per
// library and context (the last context measured is remembered per device):
// cuLibraryGetGlobal, cuLibraryGetManaged, cuLibraryGetModule,
// cuKernelGetFunction, cuLibraryGetKernel (which places the library at once,
// through cuLibraryGetModule, when a context is current), and the first
// launch of a kernel cuLibraryGetKernel handed out in a context where its
// library was not measured yet (modules.h: measured in the launch wrapper,
// before the launch, through cuKernelGetFunction in that context).
// A placement that does not fit the quota cannot be undone alone: the library
// is unloaded and the call fails with CUDA_ERROR_OUT_OF_MEMORY (the handle is
// invalid from then on), and so does a launch that placed it.
#include <cuda.h>

#include <mutex>

#include "hook/modules.h"
#include "hook/log.h"
#include "hook/measure.h"
#include "hook/oversub.h"
#include "hook/wrap.h"
#include "platform/clock.h"

namespace gpuslice::hook {
namespace {

using limiter::Counted;

constinit NoDestroy<platform::PointerTable<Counted>> g_loaded;  // CUmodule -> what was charged
// A library's placements on a device, keyed by placed_key(): what was
// charged for them all, and per context measured (the last kPlacedContexts;
// 0 bytes when NVML could not see it: still placed) the part charged there.
// The driver loads a library into each context that uses it, and that copy
// goes with the context (NVIDIA's context-independent loading): a use in a
// context not listed is measured again (one already placed measures 0) and
// adds to the count; a context's part is released when it goes
// (library_placements_take, _put). A part whose context was pushed out of the
// list stays in `bytes` until the library is unloaded (counted above).
constexpr unsigned kPlacedContexts = 4;
struct Placed {
  int entry;
  std::uint64_t bytes;
  CUcontext ctx[kPlacedContexts];
  std::uint64_t part[kPlacedContexts];
  std::uint32_t next;  // the slot replaced next once all are in use
};
bool placed_in(const Placed& p, CUcontext ctx) noexcept {
  for (unsigned i = 0; i < kPlacedContexts; ++i)
    if (ctx != nullptr && p.ctx[i] == ctx) return true;
  return false;
}
// Adds `bytes` charged in `ctx` to `v` (its total and that context's part).
void add_part(Placed& v, CUcontext ctx, std::uint64_t bytes) noexcept {
  v.bytes += bytes;
  if (ctx == nullptr) return;
  for (unsigned i = 0; i < kPlacedContexts; ++i)
    if (v.ctx[i] == ctx) {
      v.part[i] += bytes;
      return;
    }
  unsigned slot = kPlacedContexts;
  for (unsigned i = 0; i < kPlacedContexts && slot == kPlacedContexts; ++i)
    if (v.ctx[i] == nullptr) slot = i;
  if (slot == kPlacedContexts) slot = v.next, v.next = (v.next + 1) % kPlacedContexts;
  v.ctx[slot] = ctx, v.part[slot] = bytes;
}
constinit NoDestroy<platform::PointerTable<Placed>> g_placed;
// CUkernel -> its CUlibrary (from cuLibraryGetKernel), for cuKernelGetFunction
// and launches (modules.h), with the contexts its library was measured (or
// found placed) in since the last context went (`epoch`: g_context_epoch
// then; an older record has seen none: a destroyed context's handle comes
// back for the next one).
// The last kSeenContexts contexts: a kernel launched in more contexts than
// that is looked at again (and measured, 0 where placed already).
constexpr unsigned kSeenContexts = 8;
struct KernelRecord {
  std::uint64_t lib;
  std::uint64_t epoch;
  CUcontext seen[kSeenContexts];
  std::uint32_t n;     // entries of seen[] in use
  std::uint32_t next;  // the one replaced next once all are
};
constinit NoDestroy<platform::PointerTable<KernelRecord>> g_kernels;
std::atomic<int> g_live_contexts{0};
std::atomic<std::uint64_t> g_context_epoch{0};
// Libraries unloaded and contexts dropped (destroyed, reset, last released)
// so far (PlacementDrop):
// invalidates the threads' last resolved kernel.
constinit std::atomic<std::uint64_t> g_placement_drops{0};
// Uses of a library found placed already that are in the driver now, and
// drops in flight (PlacementDrop, modules.h): each side adds itself, then
// looks at the other (seq_cst, Dekker): a use that sees no drop in flight
// is waited for by every drop that begins after it; one that sees a drop
// is measured instead (issue 32, seed 1,120,116: a primary context released
// and retained again, same handle, inside a use that the driver then placed
// in the new context, unmeasured).
// (measure.h: g_placed_uses, g_drops_in_flight.)
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
// Runs `use` (a library use with no measurement) if no drop is in flight
// and still_placed() (looked at after the use counted itself in): true
// when it ran (*rc).
template <class Still, class Use>
bool use_placed(Still&& still_placed, Use&& use, CUresult* rc) noexcept {
  g_placed_uses.fetch_add(1, std::memory_order_seq_cst);
  const bool ran = g_drops_in_flight.load(std::memory_order_seq_cst) == 0 && still_placed();
  if (ran) *rc = use();
  g_placed_uses.fetch_sub(1, std::memory_order_seq_cst);
  return ran;
}
[[gnu::tls_model("initial-exec")]] constinit thread_local CUkernel t_kernel = nullptr;
[[gnu::tls_model("initial-exec")]] constinit thread_local CUcontext t_kernel_ctx = nullptr;
[[gnu::tls_model("initial-exec")]] constinit thread_local std::uint64_t t_kernel_gen = 0;
static_assert(kMaxDevices <= 64, "placed_key() keeps the device in 6 bits");
std::uint64_t placed_key(CUlibrary lib, CUdevice dev) noexcept {
  return (reinterpret_cast<std::uint64_t>(lib) << 6) | static_cast<std::uint64_t>(dev);
}
// A load that reaches another hooked load (a driver built without
// -Bsymbolic calling its own entry point) is measured once, by the outer one.
[[gnu::tls_model("initial-exec")]] thread_local bool t_loading = false;

// Oversubscription on and the container (this load's bytes charged) above
// its device-resident allowance: a module or a placement is resident device
// memory, and its size is known only once the driver took it, so it is undone
// and refused at once under every policy (docs/memory.md: not waited for).
bool over_resident(int entry) noexcept { return oversubscribing() && over_allowance(entry); }

// No context current when looked at: the call is the driver's answer (a lazy
// library load, or an error). But a context can come back to this thread
// between the look and the call — its primary context reset or released by
// another thread and retained again (the driver gives the same handle), or
// a destroyed handle re-created — and the call then places memory nobody
// measures. Resets, releases and destroys are counting operations and
// creations measure under measure_mutex(), so with the gate closed neither
// can happen: the look is repeated there and the call made under it. True
// when the call was made (*rc), false when a context is current now (*dev:
// measure it as usual).
template <class Call>
bool call_without_context(Call&& call, CUresult* rc, CUdevice* dev) noexcept {
  std::lock_guard<MeasureMutex> gate(measure_mutex());
  close_gate_and_drain(nullptr);
  if (real_cuCtxGetDevice(dev) == CUDA_SUCCESS) return false;
  t_loading = true;
  *rc = call();
  t_loading = false;
  return true;
}

void remember(CUmodule m, CUdevice, const Counted& c) noexcept;
void remember(CUlibrary l, CUdevice dev, const Counted& c) noexcept;

// Runs `load` measured on the current context's device, charges what the
// driver took, and undoes the load through `unload` if it does not fit.
template <class Handle, class Load, class Unload>
CUresult load_counted(Handle* out, Load&& load, Unload&& unload) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CUdevice dev = -1;
  if (out == nullptr) return load();  // the driver's error
  if (real_cuCtxGetDevice(&dev) != CUDA_SUCCESS && !t_loading && call_without_context(load, &rc, &dev))
    return rc;  // no context: nothing placed now
  const int entry = device_entry(dev);
  if (entry < 0 || t_loading) return load();
  std::lock_guard<MeasureMutex> measuring(measure_mutex());
  const Measure m = measure_before(dev);
  t_loading = true;
  rc = load();
  t_loading = false;
  if (rc != CUDA_SUCCESS) return rc;
  const std::uint64_t bytes = measured_bytes(dev, entry, m, nullptr);
  if (bytes == 0) return rc;
  if (!charge(entry, bytes) || over_resident(entry)) {
    release(entry, bytes);
    unload(*out);
    GPUSLICE_LOG(info, "a module on device %d needs %llu bytes beyond the container's quota", dev,
                 static_cast<unsigned long long>(bytes));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // A handle value still recorded is a module unloaded behind our back (the
  // driver reuses handles; a context destroyed with it): its memory went with it.
  remember(*out, dev, Counted{entry, bytes});
  return rc;
}

// Records what was charged for a module, or a library's placement on `dev`.
void remember_in(platform::PointerTable<Counted>& table, std::uint64_t key, const Counted& counted) noexcept {
  if (!platform::record(table, key, counted, [](const Counted& stale) {
        if (stale.bytes != 0) release(stale.entry, stale.bytes);
      })) {
    release(counted.entry, counted.bytes);  // cannot track it: do not hold budget we could never return
  }
}
void remember(CUmodule m, CUdevice, const Counted& c) noexcept {
  remember_in(*g_loaded, reinterpret_cast<std::uint64_t>(m), c);
}
void remember(CUlibrary l, CUdevice dev, const Counted& c) noexcept {
  CUcontext ctx = nullptr;
  real_cuCtxGetCurrent(&ctx);
  Placed add{c.entry, 0, {}, {}, 0};
  add_part(add, ctx, c.bytes);
  if (!g_placed->upsert(placed_key(l, dev), add, [&](Placed& v, bool fresh) {
        if (!fresh) add_part(v, ctx, c.bytes);
      })) {
    release(c.entry, c.bytes);  // cannot track it: do not hold budget we could never return
  }
}

// Whether the driver no longer knows module `key`: a function lookup by a
// name no image has answers "no such handle" then, and "not found" while
// the module is loaded. Any other answer keeps the count.
bool module_gone(std::uint64_t key) noexcept {
  if (real_cuModuleGetFunction == nullptr) return false;
  CUfunction f = nullptr;
  const CUresult rc = real_cuModuleGetFunction(&f, reinterpret_cast<CUmodule>(key), "gpuslice: no such function");
  return rc == CUDA_ERROR_INVALID_HANDLE || rc == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

// Releases what was charged for `key` (a module, or a library on every device).
void forget(CUmodule m) noexcept {
  Counted c{};
  if (g_loaded->erase(reinterpret_cast<std::uint64_t>(m), &c)) release(c.entry, c.bytes);
}
void forget(CUlibrary l) noexcept {
  g_placement_drops.fetch_add(1, std::memory_order_acq_rel);
  for (CUdevice d = 0; d < static_cast<CUdevice>(kMaxDevices); ++d) {
    Placed c{};
    if (g_placed->erase(placed_key(l, d), &c) && c.bytes != 0) release(c.entry, c.bytes);
  }
}

// --- kernels launched (modules.h) ---
bool seen_in(const KernelRecord& r, CUcontext ctx) noexcept {
  if (r.epoch != g_context_epoch.load(std::memory_order_seq_cst)) return false;
  for (std::uint32_t i = 0; i < r.n && i < kSeenContexts; ++i)
    if (r.seen[i] == ctx) return true;
  return false;
}
// Seen in as many contexts as the process has: no launch can place it anywhere new.
bool complete(const KernelRecord& r) noexcept {
  const int live = g_live_contexts.load(std::memory_order_seq_cst);
  if (live <= 0) return true;  // no context to launch in; a new one makes it incomplete
  return r.epoch == g_context_epoch.load(std::memory_order_seq_cst) && static_cast<int>(r.n) >= live;
}
void kernels_dirty() noexcept {
  std::uint64_t w = g_kernel_check.load(std::memory_order_relaxed);
  while (!g_kernel_check.compare_exchange_weak(w, (w + 2) | 1, std::memory_order_seq_cst)) {}
}
// Clears bit 0 when every kernel handed out is complete and nothing set it
// since `w0` was read (before the records were).
void try_clear(std::uint64_t w0) noexcept {
  if ((w0 & 1) == 0) return;
  bool all = true;
  g_kernels->for_each([&](std::uint64_t, const KernelRecord& r) {
    if (!complete(r)) all = false;
  });
  if (all) g_kernel_check.compare_exchange_strong(w0, w0 & ~std::uint64_t{1}, std::memory_order_seq_cst);
}
// The library of `kernel` is placed (and counted) in `ctx`; sets the check
// when the kernel may still be launched in a context where it is not.
void note_seen(CUkernel kernel, CUcontext ctx) noexcept {
  bool done = true;
  g_kernels->update(reinterpret_cast<std::uint64_t>(kernel), [&](KernelRecord& r) {
    const std::uint64_t epoch = g_context_epoch.load(std::memory_order_seq_cst);
    if (r.epoch != epoch) r.epoch = epoch, r.n = 0, r.next = 0;
    if (ctx != nullptr && !seen_in(r, ctx)) {
      if (r.n < kSeenContexts) {
        r.seen[r.n++] = ctx;
      } else {
        r.seen[r.next] = ctx;
        r.next = (r.next + 1) % kSeenContexts;
      }
    }
    done = complete(r);
    return false;
  });
  if (!done) kernels_dirty();
}
void forget_kernels(CUlibrary l) noexcept {
  const std::uint64_t w0 = g_kernel_check.load(std::memory_order_seq_cst);
  const auto lib = reinterpret_cast<std::uint64_t>(l);
  // Erased one by one (for_each holds a shard lock: no erase inside).
  for (;;) {
    std::uint64_t key = 0;
    g_kernels->for_each([&](std::uint64_t k, const KernelRecord& r) {
      if (key == 0 && r.lib == lib) key = k;
    });
    if (key == 0 || !g_kernels->erase(key, nullptr)) break;
  }
  try_clear(w0);
}

// cuLibraryUnload. The records of the library's placements are taken out
// *before* the driver call: once the driver has unloaded it, it may hand the
// same handle to the next cuLibraryLoadData of another thread, whose first
// use must not find our stale record (the "placed already" shortcut of
// place_counted) and go unmeasured; a record taken after the call raced that
// (issue 20: a placement of the new library left uncounted). What a refused
// unload still holds is put back; a placement of this handle measured
// meanwhile waits for this counting operation to end (measure.h), so it
// adds to what is put back. CUDA_ERROR_INVALID_HANDLE is not such a refusal:
// no library had the handle at the call (another thread's cuLibraryUnload
// of the same handle took it first and found our records gone), so what we
// took is stale and goes back to the budget; put back, it would make the
// next library given this handle look placed already.
CUresult unload_library_counted(CUlibrary l) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CountingOp op;       // the device's usage drops: no measurement may overlap it
  PlacementDrop drop;  // no use of it found placed already is in the driver meanwhile
  Placed taken[kMaxDevices] = {};
  for (CUdevice d = 0; d < static_cast<CUdevice>(kMaxDevices); ++d)
    if (!g_placed->erase(placed_key(l, d), &taken[d])) taken[d] = Placed{-1, 0, {}, {}, 0};
  g_placement_drops.fetch_add(1, std::memory_order_acq_rel);
  rc = real_cuLibraryUnload(l);
  if (rc == CUDA_SUCCESS || rc == CUDA_ERROR_INVALID_HANDLE) forget_kernels(l);
  for (CUdevice d = 0; d < static_cast<CUdevice>(kMaxDevices); ++d) {
    const Placed& c = taken[d];
    if (c.entry < 0) continue;
    if (rc == CUDA_SUCCESS || rc == CUDA_ERROR_INVALID_HANDLE) {
      if (c.bytes != 0) release(c.entry, c.bytes);
      continue;
    }
    if (!g_placed->upsert(placed_key(l, d), c,
                          [&](Placed& v, bool fresh) {
                            if (fresh) return;
                            std::uint64_t parts = 0;
                            for (unsigned i = 0; i < kPlacedContexts; ++i)
                              if (c.ctx[i] != nullptr) add_part(v, c.ctx[i], c.part[i]), parts += c.part[i];
                            v.bytes += c.bytes - parts;
                          }) &&
        c.bytes != 0)
      release(c.entry, c.bytes);  // cannot track it: do not hold budget we could never return
  }
  g_placement_drops.fetch_add(1, std::memory_order_acq_rel);
  return rc;
}

// The driver's answers to a use that prove it placed nothing: no library
// has the handle, or no context is current to place it in.
bool placed_nothing(CUresult rc) noexcept {
  return rc == CUDA_ERROR_INVALID_HANDLE || rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

// A use of `lib` that places it in the current context if it is not there
// yet: measured (again whenever the context differs from the last one
// measured for the library on that device) and charged like a load; over
// the quota the library is unloaded and the use fails with OUT_OF_MEMORY.
template <class Use>
CUresult place_counted(CUlibrary lib, Use&& use) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CUdevice dev = -1;
  if (lib == nullptr || t_loading) return use();  // the driver's answer
  if (real_cuCtxGetDevice(&dev) != CUDA_SUCCESS && call_without_context(use, &rc, &dev)) return rc;
  const int entry = device_entry(dev);
  if (entry < 0 || dev < 0 || static_cast<unsigned>(dev) >= kMaxDevices) return use();
  CUcontext ctx = nullptr;
  real_cuCtxGetCurrent(&ctx);
  // Placed (and counted) in this context already, and no drop in flight
  // (a context's or the library's: the driver could place it anew in the
  // context, or place another library given the handle, inside the call).
  const auto placed = [&] {
    Placed known{};
    return g_placed->find(placed_key(lib, dev), &known) && placed_in(known, ctx);
  };
  if (use_placed(placed, use, &rc)) return rc;
  std::lock_guard<MeasureMutex> measuring(measure_mutex());
  if (use_placed(placed, use, &rc)) return rc;
  const Measure m = measure_before(dev);
  t_loading = true;
  rc = use();
  t_loading = false;
  const std::uint64_t bytes = measured_bytes(dev, entry, m, nullptr);
  // A failed use may have placed it all the same (a global not found after
  // the placement): what it took is counted either way. Not one that names
  // no library or no context (an unloaded library's handle, a destroyed
  // context): nothing was placed, whatever the measurement saw meanwhile (a
  // graphics allocation, a disturbed measurement's settle), and a record
  // would make the next library given that handle look placed already: its
  // placement unmeasured (issue 32).
  if (rc != CUDA_SUCCESS && (bytes == 0 || placed_nothing(rc))) return rc;
  if (bytes != 0 && (!charge(entry, bytes) || over_resident(entry))) {
    release(entry, bytes);
    PlacementDrop drop;
    forget(lib);
    real_cuLibraryUnload(lib);
    forget_kernels(lib);
    GPUSLICE_LOG(info, "a library placed on device %d needs %llu bytes beyond the container's quota; unloaded", dev,
                 static_cast<unsigned long long>(bytes));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  remember(lib, dev, Counted{entry, bytes});
  return rc;
}

template <class Handle, class Unload>
CUresult unload_counted(Handle h, Unload&& unload) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CountingOp op;  // the device's usage drops: no measurement may overlap it
  rc = unload();
  if (rc != CUDA_SUCCESS) return rc;
  forget(h);
  return rc;
}

CUresult unload_module(CUmodule m) noexcept { return real_cuModuleUnload(m); }
CUresult unload_library(CUlibrary l) noexcept { return real_cuLibraryUnload(l); }

}  // namespace
}  // namespace gpuslice::hook

using namespace gpuslice::hook;

GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoad(CUmodule* module, const char* fname) {
  return load_counted(
      module, [&] { return real_cuModuleLoad(module, fname); }, unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule* module, const void* image) {
  return load_counted(
      module, [&] { return real_cuModuleLoadData(module, image); }, unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int numOptions,
                                                    CUjit_option* options, void** optionValues) {
  return load_counted(
      module, [&] { return real_cuModuleLoadDataEx(module, image, numOptions, options, optionValues); }, unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule* module, const void* fatCubin) {
  return load_counted(
      module, [&] { return real_cuModuleLoadFatBinary(module, fatCubin); }, unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
  return unload_counted(hmod, [&] { return real_cuModuleUnload(hmod); });
}

GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option* jitOptions,
                                                   void** jitOptionsValues, unsigned int numJitOptions,
                                                   CUlibraryOption* libraryOptions, void** libraryOptionValues,
                                                   unsigned int numLibraryOptions) {
  return load_counted(
      library,
      [&] {
        return real_cuLibraryLoadData(library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                                      libraryOptionValues, numLibraryOptions);
      },
      unload_library);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryLoadFromFile(CUlibrary* library, const char* fileName,
                                                       CUjit_option* jitOptions, void** jitOptionsValues,
                                                       unsigned int numJitOptions, CUlibraryOption* libraryOptions,
                                                       void** libraryOptionValues, unsigned int numLibraryOptions) {
  return load_counted(
      library,
      [&] {
        return real_cuLibraryLoadFromFile(library, fileName, jitOptions, jitOptionsValues, numJitOptions,
                                          libraryOptions, libraryOptionValues, numLibraryOptions);
      },
      unload_library);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryUnload(CUlibrary library) { return unload_library_counted(library); }

// First uses of a library in a context: where a lazily loaded library is placed.
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryGetGlobal(CUdeviceptr* dptr, size_t* bytes, CUlibrary library,
                                                    const char* name) {
  return place_counted(library, [&] { return real_cuLibraryGetGlobal(dptr, bytes, library, name); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryGetManaged(CUdeviceptr* dptr, size_t* bytes, CUlibrary library,
                                                     const char* name) {
  return place_counted(library, [&] {
    return real_cuLibraryGetManaged != nullptr ? real_cuLibraryGetManaged(dptr, bytes, library, name)
                                               : CUDA_ERROR_NOT_FOUND;  // a driver without it
  });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryGetModule(CUmodule* pMod, CUlibrary library) {
  return place_counted(library, [&] { return real_cuLibraryGetModule(pMod, library); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryGetKernel(CUkernel* pKernel, CUlibrary library, const char* name) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  rc = real_cuLibraryGetKernel(pKernel, library, name);
  if (rc != CUDA_SUCCESS) return rc;
  const CUkernel kernel = *pKernel;
  const KernelRecord fresh{reinterpret_cast<std::uint64_t>(library), 0, {}, 0, 0};
  if (!g_kernels->upsert(reinterpret_cast<std::uint64_t>(kernel), fresh, [&](KernelRecord& v, bool inserted) {
        if (inserted || v.lib != fresh.lib) v = fresh;
      }))
    GPUSLICE_WARN_CAPPED(3, "kernel table full: a launch of this kernel is not checked for its library's placement");
  // Placed now in the current context, if any (measured once per context);
  // a launch in another context places it there at its first launch
  // (modules.h: the launch wrappers check while the kernel is incomplete).
  CUdevice dev = -1;
  CUcontext ctx = nullptr;
  if (real_cuCtxGetDevice(&dev) != CUDA_SUCCESS || real_cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) ctx = nullptr;
  CUresult placed = CUDA_ERROR_INVALID_CONTEXT;
  if (ctx != nullptr) {
    CUmodule module = nullptr;
    placed = place_counted(library, [&] { return real_cuLibraryGetModule(&module, library); });
    if (placed == CUDA_ERROR_OUT_OF_MEMORY) return placed;
  }
  note_seen(kernel, placed == CUDA_SUCCESS ? ctx : nullptr);
  return rc;
}
// A runtime may resolve a kernel for every launch: the thread's last kernel
// and context already counted go straight to the driver (a library unloaded
// since invalidates it: the handle may be reused).
GPUSLICE_EXPORT CUresult CUDAAPI cuKernelGetFunction(CUfunction* pFunc, CUkernel kernel) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CUcontext ctx = nullptr;
  const std::uint64_t gen = g_placement_drops.load(std::memory_order_acquire);
  if (real_cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx != nullptr && kernel == t_kernel && ctx == t_kernel_ctx &&
      gen == t_kernel_gen &&
      use_placed([&] { return g_placement_drops.load(std::memory_order_seq_cst) == gen; },
                 [&] { return real_cuKernelGetFunction(pFunc, kernel); }, &rc))
    return rc;
  KernelRecord rec{};
  if (!g_kernels->find(reinterpret_cast<std::uint64_t>(kernel), &rec))
    return real_cuKernelGetFunction(pFunc, kernel);  // a kernel we never saw resolved
  rc = place_counted(reinterpret_cast<CUlibrary>(rec.lib), [&] { return real_cuKernelGetFunction(pFunc, kernel); });
  if (rc == CUDA_SUCCESS) {
    t_kernel = kernel, t_kernel_ctx = ctx, t_kernel_gen = gen;
    if (ctx != nullptr && !seen_in(rec, ctx)) note_seen(kernel, ctx);
  }
  return rc;
}

namespace gpuslice::hook {

std::atomic<std::uint64_t> g_kernel_check{0};

// Bounded (kDrainNs, as a measurement's drain): a use whose driver call does
// not return (a hung device), or a drop made by a thread inside such a use (a
// signal handler), must not hang the drop for ever; past the bound the drop
// goes on, warned, and a use still in flight may go unmeasured as before.
PlacementDrop::PlacementDrop(bool on) noexcept : on_(on) {
  if (!on_) return;
  g_drops_in_flight.fetch_add(1, std::memory_order_seq_cst);
  std::uint64_t waited = 0;
  platform::Backoff backoff(10'000, 200'000);
  while (g_placed_uses.load(std::memory_order_seq_cst) != 0) {
    if (waited >= kDrainNs) {
      GPUSLICE_WARN_CAPPED(3, "a library use stayed in the driver for %llu ms during a context drop or unload",
                           static_cast<unsigned long long>(waited / 1'000'000));
      break;
    }
    waited += backoff.pause();
  }
}
PlacementDrop::~PlacementDrop() {
  if (!on_) return;
  g_placement_drops.fetch_add(1, std::memory_order_seq_cst);  // the threads' last resolved kernel may be gone
  g_drops_in_flight.fetch_sub(1, std::memory_order_seq_cst);
}

// The first launch of a kernel handed out by cuLibraryGetKernel in a context
// (the stream's, or the current one for the NULL, legacy and per-thread
// streams): its library is placed there now, measured, by
// cuKernelGetFunction made in that context (pushed for the call when it is
// not current). The launch then finds it placed. A placement beyond the
// quota unloads the library, and the launch fails with
// CUDA_ERROR_OUT_OF_MEMORY; anything else is left to the launch (the
// driver's answer).
CUresult place_launched_kernel(CUfunction f, CUstream s) noexcept {
  const std::uint64_t w0 = g_kernel_check.load(std::memory_order_seq_cst);
  KernelRecord rec{};
  if (f == nullptr || !g_kernels->find(reinterpret_cast<std::uint64_t>(f), &rec)) return CUDA_SUCCESS;
  CUcontext ctx = nullptr;
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (v == 0 || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
    if (real_cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) ctx = nullptr;
  } else if (real_cuStreamGetCtx == nullptr || real_cuStreamGetCtx(s, &ctx) != CUDA_SUCCESS) {
    ctx = nullptr;
  }
  if (ctx == nullptr || seen_in(rec, ctx)) return CUDA_SUCCESS;
  CUcontext current = nullptr;
  if (real_cuCtxGetCurrent(&current) != CUDA_SUCCESS) current = nullptr;
  const bool push = current != ctx;
  if (push && (real_cuCtxPushCurrent_v2 == nullptr || real_cuCtxPopCurrent_v2 == nullptr ||
               real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS))
    return CUDA_SUCCESS;
  const CUkernel kernel = reinterpret_cast<CUkernel>(f);
  CUfunction function = nullptr;
  const CUresult rc =
      place_counted(reinterpret_cast<CUlibrary>(rec.lib), [&] { return real_cuKernelGetFunction(&function, kernel); });
  if (push) {
    CUcontext popped = nullptr;
    real_cuCtxPopCurrent_v2(&popped);
  }
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) return rc;
  if (rc == CUDA_SUCCESS) {
    note_seen(kernel, ctx);
    try_clear(w0);
  }
  return CUDA_SUCCESS;
}

// A graph node's kernel in `ctx` (NULL: the current context): placed as a
// launch on the NULL stream of that context would place it.
CUresult place_kernel_in_context(CUfunction f, CUcontext ctx) noexcept {
  CUcontext current = nullptr;
  if (ctx == nullptr || (real_cuCtxGetCurrent(&current) == CUDA_SUCCESS && current == ctx))
    return place_launched_kernel(f, nullptr);
  if (real_cuCtxPushCurrent_v2 == nullptr || real_cuCtxPopCurrent_v2 == nullptr ||
      real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS)
    return CUDA_SUCCESS;
  const CUresult rc = place_launched_kernel(f, nullptr);
  CUcontext popped = nullptr;
  real_cuCtxPopCurrent_v2(&popped);
  return rc;
}

// Takes out every library's part charged in `ctx` (before the driver
// destroys it: once destroyed, its handle may come back for another thread's
// new context, whose first use must not find our record and go unmeasured,
// as for cuLibraryUnload). Returns what was taken, to be released
// (library_placements_put) or put back if the destroy is refused.
void library_placements_take(CUcontext ctx, PlacedParts* out) noexcept {
  out->n = 0;
  if (ctx == nullptr) return;
  std::uint64_t keys[PlacedParts::kMax];
  unsigned n = 0;  // beyond kMax: left counted (above) until the library is unloaded
  g_placed->for_each([&](std::uint64_t k, const Placed& v) {
    if (placed_in(v, ctx) && n < PlacedParts::kMax) keys[n++] = k;
  });
  for (unsigned j = 0; j < n; ++j) {
    g_placed->update(keys[j], [&](Placed& v) {
      for (unsigned i = 0; i < kPlacedContexts; ++i) {
        if (v.ctx[i] != ctx) continue;
        out->part[out->n] = PlacedParts::Part{keys[j], v.entry, v.part[i]};
        ++out->n;
        v.bytes -= v.part[i];
        v.ctx[i] = nullptr, v.part[i] = 0;
      }
      return false;
    });
  }
}
// The context went: what was taken is released. Refused: put back.
void library_placements_put(CUcontext ctx, const PlacedParts& taken, bool gone) noexcept {
  for (unsigned j = 0; j < taken.n; ++j) {
    const PlacedParts::Part& p = taken.part[j];
    if (gone) {
      if (p.bytes != 0) release(p.entry, p.bytes);
      continue;
    }
    Placed back{p.entry, 0, {}, {}, 0};
    add_part(back, ctx, p.bytes);
    if (!g_placed->upsert(p.key, back,
                          [&](Placed& v, bool fresh) {
                            if (!fresh) add_part(v, ctx, p.bytes);
                          }) &&
        p.bytes != 0)
      release(p.entry, p.bytes);  // cannot track it: do not hold budget we could never return
  }
}

void kernels_context_created() noexcept {
  g_live_contexts.fetch_add(1, std::memory_order_seq_cst);
  if (g_kernels->size() != 0) kernels_dirty();
}

// As sweep_table (account.h) for the allocation tables: the driver is asked
// with no lock held, each record erased exactly once, and asked again about
// the record taken (a load may have got the handle back meanwhile: its
// remember() then releases the old record as stale, or finds ours gone).
void sweep_implicitly_unloaded_modules() noexcept {
  g_loaded->for_each_unlocked([](std::uint64_t key, const Counted&) {
    if (!module_gone(key)) return;
    Counted taken{};
    if (!g_loaded->erase(key, &taken)) return;
    if (module_gone(key)) {
      if (taken.bytes != 0) release(taken.entry, taken.bytes);
    } else if (!g_loaded->insert(key, taken) && taken.bytes != 0) {
      release(taken.entry, taken.bytes);  // a newer record holds the handle: ours is gone
    }
  });
}

void kernels_context_destroyed() noexcept {
  int live = g_live_contexts.load(std::memory_order_relaxed);
  while (live > 0 && !g_live_contexts.compare_exchange_weak(live, live - 1, std::memory_order_seq_cst)) {}
  g_context_epoch.fetch_add(1, std::memory_order_seq_cst);  // every kernel's contexts are forgotten
  if (g_kernels->size() != 0) kernels_dirty();
}

}  // namespace gpuslice::hook
