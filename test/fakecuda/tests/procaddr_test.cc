// cuGetProcAddress resolution: versions, stream-variant flags, failures.
#include "common.h"

using namespace fakecuda_test;

namespace {

void* Sym(const char* name) {
  static void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return dlsym(lib, name);
}

void* Resolve(const char* name, int version, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT,
              CUresult expected = CUDA_SUCCESS,
              CUdriverProcAddressQueryResult expected_status = CU_GET_PROC_ADDRESS_SUCCESS) {
  void* fn = reinterpret_cast<void*>(0x1);
  CUdriverProcAddressQueryResult status = static_cast<CUdriverProcAddressQueryResult>(-1);
  EXPECT_EQ(cuGetProcAddress(name, &fn, version, flags, &status), expected) << name << "@" << version;
  EXPECT_EQ(status, expected_status) << name << "@" << version;
  return fn;
}

TEST_F(FakeCuda, ResolvesNewestVersionNotAboveRequest) {
  // No cuInit needed: the runtime resolves cuInit itself this way.
  EXPECT_EQ(Resolve("cuMemAlloc", 2000), Sym("cuMemAlloc"));
  EXPECT_EQ(Resolve("cuMemAlloc", 3020), Sym("cuMemAlloc_v2"));
  EXPECT_EQ(Resolve("cuMemAlloc", 13000), Sym("cuMemAlloc_v2"));
  EXPECT_EQ(Resolve("cuGetProcAddress", 11030), Sym("cuGetProcAddress"));
  EXPECT_EQ(Resolve("cuGetProcAddress", 12000), Sym("cuGetProcAddress_v2"));
  EXPECT_EQ(Resolve("cuCtxCreate", 11040), Sym("cuCtxCreate_v3"));
  EXPECT_EQ(Resolve("cuCtxCreate", 12050), Sym("cuCtxCreate_v4"));
  EXPECT_EQ(Resolve("cuCtxCreate", 12000), Sym("cuCtxCreate_v3"));
  EXPECT_EQ(Resolve("cuDevicePrimaryCtxRelease", 11000), Sym("cuDevicePrimaryCtxRelease_v2"));
  EXPECT_EQ(Resolve("cuGraphAddKernelNode", 10000), Sym("cuGraphAddKernelNode"));
  EXPECT_EQ(Resolve("cuGraphAddKernelNode", 12000), Sym("cuGraphAddKernelNode_v2"));
  EXPECT_EQ(Resolve("cuGraphInstantiate", 11000), Sym("cuGraphInstantiate_v2"));
  EXPECT_EQ(Resolve("cuGraphInstantiate", 12000), Sym("cuGraphInstantiateWithFlags"));
  EXPECT_EQ(Resolve("cuEventElapsedTime", 12080), Sym("cuEventElapsedTime_v2"));
  EXPECT_EQ(Resolve("cuInit", 2000), Sym("cuInit"));
  // The pointer handed out is the library's own, never an interposer's.
  EXPECT_EQ(Resolve("cuMemAlloc", 3020), reinterpret_cast<void*>(&cuMemAlloc_v2));
}

TEST_F(FakeCuda, FlagsSelectStreamVariants) {
  const auto pt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  EXPECT_EQ(Resolve("cuLaunchKernel", 12000, pt), Sym("cuLaunchKernel_ptsz"));
  EXPECT_EQ(Resolve("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_DEFAULT), Sym("cuLaunchKernel"));
  EXPECT_EQ(Resolve("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM), Sym("cuLaunchKernel"));
  EXPECT_EQ(Resolve("cuLaunchKernel", 4000, pt), Sym("cuLaunchKernel"));  // no _ptsz before 7.0
  EXPECT_EQ(Resolve("cuMemAllocAsync", 11020, pt), Sym("cuMemAllocAsync_ptsz"));
  EXPECT_EQ(Resolve("cuStreamBeginCapture", 10000, pt), Sym("cuStreamBeginCapture_ptsz"));
  EXPECT_EQ(Resolve("cuStreamBeginCapture", 10010, pt), Sym("cuStreamBeginCapture_v2_ptsz"));
  EXPECT_EQ(Resolve("cuGraphLaunch", 12000, pt), Sym("cuGraphLaunch_ptsz"));
  EXPECT_EQ(Resolve("cuMemAlloc", 12000, pt), Sym("cuMemAlloc_v2"));  // no stream: no variant
  EXPECT_EQ(Resolve("cuMemcpyHtoD", 7000, pt), Sym("cuMemcpyHtoD_v2_ptds"));
  // An entry point the simulator does not model (copies into CUDA arrays, which
  // hold no bytes) exists and answers NOT_SUPPORTED.
  void* to_array_ptds = Resolve("cuMemcpyHtoA", 7000, pt);
  EXPECT_EQ(to_array_ptds, Sym("cuMemcpyHtoA_v2_ptds"));
  EXPECT_EQ(fakecuda_symbol_is_stub(to_array_ptds), 1);
  auto copy = reinterpret_cast<CUresult (*)(CUarray, size_t, const void*, size_t)>(to_array_ptds);
  EXPECT_EQ(copy(nullptr, 0, nullptr, 0), CUDA_ERROR_NOT_SUPPORTED);
}

TEST_F(FakeCuda, FailuresReportWhy) {
  EXPECT_EQ(Resolve("cuMemAllocAsync", 11010, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT),
            nullptr);
  EXPECT_EQ(Resolve("cuNoSuchFunction", 13000, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND), nullptr);
  EXPECT_EQ(Resolve("", 0, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND), nullptr);
  EXPECT_EQ(Resolve("cuMemAlloc_v2", 13000, 0, CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND), nullptr);
  void* fn = nullptr;
  EXPECT_EQ(cuGetProcAddress("cuInit", &fn, 13000, 4, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuGetProcAddress(nullptr, &fn, 13000, 0, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuGetProcAddress("cuInit", nullptr, 13000, 0, nullptr), CUDA_ERROR_INVALID_VALUE);
  // The legacy (11.3) entry point has no status argument.
  auto legacy = reinterpret_cast<PFN_cuGetProcAddress_v11030>(Sym("cuGetProcAddress"));
  EXPECT_CU(legacy("cuMemFree", &fn, 3020, 0));
  EXPECT_EQ(fn, Sym("cuMemFree_v2"));
  EXPECT_EQ(legacy("cuMemFree", &fn, 1000, 0), CUDA_ERROR_NOT_FOUND);
  const void* table = nullptr;
  CUuuid id{};
  EXPECT_EQ(cuGetExportTable(&table, &id), CUDA_ERROR_NOT_SUPPORTED);
}

TEST_F(FakeCuda, ModelledEntryPointsAreNotStubs) {
  for (const char* name : {"cuInit",
                           "cuDriverGetVersion",
                           "cuDeviceGet",
                           "cuDeviceGetCount",
                           "cuDeviceGetName",
                           "cuDeviceGetUuid",
                           "cuDeviceGetUuid_v2",
                           "cuDeviceGetAttribute",
                           "cuDeviceTotalMem",
                           "cuDeviceTotalMem_v2",
                           "cuDevicePrimaryCtxRetain",
                           "cuDevicePrimaryCtxRelease_v2",
                           "cuDevicePrimaryCtxReset_v2",
                           "cuDevicePrimaryCtxGetState",
                           "cuDevicePrimaryCtxSetFlags_v2",
                           "cuCtxCreate",
                           "cuCtxCreate_v2",
                           "cuCtxCreate_v3",
                           "cuCtxCreate_v4",
                           "cuCtxDestroy_v2",
                           "cuCtxGetCurrent",
                           "cuCtxSetCurrent",
                           "cuCtxPushCurrent_v2",
                           "cuCtxPopCurrent_v2",
                           "cuCtxGetDevice",
                           "cuCtxSynchronize",
                           "cuCtxGetApiVersion",
                           "cuMemGetInfo",
                           "cuMemGetInfo_v2",
                           "cuMemAlloc",
                           "cuMemAlloc_v2",
                           "cuMemAllocPitch_v2",
                           "cuMemAllocManaged",
                           "cuMemFree_v2",
                           "cuMemGetAddressRange_v2",
                           "cuMemAllocAsync",
                           "cuMemAllocAsync_ptsz",
                           "cuMemFreeAsync",
                           "cuMemFreeAsync_ptsz",
                           "cuMemAllocFromPoolAsync",
                           "cuMemAllocFromPoolAsync_ptsz",
                           "cuMemPoolCreate",
                           "cuMemPoolDestroy",
                           "cuDeviceGetDefaultMemPool",
                           "cuDeviceGetMemPool",
                           "cuDeviceSetMemPool",
                           "cuMemPoolTrimTo",
                           "cuMemPoolSetAttribute",
                           "cuMemPoolGetAttribute",
                           "cuMemCreate",
                           "cuMemRelease",
                           "cuMemAddressReserve",
                           "cuMemAddressFree",
                           "cuMemMap",
                           "cuMemUnmap",
                           "cuMemSetAccess",
                           "cuMemGetAllocationGranularity",
                           "cuMemGetAllocationPropertiesFromHandle",
                           "cuArrayCreate_v2",
                           "cuArray3DCreate_v2",
                           "cuArrayDestroy",
                           "cuArrayGetDescriptor_v2",
                           "cuArray3DGetDescriptor_v2",
                           "cuMipmappedArrayCreate",
                           "cuMipmappedArrayDestroy",
                           "cuModuleLoadData",
                           "cuModuleLoad",
                           "cuModuleUnload",
                           "cuModuleGetFunction",
                           "cuFuncGetName",
                           "cuFuncGetAttribute",
                           "cuLibraryLoadData",
                           "cuLibraryGetKernel",
                           "cuKernelGetFunction",
                           "cuStreamCreate",
                           "cuStreamCreateWithPriority",
                           "cuStreamDestroy_v2",
                           "cuStreamSynchronize",
                           "cuStreamSynchronize_ptsz",
                           "cuStreamQuery",
                           "cuStreamQuery_ptsz",
                           "cuStreamWaitEvent",
                           "cuEventCreate",
                           "cuEventRecord",
                           "cuEventRecord_ptsz",
                           "cuEventRecordWithFlags",
                           "cuEventSynchronize",
                           "cuEventQuery",
                           "cuEventElapsedTime",
                           "cuEventElapsedTime_v2",
                           "cuEventDestroy_v2",
                           "cuLaunchKernel",
                           "cuLaunchKernel_ptsz",
                           "cuLaunchKernelEx",
                           "cuLaunchKernelEx_ptsz",
                           "cuLaunchCooperativeKernel",
                           "cuLaunchCooperativeKernel_ptsz",
                           "cuGraphCreate",
                           "cuGraphAddKernelNode",
                           "cuGraphAddKernelNode_v2",
                           "cuGraphGetNodes",
                           "cuGraphNodeGetType",
                           "cuGraphKernelNodeGetParams",
                           "cuGraphKernelNodeGetParams_v2",
                           "cuGraphInstantiateWithFlags",
                           "cuGraphInstantiate",
                           "cuGraphInstantiate_v2",
                           "cuGraphInstantiateWithParams",
                           "cuGraphInstantiateWithParams_ptsz",
                           "cuGraphLaunch",
                           "cuGraphLaunch_ptsz",
                           "cuGraphExecDestroy",
                           "cuGraphDestroy",
                           "cuStreamBeginCapture",
                           "cuStreamBeginCapture_v2",
                           "cuStreamBeginCapture_ptsz",
                           "cuStreamBeginCapture_v2_ptsz",
                           "cuStreamEndCapture",
                           "cuStreamEndCapture_ptsz",
                           "cuStreamIsCapturing",
                           "cuStreamIsCapturing_ptsz",
                           "cuGetErrorName",
                           "cuGetErrorString",
                           "cuGetProcAddress",
                           "cuGetProcAddress_v2",
                           "cuGetExportTable"}) {
    void* fn = Sym(name);
    ASSERT_NE(fn, nullptr) << name;
    EXPECT_EQ(fakecuda_symbol_is_stub(fn), 0) << name;
  }
}

}  // namespace
