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
#include "hook/launch.h"
#include "hook/priority_gate.h"

#include <cuda.h>

#include "hook/wrap.h"
#include "limiter/compute.h"

namespace gpuslice::hook::launch {

std::atomic<int> g_mode{kModeCold};
std::atomic<int> g_single_ordinal{-1};
std::atomic<std::uint32_t> g_used_entries{0};
LaunchDevice g_dev[kMaxDevices];
[[gnu::tls_model("initial-exec")]] constinit thread_local ThreadCounts t_counts[kMaxDevices] = {};

namespace {

constexpr std::uint32_t kCheckEvery = 16;          // launches per thread between checks
constexpr std::uint64_t kCheckCostNs = 1'000'000;  // or this much priced time

// --- the device of a stream ---
// A stream belongs to one context, hence one device, for its whole life; the
// driver is asked once per stream handle and the answer cached here, lock-free:
// direct-mapped words of (handle << 8) | (ordinal + 1). A handle the driver
// destroys is forgotten (cuStreamDestroy), since its address may come back as
// a stream of another device.
constexpr unsigned kStreamCacheBits = 8;
constexpr unsigned kStreamCache = 1u << kStreamCacheBits;
std::atomic<std::uint64_t> g_stream_cache[kStreamCache];

unsigned stream_home(std::uintptr_t key) noexcept {
  return static_cast<unsigned>(((key >> 3) * 0x9e3779b97f4a7c15ull) >> (64 - kStreamCacheBits));
}

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

int stream_ordinal(CUstream s, bool ptsz) noexcept {
  (void)ptsz;  // a _ptsz launch on the null stream goes to the per-thread stream: the current context's
  if (current_context_stream(s)) return current_ordinal();
  const auto key = reinterpret_cast<std::uintptr_t>(s);
  if ((key >> 56) != 0) return ask_stream_ordinal(s);  // does not fit a cache word
  std::atomic<std::uint64_t>& word = g_stream_cache[stream_home(key)];
  const std::uint64_t cached = word.load(std::memory_order_relaxed);
  if ((cached >> 8) == key && (cached & 0xff) != 0) return static_cast<int>(cached & 0xff) - 1;
  const int ordinal = ask_stream_ordinal(s);
  if (ordinal >= 0 && ordinal < static_cast<int>(kMaxDevices))
    word.store((std::uint64_t{key} << 8) | static_cast<std::uint64_t>(ordinal + 1), std::memory_order_relaxed);
  return ordinal;
}

void forget_stream(CUstream s) noexcept {
  const auto key = reinterpret_cast<std::uintptr_t>(s);
  if (current_context_stream(s) || (key >> 56) != 0) return;
  std::atomic<std::uint64_t>& word = g_stream_cache[stream_home(key)];
  std::uint64_t cached = word.load(std::memory_order_relaxed);
  if ((cached >> 8) == key) word.compare_exchange_strong(cached, 0, std::memory_order_relaxed);
}

void forget_all_streams() noexcept {
  for (auto& word : g_stream_cache) word.store(0, std::memory_order_relaxed);
}

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
  priority_admit(ordinal, s, ptsz);
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
