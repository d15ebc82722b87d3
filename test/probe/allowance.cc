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
// Prints "rounds=N over=M refused=R churned=C" and exits 0, or 2 when a setup
// call failed.
#include <cuda.h>

#include <chrono>
#include <cstdio>

#include "probe.h"

namespace gpuslice::probe::allowance {

int spill_race(std::size_t hold, std::size_t churn_size, std::size_t size, long rounds, std::uint64_t limit) {
  const CUcontext ctx = use_primary(0);
  CUdeviceptr kept = 0;
  check(cuMemAlloc(&kept, hold), "cuMemAlloc (hold)");
  long churned = 0;  // the churning thread's alone until it stops
  Churn churn(ctx, [&] {
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, churn_size) == CUDA_SUCCESS) cuMemFree(p);
    ++churned;
  });
  long over = 0, done = 0, refused = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (; done < rounds && std::chrono::steady_clock::now() < deadline; ++done) {
    CUdeviceptr p = 0;
    if (cuMemAlloc(&p, size) != CUDA_SUCCESS) {
      ++refused;
      continue;
    }
    if (held_allocations() > static_cast<long long>(limit)) ++over;
    cuMemFree(p);
  }
  churn.stop();
  cuMemFree(kept);
  std::printf("rounds=%ld over=%ld refused=%ld churned=%ld\n", done, over, refused, churned);
  return 0;
}

}  // namespace gpuslice::probe::allowance
