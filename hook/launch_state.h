// The launch path's state (launch_state.cc): the mode every launch wrapper
// tests first, the per-device state admission and the queue bound share,
// each thread's counts, and the clock they run on. docs/limiter.md has the
// design. The launch path's files, bottom up:
//   launch_state.h      this state
//   launch_streams.h    the device of a stream (cached per stream)
//   launch_queue.h      the queue bound (event markers behind the launches,
//                       in a ring of launch_markers.h)
//   launch_init.h       first-launch initialisation, fork, the feedback
//                       thread's wiring, the thread's credit at its exit
//   launch.h            admission: the launch's device, its price, the bucket
//   launch_wrappers.cc  the exported launch entry points
//   launch_markers.h    the launch side's driver layer, shared with priority:
//                       a stream's context and device, capture, event markers
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
// unlimited: then the wrappers call the driver straight away. Hidden on the
// declaration too (-fvisibility=hidden covers definitions only): read
// PC-relative by every file, as by the file that defines them.
[[gnu::visibility("hidden")]] extern std::atomic<int> g_mode;
// The ordinal when the process sees one device, and the entries launched on
// (the feedback thread's work list).
[[gnu::visibility("hidden")]] extern std::atomic<int> g_single_ordinal;
[[gnu::visibility("hidden")]] extern std::atomic<std::uint32_t> g_used_entries;

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
[[gnu::visibility("hidden")]] extern LaunchDevice g_dev[kMaxDevices];

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

// The clock and the sleep of the launch path (limiter's waits take them).
std::uint64_t mono_ns() noexcept;
void sleep_ns(std::uint64_t ns) noexcept;

}  // namespace gpuslice::hook::launch
