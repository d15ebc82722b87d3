// The integrated-GPU profile (FAKECUDA_INTEGRATED=1; GB10, Jetson): the
// device says it is integrated, its memory (FAKECUDA_MEMORY, the share of
// system memory it may use) is allocated as usual, and NVML refuses the
// memory figures the documentation does not give for it.
#include "common.h"
#include "nvml_abi.h"

using namespace fakecuda_test;

namespace {

TEST_F(FakeCuda, IntegratedGpuReportsItselfAndNvmlRefusesMemoryFigures) {
  setenv("FAKECUDA_INTEGRATED", "1", 1);
  InitWithContext();
  int integrated = -1;
  ASSERT_CU(cuDeviceGetAttribute(&integrated, CU_DEVICE_ATTRIBUTE_INTEGRATED, 0));
  EXPECT_EQ(integrated, 1);
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 64 * kMiB));
  size_t free = 0, total = 0;
  ASSERT_CU(cuMemGetInfo(&free, &total));
  EXPECT_EQ(total, 1024 * kMiB);
  EXPECT_EQ(free, 960 * kMiB);
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  nvmlMemory_t m{};
  EXPECT_EQ(nvmlDeviceGetMemoryInfo(dev, &m), NVML_ERROR_NOT_SUPPORTED);
  nvmlProcessInfo_t infos[4]{};
  unsigned n = 4;
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, infos), NVML_ERROR_NOT_SUPPORTED);
  ASSERT_CU(cuMemFree(p));
}

TEST_F(FakeCuda, DiscreteGpuIsNotIntegrated) {
  ASSERT_CU(cuInit(0));
  int integrated = -1;
  ASSERT_CU(cuDeviceGetAttribute(&integrated, CU_DEVICE_ATTRIBUTE_INTEGRATED, 0));
  EXPECT_EQ(integrated, 0);
  setenv("FAKECUDA_INTEGRATED", "2", 1);  // read only by the state file's creator: no effect now
}

}  // namespace
