// Device-memory bookkeeping of every allocation family, OOM and recovery,
// addresses, context memory, initialisation and argument errors.
#include <algorithm>
#include <map>
#include <random>

#include "common.h"

using namespace fakecuda_test;

namespace {

unsigned long long Used(int dev = 0) { return fakecuda_device_used_bytes(dev); }

unsigned long long DriverUsed() {
  size_t free_bytes = 0, total = 0;
  EXPECT_CU(cuMemGetInfo(&free_bytes, &total));
  return total - free_bytes;
}

TEST_F(FakeCuda, CallsBeforeInitFail) {
  CUdeviceptr p = 0;
  EXPECT_EQ(cuMemAlloc(&p, 1024), CUDA_ERROR_NOT_INITIALIZED);
  int count = 0;
  EXPECT_EQ(cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
  int version = 0;
  EXPECT_CU(cuDriverGetVersion(&version));
  EXPECT_EQ(version, 13000);
  EXPECT_EQ(cuInit(1), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, BadEnvironmentFailsInitNamingTheVariable) {
  setenv("FAKECUDA_MEMORY", "12Q", 1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("FAKECUDA_MEMORY='12Q'"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_EQ(cuInit(0), CUDA_ERROR_INVALID_VALUE);  // failure is sticky, as in the driver
}

TEST_F(FakeCuda, DeviceProperties) {
  setenv("FAKECUDA_SMS", "66", 1);
  ASSERT_CU(cuInit(0));
  int count = 0;
  ASSERT_CU(cuDeviceGetCount(&count));
  EXPECT_EQ(count, 2);
  int value = 0;
  EXPECT_CU(cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
  EXPECT_EQ(value, 66);
  EXPECT_CU(cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 0));
  EXPECT_EQ(value, 2048);
  EXPECT_CU(cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
  EXPECT_EQ(value, 9);
  EXPECT_EQ(cuDeviceGetAttribute(&value, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 2), CUDA_ERROR_INVALID_DEVICE);
  size_t total = 0;
  EXPECT_CU(cuDeviceTotalMem(&total, 1));
  EXPECT_EQ(total, 1ull << 30);
  CUuuid a, b, a2;
  EXPECT_CU(cuDeviceGetUuid(&a, 0));
  EXPECT_CU(cuDeviceGetUuid_v2(&a2, 0));
  EXPECT_CU(cuDeviceGetUuid(&b, 1));
  EXPECT_EQ(0, memcmp(&a, &a2, sizeof(a)));
  EXPECT_NE(0, memcmp(&a, &b, sizeof(a)));
  char name[64];
  EXPECT_CU(cuDeviceGetName(name, sizeof(name), 0));
  EXPECT_NE(std::string(name).find("fakecuda"), std::string::npos);
  EXPECT_EQ(cuDeviceGetName(nullptr, 10, 0), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, EveryAllocationFamilyIsCountedExactly) {
  InitWithContext();
  CUdeviceptr linear = 0, pitched = 0, managed = 0;
  ASSERT_CU(cuMemAlloc(&linear, kMiB));
  EXPECT_EQ(Used(), kMiB);
  size_t pitch = 0;
  ASSERT_CU(cuMemAllocPitch(&pitched, &pitch, 1000, 10, 4));
  EXPECT_EQ(pitch, 1024u);
  EXPECT_EQ(Used(), kMiB + 10240);
  ASSERT_CU(cuMemAllocManaged(&managed, 3 * kMiB, CU_MEM_ATTACH_GLOBAL));
  EXPECT_EQ(Used(), 4 * kMiB + 10240);
  CUDA_ARRAY_DESCRIPTOR d2{};
  d2.Width = 100;
  d2.Height = 50;
  d2.Format = CU_AD_FORMAT_FLOAT;
  d2.NumChannels = 4;
  CUarray array2d = nullptr, array3d = nullptr;
  ASSERT_CU(cuArrayCreate(&array2d, &d2));
  EXPECT_EQ(Used(), 4 * kMiB + 10240 + 80000);
  CUDA_ARRAY3D_DESCRIPTOR d3{};
  d3.Width = d3.Height = d3.Depth = 10;
  d3.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  d3.NumChannels = 1;
  ASSERT_CU(cuArray3DCreate(&array3d, &d3));
  CUmipmappedArray mip = nullptr;
  CUDA_ARRAY3D_DESCRIPTOR dm{};
  dm.Width = dm.Height = 8;
  dm.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  dm.NumChannels = 1;
  ASSERT_CU(cuMipmappedArrayCreate(&mip, &dm, 4));  // 64 + 16 + 4 + 1
  EXPECT_EQ(cuMipmappedArrayCreate(&mip, &dm, 5), CUDA_ERROR_INVALID_VALUE);
  const unsigned long long expected = 4 * kMiB + 10240 + 80000 + 1000 + 85;
  EXPECT_EQ(Used(), expected);
  EXPECT_EQ(DriverUsed(), expected);
  EXPECT_EQ(fakecuda_process_used_bytes(0, 0), expected);
  CUDA_ARRAY_DESCRIPTOR got{};
  EXPECT_CU(cuArrayGetDescriptor(&got, array2d));
  EXPECT_EQ(got.Width, 100u);
  CUDA_ARRAY3D_DESCRIPTOR got3{};
  EXPECT_CU(cuArray3DGetDescriptor(&got3, array3d));
  EXPECT_EQ(got3.Depth, 10u);
  EXPECT_CU(cuMemFree(linear));
  EXPECT_CU(cuMemFree(pitched));
  EXPECT_CU(cuMemFree(managed));
  EXPECT_CU(cuArrayDestroy(array2d));
  EXPECT_CU(cuArrayDestroy(array3d));
  EXPECT_CU(cuMipmappedArrayDestroy(mip));
  EXPECT_EQ(Used(), 0u);
  EXPECT_EQ(cuMemFree(linear), CUDA_ERROR_INVALID_VALUE);  // double free
  EXPECT_EQ(cuArrayDestroy(array2d), CUDA_ERROR_INVALID_HANDLE);
}

TEST_F(FakeCuda, LegacyThirtyTwoBitAllocation) {
  InitWithContext();
  // cuda.h maps cuMemAlloc to cuMemAlloc_v2; the 2.x ABI is only reachable raw.
  using LegacyAlloc = CUresult (*)(unsigned int*, unsigned int);
  using LegacyFree = CUresult (*)(unsigned int);
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr);
  auto legacy_alloc = reinterpret_cast<LegacyAlloc>(dlsym(lib, "cuMemAlloc"));
  auto legacy_free = reinterpret_cast<LegacyFree>(dlsym(lib, "cuMemFree"));
  unsigned int p = 0;
  ASSERT_CU(legacy_alloc(&p, 4096));
  EXPECT_NE(p, 0u);
  EXPECT_EQ(Used(), 4096u);
  EXPECT_CU(legacy_free(p));
  EXPECT_EQ(Used(), 0u);
  dlclose(lib);
}

TEST_F(FakeCuda, PitchRejectsBadElementSize) {
  InitWithContext();
  CUdeviceptr p = 0;
  size_t pitch = 0;
  EXPECT_EQ(cuMemAllocPitch(&p, &pitch, 100, 10, 2), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAllocPitch(&p, &pitch, 100, 10, 3), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAllocPitch(&p, nullptr, 100, 10, 4), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAllocManaged(&p, 100, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAlloc(nullptr, 100), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(Used(), 0u);
}

TEST_F(FakeCuda, ManagedMemoryAdvisedToTheHostLeavesTheDevice) {
  setenv("FAKECUDA_MEMORY", "64Mi", 1);
  InitWithContext();
  CUdeviceptr m = 0;
  ASSERT_CU(cuMemAllocManaged(&m, 32 * kMiB, CU_MEM_ATTACH_GLOBAL));
  EXPECT_EQ(Used(), 32 * kMiB);
  CUmemLocation host{};
  host.type = CU_MEM_LOCATION_TYPE_HOST;
  ASSERT_CU(cuMemAdvise_v2(m, 32 * kMiB, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host));
  EXPECT_EQ(Used(), 0u);
  CUdeviceptr d = 0;
  EXPECT_EQ(cuMemAdvise_v2(d + 1, 1, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, host), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFree(m));
  EXPECT_EQ(Used(), 0u);
}

TEST_F(FakeCuda, OutOfMemoryAndRecovery) {
  setenv("FAKECUDA_MEMORY", "64Mi", 1);
  InitWithContext();
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(cuMemAlloc(&a, 40 * kMiB));
  EXPECT_EQ(cuMemAlloc(&b, 40 * kMiB), CUDA_ERROR_OUT_OF_MEMORY);
  // Managed memory may exceed the device (host-backed, migrates on demand):
  // held on the device only as far as it fits, the rest on the host.
  ASSERT_CU(cuMemAllocManaged(&b, 40 * kMiB, CU_MEM_ATTACH_GLOBAL));
  EXPECT_EQ(Used(), 64 * kMiB);
  ASSERT_CU(cuMemFree(b));
  EXPECT_EQ(Used(), 40 * kMiB);
  CUDA_ARRAY_DESCRIPTOR d{};
  d.Width = 40 * kMiB;
  d.Format = CU_AD_FORMAT_UNSIGNED_INT8;
  d.NumChannels = 1;
  CUarray array = nullptr;
  EXPECT_EQ(cuArrayCreate(&array, &d), CUDA_ERROR_OUT_OF_MEMORY);
  ASSERT_CU(cuMemAlloc(&b, 24 * kMiB));  // exactly full
  EXPECT_EQ(Used(), 64 * kMiB);
  CUdeviceptr c = 0;
  EXPECT_EQ(cuMemAlloc(&c, 1), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_CU(cuMemFree(a));
  EXPECT_CU(cuMemAlloc(&c, 40 * kMiB));
  EXPECT_EQ(fakecuda_device_used_bytes(1), 0u);  // other devices unaffected
}

TEST_F(FakeCuda, AddressesAreUniqueAndRangesResolve) {
  InitWithContext();
  std::mt19937 rng(7);
  std::map<CUdeviceptr, size_t> live;
  for (int i = 0; i < 500; ++i) {
    size_t size = 1 + rng() % 100000;
    CUdeviceptr p = 0;
    ASSERT_CU(cuMemAlloc(&p, size));
    ASSERT_EQ(live.count(p), 0u);
    live[p] = size;
    if (i % 3 == 0) {  // frees never let an address be handed out again
      auto victim = live.begin();
      std::advance(victim, rng() % live.size());
      ASSERT_CU(cuMemFree(victim->first));
      live.erase(victim);
    }
  }
  CUdeviceptr previous_end = 0;
  for (auto& [base, size] : live) {
    EXPECT_GE(base, previous_end);
    previous_end = base + size;
    CUdeviceptr found = 0;
    size_t found_size = 0;
    ASSERT_CU(cuMemGetAddressRange(&found, &found_size, base + size / 2));
    EXPECT_EQ(found, base);
    EXPECT_EQ(found_size, size);
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  EXPECT_EQ(cuMemGetAddressRange(&base, &size, 8), CUDA_ERROR_NOT_FOUND);
}

TEST_F(FakeCuda, ContextsHoldContextMemory) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "10Mi", 1);
  ASSERT_CU(cuInit(0));
  EXPECT_EQ(Used(), 0u);
  CUcontext created = nullptr, primary = nullptr, again = nullptr;
  ASSERT_CU(cuCtxCreate(&created, nullptr, 0, 0));
  EXPECT_EQ(Used(), 10 * kMiB);
  ASSERT_CU(cuDevicePrimaryCtxRetain(&primary, 0));
  ASSERT_CU(cuDevicePrimaryCtxRetain(&again, 0));
  EXPECT_EQ(primary, again);
  EXPECT_EQ(Used(), 20 * kMiB);
  EXPECT_EQ(fakecuda_process_context_bytes(0, 0), 20 * kMiB);
  unsigned flags = 0;
  int active = 0;
  EXPECT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 1);
  EXPECT_CU(cuDevicePrimaryCtxRelease(0));
  EXPECT_EQ(Used(), 20 * kMiB);
  EXPECT_CU(cuDevicePrimaryCtxRelease(0));
  EXPECT_EQ(Used(), 10 * kMiB);
  EXPECT_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
  EXPECT_EQ(active, 0);
  EXPECT_EQ(cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
  // Destroying a context frees everything allocated in it.
  CUdeviceptr p = 0;
  ASSERT_CU(cuCtxSetCurrent(created));
  ASSERT_CU(cuMemAlloc(&p, 5 * kMiB));
  EXPECT_EQ(Used(), 15 * kMiB);
  EXPECT_CU(cuCtxDestroy(created));
  EXPECT_EQ(Used(), 0u);
  CUcontext current = nullptr;
  EXPECT_CU(cuCtxGetCurrent(&current));
  EXPECT_EQ(current, nullptr);
  EXPECT_EQ(cuMemAlloc(&p, 1), CUDA_ERROR_INVALID_CONTEXT);
  // A context that does not fit is refused.
  setenv("FAKECUDA_CONTEXT_MEMORY", "2Gi", 1);  // ignored: the state's creator fixed the config
  ASSERT_CU(cuDevicePrimaryCtxRetain(&primary, 1));
  EXPECT_EQ(fakecuda_device_used_bytes(1), 10 * kMiB);
  EXPECT_CU(cuDevicePrimaryCtxReset(1));
  EXPECT_EQ(fakecuda_device_used_bytes(1), 0u);
}

TEST_F(FakeCuda, ContextStack) {
  ASSERT_CU(cuInit(0));
  CUcontext a = nullptr, b = nullptr, popped = nullptr, current = nullptr;
  ASSERT_CU(cuCtxCreate(&a, nullptr, 0, 0));
  ASSERT_CU(cuCtxCreate(&b, nullptr, 0, 1));
  CUdevice dev = -1;
  EXPECT_CU(cuCtxGetDevice(&dev));
  EXPECT_EQ(dev, 1);
  EXPECT_CU(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, b);
  EXPECT_CU(cuCtxGetCurrent(&current));
  EXPECT_EQ(current, a);
  EXPECT_CU(cuCtxPushCurrent(b));
  EXPECT_CU(cuCtxSetCurrent(a));  // replaces the top
  EXPECT_CU(cuCtxPopCurrent(&popped));
  EXPECT_EQ(popped, a);
  EXPECT_CU(cuCtxPopCurrent(&popped));
  EXPECT_EQ(cuCtxPopCurrent(&popped), CUDA_ERROR_INVALID_CONTEXT);
  unsigned version = 0;
  EXPECT_CU(cuCtxGetApiVersion(a, &version));
  EXPECT_CU(cuCtxDestroy(a));
  EXPECT_EQ(cuCtxDestroy(a), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_CU(cuCtxDestroy(b));
}

TEST_F(FakeCuda, ErrorNamesCoverReturnedCodes) {
  const char* text = nullptr;
  for (CUresult code : {CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_INITIALIZED,
                        CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_READY,
                        CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED}) {
    EXPECT_CU(cuGetErrorName(code, &text));
    EXPECT_NE(text, nullptr);
    EXPECT_CU(cuGetErrorString(code, &text));
  }
  EXPECT_CU(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &text));
  EXPECT_STREQ(text, "CUDA_ERROR_OUT_OF_MEMORY");
  EXPECT_EQ(cuGetErrorName(static_cast<CUresult>(123456), &text), CUDA_ERROR_INVALID_VALUE);
}

}  // namespace
