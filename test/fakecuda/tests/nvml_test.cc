// The fake NVML agrees with the fake driver: memory, processes, utilisation.
#include <time.h>

#include "common.h"
#include "nvml_abi.h"

using namespace fakecuda_test;

namespace {

unsigned long long RealtimeMicros() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1000000ull + ts.tv_nsec / 1000;
}

TEST_F(FakeCuda, NvmlAgreesWithTheDriver) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "8Mi", 1);
  InitWithContext();
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 24 * kMiB));
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  unsigned count = 0;
  ASSERT_EQ(nvmlDeviceGetCount_v2(&count), NVML_SUCCESS);
  EXPECT_EQ(count, 2u);
  nvmlDevice_t device = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &device), NVML_SUCCESS);
  nvmlMemory_t memory{};
  ASSERT_EQ(nvmlDeviceGetMemoryInfo(device, &memory), NVML_SUCCESS);
  size_t free_bytes = 0, total = 0;
  ASSERT_CU(cuMemGetInfo(&free_bytes, &total));
  EXPECT_EQ(memory.total, total);
  EXPECT_EQ(memory.free, free_bytes);
  EXPECT_EQ(memory.used, 32 * kMiB);
  nvmlMemory_v2_t memory2{};
  EXPECT_EQ(nvmlDeviceGetMemoryInfo_v2(device, &memory2), NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
  memory2.version = nvmlMemory_v2;
  ASSERT_EQ(nvmlDeviceGetMemoryInfo_v2(device, &memory2), NVML_SUCCESS);
  EXPECT_EQ(memory2.used, 32 * kMiB);
  EXPECT_EQ(sizeof(nvmlMemory_v2_t), 40u);

  unsigned n = 0;
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(device, &n, nullptr), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(n, 1u);
  nvmlProcessInfo_t infos[4];
  n = 4;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(device, &n, infos), NVML_SUCCESS);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(infos[0].pid, static_cast<unsigned>(getpid()));
  EXPECT_EQ(infos[0].usedGpuMemory, 32 * kMiB);
  nvmlProcessInfo_v1_t legacy[4];
  n = 4;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses(device, &n, legacy), NVML_SUCCESS);
  EXPECT_EQ(legacy[0].usedGpuMemory, 32 * kMiB);
  nvmlDevice_t other = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex(1, &other), NVML_SUCCESS);
  n = 4;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses_v2(other, &n, infos), NVML_SUCCESS);
  EXPECT_EQ(n, 0u);

  char uuid[NVML_DEVICE_UUID_BUFFER_SIZE];
  ASSERT_EQ(nvmlDeviceGetUUID(device, uuid, sizeof(uuid)), NVML_SUCCESS);
  CUuuid bytes;
  ASSERT_CU(cuDeviceGetUuid(&bytes, 0));
  char expected[64];
  const auto* u = reinterpret_cast<const unsigned char*>(bytes.bytes);
  snprintf(expected, sizeof(expected), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
           u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  EXPECT_STREQ(uuid, expected);
  nvmlDevice_t by_uuid = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByUUID(uuid, &by_uuid), NVML_SUCCESS);
  unsigned index = 9;
  EXPECT_EQ(nvmlDeviceGetIndex(by_uuid, &index), NVML_SUCCESS);
  EXPECT_EQ(index, 0u);
  EXPECT_EQ(nvmlDeviceGetUUID(device, uuid, 8), NVML_ERROR_INSUFFICIENT_SIZE);
  int cuda_version = 0;
  EXPECT_EQ(nvmlSystemGetCudaDriverVersion_v2(&cuda_version), NVML_SUCCESS);
  EXPECT_EQ(cuda_version, 13000);

  ASSERT_CU(cuMemFree(p));
  ASSERT_EQ(nvmlDeviceGetMemoryInfo(device, &memory), NVML_SUCCESS);
  EXPECT_EQ(memory.used, 8 * kMiB);
  EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetMemoryInfo(device, &memory), NVML_ERROR_UNINITIALIZED);
}

TEST_F(FakeCuda, NvmlUtilisationComesFromTheTimeline) {
  InitWithContext();
  ASSERT_EQ(nvmlInit(), NVML_SUCCESS);
  nvmlDevice_t device = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &device), NVML_SUCCESS);
  unsigned n = 0;
  EXPECT_EQ(nvmlDeviceGetProcessUtilization(device, nullptr, &n, RealtimeMicros()), NVML_ERROR_NOT_FOUND);
  CUmodule module = nullptr;
  CUfunction spin = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, "spin_10000us"));
  ASSERT_CU(cuModuleGetFunction(&spin, module, "spin_10000us"));
  unsigned long long since = RealtimeMicros();
  for (int i = 0; i < 10; ++i) ASSERT_CU(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cuCtxSynchronize());
  const unsigned long long synced = RealtimeMicros();
  n = 0;
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(device, nullptr, &n, since), NVML_ERROR_INSUFFICIENT_SIZE);
  ASSERT_EQ(n, 1u);
  nvmlProcessUtilizationSample_t samples[4];
  n = 4;
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(device, samples, &n, since), NVML_SUCCESS);
  nvmlUtilization_t rates{};
  ASSERT_EQ(nvmlDeviceGetUtilizationRates(device, &rates), NVML_SUCCESS);
  const unsigned long long asked = RealtimeMicros();
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(samples[0].pid, static_cast<unsigned>(getpid()));
  // Exactly 100 ms busy since `since`, over a window that ends at the query:
  // the percent lies between 100 ms over the longest window the query can
  // have seen and over the shortest (a loaded machine only widens the
  // window; on an idle one this is ~all of it, >= 80 %).
  const auto percent_of = [](unsigned long long window_us) {
    return static_cast<unsigned>((100'000ull * 100 + window_us / 2) / window_us);
  };
  EXPECT_GE(samples[0].smUtil + 1, percent_of(asked - since));
  EXPECT_LE(samples[0].smUtil, percent_of(synced - since) + 1);
  if (asked - since < 120'000) {
    EXPECT_GE(samples[0].smUtil, 80u);
  }
  EXPECT_GE(samples[0].timeStamp, since);
  // The last second holds all 100 ms of it when the query came within a
  // second of the first launch: 10 %.
  if (asked - since <= 1'000'000) {
    EXPECT_GE(rates.gpu, 9u);
    EXPECT_LE(rates.gpu, 11u);
  } else {
    EXPECT_LE(rates.gpu, 11u);
  }
  EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
  EXPECT_EQ(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
}

}  // namespace
