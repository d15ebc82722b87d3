// Stream-ordered pools (reserve kept until a sync point or trim) and VMM
// (physical memory held until released and unmapped).
#include "common.h"

using namespace fakecuda_test;

namespace {

constexpr unsigned long long kChunk = 2 * kMiB;

cuuint64_t PoolAttr(CUmemoryPool pool, CUmemPool_attribute attr) {
  cuuint64_t value = 0;
  EXPECT_CU(cuMemPoolGetAttribute(pool, attr, &value));
  return value;
}

TEST_F(FakeCuda, DefaultPoolKeepsReserveUntilSynchronize) {
  InitWithContext();
  CUstream stream = nullptr;
  ASSERT_CU(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  CUmemoryPool pool = nullptr, current = nullptr;
  ASSERT_CU(cuDeviceGetDefaultMemPool(&pool, 0));
  ASSERT_CU(cuDeviceGetMemPool(&current, 0));
  EXPECT_EQ(pool, current);
  CUdeviceptr p = 0, q = 0;
  ASSERT_CU(cuMemAllocAsync(&p, kMiB, stream));
  EXPECT_EQ(fakecuda_device_used_bytes(0), kChunk);  // reserved in 2 MiB chunks
  EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), kChunk);
  EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), kMiB);
  ASSERT_CU(cuMemAllocAsync(&q, kMiB, stream));  // fits in the reserve
  EXPECT_EQ(fakecuda_device_used_bytes(0), kChunk);
  EXPECT_CU(cuMemFreeAsync(p, stream));
  EXPECT_CU(cuMemFreeAsync(q, stream));
  EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT), 0u);
  EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH), 2 * kMiB);
  EXPECT_EQ(fakecuda_device_used_bytes(0), kChunk);  // a free keeps the reserve
  EXPECT_CU(cuStreamSynchronize(stream));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);  // trimmed to the threshold (0)
  EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), kChunk);
  cuuint64_t zero = 0;
  EXPECT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &zero));
  EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), 0u);
  cuuint64_t one = 1;
  EXPECT_EQ(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, &one), CUDA_ERROR_INVALID_VALUE);

  // With a release threshold the reserve survives synchronisation until trimmed.
  cuuint64_t threshold = 5 * kMiB;
  ASSERT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold));
  ASSERT_CU(cuMemAllocAsync(&p, 7 * kMiB, stream));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 8 * kMiB);
  EXPECT_CU(cuMemFreeAsync(p, stream));
  EXPECT_CU(cuCtxSynchronize());
  EXPECT_EQ(fakecuda_device_used_bytes(0), 6 * kMiB);  // threshold rounded up to a chunk
  EXPECT_CU(cuMemPoolTrimTo(pool, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_CU(cuStreamDestroy(stream));
}

TEST_F(FakeCuda, ExplicitPoolsAndPerThreadVariants) {
  InitWithContext();
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool = nullptr;
  ASSERT_CU(cuMemPoolCreate(&pool, &props));
  CUdeviceptr p = 0;
  ASSERT_CU(cuMemAllocFromPoolAsync_ptsz(&p, 3 * kMiB, pool, nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);
  CUdeviceptr base = 0;
  size_t size = 0;
  EXPECT_CU(cuMemGetAddressRange(&base, &size, p + 5));
  EXPECT_EQ(base, p);
  ASSERT_CU(cuDeviceSetMemPool(0, pool));
  CUdeviceptr q = 0;
  ASSERT_CU(cuMemAllocAsync_ptsz(&q, kMiB, CU_STREAM_PER_THREAD));  // from the current pool: fits the reserve
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);
  // Destroying a pool with allocations outstanding defers the release.
  EXPECT_CU(cuMemPoolDestroy(pool));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);
  EXPECT_CU(cuMemFreeAsync_ptsz(p, nullptr));
  EXPECT_CU(cuMemFree(q));  // cuMemFree also frees stream-ordered allocations
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  CUmemoryPool current = nullptr;
  EXPECT_CU(cuDeviceGetMemPool(&current, 0));
  CUmemoryPool default_pool = nullptr;
  EXPECT_CU(cuDeviceGetDefaultMemPool(&default_pool, 0));
  EXPECT_EQ(current, default_pool);
  EXPECT_EQ(cuMemPoolDestroy(default_pool), CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCuda, PoolOutOfMemory) {
  setenv("FAKECUDA_MEMORY", "16Mi", 1);
  InitWithContext();
  CUdeviceptr p = 0, q = 0;
  ASSERT_CU(cuMemAllocAsync(&p, 15 * kMiB, nullptr));
  EXPECT_EQ(cuMemAllocAsync(&q, 2 * kMiB, nullptr), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_CU(cuMemFreeAsync(p, nullptr));
  EXPECT_CU(cuMemAllocAsync(&q, 2 * kMiB, nullptr));  // reuses the reserve
  EXPECT_EQ(fakecuda_device_used_bytes(0), 16 * kMiB);
  CUdeviceptr r = 0;
  EXPECT_EQ(cuMemAlloc(&r, 1), CUDA_ERROR_OUT_OF_MEMORY);  // the reserve counts as used
  EXPECT_CU(cuStreamSynchronize(nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 2 * kMiB);
}

CUmemAllocationProp DeviceProp(int dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

TEST_F(FakeCuda, VmmHoldsMemoryUntilReleasedAndUnmapped) {
  InitWithContext();
  CUmemAllocationProp prop = DeviceProp(0);
  size_t granularity = 0;
  ASSERT_CU(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  EXPECT_EQ(granularity, kChunk);
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(cuMemCreate(&handle, 3 * kMiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(cuMemCreate(&handle, 4 * kMiB, &prop, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);
  CUmemAllocationProp got{};
  EXPECT_CU(cuMemGetAllocationPropertiesFromHandle(&got, handle));
  EXPECT_EQ(got.location.id, 0);
  CUdeviceptr va = 0;
  ASSERT_CU(cuMemAddressReserve(&va, 8 * kMiB, 0, 0, 0));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);  // address space is free
  ASSERT_CU(cuMemMap(va, 4 * kMiB, 0, handle, 0));
  ASSERT_CU(cuMemMap(va + 4 * kMiB, 2 * kMiB, 2 * kMiB, handle, 0));          // a second mapping of the same memory
  EXPECT_EQ(cuMemMap(va, 2 * kMiB, 0, handle, 0), CUDA_ERROR_INVALID_VALUE);  // overlaps
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EXPECT_CU(cuMemSetAccess(va, 6 * kMiB, &access, 1));
  EXPECT_EQ(cuMemSetAccess(va, 8 * kMiB, &access, 1), CUDA_ERROR_INVALID_VALUE);  // last 2 MiB unmapped
  CUdeviceptr base = 0;
  size_t size = 0;
  EXPECT_CU(cuMemGetAddressRange(&base, &size, va + 100));
  EXPECT_EQ(base, va);
  EXPECT_CU(cuMemRelease(handle));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);  // still mapped
  EXPECT_EQ(cuMemAddressFree(va, 8 * kMiB), CUDA_ERROR_INVALID_VALUE);
  EXPECT_CU(cuMemUnmap(va, 4 * kMiB));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);  // one mapping left
  EXPECT_CU(cuMemUnmap(va + 4 * kMiB, 2 * kMiB));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_EQ(cuMemRelease(handle), CUDA_ERROR_INVALID_VALUE);
  EXPECT_CU(cuMemAddressFree(va, 8 * kMiB));
}

TEST_F(FakeCuda, VmmUnmapThenReleaseAndOom) {
  setenv("FAKECUDA_MEMORY", "8Mi", 1);
  InitWithContext();
  CUmemAllocationProp prop = DeviceProp(0);
  CUmemGenericAllocationHandle handle = 0, other = 0, retained = 0;
  ASSERT_CU(cuMemCreate(&handle, 6 * kMiB, &prop, 0));
  EXPECT_EQ(cuMemCreate(&other, 4 * kMiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  CUdeviceptr va = 0;
  ASSERT_CU(cuMemAddressReserve(&va, 6 * kMiB, 0, 0, 0));
  ASSERT_CU(cuMemMap(va, 6 * kMiB, 0, handle, 0));
  ASSERT_CU(cuMemRetainAllocationHandle(&retained, reinterpret_cast<void*>(va + 10)));
  EXPECT_EQ(retained, handle);
  EXPECT_CU(cuMemUnmap(va, 6 * kMiB));
  EXPECT_CU(cuMemRelease(handle));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 6 * kMiB);  // the retain still holds it
  EXPECT_CU(cuMemRelease(retained));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  EXPECT_CU(cuMemCreate(&other, 8 * kMiB, &prop, 0));
  EXPECT_CU(cuMemRelease(other));
}

}  // namespace

// cuMemPoolDestroy with an allocation outstanding: the pool's whole reserve
// stays until that allocation is freed (cuda.h), synchronisation does not trim
// it, and the handle is no longer valid.
TEST_F(FakeCuda, DestroyedPoolKeepsItsReserveUntilItsLastAllocation) {
  InitWithContext();
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool = nullptr;
  ASSERT_CU(cuMemPoolCreate(&pool, &props));
  CUdeviceptr p = 0, q = 0;
  ASSERT_CU(cuMemAllocFromPoolAsync(&p, 3 * kMiB, pool, nullptr));
  ASSERT_CU(cuMemAllocFromPoolAsync(&q, 3 * kMiB, pool, nullptr));
  EXPECT_CU(cuMemFreeAsync(q, nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 6 * kMiB);
  EXPECT_CU(cuMemPoolDestroy(pool));
  EXPECT_CU(cuStreamSynchronize(nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 6 * kMiB);
  cuuint64_t reserved = 0;
  EXPECT_EQ(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemPoolTrimTo(pool, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_CU(cuMemFreeAsync(p, nullptr));
  EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
}

// cuda.h: a pool reuses "already completed frees when there is no
// dependency" (opportunistic) and inserts "stream dependencies" to reuse
// memory (internal dependencies), both by default. With both off, memory
// freed on one stream is reused on that stream only: another stream's
// allocation grows the reserve though the pool has that much unused.
TEST_F(FakeCuda, PoolReuseAcrossStreamsFollowsItsReuseAttributes) {
  InitWithContext();
  CUstream a = nullptr, b = nullptr;
  ASSERT_CU(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  for (const bool restricted : {false, true}) {
    SCOPED_TRACE(restricted ? "reuse on the freeing stream only" : "default reuse attributes");
    CUmemoryPool pool = nullptr;
    ASSERT_CU(cuMemPoolCreate(&pool, &props));
    int off = 0;
    if (restricted) {
      ASSERT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, &off));
      ASSERT_CU(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, &off));
    }
    CUdeviceptr p = 0, q = 0, r = 0;
    ASSERT_CU(cuMemAllocFromPoolAsync(&p, 4 * kMiB, pool, a));
    EXPECT_CU(cuMemFreeAsync(p, a));
    ASSERT_CU(cuMemAllocFromPoolAsync(&q, 4 * kMiB, pool, b));
    EXPECT_EQ(PoolAttr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), restricted ? 8 * kMiB : 4 * kMiB);
    EXPECT_EQ(fakecuda_device_used_bytes(0), restricted ? 8 * kMiB : 4 * kMiB);
    ASSERT_CU(cuMemAllocFromPoolAsync(&r, 4 * kMiB, pool, a));  // the freeing stream reuses its own
    EXPECT_EQ(fakecuda_device_used_bytes(0), 8 * kMiB);
    EXPECT_CU(cuMemFreeAsync(r, a));
    // cuMemPoolTrimTo: a free "whose completion has not been observed on the
    // host (eg. by a synchronize) can count as outstanding". Kept here until
    // stream A is synchronised (which also trims, to the threshold 0).
    EXPECT_CU(cuMemPoolTrimTo(pool, 0));
    EXPECT_EQ(fakecuda_device_used_bytes(0), restricted ? 8 * kMiB : 4 * kMiB);
    EXPECT_CU(cuStreamSynchronize(b));  // observes stream B's frees only
    EXPECT_EQ(fakecuda_device_used_bytes(0), restricted ? 8 * kMiB : 4 * kMiB);
    EXPECT_CU(cuStreamSynchronize(a));
    EXPECT_EQ(fakecuda_device_used_bytes(0), 4 * kMiB);
    EXPECT_CU(cuMemFreeAsync(q, b));
    EXPECT_CU(cuMemPoolDestroy(pool));
    EXPECT_EQ(fakecuda_device_used_bytes(0), 0u);
  }
}
