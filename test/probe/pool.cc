// gpuslice-probe pool: stream-ordered allocation under the preload library, for
// test/hardening/pool_accounting_test.cc: what the container is charged for
// its pools against what the simulated device holds. Links the simulated
// driver directly, as an application links libcuda. One scenario per run;
// each prints "key=value" lines (counted = cuMemGetInfo's total - free on a
// device; held = held_allocations(): allocations and pool reserves, contexts
// left out) and exits 0, or 2 when a setup call failed.
//
//   reclaim MIB_POOL MIB_ALLOC     pool allocation freed without sync, then cuMemAlloc
//   threshold MIB                  release threshold keeps a freed allocation reserved
//   set-mempool MIB                cuDeviceSetMemPool, then cuMemAllocAsync
//   driver-oom MIB_HELD MIB_MORE   the driver refuses a pool allocation that fits the quota
//   threads ROUNDS                 8 threads on two devices allocate, free and sync at once
//   oversize ROUNDS MIB            one thread asks for MIB (above the quota) again and again
//                                  while another allocates, frees and synchronises (reconciles)
//   coarse MIB                     two pools, MIB from each (run with a coarse
//                                  FAKECUDA_POOL_GROWTH_BYTES): the second growth passes the quota
//   reuse MIB_A MIB_B SYNC_A       MIB_A freed on stream A (synchronised if SYNC_A is 1), then MIB_B on
//                                  stream B of a pool that reuses only on the freeing stream: the
//                                  driver grows the reserve
#include <cuda.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "probe.h"

namespace gpuslice::probe::pool {

// What the container is charged on `dev`, whichever context is current.
long long counted(int dev) {
  CUcontext before = nullptr;
  cuCtxGetCurrent(&before);
  use_primary(dev);
  const long long bytes = counted_used();
  check(cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease");
  cuCtxSetCurrent(before);
  return bytes;
}

// A pool allocation freed without a synchronisation stays in the pool's
// reserve; an allocation that needs that memory must not be refused for it.
int reclaim(std::size_t pool_bytes, std::size_t alloc_bytes) {
  use_primary(0);
  CUstream s = new_stream();
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, pool_bytes, s), "cuMemAllocAsync");
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
  const long long cached = counted(0);
  const long long cached_held = held_allocations(0);
  CUdeviceptr q = 0;
  const CUresult rc = cuMemAlloc(&q, alloc_bytes);
  std::printf("reclaim cached=%lld cached_held=%lld alloc_rc=%d counted=%lld held=%lld\n", cached, cached_held,
              static_cast<int>(rc), counted(0), held_allocations(0));
  return 0;
}

// A non-zero release threshold keeps freed memory in the pool across
// synchronisations: the device holds it, so it stays counted until trimmed.
int threshold(std::size_t bytes) {
  use_primary(0);
  CUstream s = new_stream();
  CUmemoryPool pool = nullptr;
  check(cuDeviceGetDefaultMemPool(&pool, 0), "cuDeviceGetDefaultMemPool");
  set_release_threshold(pool, 2 * bytes);
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync");
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  const long long synced = counted(0);
  const long long synced_held = held_allocations(0);
  check(cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo");
  std::printf("threshold synced=%lld synced_held=%lld trimmed=%lld trimmed_held=%lld\n", synced, synced_held,
              counted(0), held_allocations(0));
  return 0;
}

// cuMemAllocAsync allocates from the device's current pool, which
// cuDeviceSetMemPool changes: the new pool's reserve is what gets counted.
int set_mempool(std::size_t bytes) {
  use_primary(0);
  CUstream s = new_stream();
  CUdeviceptr warm = 0;  // the default pool is the current one first
  check(cuMemAllocAsync(&warm, bytes, s), "cuMemAllocAsync (default pool)");
  check(cuMemFreeAsync(warm, s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  CUmemoryPool pool = new_pool(0, 4 * bytes);  // keeps what is freed into it
  check(cuDeviceSetMemPool(0, pool), "cuDeviceSetMemPool");
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, bytes, s), "cuMemAllocAsync (new pool)");
  check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
  check(cuStreamSynchronize(s), "cuStreamSynchronize");
  std::printf("set-mempool counted=%lld held=%lld\n", counted(0), held_allocations(0));
  return 0;
}

// The quota has room but the device does not: the driver's error, and the
// count stays what it was.
int driver_oom(std::size_t held_bytes, std::size_t more_bytes) {
  use_primary(0);
  CUstream s = new_stream();
  CUdeviceptr p = 0;
  check(cuMemAllocAsync(&p, held_bytes, s), "cuMemAllocAsync");
  const long long before = counted(0);
  CUdeviceptr q = 0;
  const CUresult rc = cuMemAllocAsync(&q, more_bytes, s);
  std::printf("driver-oom rc=%d before=%lld after=%lld held=%lld\n", static_cast<int>(rc), before, counted(0),
              held_allocations(0));
  return 0;
}

// The driver grows a pool by its own step: with a step of 32 MiB, MIB from a
// first pool reserves 32 MiB, and MIB from a second pool 32 MiB more. Where
// that passes the quota (or the resident allowance) the second allocation is
// refused and the device holds no more than before it; a third from the
// first pool fits in its reserve.
int coarse(std::size_t bytes) {
  use_primary(0);
  CUstream s = new_stream();
  CUmemoryPool a = new_pool(0, 0), b = new_pool(0, 0);
  CUdeviceptr p = 0, q = 0, r = 0;
  check(cuMemAllocFromPoolAsync(&p, bytes, a, s), "cuMemAllocFromPoolAsync (first pool)");
  const long long first_held = held_allocations(0);
  const CUresult rc_second = cuMemAllocFromPoolAsync(&q, bytes, b, s);
  const long long second_held = held_allocations(0);
  const CUresult rc_third = cuMemAllocFromPoolAsync(&r, bytes, a, s);
  std::printf("coarse first_held=%lld second_rc=%d second_held=%lld third_rc=%d held=%lld counted=%lld\n", first_held,
              static_cast<int>(rc_second), second_held, static_cast<int>(rc_third), held_allocations(0), counted(0));
  return 0;
}

// A pool that reuses freed memory only on its freeing stream (its three
// reuse attributes 0; a release threshold keeps what synchronisations would
// trim): FREED bytes from it on stream A, freed on A, A synchronised if
// `sync_a` (the free observed: a trim may release it), then bytes on stream
// B. gpuslice counts the pool at FREED; where B's allocation fits in that
// (its fast path) the driver grows the reserve all the same.
int reuse(std::size_t freed, std::size_t bytes, bool sync_a) {
  use_primary(0);
  CUstream a = new_stream(), b = new_stream();
  CUmemoryPool pool = new_pool(0, ~std::uint64_t{0});
  int off = 0;
  for (CUmemPool_attribute attr :
       {CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES})
    check(cuMemPoolSetAttribute(pool, attr, &off), "cuMemPoolSetAttribute");
  CUdeviceptr p = 0, q = 0;
  check(cuMemAllocFromPoolAsync(&p, freed, pool, a), "cuMemAllocFromPoolAsync (stream A)");
  check(cuMemFreeAsync(p, a), "cuMemFreeAsync (stream A)");
  if (sync_a) check(cuStreamSynchronize(a), "cuStreamSynchronize (stream A)");
  const long long freed_held = held_allocations(0);
  const CUresult rc = cuMemAllocFromPoolAsync(&q, bytes, pool, b);
  std::printf("reuse freed_held=%lld rc=%d held=%lld counted=%lld\n", freed_held, static_cast<int>(rc),
              held_allocations(0), counted(0));
  return 0;
}

// 8 threads, 4 per device, each on its own stream: the default pool (one
// thread per device through cuMemAllocFromPoolAsync of a created pool) with
// sizes from 64 KiB to ~3 MiB, frees, and synchronisations (which reconcile
// every pool while the others allocate). At the end each thread holds a few
// allocations: the count must equal what the device holds, and be 0 once
// they are freed.
int threads(int rounds) {
  constexpr int kThreads = 8;
  constexpr int kLive = 6;
  CUmemoryPool created[2] = {new_pool(0, 0), new_pool(1, 0)};
  std::vector<std::vector<CUdeviceptr>> kept(kThreads);
  std::vector<CUstream> streams(kThreads);
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      const int dev = t % 2;
      use_primary(dev);
      CUstream s = new_stream();
      streams[t] = s;
      const bool from_created = t / 2 == 1;
      const bool syncs = t / 2 == 2;
      std::vector<CUdeviceptr> live;
      unsigned seed = 12345u + static_cast<unsigned>(t);
      for (int r = 0; r < rounds; ++r) {
        seed = seed * 1103515245u + 12345u;
        const std::size_t bytes = (64 + (seed >> 8) % 3000) * kKi;
        CUdeviceptr p = 0;
        const CUresult rc =
            from_created ? cuMemAllocFromPoolAsync(&p, bytes, created[dev], s) : cuMemAllocAsync(&p, bytes, s);
        if (rc != CUDA_SUCCESS) {
          failures.fetch_add(1);
          continue;
        }
        live.push_back(p);
        if (live.size() > kLive) {
          check(cuMemFreeAsync(live.front(), s), "cuMemFreeAsync");
          live.erase(live.begin());
        }
        if (syncs && r % 8 == 0) check(cuStreamSynchronize(s), "cuStreamSynchronize");
      }
      kept[t] = live;
      check(cuStreamSynchronize(s), "cuStreamSynchronize");
    });
  }
  for (auto& th : pool) th.join();
  for (int dev = 0; dev < 2; ++dev) {
    use_primary(dev);
    check(cuCtxSynchronize(), "cuCtxSynchronize");
  }
  std::printf("threads live failures=%d counted0=%lld held0=%lld counted1=%lld held1=%lld\n", failures.load(),
              counted(0), held_allocations(0), counted(1), held_allocations(1));
  for (int t = 0; t < kThreads; ++t) {
    for (CUdeviceptr p : kept[t]) check(cuMemFreeAsync(p, streams[t]), "cuMemFreeAsync");
  }
  for (int dev = 0; dev < 2; ++dev) {
    use_primary(dev);
    check(cuCtxSynchronize(), "cuCtxSynchronize");
  }
  std::printf("threads freed counted0=%lld held0=%lld counted1=%lld held1=%lld\n", counted(0), held_allocations(0),
              counted(1), held_allocations(1));
  return 0;
}

// An allocation larger than the quota must be refused every time, also when
// it arrives while a synchronisation reconciles the same pool (its size is
// then already in the pool's `outstanding`, on its way to a reservation).
int oversize(int rounds, std::size_t big) {
  use_primary(0);
  std::atomic<bool> stop{false};
  std::atomic<int> admitted{0};
  std::atomic<int> churn_refused{0};
  std::thread churn([&] {
    use_primary(0);
    CUstream s = new_stream();
    while (!stop.load()) {
      CUdeviceptr p = 0;
      if (cuMemAllocAsync(&p, 64 * kKi, s) != CUDA_SUCCESS) {
        churn_refused.fetch_add(1);
      } else {
        check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
      }
      check(cuStreamSynchronize(s), "cuStreamSynchronize");
    }
  });
  CUstream s = new_stream();
  for (int r = 0; r < rounds; ++r) {
    CUdeviceptr p = 0;
    if (cuMemAllocAsync(&p, big, s) == CUDA_SUCCESS) {
      admitted.fetch_add(1);
      check(cuMemFreeAsync(p, s), "cuMemFreeAsync");
      check(cuStreamSynchronize(s), "cuStreamSynchronize");
    }
  }
  stop.store(true);
  churn.join();
  check(cuCtxSynchronize(), "cuCtxSynchronize");
  std::printf("oversize rounds=%d admitted=%d churn_refused=%d counted=%lld held=%lld\n", rounds, admitted.load(),
              churn_refused.load(), counted(0), held_allocations(0));
  return 0;
}

}  // namespace gpuslice::probe::pool
