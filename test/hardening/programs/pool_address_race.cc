// pool_address_race: a program of the container for implicit_free_race_test.cc.
//   pool_address_race ROUNDS MIB [mapped]
// Each round: a context is created and MIB MiB allocated in it (cuMemAlloc,
// at address X), the primary context made current again, and the context
// destroyed (the driver frees X with it; the library's sweep after the
// destroy must release X's record). Meanwhile a second thread allocates MIB
// MiB from the device's default pool (cuMemAllocAsync) until the driver hands
// it X, the address the destroy freed. Six 1 MiB allocations of the primary
// context are kept, so that the sweep asks the driver about several records;
// run with the simulator's chaos mode sleeping after each of its answers
// (FAKECUDA_CHAOS_CALLS=cuMemGetAddressRange_v2), the pool allocation at X
// often lands before the sweep asks about X: X is then known to the driver
// again, and the destroyed context's record of X is kept. The pool
// allocation at X is freed with cuMemFree (which stream-ordered memory
// allows). Prints "race hits=H" (rounds whose pool allocation got X), and,
// once everything is freed and the pool trimmed to 0, "after used=U big_rc=R":
// cuMemGetInfo's total - free, then an allocation of 6 * MIB MiB.
// With `mapped` the second thread maps buffers onto MIB MiB of imported
// graphics memory (cuExternalMemoryGetMappedBuffer: a new address, no memory
// of its own) until one gets X, and each hit prints "round N hit=1 over=O":
// what cuMemGetInfo shows as used while that buffer is held, less what it
// showed before the rounds (the six kept MiB and the import): 0 when nothing
// stale is counted.
#include <cuda.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "fakecuda_query.h"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) return 2;
  const bool mapped = argc == 4;
  const int rounds = std::atoi(argv[1]);
  const std::size_t bytes = std::strtoull(argv[2], nullptr, 10) << 20;
  CUdevice dev = 0;
  CUcontext primary = nullptr;
  CUstream stream = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&primary, dev) != CUDA_SUCCESS || cuCtxSetCurrent(primary) != CUDA_SUCCESS ||
      cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    std::printf("init failed\n");
    return 1;
  }
  CUdeviceptr keep[6] = {};
  for (CUdeviceptr& k : keep) {
    if (cuMemAlloc(&k, 1u << 20) != CUDA_SUCCESS) {
      std::printf("init failed (keep)\n");
      return 1;
    }
  }
  CUexternalMemory ext = nullptr;
  std::uint64_t graphics = 0;
  if (mapped) {
    graphics = fakecuda_graphics_alloc(0, bytes);
    CUDA_EXTERNAL_MEMORY_HANDLE_DESC d{};
    d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
    d.handle.fd = graphics != 0 ? fakecuda_graphics_export_fd(graphics) : -1;
    d.size = bytes;
    if (d.handle.fd < 0 || cuImportExternalMemory(&ext, &d) != CUDA_SUCCESS) {
      std::printf("init failed (import)\n");
      return 1;
    }
  }
  size_t base_free = 0, base_total = 0;
  cuMemGetInfo(&base_free, &base_total);
  const long long baseline = static_cast<long long>(base_total - base_free);  // the keeps and the import
  int hits = 0;
  for (int round = 0; round < rounds; ++round) {
    CUcontext ctx = nullptr;
    CUdeviceptr x = 0;
    if (cuCtxCreate(&ctx, nullptr, 0, dev) != CUDA_SUCCESS || cuMemAlloc(&x, bytes) != CUDA_SUCCESS ||
        cuCtxSetCurrent(primary) != CUDA_SUCCESS) {
      std::printf("round %d: setup failed\n", round);
      return 1;
    }
    std::atomic<bool> destroyed{false};
    CUdeviceptr got = 0;
    std::thread pool_thread([&] {
      cuCtxSetCurrent(primary);
      // Until the destroy returned (and a little after: the sweep may still be walking).
      for (int after = 0; after < 2000;) {
        CUdeviceptr y = 0;
        CUDA_EXTERNAL_MEMORY_BUFFER_DESC b{};
        b.size = bytes;
        if (mapped ? cuExternalMemoryGetMappedBuffer(&y, ext, &b) == CUDA_SUCCESS
                   : cuMemAllocAsync(&y, bytes, stream) == CUDA_SUCCESS) {
          if (y == x) {
            got = y;
            return;
          }
          if (mapped) {
            cuMemFree(y);
          } else {
            cuMemFreeAsync(y, stream);
            cuStreamSynchronize(stream);
          }
        }
        if (destroyed.load()) ++after;
        usleep(100);
      }
    });
    cuCtxDestroy(ctx);
    destroyed.store(true);
    pool_thread.join();
    long long over = 0;
    if (got != 0) {
      ++hits;
      if (mapped) {
        size_t free_bytes = 0, total = 0;
        cuMemGetInfo(&free_bytes, &total);
        over = static_cast<long long>(total - free_bytes) - baseline;
      }
      cuMemFree(got);
    }
    std::printf("round %d hit=%d over=%lld\n", round, got != 0 ? 1 : 0, over);
  }
  for (CUdeviceptr k : keep) cuMemFree(k);
  if (mapped) {
    cuDestroyExternalMemory(ext);
    fakecuda_graphics_free(graphics);
  }
  CUmemoryPool pool = nullptr;
  cuStreamSynchronize(stream);
  cuDeviceGetDefaultMemPool(&pool, dev);
  cuMemPoolTrimTo(pool, 0);
  cuCtxSynchronize();
  std::printf("race hits=%d\n", hits);
  size_t free_bytes = 0, total = 0;
  cuMemGetInfo(&free_bytes, &total);
  CUdeviceptr big = 0;
  const CUresult big_rc = cuMemAlloc(&big, 6 * bytes);
  std::printf("after used=%zu big_rc=%d\n", total - free_bytes, static_cast<int>(big_rc));
  if (big_rc == CUDA_SUCCESS) cuMemFree(big);
  return 0;
}
