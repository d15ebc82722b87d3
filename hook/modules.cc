// Modules and libraries hold device memory for their code and `__device__`
// globals. Its size is not knowable before the driver loads the image (it
// depends on the architecture the driver picks and on relocation), so it is
// measured like a context's: this process's NVML usage across the load
// (measure.h), charged when the load returns and released at unload. A load
// that does not fit the quota is undone and fails with
// CUDA_ERROR_OUT_OF_MEMORY. Memory a driver places later (CUDA's lazy loading
// places a function's code at its first launch; a library loaded with no
// context current is placed in each context on first use) is not seen here:
// the node agent's reconciliation adds it (docs/memory.md).
#include <cuda.h>

#include <mutex>

#include "hook/log.h"
#include "hook/measure.h"
#include "hook/wrap.h"

namespace gpuslice::hook {
namespace {

struct Counted {
  int entry;
  std::uint64_t bytes;
};

constinit NoDestroy<limiter::PointerTable<Counted>> g_loaded;  // CUmodule / CUlibrary -> what was charged
// A load that reaches another hooked load (a driver built without
// -Bsymbolic calling its own entry point) is measured once, by the outer one.
[[gnu::tls_model("initial-exec")]] thread_local bool t_loading = false;

// Runs `load` measured on the current context's device, charges what the
// driver took, and undoes the load through `unload` if it does not fit.
template <class Handle, class Load, class Unload>
CUresult load_counted(Handle* out, Load&& load, Unload&& unload) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CUdevice dev = -1;
  if (out == nullptr || real_cuCtxGetDevice(&dev) != CUDA_SUCCESS) return load();  // no context: nothing placed now
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
  if (!charge(entry, bytes)) {
    release(entry, bytes);
    unload(*out);
    GPUSLICE_LOG(info, "a module on device %d needs %llu bytes beyond the container's quota", dev,
                 static_cast<unsigned long long>(bytes));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // A handle value still recorded is a module unloaded behind our back (the
  // driver reuses handles; a context destroyed with it): its memory went with it.
  const Counted counted{entry, bytes};
  Counted stale{-1, 0};
  if (!g_loaded->upsert(reinterpret_cast<std::uint64_t>(*out), counted, [&](Counted& v, bool fresh) {
        if (!fresh) stale = v, v = counted;
      })) {
    release(entry, bytes);  // cannot track it: do not hold budget we could never return
  }
  if (stale.bytes != 0) release(stale.entry, stale.bytes);
  return rc;
}

template <class Handle, class Unload>
CUresult unload_counted(Handle h, Unload&& unload) noexcept {
  CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  CountingOp op;  // the device's usage drops: no measurement may overlap it
  rc = unload();
  if (rc != CUDA_SUCCESS) return rc;
  Counted c{};
  if (g_loaded->erase(reinterpret_cast<std::uint64_t>(h), &c)) release(c.entry, c.bytes);
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
GPUSLICE_EXPORT CUresult CUDAAPI cuLibraryUnload(CUlibrary library) {
  return unload_counted(library, [&] { return real_cuLibraryUnload(library); });
}
