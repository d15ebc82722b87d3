// reclaim_race: a program of the container for reclaim_race_test.cc.
//   reclaim_race POOL_MIB A_MIB B_MIB
// The device's default pool keeps POOL_MIB MiB reserved with nothing
// allocated from it (release threshold: everything). Thread A asks for
// A_MIB with cuMemAlloc: over the quota with the pool's reserve counted, so
// gpuslice trims the idle pool before it refuses (the pool reclaim). 50 ms
// later, while A's reclaim is still under way (the simulator's reserve query
// sleeps: FAKECUDA_POOL_QUERY_DELAY_US), thread B asks for B_MIB. Prints
// "race a_rc=R b_rc=R".
//   reclaim_race POOL_MIB A_MIB B_MIB busy
// The same pool, but thread B synchronises a stream first: its
// reconciliation holds the pool's mutex while the simulator's reserve query
// sleeps. 50 ms later thread A trims the pool to nothing (the device gets
// the reserve back; gpuslice's count of the pool cannot be lowered: the
// pool is busy), then asks for A_MIB with cuMemAlloc, which fits the
// device. Prints "race a_rc=R b_rc=R" (b_rc: the synchronisation's).
//   reclaim_race POOL_MIB 0 0 busy-trim
// The same, but thread A only trims, prints "trimmed" once its trim has
// returned, and the program exits 1 s later: the request comes from another
// process of the container (the test's), which has no pool to reclaim.
#include <cuda.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) return 2;
  const bool trim_only = argc == 5 && std::string(argv[4]) == "busy-trim";
  const bool busy = trim_only || (argc == 5 && std::string(argv[4]) == "busy");
  const std::size_t pool_mib = std::strtoull(argv[1], nullptr, 10);
  const std::size_t a_mib = std::strtoull(argv[2], nullptr, 10);
  const std::size_t b_mib = std::strtoull(argv[3], nullptr, 10);
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmemoryPool pool = nullptr;
  CUstream stream = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
      cuDeviceGetDefaultMemPool(&pool, dev) != CUDA_SUCCESS ||
      cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    std::printf("init failed\n");
    return 1;
  }
  cuuint64_t keep = ~cuuint64_t{0};
  CUdeviceptr p = 0;
  if (cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep) != CUDA_SUCCESS ||
      cuMemAllocAsync(&p, pool_mib << 20, stream) != CUDA_SUCCESS || cuMemFreeAsync(p, stream) != CUDA_SUCCESS ||
      cuStreamSynchronize(stream) != CUDA_SUCCESS) {
    std::printf("pool failed\n");
    return 1;
  }
  if (busy) {
    CUresult a_rc = CUDA_ERROR_UNKNOWN, b_rc = CUDA_ERROR_UNKNOWN;
    CUdeviceptr a = 0;
    std::thread tb([&] {
      cuCtxSetCurrent(ctx);
      b_rc = cuStreamSynchronize(stream);  // reconciles the pool (it holds more than its allocations)
    });
    usleep(50 * 1000);
    std::thread ta([&] {
      cuCtxSetCurrent(ctx);
      cuMemPoolTrimTo(pool, 0);
      if (trim_only) {
        std::printf("trimmed\n");
        std::fflush(stdout);
        usleep(1000 * 1000);  // the other process's request
        a_rc = CUDA_SUCCESS;
        return;
      }
      a_rc = cuMemAlloc(&a, a_mib << 20);
    });
    ta.join();
    tb.join();
    std::printf("race a_rc=%d b_rc=%d\n", static_cast<int>(a_rc), static_cast<int>(b_rc));
    return 0;
  }
  CUresult a_rc = CUDA_ERROR_UNKNOWN, b_rc = CUDA_ERROR_UNKNOWN;
  CUdeviceptr a = 0, b = 0;
  std::thread ta([&] {
    cuCtxSetCurrent(ctx);
    a_rc = cuMemAlloc(&a, a_mib << 20);
  });
  usleep(50 * 1000);
  std::thread tb([&] {
    cuCtxSetCurrent(ctx);
    b_rc = cuMemAlloc(&b, b_mib << 20);
  });
  ta.join();
  tb.join();
  std::printf("race a_rc=%d b_rc=%d\n", static_cast<int>(a_rc), static_cast<int>(b_rc));
  return 0;
}
