// multi_gpu_probe N CHUNK_MIB: one process, N devices (multi_gpu_test.cc).
// A created context on each, peer access enabled between every pair, then
// CHUNK_MIB allocations round-robin over the devices (each device's context
// current in turn) until every device refuses. Prints
//   peers can=C enabled=E           pairs that can access / were enabled
//   dev d=D succeeded=N counted=C total=T held=H   per device
//   peer-copy rc=R                  a copy from device 0 to device N-1
//   freed held=H                    every device's held bytes after the frees
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fakecuda_query.h"

int main(int argc, char** argv) {
  if (argc != 3 || cuInit(0) != CUDA_SUCCESS) return 2;
  const int n = std::atoi(argv[1]);
  const size_t chunk = std::strtoull(argv[2], nullptr, 10) << 20;
  std::vector<CUcontext> ctx(n);
  for (int d = 0; d < n; ++d)
    if (cuCtxCreate(&ctx[d], nullptr, 0, d) != CUDA_SUCCESS) return 3;
  int can_total = 0, enabled = 0;
  for (int d = 0; d < n; ++d) {
    cuCtxSetCurrent(ctx[d]);
    for (int p = 0; p < n; ++p) {
      int can = 0;
      if (p == d || cuDeviceCanAccessPeer(&can, d, p) != CUDA_SUCCESS || can == 0) continue;
      ++can_total;
      if (cuCtxEnablePeerAccess(ctx[p], 0) == CUDA_SUCCESS) ++enabled;
    }
  }
  std::printf("peers can=%d enabled=%d\n", can_total, enabled);
  std::vector<std::vector<CUdeviceptr>> held(n);
  std::vector<bool> full(n, false);
  for (int left = n; left > 0;) {
    for (int d = 0; d < n; ++d) {
      if (full[d]) continue;
      cuCtxSetCurrent(ctx[d]);
      CUdeviceptr p = 0;
      if (held[d].size() < 4096 && cuMemAlloc(&p, chunk) == CUDA_SUCCESS) {
        held[d].push_back(p);
      } else {
        full[d] = true;
        --left;
      }
    }
  }
  for (int d = 0; d < n; ++d) {
    cuCtxSetCurrent(ctx[d]);
    size_t free = 0, total = 0;
    cuMemGetInfo(&free, &total);
    std::printf("dev d=%d succeeded=%zu counted=%zu total=%zu held=%llu\n", d, held[d].size(), total - free, total,
                static_cast<unsigned long long>(fakecuda_process_used_bytes(d, 0)));
  }
  cuCtxSetCurrent(ctx[0]);
  const CUresult copy = held[0].empty() || held[n - 1].empty()
                            ? CUDA_ERROR_INVALID_VALUE
                            : cuMemcpyPeer(held[n - 1][0], ctx[n - 1], held[0][0], ctx[0], chunk);
  std::printf("peer-copy rc=%d\n", copy);
  unsigned long long after = 0;
  for (int d = 0; d < n; ++d) {
    cuCtxSetCurrent(ctx[d]);
    for (CUdeviceptr p : held[d]) cuMemFree(p);
    after += fakecuda_process_used_bytes(d, 0);
  }
  std::printf("freed held=%llu\n", after);
  return 0;
}
