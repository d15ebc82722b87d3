// External memory and semaphores over the simulated graphics allocator
// (interop.cc): graphics memory is the process's on the device (NVML too),
// an import adds nothing, a mapped buffer is freed with cuMemFree and adds
// nothing, the bytes leave the device when neither the graphics API nor an
// import holds them; what the documentation leaves open is refused.
#include "common.h"
#include "nvml_abi.h"

using namespace fakecuda_test;

namespace {

CUDA_EXTERNAL_MEMORY_HANDLE_DESC OpaqueFd(int fd, unsigned long long size) {
  CUDA_EXTERNAL_MEMORY_HANDLE_DESC d{};
  d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
  d.handle.fd = fd;
  d.size = size;
  return d;
}

TEST_F(FakeCuda, GraphicsMemoryIsTheProcesssAndImportsAddNothing) {
  InitWithContext();
  const uint64_t gfx = fakecuda_graphics_alloc(0, 64 * kMiB);
  ASSERT_NE(gfx, 0u);
  EXPECT_EQ(fakecuda_process_used_bytes(0, 0), 64 * kMiB);
  EXPECT_EQ(fakecuda_device_used_bytes(0), 64 * kMiB);
  const int fd = fakecuda_graphics_export_fd(gfx);
  ASSERT_GE(fd, 0);
  CUDA_EXTERNAL_MEMORY_HANDLE_DESC d = OpaqueFd(fd, 64 * kMiB);
  CUexternalMemory ext = nullptr;
  ASSERT_CU(cuImportExternalMemory(&ext, &d));
  EXPECT_EQ(fcntl(fd, F_GETFD), -1) << "the driver owns (and closed) the descriptor";
  CUDA_EXTERNAL_MEMORY_BUFFER_DESC b{};
  b.offset = 16 * kMiB;
  b.size = 48 * kMiB;
  CUdeviceptr p = 0;
  ASSERT_CU(cuExternalMemoryGetMappedBuffer(&p, ext, &b));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 64 * kMiB);
  ASSERT_CU(cuMemsetD8(p, 7, 48 * kMiB));
  // The graphics API frees first: the import keeps the memory on the device.
  ASSERT_EQ(fakecuda_graphics_free(gfx), 0);
  EXPECT_EQ(fakecuda_device_used_bytes(0), 64 * kMiB);
  ASSERT_CU(cuMemFree(p));
  EXPECT_EQ(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuDestroyExternalMemory(ext));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_EQ(cuDestroyExternalMemory(ext), CUDA_ERROR_INVALID_HANDLE);
}

// NVML: graphics memory is in the process's figure, and the process is
// listed with a graphics context while it holds graphics allocations.
TEST_F(FakeCuda, NvmlListsAProcessWithGraphicsMemoryAsAGraphicsProcess) {
  InitWithContext();
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  nvmlProcessInfo_t infos[8]{};
  unsigned int n = 8;
  ASSERT_EQ(nvmlDeviceGetGraphicsRunningProcesses_v3(dev, &n, infos), NVML_SUCCESS);
  EXPECT_EQ(n, 0u);
  const uint64_t gfx = fakecuda_graphics_alloc(0, 32 * kMiB);
  ASSERT_NE(gfx, 0u);
  n = 8;
  ASSERT_EQ(nvmlDeviceGetGraphicsRunningProcesses_v3(dev, &n, infos), NVML_SUCCESS);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(infos[0].usedGpuMemory, 32 * kMiB);
  n = 8;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, infos), NVML_SUCCESS);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(infos[0].usedGpuMemory, 32 * kMiB) << "all of the memory used by the application";
  ASSERT_EQ(fakecuda_graphics_free(gfx), 0);
  n = 8;
  ASSERT_EQ(nvmlDeviceGetGraphicsRunningProcesses_v3(dev, &n, infos), NVML_SUCCESS);
  EXPECT_EQ(n, 0u);
}

TEST_F(FakeCuda, ExternalMemoryRefusesWhatIsNotModelled) {
  InitWithContext();
  const uint64_t gfx = fakecuda_graphics_alloc(0, 8 * kMiB);
  ASSERT_NE(gfx, 0u);
  CUexternalMemory ext = nullptr;
  EXPECT_EQ(cuImportExternalMemory(nullptr, nullptr), CUDA_ERROR_INVALID_VALUE);
  CUDA_EXTERNAL_MEMORY_HANDLE_DESC d = OpaqueFd(fakecuda_graphics_export_fd(gfx), 16 * kMiB);
  EXPECT_EQ(cuImportExternalMemory(&ext, &d), CUDA_ERROR_INVALID_VALUE) << "larger than the memory object";
  d.size = 8 * kMiB;
  d.flags = 0x10;
  EXPECT_EQ(cuImportExternalMemory(&ext, &d), CUDA_ERROR_INVALID_VALUE);
  d.flags = 0;
  d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_WIN32;
  EXPECT_EQ(cuImportExternalMemory(&ext, &d), CUDA_ERROR_NOT_SUPPORTED);
  d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
  const int other = open("/dev/null", O_RDONLY | O_CLOEXEC);
  CUDA_EXTERNAL_MEMORY_HANDLE_DESC not_memory = OpaqueFd(other, 8 * kMiB);
  EXPECT_EQ(cuImportExternalMemory(&ext, &not_memory), CUDA_ERROR_INVALID_HANDLE);
  close(other);
  ASSERT_CU(cuImportExternalMemory(&ext, &d));
  CUDA_EXTERNAL_MEMORY_BUFFER_DESC b{};
  b.offset = 4 * kMiB;
  b.size = 8 * kMiB;
  CUdeviceptr p = 0;
  EXPECT_EQ(cuExternalMemoryGetMappedBuffer(&p, ext, &b), CUDA_ERROR_INVALID_VALUE) << "past the end";
  CUmipmappedArray mip = nullptr;
  CUDA_EXTERNAL_MEMORY_MIPMAPPED_ARRAY_DESC m{};
  EXPECT_EQ(cuExternalMemoryGetMappedMipmappedArray(&mip, ext, &m), CUDA_ERROR_NOT_SUPPORTED);
  ASSERT_CU(cuDestroyExternalMemory(ext));
  ASSERT_EQ(fakecuda_graphics_free(gfx), 0);
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

TEST_F(FakeCuda, ExternalSemaphoresSignalThenWait) {
  InitWithContext();
  CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC d{};
  d.type = CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD;
  d.handle.fd = fakecuda_graphics_semaphore();
  CUexternalSemaphore sem = nullptr;
  ASSERT_CU(cuImportExternalSemaphore(&sem, &d));
  CUDA_EXTERNAL_SEMAPHORE_SIGNAL_PARAMS sp{};
  CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS wp{};
  EXPECT_EQ(cuWaitExternalSemaphoresAsync(&sem, &wp, 1, nullptr), CUDA_ERROR_NOT_SUPPORTED)
      << "nothing would ever signal it";
  ASSERT_CU(cuSignalExternalSemaphoresAsync(&sem, &sp, 1, nullptr));
  ASSERT_CU(cuWaitExternalSemaphoresAsync(&sem, &wp, 1, nullptr));
  EXPECT_EQ(cuSignalExternalSemaphoresAsync(nullptr, &sp, 1, nullptr), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuDestroyExternalSemaphore(sem));
  EXPECT_EQ(cuDestroyExternalSemaphore(sem), CUDA_ERROR_INVALID_HANDLE);
}

}  // namespace
