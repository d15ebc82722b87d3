// gpuslice-probe reserve: the thread reserve (hook/account.cc): what a
// thread keeps of the bytes it frees for its own next allocations goes back
// to the container when the thread exits. For thread_reserve_test.cc.
//
//   thread-exit THREADS MIB BIG_MIB
//     THREADS threads each allocate and free MIB (keeping it) and exit; then
//     the main thread allocates BIG_MIB in one call. Prints
//     "thread-exit freed=N big_rc=RC" (N: the threads' frees that succeeded).
#include <cuda.h>

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "probe.h"

namespace gpuslice::probe::reserve {

int thread_exit(int threads, std::size_t bytes, std::size_t big) {
  const CUcontext ctx = use_primary(0);
  std::atomic<int> freed{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) return;
      CUdeviceptr p = 0;
      if (cuMemAlloc(&p, bytes) == CUDA_SUCCESS && cuMemFree(p) == CUDA_SUCCESS) freed.fetch_add(1);
    });
  }
  for (std::thread& t : pool) t.join();
  CUdeviceptr p = 0;
  const CUresult rc = cuMemAlloc(&p, big);
  std::printf("thread-exit freed=%d big_rc=%d\n", freed.load(), static_cast<int>(rc));
  if (rc == CUDA_SUCCESS) check(cuMemFree(p), "cuMemFree");
  return 0;
}

}  // namespace gpuslice::probe::reserve
