// gpuslice-probe allowance: one process against its device-resident allowance
// (GPUSLICE_MEMORY_RESIDENT, GPUSLICE_OVERSUBSCRIBE=spill) while another of
// its threads spills and frees in a loop, for allowance_race_test.cc. Links
// the simulated driver directly; the preload library interposes at run time.
//
//   spill-race HOLD_MIB CHURN_MIB MAIN_MIB ROUNDS LIMIT_MIB
//     holds HOLD_MIB resident; a second thread allocates and frees CHURN_MIB
//     (beyond the allowance: spilled) in a loop; the main thread allocates
//     MAIN_MIB ROUNDS times (each must spill too) and after each looks at what
//     the simulated device holds for the process. The simulator holds a
//     managed allocation on the device until cuMemAdvise moves it to the host
//     (it has no page-touch model), so the churning thread may show CHURN_MIB
//     for a moment: LIMIT_MIB = HOLD_MIB + CHURN_MIB, and more than that
//     means the main thread's allocation was placed on the device.
// Prints "rounds=N over=M" and exits 0, or 2 when a setup call failed.
#include <cuda.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "fakecuda_query.h"
#include "probe.h"

namespace gpuslice::probe::allowance {

bool ok(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return true;
  std::printf("setup failed: %s rc=%d\n", what, static_cast<int>(rc));
  return false;
}

std::uint64_t device_allocations() { return fakecuda_process_used_bytes(0, 0) - fakecuda_process_context_bytes(0, 0); }

int spill_race(std::size_t hold, std::size_t churn_size, std::size_t size, long rounds, std::uint64_t limit) {
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (!ok(cuInit(0), "cuInit") || !ok(cuDeviceGet(&dev, 0), "cuDeviceGet") ||
      !ok(cuDevicePrimaryCtxRetain(&ctx, dev), "retain") || !ok(cuCtxSetCurrent(ctx), "set current"))
    return 2;
  CUdeviceptr held = 0;
  if (!ok(cuMemAlloc(&held, hold), "hold")) return 2;
  std::atomic<bool> stop{false};
  std::atomic<long> churned{0};
  std::thread churn([&] {
    cuCtxSetCurrent(ctx);
    while (!stop.load(std::memory_order_relaxed)) {
      CUdeviceptr p = 0;
      if (cuMemAlloc(&p, churn_size) == CUDA_SUCCESS) cuMemFree(p);
      churned.fetch_add(1, std::memory_order_relaxed);
    }
  });
  long over = 0, done = 0, refused = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (; done < rounds && std::chrono::steady_clock::now() < deadline; ++done) {
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, size) != CUDA_SUCCESS) {
      ++refused;
      continue;
    }
    if (device_allocations() > limit) ++over;
    cuMemFree(p);
  }
  stop = true;
  churn.join();
  cuMemFree(held);
  std::printf("rounds=%ld over=%ld refused=%ld churned=%ld\n", done, over, refused, churned.load());
  return 0;
}

}  // namespace gpuslice::probe::allowance
