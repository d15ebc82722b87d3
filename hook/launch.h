// Admission of kernel launches (launch.cc): what every launch wrapper runs
// around its driver call (gated(), unlimited()). The launch path's files are
// listed in launch_state.h; docs/limiter.md has the design.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "hook/launch_init.h"
#include "hook/launch_state.h"

namespace gpuslice::hook::launch {

struct Ticket {
  LaunchDevice* dev = nullptr;  // null: nothing to settle
  int ordinal = 0;
  std::int64_t cost = 0;
  std::uint32_t kernels = 0;
  bool marker = false;
  bool priority = false;  // priority_after_launch() once queued (hook/priority_gate.h)
};

// Admission of one launch (or one graph) on stream `s`: `work` is a block
// count, or when `nominal` is set an already-computed nominal_ns. The launch
// is charged to the stream's device. Returns the error to hand back (bootstrap
// failed), else CUDA_SUCCESS with *t filled when charged.
[[gnu::noinline]] CUresult admit(std::uint64_t work, bool nominal, std::uint32_t kernels, CUstream s, bool ptsz,
                                 Ticket* t) noexcept;
void settle(const Ticket& t, CUresult rc, CUstream s, bool ptsz) noexcept;

inline bool unlimited() noexcept {
  if (__builtin_expect(g_mode.load(std::memory_order_acquire) == kModeUnlimited, 1)) {
    if (__builtin_expect((++t_unlimited_launches % kRecheckEvery) != 0, 1)) return true;
    return !recheck_limits();
  }
  return false;
}

// The split form of unlimited() for the wrappers whose fast path is a bare
// tail call (launch_wrappers.cc): unlimited_turn() counts the launch and is
// true while the process is unlimited and it is not this thread's turn to
// read the limits again; after it said false, unlimited_after_turn() (out of
// line, in the slow twin) decides without counting the launch twice.
inline bool unlimited_turn() noexcept {
  return g_mode.load(std::memory_order_acquire) == kModeUnlimited && (++t_unlimited_launches % kRecheckEvery) != 0;
}
inline bool unlimited_after_turn() noexcept {
  if (g_mode.load(std::memory_order_acquire) != kModeUnlimited) return false;
  if (t_unlimited_launches % kRecheckEvery != 0) return true;  // the slow path came for another reason
  return !recheck_limits();
}

inline std::uint64_t blocks(unsigned gx, unsigned gy, unsigned gz) noexcept { return std::uint64_t{gx} * gy * gz; }

template <class Launch>
CUresult gated(std::uint64_t work, bool nominal, std::uint32_t kernels, CUstream s, bool ptsz,
               Launch&& launch) noexcept {
  Ticket t;
  CUresult rc = admit(work, nominal, kernels, s, ptsz, &t);
  if (rc != CUDA_SUCCESS) return rc;
  rc = launch();
  settle(t, rc, s, ptsz);
  return rc;
}

}  // namespace gpuslice::hook::launch
