// Driver semantics the simulator must share with the real driver (issue 9's
// "simulated driver" list, issue 14's address reuse): exit-time teardown,
// reused device addresses, where a launch runs when the stream is another
// device's or no context is current.
#include "common.h"

using namespace fakecuda_test;

namespace {

constexpr const char* kImage = ".entry spin_1000us\n";

// cuMemFree's range is handed out again, as the real driver does.
TEST_F(FakeCuda, FreedAddressesAreReused) {
  InitWithContext();
  CUdeviceptr a = 0, b = 0, c = 0;
  ASSERT_CU(cuMemAlloc(&a, 1 * kMiB));
  ASSERT_CU(cuMemFree(a));
  ASSERT_CU(cuMemAlloc(&b, 1 * kMiB));
  EXPECT_EQ(b, a) << "same size right after a free: same address";
  ASSERT_CU(cuMemFree(b));
  // A smaller allocation fits in the freed range; the rest stays usable.
  ASSERT_CU(cuMemAlloc(&c, 256 * 1024));
  EXPECT_EQ(c, a);
  CUdeviceptr d = 0;
  ASSERT_CU(cuMemAlloc(&d, 512 * 1024));
  EXPECT_EQ(d, a + 256 * 1024);
  // A reused address is a new allocation: its size is the new one.
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_CU(cuMemGetAddressRange(&base, &size, d));
  EXPECT_EQ(size, 512u * 1024);
  ASSERT_CU(cuMemFree(c));
  ASSERT_CU(cuMemFree(d));
  EXPECT_EQ(cuMemFree(d), CUDA_ERROR_INVALID_VALUE) << "a double free is still refused";
}

// After the driver's exit-time teardown, a call from a later destructor gets
// CUDA_ERROR_DEINITIALIZED ("driver shutting down") and nothing crashes (it
// crashed on the context stack's destroyed thread-local storage before).
TEST_F(FakeCuda, CallsAfterTeardownReturnDeinitialized) {
  ASSERT_CU(cuInit(0));
  Child child = Child::Spawn({"teardown", std::to_string(kMiB), "0"});
  EXPECT_EQ(child.ReadLine(), "ready");
  EXPECT_EQ(child.ReadLine(), "late " + std::to_string(CUDA_ERROR_DEINITIALIZED));
  EXPECT_EQ(child.Wait(), 0);
  // Teardown freed the child's context: nothing is left on the device.
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

// A CUkernel launched as a CUfunction runs in the stream's context (cuda.h,
// cuLaunchKernel): on device 1 for a device-1 stream while device 0's context
// is current, and with no current context at all.
TEST_F(FakeCuda, KernelHandleLaunchRunsOnTheStreamsDevice) {
  ASSERT_CU(cuInit(0));
  CUcontext ctx0 = nullptr, ctx1 = nullptr;
  ASSERT_CU(cuCtxCreate(&ctx1, nullptr, 0, 1));
  CUstream s1 = nullptr;
  ASSERT_CU(cuStreamCreate(&s1, 0));
  ASSERT_CU(cuCtxCreate(&ctx0, nullptr, 0, 0));
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadData(&library, kImage, nullptr, nullptr, 0, nullptr, nullptr, 0));
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "spin_1000us"));
  auto f = reinterpret_cast<CUfunction>(kernel);
  std::uint64_t t0 = fakecuda_now_ns();
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s1, nullptr, nullptr));
  // Empty the thread's context stack (cuCtxSetCurrent(NULL) only pops its top).
  CUcontext popped = nullptr;
  while (cuCtxPopCurrent(&popped) == CUDA_SUCCESS) {}
  ASSERT_EQ(cuCtxGetCurrent(&popped), CUDA_SUCCESS);
  ASSERT_EQ(popped, nullptr);
  ASSERT_CU(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s1, nullptr, nullptr));
  // NULL stream with no current context: there is no context to run in.
  EXPECT_EQ(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr), CUDA_ERROR_INVALID_CONTEXT);
  ASSERT_CU(cuStreamSynchronize(s1));
  EXPECT_GE(fakecuda_busy_ns(1, 0, t0, fakecuda_now_ns()), 2000000u);
  EXPECT_EQ(fakecuda_busy_ns(0, 0, t0, fakecuda_now_ns()), 0u);
}

// A CUfunction belongs to the context its module was loaded in: launching it
// into another context's stream is refused.
TEST_F(FakeCuda, FunctionOfAnotherContextIsRefused) {
  ASSERT_CU(cuInit(0));
  CUcontext ctx0 = nullptr, ctx1 = nullptr;
  ASSERT_CU(cuCtxCreate(&ctx1, nullptr, 0, 1));
  CUstream s1 = nullptr;
  ASSERT_CU(cuStreamCreate(&s1, 0));
  ASSERT_CU(cuCtxCreate(&ctx0, nullptr, 0, 0));
  CUmodule module = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, kImage));
  CUfunction f = nullptr;
  ASSERT_CU(cuModuleGetFunction(&f, module, "spin_1000us"));
  EXPECT_EQ(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s1, nullptr, nullptr), CUDA_ERROR_INVALID_HANDLE);
}

// CUDA 12's loading path from a file (cuLibraryLoadFromFile), then
// cuLibraryGetKernel / cuKernelGetFunction, as the CUDA 12+ runtime does.
TEST_F(FakeCuda, LibraryLoadsFromAFile) {
  InitWithContext();
  char path[] = "/tmp/fakecuda-library-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, kImage, strlen(kImage)), static_cast<ssize_t>(strlen(kImage)));
  close(fd);
  CUlibrary library = nullptr;
  ASSERT_CU(cuLibraryLoadFromFile(&library, path, nullptr, nullptr, 0, nullptr, nullptr, 0));
  unlink(path);
  CUkernel kernel = nullptr;
  ASSERT_CU(cuLibraryGetKernel(&kernel, library, "spin_1000us"));
  CUfunction function = nullptr;
  ASSERT_CU(cuKernelGetFunction(&function, kernel));
  EXPECT_CU(cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, nullptr));
  EXPECT_CU(cuCtxSynchronize());
  EXPECT_EQ(cuLibraryLoadFromFile(&library, "/nonexistent/lib", nullptr, nullptr, 0, nullptr, nullptr, 0),
            CUDA_ERROR_FILE_NOT_FOUND);
}

}  // namespace
