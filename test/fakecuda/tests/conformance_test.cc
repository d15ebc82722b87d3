// Documented driver semantics the simulator claims to share with NVIDIA's
// driver (CTest label "conformance"). Run as is, they check the simulator; with
// GPUSLICE_TEST_REAL_DRIVER=1 the same binary checks the machine's real
// libcuda.so.1 + libnvidia-ml.so.1 (and skips, saying why, when there is none).
// A test that passes on one and fails on the other is a bug in the simulator.
// Only the timing-independent semantics are here; the timing model has its own
// tests (realistic_test.cc).
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include "conformance.h"

using conformance::Conformance;
using conformance::kPtx;

namespace {

#define ASSERT_CU(call) ASSERT_EQ((call), CUDA_SUCCESS) << #call
#define EXPECT_CU(call) EXPECT_EQ((call), CUDA_SUCCESS) << #call

constexpr size_t kMiB = size_t{1} << 20;

TEST_F(Conformance, InitRejectsFlagsAndCallsBeforeInitFail) {
  int count = -1;
  EXPECT_EQ(cu().cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cu().cuInit(1), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cu().cuInit(0));
  ASSERT_CU(cu().cuDeviceGetCount(&count));
  EXPECT_GE(count, 1);
}

TEST_F(Conformance, MemGetInfoTotalIsTheDevicesMemory) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  size_t free_bytes = 0, total = 0, device_total = 0;
  ASSERT_CU(cu().cuMemGetInfo(&free_bytes, &total));
  ASSERT_CU(cu().cuDeviceTotalMem(&device_total, 0));
  EXPECT_EQ(total, device_total);
  EXPECT_LE(free_bytes, total);
  CUdeviceptr p = 0;
  ASSERT_CU(cu().cuMemAlloc(&p, 64 * kMiB));
  size_t free_after = 0;
  ASSERT_CU(cu().cuMemGetInfo(&free_after, &total));
  EXPECT_LE(free_after + 64 * kMiB, free_bytes);
  ASSERT_CU(cu().cuMemFree(p));
}

// NULL outputs are the driver's documented error, not a crash (programs do
// this; HAMi-core segfaults on it).
TEST_F(Conformance, MemoryQueriesRefuseNullOutputs) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  size_t bytes = 0;
  EXPECT_EQ(cu().cuMemGetInfo(nullptr, &bytes), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cu().cuMemGetInfo(&bytes, nullptr), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(cu().nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev = nullptr;
  ASSERT_EQ(cu().nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  EXPECT_EQ(cu().nvmlDeviceGetMemoryInfo(dev, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  cu().nvmlShutdown();
}

// An OPAQUE_FD that references no memory object is refused, and the import
// of NULL arguments too (driver API, cuImportExternalMemory).
TEST_F(Conformance, ExternalMemoryImportRefusesADescriptorOfNoMemory) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUexternalMemory ext = nullptr;
  EXPECT_EQ(cu().cuImportExternalMemory(&ext, nullptr), CUDA_ERROR_INVALID_VALUE);
  CUDA_EXTERNAL_MEMORY_HANDLE_DESC d{};
  d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
  d.handle.fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  d.size = 4 * kMiB;
  EXPECT_EQ(cu().cuImportExternalMemory(&ext, &d), CUDA_ERROR_INVALID_HANDLE);
  close(d.handle.fd);
}

// cuMemFree takes only the base of a live allocation.
TEST_F(Conformance, FreeTakesOnlyALiveBase) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUdeviceptr p = 0;
  ASSERT_CU(cu().cuMemAlloc(&p, 4 * kMiB));
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_CU(cu().cuMemGetAddressRange(&base, &size, p + 4096));
  EXPECT_EQ(base, p);
  EXPECT_EQ(size, 4 * kMiB);
  EXPECT_EQ(cu().cuMemFree(p + 4096), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cu().cuMemFree(p));
  EXPECT_EQ(cu().cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
}

// The driver hands a freed range out again (issue 14): gpuslice must not
// assume addresses are unique over a process's life.
TEST_F(Conformance, FreedAddressIsReused) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(cu().cuMemAlloc(&a, 2 * kMiB));
  ASSERT_CU(cu().cuMemFree(a));
  ASSERT_CU(cu().cuMemAlloc(&b, 2 * kMiB));
  EXPECT_EQ(a, b);
  ASSERT_CU(cu().cuMemFree(b));
}

// cuCtxSetCurrent(NULL) pops the top of the thread's context stack (cuda.h).
TEST_F(Conformance, SetCurrentNullPopsTheStack) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext first = nullptr, second = nullptr, current = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&first, nullptr, 0, 0));
  ASSERT_CU(cu().cuCtxCreate(&second, nullptr, 0, 0));
  ASSERT_CU(cu().cuCtxGetCurrent(&current));
  EXPECT_EQ(current, second);
  ASSERT_CU(cu().cuCtxSetCurrent(nullptr));
  ASSERT_CU(cu().cuCtxGetCurrent(&current));
  EXPECT_EQ(current, first);
}

// A CUkernel cast to CUfunction runs in the stream's context, or the current
// one for the NULL stream (cuda.h, cuLaunchKernel); with neither there is no
// context to launch in.
TEST_F(Conformance, KernelHandleTakesTheStreamsContext) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext a = nullptr, b = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&b, nullptr, 0, 0));
  CUstream sb = nullptr;
  ASSERT_CU(cu().cuStreamCreate(&sb, CU_STREAM_NON_BLOCKING));
  CUcontext owner = nullptr;
  ASSERT_CU(cu().cuStreamGetCtx(sb, &owner));
  EXPECT_EQ(owner, b);
  ASSERT_CU(cu().cuCtxCreate(&a, nullptr, 0, 0));
  CUlibrary library = nullptr;
  ASSERT_CU(cu().cuLibraryLoadData(&library, kPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  ASSERT_CU(cu().cuLibraryGetKernel(&kernel, library, "noop"));
  auto f = reinterpret_cast<CUfunction>(kernel);
  EXPECT_CU(cu().cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, sb, nullptr, nullptr));  // a is current
  CUcontext popped = nullptr;
  while (cu().cuCtxPopCurrent(&popped) == CUDA_SUCCESS) {}
  EXPECT_CU(cu().cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, sb, nullptr, nullptr));  // none is current
  EXPECT_EQ(cu().cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_ERROR_INVALID_CONTEXT);
  ASSERT_CU(cu().cuStreamSynchronize(sb));
}

// A CUfunction belongs to its module's context: another context's stream is refused.
TEST_F(Conformance, FunctionOfAnotherContextIsRefused) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext a = nullptr, b = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&b, nullptr, 0, 0));
  CUstream sb = nullptr;
  ASSERT_CU(cu().cuStreamCreate(&sb, 0));
  ASSERT_CU(cu().cuCtxCreate(&a, nullptr, 0, 0));
  CUmodule module = nullptr;
  ASSERT_CU(cu().cuModuleLoadData(&module, kPtx));
  CUfunction f = nullptr;
  ASSERT_CU(cu().cuModuleGetFunction(&f, module, "noop"));
  EXPECT_EQ(cu().cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, sb, nullptr, nullptr), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_CU(cu().cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
  EXPECT_CU(cu().cuCtxSynchronize());
}

// Events: elapsed time needs two recorded, completed, timing events; a 1 ms
// spin kernel between them takes at least 1 ms.
TEST_F(Conformance, EventsTimeTheWorkBetweenThem) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUmodule module = nullptr;
  ASSERT_CU(cu().cuModuleLoadData(&module, kPtx));
  CUfunction spin = nullptr;
  ASSERT_CU(cu().cuModuleGetFunction(&spin, module, "spin_1000us"));
  CUevent start = nullptr, end = nullptr, untimed = nullptr;
  ASSERT_CU(cu().cuEventCreate(&start, 0));
  ASSERT_CU(cu().cuEventCreate(&end, 0));
  ASSERT_CU(cu().cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
  float ms = 0;
  EXPECT_EQ(cu().cuEventElapsedTime(&ms, start, end), CUDA_ERROR_INVALID_HANDLE) << "never recorded";
  EXPECT_CU(cu().cuEventQuery(start)) << "an event never recorded is complete";
  ASSERT_CU(cu().cuEventRecord(start, nullptr));
  ASSERT_CU(cu().cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cu().cuEventRecord(end, nullptr));
  ASSERT_CU(cu().cuEventRecord(untimed, nullptr));
  ASSERT_CU(cu().cuEventSynchronize(end));
  ASSERT_CU(cu().cuEventSynchronize(untimed));
  ASSERT_CU(cu().cuEventElapsedTime(&ms, start, end));
  EXPECT_GE(ms, 0.99f);
  EXPECT_EQ(cu().cuEventElapsedTime(&ms, start, untimed), CUDA_ERROR_INVALID_HANDLE) << "timing disabled";
}

// NVML: per-process memory covers at least what the process allocated (the
// real driver adds context and module memory); utilisation samples are
// percentages stamped no later than now, and none is newer than "the future".
TEST_F(Conformance, NvmlSeesTheProcess) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUdeviceptr p = 0;
  ASSERT_CU(cu().cuMemAlloc(&p, 64 * kMiB));
  CUmodule module = nullptr;
  ASSERT_CU(cu().cuModuleLoadData(&module, kPtx));
  CUfunction spin = nullptr;
  ASSERT_CU(cu().cuModuleGetFunction(&spin, module, "spin_1000us"));
  for (int i = 0; i < 50; ++i) ASSERT_CU(cu().cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cu().cuCtxSynchronize());
  ASSERT_EQ(cu().nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t device = nullptr;
  ASSERT_EQ(cu().nvmlDeviceGetHandleByIndex_v2(0, &device), NVML_SUCCESS);
  nvmlProcessInfo_t infos[64];
  unsigned count = 64;
  ASSERT_EQ(cu().nvmlDeviceGetComputeRunningProcesses_v3(device, &count, infos), NVML_SUCCESS);
  bool found = false;
  for (unsigned i = 0; i < count; ++i) {
    if (infos[i].pid != static_cast<unsigned>(getpid())) continue;
    found = true;
    EXPECT_GE(infos[i].usedGpuMemory, 64 * kMiB);
  }
  EXPECT_TRUE(found) << "this process is not listed";
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  unsigned long long now_us = ts.tv_sec * 1000000ull + ts.tv_nsec / 1000;
  nvmlProcessUtilizationSample_t samples[256];
  unsigned n = 256;
  nvmlReturn_t rc = cu().nvmlDeviceGetProcessUtilization(device, samples, &n, 0);
  ASSERT_TRUE(rc == NVML_SUCCESS || rc == NVML_ERROR_NOT_FOUND) << rc;
  for (unsigned i = 0; rc == NVML_SUCCESS && i < n; ++i) {
    EXPECT_LE(samples[i].smUtil, 100u);
    EXPECT_LE(samples[i].timeStamp, now_us + 1000000) << "stamped in the future";
  }
  n = 256;
  EXPECT_EQ(cu().nvmlDeviceGetProcessUtilization(device, samples, &n, now_us + 3600ull * 1000000),
            NVML_ERROR_NOT_FOUND);
  nvmlUtilization_t rates{};
  ASSERT_EQ(cu().nvmlDeviceGetUtilizationRates(device, &rates), NVML_SUCCESS);
  EXPECT_LE(rates.gpu, 100u);
  cu().nvmlShutdown();
  ASSERT_CU(cu().cuMemFree(p));
}

// VMM: cuMemRetainAllocationHandle gives the handle mapped at an address with
// one more reference; each reference needs its own cuMemRelease (cuda.h).
TEST_F(Conformance, RetainedVmmHandleNeedsItsOwnRelease) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t granule = 0;
  ASSERT_CU(cu().cuMemGetAllocationGranularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  ASSERT_GT(granule, 0u);
  CUmemGenericAllocationHandle handle = 0, retained = 0;
  ASSERT_CU(cu().cuMemCreate(&handle, granule, &prop, 0));
  CUdeviceptr va = 0;
  ASSERT_CU(cu().cuMemAddressReserve(&va, granule, 0, 0, 0));
  ASSERT_CU(cu().cuMemMap(va, granule, 0, handle, 0));
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU(cu().cuMemSetAccess(va, granule, &access, 1));
  ASSERT_CU(cu().cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(va)));
  EXPECT_EQ(retained, handle);
  ASSERT_CU(cu().cuMemRelease(handle));
  ASSERT_CU(cu().cuMemRelease(retained));
  ASSERT_CU(cu().cuMemUnmap(va, granule));
  ASSERT_CU(cu().cuMemAddressFree(va, granule));
}

// Legacy IPC: a handle is for other processes. cuda.h does not say what
// opening it in the exporting process answers; the simulator answers what the
// real driver is reported to (CUDA_ERROR_INVALID_CONTEXT): this checks it.
TEST_F(Conformance, IpcHandleOpenedByItsExporterIsRefused) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUdeviceptr p = 0;
  ASSERT_CU(cu().cuMemAlloc(&p, 2 * kMiB));
  CUipcMemHandle handle{};
  ASSERT_CU(cu().cuIpcGetMemHandle(&handle, p));
  CUdeviceptr opened = 0;
  EXPECT_EQ(cu().cuIpcOpenMemHandle(&opened, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_CU(cu().cuMemFree(p));
  EXPECT_CU(cu().cuCtxDestroy(ctx));
}

// cuMemPoolDestroy with an allocation outstanding returns at once; the
// allocation stays valid and can still be freed (cuda.h).
TEST_F(Conformance, PoolDestroyWithOutstandingAllocation) {
  ASSERT_CU(cu().cuInit(0));
  CUcontext ctx = nullptr;
  ASSERT_CU(cu().cuCtxCreate(&ctx, nullptr, 0, 0));
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool = nullptr;
  ASSERT_CU(cu().cuMemPoolCreate(&pool, &props));
  CUdeviceptr p = 0;
  ASSERT_CU(cu().cuMemAllocFromPoolAsync(&p, 4 * kMiB, pool, nullptr));
  ASSERT_CU(cu().cuStreamSynchronize(nullptr));
  ASSERT_CU(cu().cuMemPoolDestroy(pool));
  ASSERT_CU(cu().cuMemFreeAsync(p, nullptr));
  ASSERT_CU(cu().cuStreamSynchronize(nullptr));
}

}  // namespace
