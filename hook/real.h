// Pointers to the next layer: the real driver and the real NVML, resolved once
// from the libraries the loader found. `real_<symbol>` for every hooked symbol
// (symbols.def) plus the unhooked entry points the wrappers call themselves.
#pragma once

#include <cuda.h>

#include "gpuslice/nvml_abi.h"

namespace gpuslice::hook {

// Hidden on the declaration (process.h): the wrappers call through them
// PC-relative, without a GOT load.
#define GPUSLICE_CU(symbol) [[gnu::visibility("hidden")]] extern decltype(&::symbol) real_##symbol;
#define GPUSLICE_NVML(symbol) [[gnu::visibility("hidden")]] extern decltype(&::symbol) real_##symbol;
#include "hook/symbols.def"

// Driver entry points used internally but not hooked: the one list of them
// (resolved with the hooked ones at load time, so no later lookup takes the
// loader lock). A hooked one (symbols.def) is real_<symbol> already.
#define GPUSLICE_CU_INTERNAL(X)             \
  X(cuCtxGetDevice)                         \
  X(cuCtxGetCurrent)                        \
  X(cuCtxGetLimit)                          \
  X(cuDevicePrimaryCtxGetState)             \
  X(cuDriverGetVersion)                     \
  X(cuDeviceGet)                            \
  X(cuDeviceGetCount)                       \
  X(cuDeviceGetUuid_v2)                     \
  X(cuDeviceGetAttribute)                   \
  X(cuMemGetAddressRange_v2)                \
  X(cuMemGetAllocationPropertiesFromHandle) \
  X(cuArray3DGetDescriptor_v2)              \
  X(cuMipmappedArrayGetLevel)               \
  X(cuModuleGetFunction)                    \
  X(cuMemAdvise_v2)                         \
  X(cuMemPoolGetAttribute)                  \
  X(cuArrayGetMemoryRequirements)           \
  X(cuMipmappedArrayGetMemoryRequirements)  \
  X(cuEventCreate)                          \
  X(cuEventRecord)                          \
  X(cuEventQuery)                           \
  X(cuEventDestroy_v2)                      \
  X(cuEventElapsedTime)                     \
  X(cuStreamIsCapturing)                    \
  X(cuStreamGetDevice)                      \
  X(cuStreamGetCtx)                         \
  X(cuCtxPushCurrent_v2)                    \
  X(cuCtxPopCurrent_v2)                     \
  X(cuGraphGetNodes)                        \
  X(cuGraphNodeGetType)                     \
  X(cuGraphKernelNodeGetParams_v2)          \
  X(cuGraphChildGraphNodeGetGraph)
#define GPUSLICE_NVML_INTERNAL(X)             \
  X(nvmlInit_v2)                              \
  X(nvmlDeviceGetCount_v2)                    \
  X(nvmlDeviceGetHandleByIndex_v2)            \
  X(nvmlDeviceGetUUID)                        \
  X(nvmlDeviceGetHandleByUUID)                \
  X(nvmlDeviceGetComputeRunningProcesses_v3)  \
  X(nvmlDeviceGetGraphicsRunningProcesses_v3) \
  X(nvmlDeviceGetProcessUtilization)

#define GPUSLICE_DECLARE_REAL(symbol) [[gnu::visibility("hidden")]] extern decltype(&::symbol) real_##symbol;
GPUSLICE_CU_INTERNAL(GPUSLICE_DECLARE_REAL)
GPUSLICE_NVML_INTERNAL(GPUSLICE_DECLARE_REAL)
#undef GPUSLICE_DECLARE_REAL

// glibc's dlsym, found with dlvsym so that our own exported dlsym is skipped.
// Written before the first jump through it (dlsym.cc); read by the asm stub.
extern "C" void* (*gpuslice_real_dlsym)(void*, const char*);
// On the driver's handle, the names resolved at load time (hooked and
// internal) are answered from our table without glibc's dlsym, which takes
// the loader lock.
void* real_dlsym(void* handle, const char* name) noexcept;
// Resolves gpuslice_real_dlsym without looking anything up; false if glibc has none.
bool resolve_real_dlsym() noexcept;

// Loads the real driver once (GPUSLICE_REAL_LIBCUDA, the loader's search, the
// NVIDIA container runtime's mounts) and resolves every real_ pointer. Safe to
// call from several threads and re-entrantly (a nested call from the driver's
// own constructors returns false instead of deadlocking). Returns whether the
// real driver is available.
bool load_driver() noexcept;
// Same for NVML; false when no NVML library can be found.
bool load_nvml() noexcept;
void* driver_handle() noexcept;
void* nvml_handle() noexcept;

// Identity map: the wrapper standing for a real entry point, or nullptr when
// `real` is not a hooked symbol. Used by cuGetProcAddress and dlsym.
void* wrapper_for_real(const void* real) noexcept;

}  // namespace gpuslice::hook
