// The CUDA driver as gpuslice-bench sees it: dlopen("libcuda.so.1") and every
// entry point through cuGetProcAddress, the route the CUDA runtime takes, so
// that under LD_PRELOAD the bench exercises the same interception path as a
// real application. Nothing links libcuda; cuda.h only supplies the types.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace gpuslice::bench {

// Entry points the bench uses, by base name (cuda.h's macros give each the ABI
// of CUDA_VERSION, which is also the version we ask cuGetProcAddress for).
#define GPUSLICE_BENCH_DRIVER_API(X) \
  X(cuInit)                          \
  X(cuDriverGetVersion)              \
  X(cuGetErrorName)                  \
  X(cuDeviceGet)                     \
  X(cuDeviceGetName)                 \
  X(cuDeviceGetAttribute)            \
  X(cuDeviceTotalMem)                \
  X(cuDevicePrimaryCtxRetain)        \
  X(cuDevicePrimaryCtxRelease)       \
  X(cuCtxSetCurrent)                 \
  X(cuCtxSynchronize)                \
  X(cuModuleLoadData)                \
  X(cuModuleUnload)                  \
  X(cuModuleGetFunction)             \
  X(cuLaunchKernel)                  \
  X(cuStreamCreate)                  \
  X(cuStreamDestroy)                 \
  X(cuStreamSynchronize)             \
  X(cuEventCreate)                   \
  X(cuEventDestroy)                  \
  X(cuEventRecord)                   \
  X(cuEventSynchronize)              \
  X(cuEventElapsedTime)              \
  X(cuMemAlloc)                      \
  X(cuMemFree)                       \
  X(cuMemGetInfo)

// Test queries the simulated driver exports (test/fakecuda/fakecuda_query.h).
using FakeBusyNs = std::uint64_t (*)(int dev, int pid_or_0, std::uint64_t t0_ns, std::uint64_t t1_ns);

struct DriverApi {
#define GPUSLICE_BENCH_MEMBER(name) decltype(&::name) name = nullptr;
  GPUSLICE_BENCH_DRIVER_API(GPUSLICE_BENCH_MEMBER)
#undef GPUSLICE_BENCH_MEMBER
  void* handle = nullptr;
  // Non-null when the driver is the simulator: device busy time from its timeline.
  FakeBusyNs fake_busy_ns = nullptr;
  bool simulated() const { return fake_busy_ns != nullptr; }
};

// A failed driver call, named: "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2)".
class DriverError : public std::runtime_error {
 public:
  DriverError(const std::string& what, CUresult code) : std::runtime_error(what), code_(code) {}
  CUresult code() const { return code_; }

 private:
  CUresult code_;
};

// dlopen("libcuda.so.1") (the loader's search, so LD_LIBRARY_PATH decides) and
// resolve every entry point. Throws std::runtime_error naming what is missing.
DriverApi load_driver_api();

// Name of a CUresult ("CUDA_ERROR_OUT_OF_MEMORY"), or its number.
std::string error_name(const DriverApi& api, CUresult rc);

// Throws DriverError unless rc == CUDA_SUCCESS.
void check(const DriverApi& api, CUresult rc, const char* call);

}  // namespace gpuslice::bench

#define GPUSLICE_BENCH_CHECK(api, call) ::gpuslice::bench::check((api), (call), #call)
