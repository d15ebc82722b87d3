// The queue bound's driver side (launch_queue.cc): event markers recorded
// behind the launches and polled for completion (docs/limiter.md, "queue
// bound"); its arithmetic is limiter/compute_queue.h's.
#pragma once

#include <cuda.h>

#include "hook/launch_state.h"

namespace gpuslice::hook::launch {

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

}  // namespace gpuslice::hook::launch
