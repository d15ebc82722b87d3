// Kernel launches: the hot path. Lock-free: validate, resolve the stream, one
// CAS on the device timeline, one ring append, two atomic maxima. Capture into a
// graph is the only slow path and lives in graph.cc.
#include "driver.h"

using namespace gpuslice::fakecuda;

namespace {

struct Launch {
  unsigned grid[3];
  unsigned block[3];
  unsigned shared_bytes;
  CUstream stream;
  void** params;
  void** extra;
};

CUresult validate(const CUfunc_st* function, const Launch& l, bool cooperative) {
  for (int i = 0; i < 3; ++i) {
    if (l.grid[i] == 0 || l.block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
  }
  if (l.grid[1] > 65535 || l.grid[2] > 65535 || l.block[2] > 64) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t threads = std::uint64_t{l.block[0]} * l.block[1] * l.block[2];
  if (threads > 1024) return CUDA_ERROR_INVALID_VALUE;
  if (l.shared_bytes > static_cast<unsigned>(function->max_dynamic_shared) && l.shared_bytes > 49152) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (l.params != nullptr && l.extra != nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (cooperative) {
    // Every block must be co-resident: at most (blocks per SM) * SMs.
    std::uint64_t warps = (threads + 31) / 32;
    std::uint64_t per_sm = 64 / warps < 32 ? 64 / warps : 32;
    std::uint64_t blocks = std::uint64_t{l.grid[0]} * l.grid[1] * l.grid[2];
    if (blocks > per_sm * state().header().sms) return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
  }
  return CUDA_SUCCESS;
}

[[gnu::noinline, gnu::cold]] CUresult capture(CUfunc_st* function, const Launch& l, CUstream_st* stream) {
  CUDA_KERNEL_NODE_PARAMS params{};
  params.func = function;
  params.gridDimX = l.grid[0];
  params.gridDimY = l.grid[1];
  params.gridDimZ = l.grid[2];
  params.blockDimX = l.block[0];
  params.blockDimY = l.block[1];
  params.blockDimZ = l.block[2];
  params.sharedMemBytes = l.shared_bytes;
  params.kernelParams = l.params;
  params.extra = l.extra;
  params.ctx = stream->ctx;
  return capture_kernel_node(stream, params);
}

inline CUresult launch(CUfunction f, const Launch& l, bool ptsz, bool cooperative) {
  if (!initialized()) return uninitialized_error();
  CUfunc_st* function = function_from_handle(f);
  if (function == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (CUresult rc = validate(function, l, cooperative); rc != CUDA_SUCCESS) return rc;
  CUstream_st* stream = nullptr;
  if (CUresult rc = resolve_stream(l.stream, ptsz, &stream); rc != CUDA_SUCCESS) return rc;
  // A module belongs to the context it was loaded in (libraries to none; a
  // green context uses its primary context's).
  CUctx_st* owner = function->module != nullptr ? function->module->ctx : nullptr;
  if (owner != nullptr && owner != memory_owner(stream->ctx)) return CUDA_ERROR_INVALID_HANDLE;
  // A CUkernel of a library not used in the launch's context yet: the driver
  // loads the library into that context now (lazy loading, README "Modules").
  // One load and a predictable branch while one context launches it.
  if (owner == nullptr && function->module != nullptr && !library_placed_in(function->module, stream->ctx))
      [[unlikely]] {
    if (CUresult rc = place_library_at_launch(function, stream->ctx); rc != CUDA_SUCCESS) return rc;
  }
  if (stream->capture.load(std::memory_order_acquire) != nullptr) return capture(function, l, stream);
  return launch_on_stream(function, stream, std::uint64_t{l.grid[0]} * l.grid[1] * l.grid[2]);
}

Launch from_args(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                 CUstream stream, void** params, void** extra) {
  return Launch{{gx, gy, gz}, {bx, by, bz}, shared, stream, params, extra};
}

CUresult launch_ex(const CUlaunchConfig* config, CUfunction f, void** kernelParams, void** extra, bool ptsz) {
  if (config == nullptr || (config->numAttrs > 0 && config->attrs == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  bool cooperative = false;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    if (config->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && config->attrs[i].value.cooperative != 0) {
      cooperative = true;
    }
  }
  Launch l = from_args(config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                       config->blockDimZ, config->sharedMemBytes, config->hStream, kernelParams, extra);
  return launch(f, l, ptsz, cooperative);
}

}  // namespace

namespace gpuslice::fakecuda {

CUresult launch_on_stream(CUfunc_st* function, CUstream_st* stream, std::uint64_t blocks) {
  const StateHeader& header = state().header();
  if (header.profile != 0) [[unlikely]]
    return sched_launch(stream, function->duration_ns, blocks);
  std::uint64_t duration = function->duration_ns;
  if (header.jitter_pct != 0 || header.launch_cost_ns != 0) [[unlikely]] {
    const std::uint32_t dev = stream->ctx->device;
    duration = jittered_ns(header, dev, state().device(dev).kernels.load(std::memory_order_relaxed), duration) +
               header.launch_cost_ns;
  }
  std::uint64_t end = timeline_submit(state(), stream->ctx->device, duration, runtime().submitter);
  note_stream_work(stream, end);
  return CUDA_SUCCESS;
}

}  // namespace gpuslice::fakecuda

extern "C" CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                   unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream, void** kernelParams, void** extra) {
  return launch(f,
                from_args(gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, extra),
                false, false);
}

extern "C" CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                        void** kernelParams, void** extra) {
  return launch(f,
                from_args(gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, extra),
                true, false);
}

extern "C" CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                              void** kernelParams) {
  return launch(f,
                from_args(gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, nullptr),
                false, true);
}

extern "C" CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                   unsigned int gridDimZ, unsigned int blockDimX,
                                                   unsigned int blockDimY, unsigned int blockDimZ,
                                                   unsigned int sharedMemBytes, CUstream hStream, void** kernelParams) {
  return launch(f,
                from_args(gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                          kernelParams, nullptr),
                true, true);
}

extern "C" CUresult cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** kernelParams, void** extra) {
  return launch_ex(config, f, kernelParams, extra, false);
}

extern "C" CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig* config, CUfunction f, void** kernelParams,
                                          void** extra) {
  return launch_ex(config, f, kernelParams, extra, true);
}

// Deprecated launches (cuda.h, "Execution Control [DEPRECATED]"): the block
// shape and dynamic shared memory come from cuFuncSetBlockShape /
// cuFuncSetSharedSize; cuLaunch runs a 1x1 grid, cuLaunchGrid a w x h grid on
// the NULL stream, cuLaunchGridAsync on the given stream. Kernel parameters
// (cuParamSet*) are not modelled: the simulated kernels take none.
namespace {
CUresult legacy_launch(CUfunction f, int grid_w, int grid_h, CUstream stream) {
  if (!initialized()) return uninitialized_error();
  CUfunc_st* function = function_from_handle(f);
  if (function == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (grid_w <= 0 || grid_h <= 0) return CUDA_ERROR_INVALID_VALUE;
  Launch l = from_args(static_cast<unsigned>(grid_w), static_cast<unsigned>(grid_h), 1,
                       function->legacy_block[0].load(), function->legacy_block[1].load(),
                       function->legacy_block[2].load(), function->legacy_shared.load(), stream, nullptr, nullptr);
  return launch(f, l, false, false);
}
}  // namespace

extern "C" CUresult cuFuncSetBlockShape(CUfunction hfunc, int x, int y, int z) {
  if (!initialized()) return uninitialized_error();
  CUfunc_st* function = function_from_handle(hfunc);
  if (function == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (x <= 0 || y <= 0 || z <= 0) return CUDA_ERROR_INVALID_VALUE;
  function->legacy_block[0].store(static_cast<unsigned>(x));
  function->legacy_block[1].store(static_cast<unsigned>(y));
  function->legacy_block[2].store(static_cast<unsigned>(z));
  return CUDA_SUCCESS;
}

extern "C" CUresult cuFuncSetSharedSize(CUfunction hfunc, unsigned int bytes) {
  if (!initialized()) return uninitialized_error();
  CUfunc_st* function = function_from_handle(hfunc);
  if (function == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  function->legacy_shared.store(bytes);
  return CUDA_SUCCESS;
}

extern "C" CUresult cuLaunch(CUfunction f) { return legacy_launch(f, 1, 1, nullptr); }
extern "C" CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
  return legacy_launch(f, grid_width, grid_height, nullptr);
}
extern "C" CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream) {
  return legacy_launch(f, grid_width, grid_height, hStream);
}

// One cooperative launch per entry, each on its own stream (cuda.h: "a
// kernel on each of the devices"); flags (the pre/post-launch syncs) change
// nothing the simulator models.
extern "C" CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS* launchParamsList, unsigned int numDevices,
                                                         unsigned int flags) {
  (void)flags;
  if (launchParamsList == nullptr || numDevices == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!initialized()) return uninitialized_error();
  for (unsigned i = 0; i < numDevices; ++i) {
    const CUDA_LAUNCH_PARAMS& p = launchParamsList[i];
    Launch l = from_args(p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ, p.sharedMemBytes,
                         p.hStream, p.kernelParams, nullptr);
    if (CUresult rc = launch(p.function, l, false, true); rc != CUDA_SUCCESS) return rc;
  }
  return CUDA_SUCCESS;
}
