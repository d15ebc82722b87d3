// Host-located VMM and pools (CU_MEM_LOCATION_TYPE_HOST / HOST_NUMA, CUDA
// 12.2+) hold no device memory; exported/imported VMM handles carry references
// like cuMemRetainAllocationHandle.
#include "common.h"

using namespace fakecuda_test;

namespace {

constexpr size_t kGranule = 2 * kMiB;

CUmemAllocationProp Prop(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  return prop;
}

TEST_F(FakeCuda, HostLocatedVmmHoldsNoDeviceMemory) {
  InitWithContext();
  for (CUmemLocationType type : {CU_MEM_LOCATION_TYPE_HOST, CU_MEM_LOCATION_TYPE_HOST_NUMA}) {
    CUmemAllocationProp prop = Prop(type, 0);
    CUmemGenericAllocationHandle handle = 0;
    ASSERT_CU(cuMemCreate(&handle, 4 * kGranule, &prop, 0));
    EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
    CUdeviceptr va = 0;
    ASSERT_CU(cuMemAddressReserve(&va, 4 * kGranule, 0, 0, 0));
    ASSERT_CU(cuMemMap(va, 4 * kGranule, 0, handle, 0));
    CUmemAllocationProp back{};
    ASSERT_CU(cuMemGetAllocationPropertiesFromHandle(&back, handle));
    EXPECT_EQ(back.location.type, type);
    ASSERT_CU(cuMemUnmap(va, 4 * kGranule));
    ASSERT_CU(cuMemRelease(handle));
    ASSERT_CU(cuMemAddressFree(va, 4 * kGranule));
  }
  CUmemAllocationProp bad = Prop(CU_MEM_LOCATION_TYPE_HOST_NUMA, -1);
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(cuMemCreate(&handle, kGranule, &bad, 0), CUDA_ERROR_INVALID_VALUE);
  // A device allocation still counts, for contrast.
  CUmemAllocationProp device = Prop(CU_MEM_LOCATION_TYPE_DEVICE, 0);
  ASSERT_CU(cuMemCreate(&handle, kGranule, &device, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), kGranule);
  ASSERT_CU(cuMemRelease(handle));
}

TEST_F(FakeCuda, HostLocatedPoolHoldsNoDeviceMemory) {
  InitWithContext();
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  props.location.id = 0;
  CUmemoryPool pool = nullptr;
  ASSERT_CU(cuMemPoolCreate(&pool, &props));
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAllocFromPoolAsync(&p, 8 * kMiB, pool, nullptr));
  EXPECT_NE(p, 0u);
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  // Not a device's pool: it cannot become a device's current pool.
  EXPECT_EQ(cuDeviceSetMemPool(0, pool), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFreeAsync(p, nullptr));
  ASSERT_CU(cuStreamSynchronize(nullptr));
  ASSERT_CU(cuMemPoolDestroy(pool));
}

TEST_F(FakeCuda, ExportedHandleImportsWithAReference) {
  InitWithContext();
  CUmemAllocationProp plain = Prop(CU_MEM_LOCATION_TYPE_DEVICE, 0);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU(cuMemCreate(&handle, kGranule, &plain, 0));
  int fd = -1;
  EXPECT_EQ(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_ERROR_INVALID_VALUE)
      << "not requested at creation";
  ASSERT_CU(cuMemRelease(handle));
  CUmemAllocationProp shareable = plain;
  shareable.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  ASSERT_CU(cuMemCreate(&handle, kGranule, &shareable, 0));
  ASSERT_CU(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  ASSERT_GE(fd, 0);
  CUmemGenericAllocationHandle imported = 0;
  ASSERT_CU(cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  EXPECT_EQ(imported, handle);
  ASSERT_CU(cuMemRelease(handle));
  EXPECT_EQ(fakecuda_device_used_bytes(0), kGranule) << "the import still holds a reference";
  ASSERT_CU(cuMemRelease(imported));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_EQ(cuMemRelease(imported), CUDA_ERROR_INVALID_VALUE);
}

}  // namespace
