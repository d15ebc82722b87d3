// The conformance tests' view of a driver: the simulated one (default) or the
// machine's real libcuda.so.1 + libnvidia-ml.so.1 (GPUSLICE_TEST_REAL_DRIVER=1).
// The binary links neither: it dlopen()s the fake by full path, or the real
// libraries by SONAME through the loader's normal search, and calls everything
// through this table, so one binary checks both.
#pragma once

#include <cuda.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "nvml_abi.h"

namespace conformance {

#define CONFORMANCE_STR2(x) #x
#define CONFORMANCE_STR(x) CONFORMANCE_STR2(x)  // cuda.h maps names to versioned symbols first
// An X-macro list, kept as written (clang-format 14 reflows it differently on each pass).
// clang-format off
#define CONFORMANCE_CUDA(X)                                                                                     \
  X(cuInit) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceTotalMem) X(cuCtxCreate) X(cuCtxDestroy)            \
  X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxPopCurrent) X(cuCtxSynchronize) X(cuMemAlloc) X(cuMemFree)      \
  X(cuMemGetInfo) X(cuMemGetAddressRange) X(cuModuleLoadData) X(cuModuleGetFunction) X(cuModuleUnload)         \
  X(cuLibraryLoadData) X(cuLibraryGetKernel) X(cuLibraryUnload) X(cuLaunchKernel) X(cuStreamCreate)            \
  X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamGetCtx) X(cuEventCreate) X(cuEventDestroy)               \
  X(cuEventRecord) X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventQuery) X(cuMemCreate) X(cuMemRelease)  \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)                      \
  X(cuMemRetainAllocationHandle) X(cuMemGetAllocationGranularity) X(cuMemPoolCreate) X(cuMemPoolDestroy)      \
  X(cuMemAllocFromPoolAsync) X(cuMemFreeAsync) X(cuImportExternalMemory) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle)
#define CONFORMANCE_NVML(X)                                                                                     \
  X(nvmlInit_v2) X(nvmlShutdown) X(nvmlDeviceGetHandleByIndex_v2) X(nvmlDeviceGetProcessUtilization)            \
  X(nvmlDeviceGetUtilizationRates) X(nvmlDeviceGetComputeRunningProcesses_v3) X(nvmlDeviceGetMemoryInfo)
// clang-format on

struct Driver {
#define CONFORMANCE_MEMBER(name) decltype(&::name) name = nullptr;
  CONFORMANCE_CUDA(CONFORMANCE_MEMBER)
  CONFORMANCE_NVML(CONFORMANCE_MEMBER)
#undef CONFORMANCE_MEMBER
  bool real = false;
  std::string why;  // empty once loaded

  static bool RealRequested() {
    const char* value = std::getenv("GPUSLICE_TEST_REAL_DRIVER");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }

  // Loads once per process; `why` says what is missing.
  static Driver& Get() {
    static Driver driver = Load();
    return driver;
  }

 private:
  static Driver Load() {
    Driver d;
    d.real = RealRequested();
    std::string cuda = d.real ? "libcuda.so.1" : std::string(FAKECUDA_LIB_DIR) + "/libcuda.so.1";
    std::string nvml = d.real ? "libnvidia-ml.so.1" : std::string(FAKECUDA_LIB_DIR) + "/libnvidia-ml.so.1";
    void* cuda_lib = dlopen(cuda.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (cuda_lib == nullptr) {
      d.why = std::string("cannot load ") + cuda + ": " + dlerror();
      return d;
    }
    void* nvml_lib = dlopen(nvml.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (nvml_lib == nullptr) {
      d.why = std::string("cannot load ") + nvml + ": " + dlerror();
      return d;
    }
    // The simulator exports its test API; a "real" driver that has it is the fake.
    if (d.real && dlsym(cuda_lib, "fakecuda_device_used_bytes") != nullptr) {
      d.why = "GPUSLICE_TEST_REAL_DRIVER=1 but the libcuda.so.1 found is the simulator";
      return d;
    }
#define CONFORMANCE_LOAD(name)                                                                                \
  d.name = reinterpret_cast<decltype(d.name)>(dlsym(cuda_lib, CONFORMANCE_STR(name)));                        \
  if (d.name == nullptr) d.name = reinterpret_cast<decltype(d.name)>(dlsym(nvml_lib, CONFORMANCE_STR(name))); \
  if (d.name == nullptr && d.why.empty()) d.why = std::string("missing symbol ") + CONFORMANCE_STR(name);
    CONFORMANCE_CUDA(CONFORMANCE_LOAD)
    CONFORMANCE_NVML(CONFORMANCE_LOAD)
#undef CONFORMANCE_LOAD
    return d;
  }
};

// Each test runs in its own process (gtest_discover_tests); with the simulator
// it gets its own state file, as the other fakecuda tests do.
class Conformance : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Driver::RealRequested()) {
      char dir[] = "/tmp/fakecuda-conformance-XXXXXX";
      ASSERT_NE(mkdtemp(dir), nullptr);
      dir_ = dir;
      setenv("FAKECUDA_STATE", (dir_ + "/state").c_str(), 1);
      setenv("FAKECUDA_DEVICES", "2", 1);
    }
    Driver& d = Driver::Get();
    if (!d.why.empty()) {
      if (d.real) GTEST_SKIP() << "no real NVIDIA driver: " << d.why;
      FAIL() << d.why;
    }
  }
  void TearDown() override {
    if (dir_.empty()) return;
    unlink((dir_ + "/state").c_str());
    rmdir(dir_.c_str());
  }
  Driver& cu() { return Driver::Get(); }
  std::string dir_;
};

// Real PTX whose behaviour the simulator reproduces by name: `noop` does
// nothing, `spin_1000us` spins on %globaltimer for 1 ms.
inline constexpr const char* kPtx = R"(.version 7.0
.target sm_75
.address_size 64
.visible .entry noop() { ret; }
.visible .entry spin_1000us()
{
  .reg .u64 %t0, %t1, %d;
  .reg .pred %p;
  mov.u64 %t0, %globaltimer;
SPIN:
  mov.u64 %t1, %globaltimer;
  sub.u64 %d, %t1, %t0;
  setp.lt.u64 %p, %d, 1000000;
  @%p bra SPIN;
  ret;
}
)";

}  // namespace conformance
