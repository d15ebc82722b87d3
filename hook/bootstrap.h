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

// Frameworks size themselves from their first cuMemGetInfo (vLLM,
// TensorFlow, JAX's preallocation): memory of the container's processes that
// died without exiting must not be in it. One full pass of the reaper (a
// slot-lock probe per live slot, a /proc read for those not held), at a
// process's first query only (hook/query.cc): a start itself does a bounded
// sweep, whatever the number of live processes (issue 35).
[[gnu::cold, gnu::noinline]] void reap_before_first_query() noexcept;

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
