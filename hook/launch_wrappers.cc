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

// The fast path of a kernel launch: no CUkernel waits to be placed
// (modules.h) and unlimited_turn() (launch.h): two loads, a thread-local
// count and three predictable branches before the tail call.
inline bool kernel_fast() noexcept {
  return __builtin_expect((g_kernel_check.load(std::memory_order_relaxed) & 1) == 0, 1) && unlimited_turn();
}

// What launch_fast_x86_64.S assumes of the words it reads.
static_assert(kModeUnlimited == 1 && sizeof(g_mode) == 4);
static_assert(kRecheckEvery == 256, "the assembly tests the low byte of t_unlimited_launches");
static_assert(sizeof(t_unlimited_launches) == 4);

// Grid sides of the legacy entry points are ints: a non-positive one is the
// driver's error (the price is refunded), priced as one block meanwhile.
std::uint64_t side(int n) noexcept { return n > 0 ? static_cast<std::uint64_t>(n) : 1; }

}  // namespace

// The slow twins of the wrappers below: everything but the fast path, out of
// line, so that the fast path keeps no frame and saves no register — the
// wrapper tail-calls the driver with its arguments where the caller put them
// (stack arguments included). A twin is entered with the launch already
// counted by unlimited_turn() (launch.h).
namespace {

[[gnu::noinline]] CUresult cuLaunchKernelEx_slow(const CUlaunchConfig* config, CUfunction f, void** params,
                                                 void** extra) noexcept {
  if (const CUresult placed = place_kernel(f, config->hStream); placed != CUDA_SUCCESS) return placed;
  if (unlimited_after_turn()) return real_cuLaunchKernelEx(config, f, params, extra);
  return gated(blocks(config->gridDimX, config->gridDimY, config->gridDimZ), false, 1, config->hStream, false,
               [&] { return real_cuLaunchKernelEx(config, f, params, extra); });
}
[[gnu::noinline]] CUresult cuLaunchKernelEx_ptsz_slow(const CUlaunchConfig* config, CUfunction f, void** params,
                                                      void** extra) noexcept {
  if (const CUresult placed = place_kernel(f, config->hStream); placed != CUDA_SUCCESS) return placed;
  if (unlimited_after_turn()) return real_cuLaunchKernelEx_ptsz(config, f, params, extra);
  return gated(blocks(config->gridDimX, config->gridDimY, config->gridDimZ), false, 1, config->hStream, true,
               [&] { return real_cuLaunchKernelEx_ptsz(config, f, params, extra); });
}
[[gnu::noinline]] CUresult cuGraphLaunch_slow(CUgraphExec g, CUstream s) noexcept {
  if (unlimited_after_turn()) return real_cuGraphLaunch(g, s);
  return gated_graph(g, s, false, [&] { return real_cuGraphLaunch(g, s); });
}
[[gnu::noinline]] CUresult cuGraphLaunch_ptsz_slow(CUgraphExec g, CUstream s) noexcept {
  if (unlimited_after_turn()) return real_cuGraphLaunch_ptsz(g, s);
  return gated_graph(g, s, true, [&] { return real_cuGraphLaunch_ptsz(g, s); });
}

}  // namespace

// The slow twins of the wrappers with stack arguments, under C names: on
// x86-64 their fast paths are launch_fast_x86_64.S (the compiler copies stack
// arguments through registers before a tail call: 35 instructions where 9 do).
extern "C" [[gnu::noinline, gnu::visibility("hidden")]] CUresult gpuslice_cuLaunchKernel_slow(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
    unsigned int shmem, CUstream s, void** params, void** extra) noexcept {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) return placed;
  if (unlimited_after_turn()) return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gated(blocks(gx, gy, gz), false, 1, s, false,
               [&] { return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
extern "C" [[gnu::noinline, gnu::visibility("hidden")]] CUresult gpuslice_cuLaunchKernel_ptsz_slow(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
    unsigned int shmem, CUstream s, void** params, void** extra) noexcept {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) return placed;
  if (unlimited_after_turn()) return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gated(blocks(gx, gy, gz), false, 1, s, true,
               [&] { return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra); });
}
extern "C" [[gnu::noinline, gnu::visibility("hidden")]] CUresult gpuslice_cuLaunchCooperativeKernel_slow(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
    unsigned int shmem, CUstream s, void** params) noexcept {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) return placed;
  if (unlimited_after_turn()) return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gated(blocks(gx, gy, gz), false, 1, s, false,
               [&] { return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params); });
}
extern "C" [[gnu::noinline, gnu::visibility("hidden")]] CUresult gpuslice_cuLaunchCooperativeKernel_ptsz_slow(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by, unsigned int bz,
    unsigned int shmem, CUstream s, void** params) noexcept {
  if (const CUresult placed = place_kernel(f, s); placed != CUDA_SUCCESS) return placed;
  if (unlimited_after_turn()) return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gated(blocks(gx, gy, gz), false, 1, s, true,
               [&] { return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params); });
}

#if !defined(__x86_64__)
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                                                CUstream s, void** params, void** extra) {
  if (kernel_fast()) [[likely]]
    return real_cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gpuslice_cuLaunchKernel_slow(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                                     unsigned int bx, unsigned int by, unsigned int bz,
                                                     unsigned int shmem, CUstream s, void** params, void** extra) {
  if (kernel_fast()) [[likely]]
    return real_cuLaunchKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
  return gpuslice_cuLaunchKernel_ptsz_slow(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra);
}
#endif
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params,
                                                  void** extra) {
  if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (kernel_fast()) [[likely]]
    return real_cuLaunchKernelEx(config, f, params, extra);
  return cuLaunchKernelEx_slow(config, f, params, extra);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** params,
                                                       void** extra) {
  if (config == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (kernel_fast()) [[likely]]
    return real_cuLaunchKernelEx_ptsz(config, f, params, extra);
  return cuLaunchKernelEx_ptsz_slow(config, f, params, extra);
}
#if !defined(__x86_64__)
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                                           unsigned int gz, unsigned int bx, unsigned int by,
                                                           unsigned int bz, unsigned int shmem, CUstream s,
                                                           void** params) {
  if (kernel_fast()) [[likely]]
    return real_cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gpuslice_cuLaunchCooperativeKernel_slow(f, gx, gy, gz, bx, by, bz, shmem, s, params);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                                                unsigned int gz, unsigned int bx, unsigned int by,
                                                                unsigned int bz, unsigned int shmem, CUstream s,
                                                                void** params) {
  if (kernel_fast()) [[likely]]
    return real_cuLaunchCooperativeKernel_ptsz(f, gx, gy, gz, bx, by, bz, shmem, s, params);
  return gpuslice_cuLaunchCooperativeKernel_ptsz_slow(f, gx, gy, gz, bx, by, bz, shmem, s, params);
}
#endif
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphLaunch(CUgraphExec g, CUstream s) {
  if (unlimited_turn()) [[likely]]
    return real_cuGraphLaunch(g, s);
  return cuGraphLaunch_slow(g, s);
}
GPUSLICE_EXPORT CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
  if (unlimited_turn()) [[likely]]
    return real_cuGraphLaunch_ptsz(g, s);
  return cuGraphLaunch_ptsz_slow(g, s);
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
