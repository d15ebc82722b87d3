// The launch path's state (launch_state.h).
// gpuslice: hot path (no heap, no locks)
#include "hook/launch_state.h"

#include "platform/clock.h"

namespace gpuslice::hook::launch {

std::atomic<int> g_mode{kModeCold};
std::atomic<int> g_single_ordinal{-1};
std::atomic<std::uint32_t> g_used_entries{0};
LaunchDevice g_dev[kMaxDevices];
[[gnu::tls_model("initial-exec")]] constinit thread_local ThreadCounts t_counts[kMaxDevices] = {};

std::uint64_t mono_ns() noexcept { return platform::monotonic_ns(); }
void sleep_ns(std::uint64_t ns) noexcept { platform::sleep_ns(ns); }

}  // namespace gpuslice::hook::launch
