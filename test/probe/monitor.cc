// gpuslice-probe monitor: a program for the chaos suite's invariant monitor
// (test/chaos/chaos_test.cc).
//   hold MIB HOLD_MS [checkpoint]
//       prints "allocating" and allocates MIB with cuMemAlloc in the primary context (then, with
//       checkpoint, prints the monitor's checkpoint, test/chaos/monitor.h), holds it HOLD_MS,
//       frees it, exits 0. Run without libgpuslice.so it is a program that
//       bypasses gpuslice: the monitor must report it.
//   hold-managed MIB HOLD_MS
//       the same with cuMemAllocManaged of MIB, then of 1 MiB more.
#include <cuda.h>
#include <unistd.h>

#include <cstdio>

#include "monitor.h"  // test/chaos: the invariant monitor, linked in
#include "probe.h"

namespace gpuslice::probe::monitor {

int hold(std::size_t bytes, unsigned hold_ms, bool checkpoint, bool managed) {
  use_primary(0);
  CUdeviceptr p = 0;
  CUdeviceptr more = 0;
  std::printf("allocating\n");
  std::fflush(stdout);
  CUresult rc = managed ? cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL) : cuMemAlloc(&p, bytes);
  if (managed && rc == CUDA_SUCCESS) rc = cuMemAllocManaged(&more, 1 << 20, CU_MEM_ATTACH_GLOBAL);
  std::printf("alloc=%d\n", static_cast<int>(rc));
  std::fflush(stdout);
  if (checkpoint) std::printf("checkpoint=%d\n", gpuslice::chaos::monitor_checkpoint());
  std::fflush(stdout);
  usleep(hold_ms * 1000);
  if (p != 0) cuMemFree(p);
  if (more != 0) cuMemFree(more);
  cuDevicePrimaryCtxRelease(0);
  return 0;
}

}  // namespace gpuslice::probe::monitor
