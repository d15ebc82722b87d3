// The launch path's shared pieces (hook/launch*.cc): the mode every launch
// wrapper tests first, the per-device state, and admission. docs/limiter.md
// has the design.
//   launch.cc           admission: which device a launch runs on (cached per
//                       stream), its price, the bucket
//   launch_queue.cc     the queue bound (event markers behind the launches,
//                       in a ring of launch_markers.h)
//   launch_markers.h    the launch side's driver layer, shared with priority:
//                       a stream's context and device, capture, event markers
//   launch_init.cc      first-launch initialisation, fork, the feedback thread's wiring
//   launch_wrappers.cc  the exported launch entry points
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"
#include "hook/launch_markers.h"
#include "limiter/compute_queue.h"

namespace gpuslice::hook::launch {

enum : int { kModeCold = 0, kModeUnlimited = 1, kModeLimited = 2 };
// kModeUnlimited only once bootstrap succeeded and every visible device is
// unlimited: then the wrappers call the driver straight away.
extern std::atomic<int> g_mode;
extern std::atomic<int> g_single_ordinal;          // the ordinal when the process sees one device
extern std::atomic<std::uint32_t> g_used_entries;  // entries launched on (feedback thread's work list)

struct Marker {
  CUevent event;
  std::uint64_t recorded_ns;
  std::uint64_t count;  // queue.submitted_count() when recorded
  std::uint64_t cost;   // queue.submitted_cost() when recorded
};
inline constexpr unsigned kMarkers = 32;

struct alignas(64) LaunchDevice {
  // Read by every limited launch.
  std::atomic<int> limited{0};
  std::atomic<int> calibrated{0};
  std::atomic<int> used{0};
  int entry = -1;
  DeviceState* state = nullptr;
  std::uint64_t sm_recip = 1;
  // Queue bound, process-local (its arithmetic: limiter/compute_queue.h).
  // Counters flushed from threads at checks.
  alignas(64) limiter::QueueBound queue;
  MarkerRing<Marker, kMarkers> markers;
};
extern LaunchDevice g_dev[kMaxDevices];

struct ThreadCounts {
  std::uint32_t launches;
  std::uint32_t since_check;
  std::uint64_t cost;
  // Prices this thread took from the bucket ahead of its launches and has
  // not spent yet (limiter::spend_ahead): kept across checks, given back
  // when the thread exits, cleared in a forked child.
  std::int64_t credit;
};
[[gnu::tls_model("initial-exec")]] extern constinit thread_local ThreadCounts t_counts[kMaxDevices];

std::uint64_t mono_ns() noexcept;
void sleep_ns(std::uint64_t ns) noexcept;

// --- queue bound (launch_queue.cc) ---
// Markers use the driver's event API (markers_available(), launch_markers.h):
// without it the limiter runs without its queue bound. Launches into a
// capturing stream (capturing(), launch_markers.h) do not run: they are
// neither throttled nor followed by a marker.
// Every few launches per thread: publish this thread's counts, retire markers,
// sleep while the queue is over its bound; true when a marker is due behind this launch.
[[gnu::noinline, gnu::cold]] bool check_queue(LaunchDevice& d, ThreadCounts& tc, CUstream s, bool ptsz) noexcept;
void record_marker(LaunchDevice& d, CUstream s, bool ptsz) noexcept;
// While the device's price is still the prior (no measurement of the
// container's kernels yet), a launch returns only once its kernel completed:
// nothing is known of its length, so a process must not leave unmeasured
// work behind (it could exit and leave it queued, uncharged: issue 9,
// short-lived processes); it lives while its work runs, and the feedback
// measures it. Ends as soon as the price is measured.
[[gnu::noinline, gnu::cold]] void wait_while_uncalibrated(LaunchDevice& d) noexcept;
// Without a marker nothing tells us when the work completes.
void forget_queue(LaunchDevice& d) noexcept;
void reset_queue_after_fork(LaunchDevice& d) noexcept;

// The pid of the process whose buckets the thread's credit came from, once
// its return at thread exit is armed (0: not armed). Armed at the thread's
// first credit (the hook's thread-exit key: arm_thread_exit, hook/account.h),
// disarmed when the credit went back; a child forked without our handlers (_Fork, clone) finds
// another pid there and drops the parent's credit instead of returning it.
[[gnu::tls_model("initial-exec")]] extern constinit thread_local std::uint32_t t_credit_owner;
[[gnu::noinline, gnu::cold]] void arm_credit_return() noexcept;

// --- initialisation (launch_init.cc) ---
[[gnu::noinline, gnu::cold]] CUresult init_launch_path() noexcept;

// --- admission (launch.cc) ---
struct Ticket {
  LaunchDevice* dev = nullptr;  // null: nothing to settle
  int ordinal = 0;
  std::int64_t cost = 0;
  std::uint32_t kernels = 0;
  bool marker = false;
};

// Admission of one launch (or one graph) on stream `s`: `work` is a block
// count, or when `nominal` is set an already-computed nominal_ns. The launch
// is charged to the stream's device. Returns the error to hand back (bootstrap
// failed), else CUDA_SUCCESS with *t filled when charged.
[[gnu::noinline]] CUresult admit(std::uint64_t work, bool nominal, std::uint32_t kernels, CUstream s, bool ptsz,
                                 Ticket* t) noexcept;
void settle(const Ticket& t, CUresult rc, CUstream s, bool ptsz) noexcept;
// The device ordinal a launch on `s` runs on (cached per stream), or -1 when
// the driver cannot tell (no current context for a default stream).
int stream_ordinal(CUstream s, bool ptsz) noexcept;
// A stream handle the driver destroyed: its address may come back as a
// stream of another device.
void forget_stream(CUstream s) noexcept;
// Every stream of a destroyed context is gone too.
void forget_all_streams() noexcept;

// Every kRecheckEvery unlimited launches of a thread, the region's limits are
// read again: a limit set at run time (gpuslice-smi set, the agent) reaches a
// process that started without any, which has no feedback thread to see it.
inline constexpr std::uint32_t kRecheckEvery = 256;
[[gnu::tls_model("initial-exec")]] extern constinit thread_local std::uint32_t t_unlimited_launches;
// Re-reads the limits; true if the process is (now) limited.
[[gnu::cold, gnu::noinline]] bool recheck_limits() noexcept;

inline bool unlimited() noexcept {
  if (__builtin_expect(g_mode.load(std::memory_order_acquire) == kModeUnlimited, 1)) {
    if (__builtin_expect((++t_unlimited_launches % kRecheckEvery) != 0, 1)) return true;
    return !recheck_limits();
  }
  return false;
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
