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
// cuKernelGetFunction, and cuLibraryGetKernel (which
// places the library at once, through cuLibraryGetModule, when a context is
// current: the launch that would place it later is not a point we measure).
// A placement that does not fit the quota cannot be undone alone: the library
// is unloaded and the call fails with CUDA_ERROR_OUT_OF_MEMORY (the handle is
// invalid from then on). Code a driver places at a function's first launch
// in a context we never saw a placement point in is not seen: the node
// agent's reconciliation adds it (docs/memory.md).
#include <cuda.h>

#include <mutex>

#include "hook/log.h"
#include "hook/measure.h"
#include "hook/oversub.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

using limiter::Counted;

constinit NoDestroy<limiter::PointerTable<Counted>> g_loaded;  // CUmodule -> what was charged
// A library's placements on a device, keyed by placed_key(): what was
// charged for them all, and the context of the last one measured (0 bytes
// when NVML could not see it: still placed). A use in another context of the
// device is measured again (the driver places a library in each context;
// one already placed measures 0) and adds to the count.
struct Placed {
  int entry;
  std::uint64_t bytes;
  CUcontext ctx;
};
constinit NoDestroy<limiter::PointerTable<Placed>> g_placed;
// CUkernel -> its CUlibrary (from cuLibraryGetKernel), for cuKernelGetFunction.
constinit NoDestroy<limiter::PointerTable<std::uint64_t>> g_kernels;
// Libraries unloaded so far: invalidates the threads' last resolved kernel.
constinit std::atomic<std::uint64_t> g_unloads{0};
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
void remember_in(limiter::PointerTable<Counted>& table, std::uint64_t key, const Counted& counted) noexcept {
  if (!limiter::record(table, key, counted, [](const Counted& stale) {
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
  const Placed add{c.entry, c.bytes, ctx};
  if (!g_placed->upsert(placed_key(l, dev), add, [&](Placed& v, bool fresh) {
        if (!fresh) v.bytes += c.bytes, v.ctx = ctx;
      })) {
    release(c.entry, c.bytes);  // cannot track it: do not hold budget we could never return
  }
}

// Releases what was charged for `key` (a module, or a library on every device).
void forget(CUmodule m) noexcept {
  Counted c{};
  if (g_loaded->erase(reinterpret_cast<std::uint64_t>(m), &c)) release(c.entry, c.bytes);
}
void forget(CUlibrary l) noexcept {
  g_unloads.fetch_add(1, std::memory_order_acq_rel);
  for (CUdevice d = 0; d < static_cast<CUdevice>(kMaxDevices); ++d) {
    Placed c{};
    if (g_placed->erase(placed_key(l, d), &c) && c.bytes != 0) release(c.entry, c.bytes);
  }
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
  CountingOp op;  // the device's usage drops: no measurement may overlap it
  Placed taken[kMaxDevices] = {};
  for (CUdevice d = 0; d < static_cast<CUdevice>(kMaxDevices); ++d)
    if (!g_placed->erase(placed_key(l, d), &taken[d])) taken[d] = Placed{-1, 0, nullptr};
  g_unloads.fetch_add(1, std::memory_order_acq_rel);
  rc = real_cuLibraryUnload(l);
  for (CUdevice d = 0; d < static_cast<CUdevice>(kMaxDevices); ++d) {
    const Placed& c = taken[d];
    if (c.entry < 0) continue;
    if (rc == CUDA_SUCCESS || rc == CUDA_ERROR_INVALID_HANDLE) {
      if (c.bytes != 0) release(c.entry, c.bytes);
      continue;
    }
    if (!g_placed->upsert(placed_key(l, d), c, [&](Placed& v, bool fresh) {
          if (!fresh) v.bytes += c.bytes;
        }) &&
        c.bytes != 0)
      release(c.entry, c.bytes);  // cannot track it: do not hold budget we could never return
  }
  g_unloads.fetch_add(1, std::memory_order_acq_rel);
  return rc;
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
  Placed known{};
  // Placed (and counted) in this context already.
  if (g_placed->find(placed_key(lib, dev), &known) && known.ctx == ctx) return use();
  std::lock_guard<MeasureMutex> measuring(measure_mutex());
  if (g_placed->find(placed_key(lib, dev), &known) && known.ctx == ctx) return use();
  const Measure m = measure_before(dev);
  t_loading = true;
  rc = use();
  t_loading = false;
  const std::uint64_t bytes = measured_bytes(dev, entry, m, nullptr);
  // A failed use may have placed it all the same (a global not found after
  // the placement): what it took is counted either way.
  if (rc != CUDA_SUCCESS && bytes == 0) return rc;
  if (bytes != 0 && (!charge(entry, bytes) || over_resident(entry))) {
    release(entry, bytes);
    forget(lib);
    real_cuLibraryUnload(lib);
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
  return load_counted(module, [&] { return real_cuModuleLoad(module, fname); }, unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule* module, const void* image) {
  return load_counted(module, [&] { return real_cuModuleLoadData(module, image); }, unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int numOptions,
                                                    CUjit_option* options, void** optionValues) {
  return load_counted(
      module, [&] { return real_cuModuleLoadDataEx(module, image, numOptions, options, optionValues); },
      unload_module);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule* module, const void* fatCubin) {
  return load_counted(module, [&] { return real_cuModuleLoadFatBinary(module, fatCubin); }, unload_module);
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
  g_kernels->upsert(reinterpret_cast<std::uint64_t>(*pKernel), reinterpret_cast<std::uint64_t>(library),
                    [&](std::uint64_t& v, bool) { v = reinterpret_cast<std::uint64_t>(library); });
  // Placed now in the current context, if any (measured once per context):
  // the launch that would place it later is not a point we measure.
  CUdevice dev = -1;
  if (real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return rc;
  CUmodule module = nullptr;
  const CUresult placed = place_counted(library, [&] { return real_cuLibraryGetModule(&module, library); });
  return placed == CUDA_ERROR_OUT_OF_MEMORY ? placed : rc;
}
// A runtime may resolve a kernel for every launch: the thread's last kernel
// and context already counted go straight to the driver (a library unloaded
// since invalidates it: the handle may be reused).
GPUSLICE_EXPORT CUresult CUDAAPI cuKernelGetFunction(CUfunction* pFunc, CUkernel kernel) {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CUcontext ctx = nullptr;
  const std::uint64_t gen = g_unloads.load(std::memory_order_acquire);
  if (real_cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx != nullptr && kernel == t_kernel && ctx == t_kernel_ctx &&
      gen == t_kernel_gen)
    return real_cuKernelGetFunction(pFunc, kernel);
  std::uint64_t lib = 0;
  if (!g_kernels->find(reinterpret_cast<std::uint64_t>(kernel), &lib))
    return real_cuKernelGetFunction(pFunc, kernel);  // a kernel we never saw resolved
  rc = place_counted(reinterpret_cast<CUlibrary>(lib), [&] { return real_cuKernelGetFunction(pFunc, kernel); });
  if (rc == CUDA_SUCCESS) t_kernel = kernel, t_kernel_ctx = ctx, t_kernel_gen = gen;
  return rc;
}
