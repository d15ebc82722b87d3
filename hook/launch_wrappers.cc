// The exported launch entry points (symbols.def, "kernel launches"). Each one
// tests the mode once and, unlimited, tail-calls the driver; otherwise it is
// admitted on its stream's device (launch.cc). Those that take a CUkernel
// cast to CUfunction first test whether a kernel's library may still be
// placed by this launch (modules.h: one load and a predictable branch). A NULL configuration is
// refused here with the driver's documented CUDA_ERROR_INVALID_VALUE, before
// any pointer that may never have been loaded is touched.
// gpuslice: hot path (no heap, no locks)
#include <cuda.h>

#include "hook/launch.h"
#include "hook/launch_streams.h"
#include "hook/modules.h"
#include "hook/wrap.h"
#include "limiter/compute.h"
#include "limiter/compute_graphs.h"

using namespace gpuslice;
using namespace gpuslice::hook;
using namespace gpuslice::hook::launch;

namespace {

template <class Launch>
CUresult gated_graph(CUgraphExec g, CUstream s, bool ptsz, Launch&& launch) noexcept {
  limiter::GraphCost cost;
  if (!limiter::graph_costs().find(reinterpret_cast<std::uintptr_t>(g), &cost) || cost.kernels == 0) {
    // Instantiated where we could not price it: one kernel's prior, which the
    // true-up corrects with what the graph measurably used.
    cost.nominal_ns = limiter::kNominalWaveNs;
    cost.kernels = 1;
  }
  return gated(cost.nominal_ns, true, cost.kernels, s, ptsz, launch);
}

// Grid sides of the legacy entry points are ints: a non-positive one is the
// driver's error (the price is refunded), priced as one block meanwhile.
std::uint64_t side(int n) noexcept { return n > 0 ? static_cast<std::uint64_t>(n) : 1; }

}  // namespace

GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                                CUstream s, void** params, void** extra) {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) [[unlikely]]
    return placed;
  if (unlimited()) return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gated(blocks(gx, gy, gz), false, 1, s, false,
               [&] { return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                     unsigned int bx, unsigned int by, unsigned int bz,
                                                     unsigned int shmem, CUstream s, void** params, void** extra) {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) [[unlikely]]
    return placed;
  if (unlimited()) return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gated(blocks(gx, gy, gz), false, 1, s, true,
               [&] { return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params,
                                                  void** extra) {
  if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult placed = place_kernel(f, config->hStream); placed != CUDA_SUCCESS) [[unlikely]]
    return placed;
  if (unlimited()) return real_cuLaunchKernelEx(config, f, params, extra);
  return gated(blocks(config->gridDimX, config->gridDimY, config->gridDimZ), false, 1, config->hStream, false,
               [&] { return real_cuLaunchKernelEx(config, f, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params,
                                                       void** extra) {
  if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult placed = place_kernel(f, config->hStream); placed != CUDA_SUCCESS) [[unlikely]]
    return placed;
  if (unlimited()) return real_cuLaunchKernelEx_ptsz(config, f, params, extra);
  return gated(blocks(config->gridDimX, config->gridDimY, config->gridDimZ), false, 1, config->hStream, true,
               [&] { return real_cuLaunchKernelEx_ptsz(config, f, params, extra); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                                           unsigned int gz, unsigned int bx, unsigned int by,
                                                           unsigned int bz, unsigned int shmem, CUstream s,
                                                           void** params) {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) [[unlikely]]
    return placed;
  if (unlimited()) return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gated(blocks(gx, gy, gz), false, 1, s, false,
               [&] { return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                                                unsigned int gz, unsigned int bx, unsigned int by,
                                                                unsigned int bz, unsigned int shmem, CUstream s,
                                                                void** params) {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) [[unlikely]]
    return placed;
  if (unlimited()) return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gated(blocks(gx, gy, gz), false, 1, s, true,
               [&] { return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphLaunch(CUgraphExec g, CUstream s) {
  if (unlimited()) return real_cuGraphLaunch(g, s);
  return gated_graph(g, s, false, [&] { return real_cuGraphLaunch(g, s); });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
  if (unlimited()) return real_cuGraphLaunch_ptsz(g, s);
  return gated_graph(g, s, true, [&] { return real_cuGraphLaunch_ptsz(g, s); });
}

// --- deprecated entry points, still exported by the driver and reachable
// through cuGetProcAddress: a driver without them gets CUDA_ERROR_NOT_FOUND ---
// cuLaunch runs a 1x1 grid (block shape from cuFuncSetBlockShape) on the
// legacy stream of the current context.
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunch(CUfunction f) {
  if (unlimited()) return real_cuLaunch != nullptr ? real_cuLaunch(f) : CUDA_ERROR_NOT_FOUND;
  return gated(1, false, 1, nullptr, false,
               [&] { return real_cuLaunch != nullptr ? real_cuLaunch(f) : CUDA_ERROR_NOT_FOUND; });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
  if (unlimited())
    return real_cuLaunchGrid != nullptr ? real_cuLaunchGrid(f, grid_width, grid_height) : CUDA_ERROR_NOT_FOUND;
  return gated(side(grid_width) * side(grid_height), false, 1, nullptr, false, [&] {
    return real_cuLaunchGrid != nullptr ? real_cuLaunchGrid(f, grid_width, grid_height) : CUDA_ERROR_NOT_FOUND;
  });
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream s) {
  if (unlimited())
    return real_cuLaunchGridAsync != nullptr ? real_cuLaunchGridAsync(f, grid_width, grid_height, s)
                                             : CUDA_ERROR_NOT_FOUND;
  return gated(side(grid_width) * side(grid_height), false, 1, s, false, [&] {
    return real_cuLaunchGridAsync != nullptr ? real_cuLaunchGridAsync(f, grid_width, grid_height, s)
                                             : CUDA_ERROR_NOT_FOUND;
  });
}
// One kernel per device, each on its own stream (hence device): every one is
// admitted on its device before the driver starts any.
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS* list,
                                                                      unsigned int num_devices, unsigned int flags) {
  if (list == nullptr || num_devices == 0) return CUDA_ERROR_INVALID_VALUE;
  auto forward = [&] {
    return real_cuLaunchCooperativeKernelMultiDevice != nullptr
               ? real_cuLaunchCooperativeKernelMultiDevice(list, num_devices, flags)
               : CUDA_ERROR_NOT_FOUND;
  };
  if (unlimited()) return forward();
  // Devices past the region's kMaxDevices entries are never limited.
  const unsigned n = num_devices < kMaxDevices ? num_devices : kMaxDevices;
  Ticket tickets[kMaxDevices];
  for (unsigned i = 0; i < n; ++i) {
    const CUDA_LAUNCH_PARAMS& p = list[i];
    const CUresult rc = admit(blocks(p.gridDimX, p.gridDimY, p.gridDimZ), false, 1, p.hStream, false, &tickets[i]);
    if (rc != CUDA_SUCCESS) {
      for (unsigned j = 0; j < i; ++j) settle(tickets[j], rc, list[j].hStream, false);
      return rc;
    }
  }
  const CUresult rc = forward();
  for (unsigned i = 0; i < n; ++i) settle(tickets[i], rc, list[i].hStream, false);
  return rc;
}

// A destroyed stream's handle may come back as a stream of another device:
// its cached device is forgotten (before, and after in case a racing launch
// cached it again).
GPUSLICE_EXPORT CUresult CUDAAPI cuStreamDestroy_v2(CUstream s) {
  const CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuStreamDestroy_v2 == nullptr) return CUDA_ERROR_NOT_FOUND;
  forget_stream(s);
  const CUresult destroyed = real_cuStreamDestroy_v2(s);
  forget_stream(s);
  return destroyed;
}
GPUSLICE_EXPORT CUresult CUDAAPI cuStreamDestroy(CUstream s) {
  const CUresult rc = ensure_ready();
  if (rc != CUDA_SUCCESS) return rc;
  if (real_cuStreamDestroy == nullptr) return CUDA_ERROR_NOT_FOUND;
  forget_stream(s);
  const CUresult destroyed = real_cuStreamDestroy(s);
  forget_stream(s);
  return destroyed;
}
