// Wrapped and unwrapped entry points in one process, for ns-per-call
// comparisons on the simulated driver. The unwrapped ones come from the
// simulated libcuda.so.1 (dlopen by path); the wrapped ones are libgpuslice.so's
// exported wrappers, taken with dlsym on its own handle (dlopen, not preload),
// which forward to that very driver (GPUSLICE_REAL_LIBCUDA names it). The
// library reads its options (region, limits) from the environment at its first
// hooked call, so the process must be started with them: see main.cc.
#pragma once

#include <cuda.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace gpuslice::microbench {

// The calls under test, one set per side.
struct Calls {
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuLaunchKernel) launch = nullptr;
  decltype(&::cuLaunchKernelEx) launch_ex = nullptr;
  decltype(&::cuGraphLaunch) graph_launch = nullptr;
  decltype(&::cuMemAlloc) alloc = nullptr;  // cuMemAlloc_v2
  decltype(&::cuMemFree) free = nullptr;    // cuMemFree_v2
  decltype(&::cuMemAllocAsync) alloc_async = nullptr;
  decltype(&::cuMemFreeAsync) free_async = nullptr;
  decltype(&::cuMemGetInfo) get_info = nullptr;              // cuMemGetInfo_v2
  decltype(&::cuGetProcAddress) get_proc_address = nullptr;  // cuGetProcAddress_v2
};

inline constexpr int kMaxThreads = 32;

struct Fixture {
  Calls native;   // the simulated driver's own entry points
  Calls wrapped;  // libgpuslice.so's wrappers of the same entry points
  decltype(&::cuCtxSetCurrent) set_current = nullptr;
  decltype(&::cuStreamSynchronize) stream_synchronize = nullptr;
  CUcontext ctx = nullptr;
  CUfunction empty = nullptr;
  CUfunction spin = nullptr;        // spin_50us: 50 us of simulated device time
  std::vector<CUstream> streams;    // one per benchmark thread
  std::vector<CUgraphExec> graphs;  // one empty-kernel graph per thread
  std::size_t quota_seen = 0;       // cuMemGetInfo total through the wrapper
  std::size_t total_native = 0;     // cuMemGetInfo total from the driver
  std::thread load;                 // calibration load, see start_calibration_load
  std::atomic<bool> stop_load{false};
};

// Loads both sides, bootstraps the library and builds the context, streams and
// graphs. Throws std::runtime_error naming what failed.
void setup_fixture(Fixture& f, const std::string& driver_path, const std::string& library_path);

// The compute limiter prices a launch by an estimate (grid size x a prior)
// until it has measured the container's device time per estimated nanosecond;
// kernels of 0 us give it nothing to measure, so it never leaves that
// cautious start. To measure the steady state as well, this thread adds a
// light real load from the same process through the driver's own entry
// point (not counted as admissions): one spin_50us kernel every 2 ms (2.5% of
// the device). It then lets the limiter calibrate for `warmup_s` while
// launching empty kernels through the wrapper, and returns the wall ns per
// wrapped launch measured afterwards (a calibrated limiter with tokens to
// spare launches in well under a microsecond).
double start_calibration_load(Fixture& f, double warmup_s);
void stop_calibration_load(Fixture& f);

}  // namespace gpuslice::microbench
