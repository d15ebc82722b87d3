// Green contexts and SM resources (green.cc; cuda.h 13.0, "Green Contexts"):
// the documented split granularity, the primary context a green context
// retains, memory allocated in it belonging to the primary context, its
// streams on its device, and what the header leaves open refused.
#include "common.h"

using namespace fakecuda_test;

namespace {

uint64_t NowNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Splits device `dev`'s SMs into groups of at least `min_count` and makes a
// green context of the first group.
CUgreenCtx MakeGreen(CUdevice dev, unsigned min_count, unsigned* sms = nullptr) {
  CUdevResource all{};
  EXPECT_CU(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
  CUdevResource parts[16]{};
  unsigned n = 16;
  EXPECT_CU(cuDevSmResourceSplitByCount(parts, &n, &all, nullptr, 0, min_count));
  if (n == 0) return nullptr;
  CUdevResourceDesc desc = nullptr;
  EXPECT_CU(cuDevResourceGenerateDesc(&desc, parts, 1));
  CUgreenCtx green = nullptr;
  EXPECT_CU(cuGreenCtxCreate(&green, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
  if (sms != nullptr) *sms = parts[0].sm.smCount;
  return green;
}

TEST_F(FakeCuda, SmSplitHonoursTheDocumentedGranularity) {
  setenv("FAKECUDA_SMS", "132", 1);
  ASSERT_CU(cuInit(0));
  CUdevResource all{};
  ASSERT_CU(cuDeviceGetDevResource(0, &all, CU_DEV_RESOURCE_TYPE_SM));
  EXPECT_EQ(all.type, CU_DEV_RESOURCE_TYPE_SM);
  EXPECT_EQ(all.sm.smCount, 132u);
  EXPECT_EQ(all.sm.minSmPartitionSize, 8u) << "compute capability 9.0: at least 8 SMs";
  EXPECT_EQ(all.sm.smCoscheduledAlignment, 8u) << "... in multiples of 8";
  unsigned n = 0;
  ASSERT_CU(cuDevSmResourceSplitByCount(nullptr, &n, &all, nullptr, 0, 1));
  EXPECT_EQ(n, 16u) << "minCount 1 rounds up to 8: 132 / 8";
  ASSERT_CU(cuDevSmResourceSplitByCount(nullptr, &n, &all, nullptr, 0, 20));
  EXPECT_EQ(n, 5u) << "minCount 20 rounds up to 24: 132 / 24";
  CUdevResource parts[3]{};
  CUdevResource rest{};
  n = 3;
  ASSERT_CU(cuDevSmResourceSplitByCount(parts, &n, &all, &rest, 0, 20));
  EXPECT_EQ(n, 3u);
  for (const CUdevResource& p : parts) EXPECT_EQ(p.sm.smCount, 24u);
  EXPECT_EQ(rest.sm.smCount, 132u - 72u);
  EXPECT_EQ(cuDevSmResourceSplitByCount(nullptr, &n, &all, nullptr, 0, 133), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuDevSmResourceSplitByCount(nullptr, &n, &parts[0], nullptr, 0, 8),
            CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION)
      << "a split's output cannot be split again";
  EXPECT_EQ(cuDevSmResourceSplitByCount(nullptr, &n, &all, nullptr, CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING, 1),
            CUDA_ERROR_NOT_SUPPORTED)
      << "the finer granularity is not documented";
  EXPECT_EQ(cuDeviceGetDevResource(0, &all, CU_DEV_RESOURCE_TYPE_INVALID), CUDA_ERROR_INVALID_RESOURCE_TYPE);
  // A descriptor: several SM resources only from one split.
  CUdevResourceDesc desc = nullptr;
  ASSERT_CU(cuDevResourceGenerateDesc(&desc, parts, 2));
  CUdevResource other[1]{};
  n = 1;
  ASSERT_CU(cuDevSmResourceSplitByCount(other, &n, &all, nullptr, 0, 8));
  CUdevResource mixed[2] = {parts[0], other[0]};
  EXPECT_EQ(cuDevResourceGenerateDesc(&desc, mixed, 2), CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
}

TEST_F(FakeCuda, GreenContextRetainsThePrimaryContextAndOwnsNoMemory) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "64Mi", 1);
  ASSERT_CU(cuInit(0));
  EXPECT_EQ(fakecuda_device_used_bytes(1), 0u);
  unsigned sms = 0;
  CUgreenCtx green = MakeGreen(1, 16, &sms);
  ASSERT_NE(green, nullptr);
  EXPECT_EQ(sms, 16u);
  EXPECT_EQ(fakecuda_device_used_bytes(1), 64 * kMiB) << "the primary context, retained";
  unsigned int flags = 0;
  int active = 0;
  ASSERT_CU(cuDevicePrimaryCtxGetState(1, &flags, &active));
  EXPECT_EQ(active, 1);
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxFromGreenCtx(&ctx, green));
  ASSERT_CU(cuCtxSetCurrent(ctx));
  CUdevice dev = -1;
  ASSERT_CU(cuCtxGetDevice(&dev));
  EXPECT_EQ(dev, 1);
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 32 * kMiB));
  EXPECT_EQ(fakecuda_device_used_bytes(1), 96 * kMiB);
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  CUdevResource res{};
  ASSERT_CU(cuGreenCtxGetDevResource(green, &res, CU_DEV_RESOURCE_TYPE_SM));
  EXPECT_EQ(res.sm.smCount, 16u);
  ASSERT_CU(cuCtxGetDevResource(ctx, &res, CU_DEV_RESOURCE_TYPE_SM));
  EXPECT_EQ(res.sm.smCount, 16u);
  unsigned long long id = 0, current_id = 0;
  ASSERT_CU(cuGreenCtxGetId(green, &id));
  ASSERT_CU(cuGreenCtxGetId(nullptr, &current_id));
  EXPECT_EQ(id, current_id);
  EXPECT_EQ(cuCtxDestroy(ctx), CUDA_ERROR_INVALID_CONTEXT) << "a primary context is not destroyed";
  // Destroying the green context releases the primary context; the memory it
  // allocated was the primary context's and goes with it.
  ASSERT_CU(cuCtxSetCurrent(nullptr));
  ASSERT_CU(cuGreenCtxDestroy(green));
  EXPECT_EQ(fakecuda_device_used_bytes(1), 0u);
  EXPECT_EQ(cuGreenCtxDestroy(green), CUDA_ERROR_CONTEXT_IS_DESTROYED);
  EXPECT_EQ(cuCtxFromGreenCtx(&ctx, green), CUDA_ERROR_INVALID_CONTEXT);
}

TEST_F(FakeCuda, GreenContextMemoryOutlivesItWhileThePrimaryIsRetained) {
  setenv("FAKECUDA_CONTEXT_MEMORY", "64Mi", 1);
  ASSERT_CU(cuInit(0));
  CUcontext primary = nullptr;
  ASSERT_CU(cuDevicePrimaryCtxRetain(&primary, 0));
  CUgreenCtx green = MakeGreen(0, 8);
  ASSERT_NE(green, nullptr);
  EXPECT_EQ(fakecuda_device_used_bytes(0), 64 * kMiB) << "one primary context";
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxFromGreenCtx(&ctx, green));
  ASSERT_CU(cuCtxPushCurrent(ctx));
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 16 * kMiB));
  ASSERT_CU(cuCtxPopCurrent(nullptr));
  ASSERT_CU(cuGreenCtxDestroy(green));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 80 * kMiB);
  ASSERT_CU(cuCtxSetCurrent(primary));
  ASSERT_CU(cuMemFree(p)) << "the primary context's allocation";
  EXPECT_EQ(fakecuda_device_used_bytes(0), 64 * kMiB);
  ASSERT_CU(cuDevicePrimaryCtxRelease(0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

TEST_F(FakeCuda, GreenContextStreamsRunOnItsDevice) {
  ASSERT_CU(cuInit(0));
  CUgreenCtx green = MakeGreen(1, 8);
  ASSERT_NE(green, nullptr);
  CUstream s = nullptr;
  EXPECT_EQ(cuGreenCtxStreamCreate(&s, green, 0, 0), CUDA_ERROR_INVALID_VALUE) << "NON_BLOCKING is required";
  ASSERT_CU(cuGreenCtxStreamCreate(&s, green, CU_STREAM_NON_BLOCKING, 0));
  CUdevice dev = -1;
  ASSERT_CU(cuStreamGetDevice(s, &dev));
  EXPECT_EQ(dev, 1);
  CUgreenCtx owner = nullptr;
  ASSERT_CU(cuStreamGetGreenCtx(s, &owner));
  EXPECT_EQ(owner, green);
  CUcontext ctx = nullptr;
  ASSERT_CU(cuCtxFromGreenCtx(&ctx, green));
  ASSERT_CU(cuCtxSetCurrent(ctx));
  static const char kPtx[] = "// fake PTX\n.entry spin_1000us\n";
  CUmodule mod = nullptr;
  ASSERT_CU(cuModuleLoadData(&mod, kPtx));
  CUfunction f = nullptr;
  ASSERT_CU(cuModuleGetFunction(&f, mod, "spin_1000us"));
  const uint64_t t0 = NowNs();
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, nullptr));
  ASSERT_CU(cuStreamSynchronize(s));
  const uint64_t t1 = NowNs();
  EXPECT_EQ(fakecuda_busy_ns(1, 0, t0, t1), 1000000u) << "the kernel ran on device 1";
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, t1), 0u);
  ASSERT_CU(cuCtxSetCurrent(nullptr));
  ASSERT_CU(cuGreenCtxDestroy(green));
  EXPECT_EQ(cuStreamSynchronize(s), CUDA_ERROR_CONTEXT_IS_DESTROYED) << "its streams are detached";
  EXPECT_EQ(cuStreamDestroy(s), CUDA_ERROR_CONTEXT_IS_DESTROYED) << "cuStreamDestroy included";
  EXPECT_EQ(cuGreenCtxCreate(&green, nullptr, 0, CU_GREEN_CTX_DEFAULT_STREAM), CUDA_ERROR_INVALID_VALUE);
}

}  // namespace
