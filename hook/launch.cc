// Admission of kernel launches. Every launch path — cuLaunchKernel,
// cuLaunchKernelEx, cooperative and legacy launches, their per-thread-stream
// variants and cuGraphLaunch — comes here from launch_wrappers.cc, by
// exported symbol, dlsym or cuGetProcAddress.
//
// Without a compute limit on any device the wrapper is one load, one
// predictable branch and a tail call. With one, admit() finds the device the
// launch runs on (the stream's: a kernel launched into a stream of device 1
// runs on device 1 whatever context is current), prices the launch, spends it
// from the container's shared bucket (limiter/compute.h) and, when the bucket
// is in debt, sleeps; every few launches it also checks the queue bound
// (launch_queue.cc). docs/limiter.md has the design.
// gpuslice: hot path (no heap, no locks)
#include "hook/launch.h"

#include <cuda.h>

#include "hook/launch_queue.h"
#include "hook/launch_streams.h"
#include "hook/priority_gate.h"
#include "hook/wrap.h"
#include "limiter/compute.h"

namespace gpuslice::hook::launch {

namespace {

constexpr std::uint32_t kCheckEvery = 16;          // launches per thread between checks
constexpr std::uint64_t kCheckCostNs = 1'000'000;  // or this much priced time

// No device to charge (no current context for a default stream, or a driver
// that cannot tell a stream's device): the launch most likely fails in the
// driver and is refunded; if it runs, it is charged to the first limited
// device rather than to nobody.
[[gnu::noinline, gnu::cold]] int unresolved_ordinal() noexcept {
  for (unsigned i = 0; i < kMaxDevices; ++i)
    if (g_dev[i].state != nullptr && g_dev[i].limited.load(std::memory_order_relaxed) != 0) return static_cast<int>(i);
  return -1;
}

// Spends `cost` from the bucket, and a small launch's next prices with it
// (limiter::spend_ahead). True when the launch may go at once.
inline bool spend(DeviceState& state, ThreadCounts& tc, std::int64_t cost) noexcept {
  const std::int64_t ahead = limiter::ahead_for(cost);
  if (ahead == 0) return limiter::spend(state, cost);
  bool go = false;
  const std::int64_t taken = limiter::spend_ahead(state, cost, ahead, &go);
  if (taken != 0) {
    tc.credit += taken;
    if (__builtin_expect(t_credit_owner == 0, 0)) arm_credit_return();
  }
  return go;
}

}  // namespace

CUresult admit(std::uint64_t work, bool nominal, std::uint32_t kernels, CUstream s, bool ptsz, Ticket* t) noexcept {
  if (__builtin_expect(g_mode.load(std::memory_order_acquire) == kModeCold, 0)) {
    const CUresult rc = init_launch_path();
    if (rc != CUDA_SUCCESS) return rc;
  }
  int ordinal = g_single_ordinal.load(std::memory_order_relaxed);
  if (ordinal < 0) {
    ordinal = stream_ordinal(s, ptsz);
    if (ordinal < 0) ordinal = unresolved_ordinal();
    if (ordinal < 0) return CUDA_SUCCESS;  // no limited device: nothing to charge
  }
  if (static_cast<unsigned>(ordinal) >= kMaxDevices) return CUDA_SUCCESS;
  LaunchDevice& d = g_dev[ordinal];
  if (priority_admit(ordinal, s, ptsz)) {
    t->priority = true;
    t->ordinal = ordinal;
  }
  if (d.limited.load(std::memory_order_relaxed) == 0) return CUDA_SUCCESS;
  if (__builtin_expect(d.used.load(std::memory_order_relaxed) == 0, 0)) {
    d.used.store(1, std::memory_order_relaxed);
    g_used_entries.fetch_or(1u << d.entry, std::memory_order_relaxed);
  }
  DeviceState& state = *d.state;
  const std::uint64_t nominal_ns = nominal ? work : limiter::nominal_ns(work, d.sm_recip);
  const std::int64_t cost = limiter::price_ns(nominal_ns, state.cost_scale_ppm.load(std::memory_order_relaxed));
  ThreadCounts& tc = t_counts[ordinal];
  tc.launches += kernels;
  tc.cost += static_cast<std::uint64_t>(cost);
  const std::uint32_t every = d.calibrated.load(std::memory_order_relaxed) != 0 ? kCheckEvery : 1;
  if (++tc.since_check >= every || tc.cost >= kCheckCostNs) t->marker = check_queue(d, tc, s, ptsz);
  if (tc.credit >= cost) {
    tc.credit -= cost;  // taken ahead by an earlier launch of this thread
  } else if (!spend(state, tc, cost)) {
    if (capturing(s, ptsz)) {
      limiter::refund(state, cost);
      return CUDA_SUCCESS;
    }
    limiter::wait_for_credit(state, mono_ns, sleep_ns);
  }
  t->dev = &d;
  t->ordinal = ordinal;
  t->cost = cost;
  t->kernels = kernels;
  return CUDA_SUCCESS;
}

void settle(const Ticket& t, CUresult rc, CUstream s, bool ptsz) noexcept {
  if (__builtin_expect(t.priority, 0)) priority_after_launch(t.ordinal, s, ptsz, rc == CUDA_SUCCESS);
  if (t.dev == nullptr) return;
  if (rc != CUDA_SUCCESS) {
    // Not launched: give the price back and uncount it (this thread's counts
    // may have been flushed since; then the statistics keep one stray launch).
    limiter::refund(*t.dev->state, t.cost);
    ThreadCounts& tc = t_counts[t.ordinal];
    if (tc.launches >= t.kernels && tc.cost >= static_cast<std::uint64_t>(t.cost)) {
      tc.launches -= t.kernels;
      tc.cost -= static_cast<std::uint64_t>(t.cost);
    }
    return;
  }
  if (t.marker) {
    record_marker(*t.dev, s, ptsz);
    if (t.dev->calibrated.load(std::memory_order_relaxed) == 0) wait_while_uncalibrated(*t.dev);
  }
}

}  // namespace gpuslice::hook::launch
