// Bootstrap of the preload library (bootstrap.cc): options, driver, region and
// this process's slot, lazily on the first hooked call, allocation-free,
// thread-safe and re-entrancy-safe; after fork() (or _Fork, clone) the child
// starts over and claims a slot of its own.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "hook/lifecycle.h"
#include "hook/process.h"

namespace gpuslice::hook {

// Slow path: bootstrap (options, driver, region, slot). Returns CUDA_SUCCESS or
// the fail-closed error.
[[gnu::cold, gnu::noinline]] CUresult bootstrap() noexcept;

// The hot-path test every accounting wrapper starts with.
inline CUresult ensure_ready() noexcept {
  if (__builtin_expect(g_ready.load(std::memory_order_acquire) == kReadyYes, 1)) return CUDA_SUCCESS;
  return bootstrap();
}

// A child the kernel forked without our fork handler (_Fork, raw clone)
// still holds its parent's slot index: it claims its own (one thread does,
// the others yield; the claim takes no loader lock) before any accounting.
[[gnu::cold, gnu::noinline]] bool adopt_as_new_process() noexcept;

// The slot this process may account on, or -1. Hot path: two loads.
inline int own_slot() noexcept {
  if (__builtin_expect(g_owner.load(std::memory_order_relaxed)->load(std::memory_order_acquire) != kSlotOurs, 0) &&
      !adopt_as_new_process())
    return -1;
  return g_process.slot.load(std::memory_order_acquire);
}

}  // namespace gpuslice::hook
