// The node agent's extra (DeviceState::agent_extra_bytes: memory NVML shows
// beyond the container's count) is in force only while the agent that wrote
// it is alive: its heartbeat (RegionHeader::agent_heartbeat_ns, CLOCK_MONOTONIC,
// written at the start of every cycle before any extra) is at most
// kAgentExtraHoldNs old. A SIGKILLed agent's last value then stops shrinking
// the quota within that bound instead of until an agent runs again. A
// heartbeat of 0 (no agent ever cycled on the region, so no agent wrote the
// value) and one ahead of our clock keep the value in force.
//
// Read only where admission already reads the extra (the refill and slow
// paths, never the lease fast path), and the clock only when the extra is
// not 0: a coarse-clock read (vDSO, no syscall), which lags by at most a tick
// and so only keeps the value slightly longer.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>

#include "gpuslice/region.h"

namespace gpuslice::limiter {

// Ten times the agent's default --interval and more than any cycle of a live
// agent takes; an agent run with --interval above it has its extra lapse
// between cycles (docs/agent.md).
inline constexpr std::uint64_t kAgentExtraHoldNs = 10'000'000'000;

// Whether an extra with heartbeat `beat` is in force at `now_ns`.
constexpr bool agent_extra_fresh(std::uint64_t beat, std::uint64_t now_ns) noexcept {
  return beat == 0 || now_ns <= beat || now_ns - beat <= kAgentExtraHoldNs;
}

// The extra that counts against the quota of `d` (a device of `r`) now.
inline std::uint64_t agent_extra_in_force(const Region* r, const DeviceState& d) noexcept {
  const std::uint64_t extra = d.agent_extra_bytes.load(std::memory_order_acquire);
  if (extra == 0) return 0;
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const std::uint64_t now =
      static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<std::uint64_t>(ts.tv_nsec);
  return agent_extra_fresh(r->header.agent_heartbeat_ns.load(std::memory_order_relaxed), now) ? extra : 0;
}

}  // namespace gpuslice::limiter
