// Legacy CUDA IPC (cuda.h, cuIpc*): handles, their errors, and the memory
// staying the exporter's when another process opens it.
#include "common.h"

using namespace fakecuda_test;

namespace {

TEST_F(FakeCuda, IpcHandlesRefuseWhatCudaHDoesNotAllow) {
  InitWithContext();
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 4 * kMiB));
  CUipcMemHandle handle{};
  EXPECT_EQ(cuIpcGetMemHandle(&handle, p + 512), CUDA_ERROR_INVALID_VALUE) << "not the base of an allocation";
  EXPECT_EQ(cuIpcGetMemHandle(nullptr, p), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuIpcGetMemHandle(&handle, p));
  CUdeviceptr opened = 0;
  EXPECT_EQ(cuIpcOpenMemHandle(&opened, handle, 0), CUDA_ERROR_INVALID_VALUE)
      << "flags must be LAZY_ENABLE_PEER_ACCESS";
  EXPECT_EQ(cuIpcOpenMemHandle(&opened, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_CONTEXT)
      << "opened in the exporting process";
  CUipcMemHandle garbage{};
  EXPECT_EQ(cuIpcOpenMemHandle(&opened, garbage, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(cuIpcCloseMemHandle(p), CUDA_ERROR_INVALID_VALUE) << "not an opened handle";
  CUevent timed = nullptr, shared = nullptr;
  ASSERT_CU(cuEventCreate(&timed, CU_EVENT_DEFAULT));
  CUipcEventHandle event_handle{};
  EXPECT_EQ(cuIpcGetEventHandle(&event_handle, timed), CUDA_ERROR_INVALID_VALUE) << "not CU_EVENT_INTERPROCESS";
  ASSERT_CU(cuEventCreate(&shared, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  ASSERT_CU(cuIpcGetEventHandle(&event_handle, shared));
  CUevent again = nullptr;
  EXPECT_EQ(cuIpcOpenEventHandle(&again, event_handle), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_CU(cuMemFree(p));
}

// Another process opens it: mapped there, charged to the exporter only.
// The child is forked before this process's cuInit (a child forked after it
// cannot use CUDA) and gets the handle through a pipe.
TEST_F(FakeCuda, IpcOpenedMemoryStaysTheExporters) {
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  const pid_t child = fork();
  if (child == 0) {
    CUipcMemHandle handle{};
    if (read(to_child[0], &handle, sizeof handle) != static_cast<ssize_t>(sizeof handle)) _exit(10);
    CUcontext ctx = nullptr;
    if (cuInit(0) != CUDA_SUCCESS || cuCtxCreate(&ctx, nullptr, 0, 0) != CUDA_SUCCESS) _exit(11);
    CUdeviceptr a = 0, b = 0;
    int results[6] = {cuIpcOpenMemHandle(&a, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                      cuIpcOpenMemHandle(&b, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                      a == b && a != 0,
                      static_cast<int>(fakecuda_process_used_bytes(0, getpid()) / kMiB),
                      cuMemFree(a),
                      0};
    results[5] = cuIpcCloseMemHandle(a) | cuIpcCloseMemHandle(a) << 8 | cuIpcCloseMemHandle(a) << 16;
    if (write(from_child[1], results, sizeof results) != static_cast<ssize_t>(sizeof results)) _exit(12);
    _exit(0);
  }
  InitWithContext();
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAlloc(&p, 64 * kMiB));
  CUipcMemHandle handle{};
  ASSERT_CU(cuIpcGetMemHandle(&handle, p));
  ASSERT_EQ(write(to_child[1], &handle, sizeof handle), static_cast<ssize_t>(sizeof handle));
  int results[6] = {};
  ASSERT_EQ(read(from_child[0], results, sizeof results), static_cast<ssize_t>(sizeof results));
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(results[0], CUDA_SUCCESS) << "open";
  EXPECT_EQ(results[1], CUDA_SUCCESS) << "opened again by the same context";
  EXPECT_EQ(results[2], 1) << "the same pointer, one more reference";
  EXPECT_EQ(results[3], 0) << "MiB the importer holds";
  EXPECT_EQ(results[4], CUDA_ERROR_INVALID_VALUE) << "cuMemFree of an opened pointer";
  EXPECT_EQ(results[5], CUDA_SUCCESS | CUDA_SUCCESS << 8 | CUDA_ERROR_INVALID_VALUE << 16)
      << "two references, then none";
  EXPECT_EQ(fakecuda_device_used_bytes(0), 64 * kMiB);
  EXPECT_CU(cuMemFree(p));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

}  // namespace
