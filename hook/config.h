// Configuration of the preload library: the options as parsed once, and the
// modes derived from them that hot paths test (config.cc). Depends on nothing
// else in hook/: the driver layer (real.cc) and everything above read it.
#pragma once

#include <cuda.h>

#include <atomic>

#include "limiter/options/options.h"
#include "shm/region_file.h"

namespace gpuslice::hook {

struct Config {
  options::Options options;
  bool valid;        // options parsed without error
  shm::Error error;  // the one-line reason when !valid
};

// Options parsed once from environ, then the configuration file for what the
// environment does not set (limiter/options/file.h; no getenv, no heap).
const Config& config() noexcept;

// The error every hooked call returns once bootstrap failed closed (bad option,
// unusable region, full region, no driver): what the driver returns when
// cuInit failed. Documented in the README.
inline constexpr CUresult kFailClosed = CUDA_ERROR_NOT_INITIALIZED;

// Whether memory oversubscription (GPUSLICE_OVERSUBSCRIBE,
// GPUSLICE_MEMORY_RESIDENT; hook/oversub.h) is on.
// 0 until first asked, then 1 (neither option set) or 2 (oversubscription on).
[[gnu::visibility("hidden")]] extern std::atomic<int> g_oversub_state;
[[gnu::cold, gnu::noinline]] bool oversub_init() noexcept;
inline bool oversubscribing() noexcept {
  const int s = g_oversub_state.load(std::memory_order_relaxed);
  if (__builtin_expect(s == 1, 1)) return false;
  return s == 2 || oversub_init();
}

}  // namespace gpuslice::hook
