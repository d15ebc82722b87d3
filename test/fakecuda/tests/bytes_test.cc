// The simulator keeps bytes: copies and sets over device, managed, pool, VMM
// and page-locked host memory, sparse until touched; pointer attributes.
#include <sys/resource.h>
#include <time.h>

#include <array>
#include <numeric>

#include "common.h"

using namespace fakecuda_test;

namespace {

std::vector<unsigned char> Pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) & 0xFF);
  return v;
}

long ResidentKiB() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

double NowMs() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

TEST_F(FakeCuda, DeviceMemoryKeepsWhatIsCopiedAndSet) {
  InitWithContext();
  const size_t n = kMiB;
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(cuMemAlloc(&a, n));
  ASSERT_CU(cuMemAlloc(&b, n));
  std::vector<unsigned char> in = Pattern(n, 7), out(n, 0);
  ASSERT_CU(cuMemcpyHtoD(a, in.data(), n));
  ASSERT_CU(cuMemcpyDtoD(b, a, n));
  ASSERT_CU(cuMemcpyDtoH(out.data(), b, n));
  EXPECT_EQ(in, out);
  // Unified cuMemcpy infers each side from the pointer.
  std::vector<unsigned char> back(n, 0);
  ASSERT_CU(cuMemcpy(reinterpret_cast<CUdeviceptr>(back.data()), a, n));
  EXPECT_EQ(in, back);
  // Interior pointers and sets of every width.
  ASSERT_CU(cuMemsetD8(a + 1, 0xAB, 3));
  ASSERT_CU(cuMemsetD16(a + 4, 0x1234, 2));
  ASSERT_CU(cuMemsetD32(a + 8, 0xDEADBEEF, 1));
  std::array<unsigned char, 12> head{};
  ASSERT_CU(cuMemcpyDtoH(head.data(), a, head.size()));
  const std::array<unsigned char, 12> want = {in[0], 0xAB, 0xAB, 0xAB, 0x34, 0x12, 0x34, 0x12, 0xEF, 0xBE, 0xAD, 0xDE};
  EXPECT_EQ(head, want);
  // Misaligned 16/32-bit sets, ranges past the allocation, non-device
  // destinations and freed memory are errors, as on the driver.
  EXPECT_EQ(cuMemsetD16(a + 1, 1, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemsetD32(a + 2, 1, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemcpyHtoD(a + n - 4, in.data(), 8), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemcpyDtoH(out.data(), b + 1, n), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(out.data()), in.data(), 8), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFree(b));
  EXPECT_EQ(cuMemcpyDtoH(out.data(), b, 8), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFree(a));
}

TEST_F(FakeCuda, LargeAllocationsCostNothingUntilTouched) {
  setenv("FAKECUDA_MEMORY", "64Gi", 1);
  InitWithContext();
  const long before = ResidentKiB();
  std::vector<CUdeviceptr> blocks(4);
  for (CUdeviceptr& p : blocks) ASSERT_CU(cuMemAlloc(&p, 8ull << 30));
  for (size_t i = 0; i < blocks.size(); ++i) {
    const unsigned value = 0x01020304u * static_cast<unsigned>(i + 1);
    ASSERT_CU(cuMemsetD32(blocks[i] + (8ull << 30) - 4, value, 1));
    ASSERT_CU(cuMemsetD32(blocks[i], value + 1, 1));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    unsigned last = 0, first = 0;
    ASSERT_CU(cuMemcpyDtoH(&last, blocks[i] + (8ull << 30) - 4, 4));
    ASSERT_CU(cuMemcpyDtoH(&first, blocks[i], 4));
    EXPECT_EQ(last, 0x01020304u * static_cast<unsigned>(i + 1));
    EXPECT_EQ(first, last + 1);
  }
  // 32 GiB allocated and touched at both ends: a few pages resident.
  EXPECT_LT(ResidentKiB() - before, 16 * 1024);
  for (CUdeviceptr p : blocks) ASSERT_CU(cuMemFree(p));
}

TEST_F(FakeCuda, ManagedMemoryIsHostAccessible) {
  InitWithContext();
  CUdeviceptr m = 0;
  ASSERT_CU(cuMemAllocManaged(&m, 4096, CU_MEM_ATTACH_GLOBAL));
  EXPECT_LT(m, 1ull << 44);  // below every device window
  auto* host = reinterpret_cast<unsigned*>(m);
  for (unsigned i = 0; i < 1024; ++i) host[i] = i;
  std::vector<unsigned> out(1024);
  ASSERT_CU(cuMemcpyDtoH(out.data(), m, 4096));
  for (unsigned i = 0; i < 1024; ++i) ASSERT_EQ(out[i], i);
  ASSERT_CU(cuMemsetD32(m, 7, 1024));
  EXPECT_EQ(host[1023], 7u);
  int managed = 0;
  void* host_ptr = nullptr;
  ASSERT_CU(cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, m));
  ASSERT_CU(cuPointerGetAttribute(&host_ptr, CU_POINTER_ATTRIBUTE_HOST_POINTER, m + 8));
  EXPECT_EQ(managed, 1);
  EXPECT_EQ(host_ptr, reinterpret_cast<void*>(m + 8));
  CUmemLocation device0{};
  device0.type = CU_MEM_LOCATION_TYPE_DEVICE;
  ASSERT_CU(cuMemPrefetchAsync(m, 4096, device0, 0, nullptr));
  EXPECT_EQ(cuMemPrefetchAsync(m, 8192, device0, 0, nullptr), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFree(m));
  EXPECT_EQ(cuPointerGetAttribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, m), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, StreamOrderedCopiesPoolsAndPeers) {
  CUcontext ctx0 = nullptr;
  InitWithContext(&ctx0);
  CUstream stream = nullptr;
  ASSERT_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUdeviceptr pooled = 0;
  ASSERT_CU(cuMemAllocAsync(&pooled, 4096, stream));
  std::vector<unsigned char> in = Pattern(4096, 3), out(4096);
  ASSERT_CU(cuMemcpyHtoDAsync(pooled, in.data(), 4096, stream));
  ASSERT_CU(cuMemsetD8Async(pooled + 4000, 0x5A, 96, stream));
  ASSERT_CU(cuMemcpyDtoHAsync(out.data(), pooled, 4096, stream));
  ASSERT_CU(cuStreamSynchronize(stream));
  std::fill(in.begin() + 4000, in.end(), 0x5A);
  EXPECT_EQ(in, out);
  // A peer copy into device 1.
  CUcontext ctx1 = nullptr;
  ASSERT_CU(cuCtxCreate(&ctx1, nullptr, 0, 1));
  CUdeviceptr remote = 0;
  ASSERT_CU(cuMemAlloc(&remote, 4096));
  ASSERT_CU(cuMemcpyPeer(remote, ctx1, pooled, ctx0, 4096));
  std::vector<unsigned char> peer(4096);
  ASSERT_CU(cuMemcpyDtoH(peer.data(), remote, 4096));
  EXPECT_EQ(in, peer);
  EXPECT_EQ(cuMemcpyPeer(remote, nullptr, pooled, ctx0, 4096), CUDA_ERROR_INVALID_CONTEXT);
  ASSERT_CU(cuCtxSetCurrent(ctx0));
  ASSERT_CU(cuMemFreeAsync(pooled, stream));
  ASSERT_CU(cuStreamSynchronize(stream));
}

TEST_F(FakeCuda, PitchedAnd3DCopies) {
  InitWithContext();
  CUdeviceptr pitched = 0;
  size_t pitch = 0;
  ASSERT_CU(cuMemAllocPitch(&pitched, &pitch, 100, 8, 4));
  ASSERT_EQ(pitch, 512u);
  std::vector<unsigned char> host(100 * 8);
  std::iota(host.begin(), host.end(), 0);
  CUDA_MEMCPY2D up{};
  up.srcMemoryType = CU_MEMORYTYPE_HOST;
  up.srcHost = host.data();
  up.srcPitch = 100;
  up.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  up.dstDevice = pitched;
  up.dstPitch = pitch;
  up.WidthInBytes = 100;
  up.Height = 8;
  ASSERT_CU(cuMemcpy2D(&up));
  unsigned char row3 = 0;
  ASSERT_CU(cuMemcpyDtoH(&row3, pitched + 3 * pitch + 5, 1));
  EXPECT_EQ(row3, static_cast<unsigned char>(3 * 100 + 5));
  ASSERT_CU(cuMemsetD2D8(pitched + 10, pitch, 0xEE, 4, 8));
  // 3D: a 4x2x2 box from offset (10, 1, 0) of the pitched block (height 4 per slice).
  std::vector<unsigned char> box(4 * 2 * 2, 0);
  CUDA_MEMCPY3D down{};
  down.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  down.srcDevice = pitched;
  down.srcPitch = pitch;
  down.srcHeight = 4;
  down.srcXInBytes = 10;
  down.srcY = 1;
  down.dstMemoryType = CU_MEMORYTYPE_HOST;
  down.dstHost = box.data();
  down.dstPitch = 4;
  down.dstHeight = 2;
  down.WidthInBytes = 4;
  down.Height = 2;
  down.Depth = 2;
  ASSERT_CU(cuMemcpy3D(&down));
  for (unsigned char c : box) EXPECT_EQ(c, 0xEE);
  down.srcXInBytes = 14;  // just right of the set columns: the uploaded bytes
  ASSERT_CU(cuMemcpy3D(&down));
  EXPECT_EQ(box[0], static_cast<unsigned char>(1 * 100 + 14));
  EXPECT_EQ(box[8], static_cast<unsigned char>(5 * 100 + 14));  // slice 1 starts at row 4, +1
  down.srcPitch = 8;                                            // narrower than the row it addresses
  EXPECT_EQ(cuMemcpy3D(&down), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, VmmMappingsOfOneAllocationShareBytes) {
  InitWithContext();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU(cuMemCreate(&handle, 4 * kMiB, &prop, 0));
  CUdeviceptr va = 0;
  ASSERT_CU(cuMemAddressReserve(&va, 8 * kMiB, 0, 0, 0));
  ASSERT_CU(cuMemMap(va, 4 * kMiB, 0, handle, 0));
  ASSERT_CU(cuMemMap(va + 4 * kMiB, 2 * kMiB, 2 * kMiB, handle, 0));  // second half again
  ASSERT_CU(cuMemsetD32(va + 2 * kMiB + 64, 0xCAFEF00D, 1));
  unsigned seen = 0;
  ASSERT_CU(cuMemcpyDtoH(&seen, va + 4 * kMiB + 64, 4));
  EXPECT_EQ(seen, 0xCAFEF00Du);
  EXPECT_EQ(cuMemcpyDtoH(&seen, va + 6 * kMiB, 4), CUDA_ERROR_INVALID_VALUE);  // reserved, unmapped
  ASSERT_CU(cuMemUnmap(va, 4 * kMiB));
  ASSERT_CU(cuMemUnmap(va + 4 * kMiB, 2 * kMiB));
  ASSERT_CU(cuMemRelease(handle));
  ASSERT_CU(cuMemAddressFree(va, 8 * kMiB));
}

// An exported VMM allocation is the same memory in the importing process.
TEST_F(FakeCuda, ExportedVmmBytesAreSharedWithTheImporter) {
  InitWithContext();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_CU(cuMemCreate(&handle, 2 * kMiB, &prop, 0));
  CUdeviceptr va = 0;
  ASSERT_CU(cuMemAddressReserve(&va, 2 * kMiB, 0, 0, 0));
  ASSERT_CU(cuMemMap(va, 2 * kMiB, 0, handle, 0));
  ASSERT_CU(cuMemsetD32(va + 64, 0xFEEDBEEF, 1));
  int fd = -1;
  ASSERT_CU(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  const int inherited = fcntl(fd, F_DUPFD, 100);  // without close-on-exec: the helper inherits it
  ASSERT_GE(inherited, 0);
  Child child = Child::Spawn({"vmmimport", std::to_string(inherited), std::to_string(2 * kMiB)});
  ASSERT_GT(child.pid, 0);
  EXPECT_EQ(child.ReadLine(), "read feedbeef");
  EXPECT_EQ(child.ReadLine(), "wrote");
  EXPECT_EQ(child.Wait(), 0);
  close(inherited);
  close(fd);
  unsigned written = 0;
  ASSERT_CU(cuMemcpyDtoH(&written, va + 128, 4));
  EXPECT_EQ(written, 0x600DF00Du);
  ASSERT_CU(cuMemUnmap(va, 2 * kMiB));
  ASSERT_CU(cuMemRelease(handle));
  ASSERT_CU(cuMemAddressFree(va, 2 * kMiB));
}

TEST_F(FakeCuda, PageLockedHostMemory) {
  InitWithContext();
  std::vector<unsigned char> buffer(8192, 1);
  ASSERT_CU(cuMemHostRegister(buffer.data(), buffer.size(), CU_MEMHOSTREGISTER_DEVICEMAP));
  EXPECT_EQ(cuMemHostRegister(buffer.data() + 4096, 16, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  EXPECT_EQ(cuMemHostRegister(buffer.data(), 16, 0x80), CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr mapped = 0;
  ASSERT_CU(cuMemHostGetDevicePointer(&mapped, buffer.data() + 16, 0));
  EXPECT_EQ(mapped, reinterpret_cast<CUdeviceptr>(buffer.data() + 16));
  unsigned type = 0;
  ASSERT_CU(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, mapped));
  EXPECT_EQ(type, static_cast<unsigned>(CU_MEMORYTYPE_HOST));
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_CU(cuMemGetAddressRange(&base, &size, mapped));
  EXPECT_EQ(base, reinterpret_cast<CUdeviceptr>(buffer.data()));
  EXPECT_EQ(size, 8192u);
  // Registered memory is a valid device-side operand of copies and sets.
  CUdeviceptr dev = 0;
  ASSERT_CU(cuMemAlloc(&dev, 64));
  ASSERT_CU(cuMemsetD8(mapped, 9, 64));
  ASSERT_CU(cuMemcpyDtoD(dev, mapped, 64));
  unsigned char got = 0;
  ASSERT_CU(cuMemcpyDtoH(&got, dev + 63, 1));
  EXPECT_EQ(got, 9);
  EXPECT_EQ(cuMemFreeHost(buffer.data()), CUDA_ERROR_INVALID_VALUE);  // not the driver's allocation
  ASSERT_CU(cuMemHostUnregister(buffer.data()));
  EXPECT_EQ(cuMemHostUnregister(buffer.data()), CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  void* pinned = nullptr;
  EXPECT_EQ(cuMemHostAlloc(&pinned, 4096, 0x40), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemHostAlloc(&pinned, 4096, CU_MEMHOSTALLOC_PORTABLE));
  unsigned flags = 0;
  ASSERT_CU(cuMemHostGetFlags(&flags, pinned));
  EXPECT_EQ(flags, static_cast<unsigned>(CU_MEMHOSTALLOC_PORTABLE));
  ASSERT_CU(cuMemFreeHost(pinned));
  EXPECT_EQ(cuMemFreeHost(pinned), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, PointerAttributes) {
  InitWithContext();
  CUdeviceptr a = 0;
  ASSERT_CU(cuMemAlloc(&a, 1000));
  unsigned long long first_id = 0, second_id = 0;
  ASSERT_CU(cuPointerGetAttribute(&first_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, a));
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                 CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_HOST_POINTER};
  unsigned type = 0;
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  void* host = reinterpret_cast<void*>(1);
  void* data[] = {&type, &ordinal, &start, &size, &host};
  ASSERT_CU(cuPointerGetAttributes(5, attrs, data, a + 10));
  EXPECT_EQ(type, static_cast<unsigned>(CU_MEMORYTYPE_DEVICE));
  EXPECT_EQ(ordinal, 0);
  EXPECT_EQ(start, a);
  EXPECT_EQ(size, 1000u);
  EXPECT_EQ(host, nullptr);  // device memory has no host address
  EXPECT_EQ(cuPointerGetAttribute(&host, CU_POINTER_ATTRIBUTE_HOST_POINTER, a), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemFree(a));
  CUdeviceptr again = 0;
  ASSERT_CU(cuMemAlloc(&again, 1000));
  ASSERT_EQ(again, a);  // the address comes back ...
  ASSERT_CU(cuPointerGetAttribute(&second_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, again));
  EXPECT_NE(first_id, second_id);  // ... the buffer id does not
  // Not CUDA memory: an error for one attribute, defaults for several.
  int local = 0;
  const auto ptr = reinterpret_cast<CUdeviceptr>(&local);
  EXPECT_EQ(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr), CUDA_ERROR_INVALID_VALUE);
  type = 99;
  ASSERT_CU(cuPointerGetAttributes(5, attrs, data, ptr));
  EXPECT_EQ(type, 0u);
}

TEST_F(FakeCuda, SynchronousCopiesWaitForTheLegacyStream) {
  InitWithContext();
  const char image[] = ".visible .entry spin_30000us() { ret; }";
  CUmodule module = nullptr;
  CUfunction spin = nullptr;
  ASSERT_CU(cuModuleLoadData(&module, image));
  ASSERT_CU(cuModuleGetFunction(&spin, module, "spin_30000us"));
  CUdeviceptr a = 0;
  ASSERT_CU(cuMemAlloc(&a, 16));
  unsigned char out[16];
  const double t0 = NowMs();
  ASSERT_CU(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cuMemcpyDtoH(out, a, sizeof(out)));
  EXPECT_GE(NowMs() - t0, 29.0);
  // A host function runs once the stream's earlier work is done.
  struct Seen {
    double t0, at;
  } seen{NowMs(), 0};
  ASSERT_CU(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr));
  ASSERT_CU(cuLaunchHostFunc(
      nullptr, [](void* p) { static_cast<Seen*>(p)->at = NowMs(); }, &seen));
  EXPECT_GE(seen.at - seen.t0, 29.0);
  EXPECT_EQ(cuStreamAddCallback(
                nullptr, [](CUstream, CUresult, void*) {}, nullptr, 1),
            CUDA_ERROR_INVALID_VALUE);
}

}  // namespace
