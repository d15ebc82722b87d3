// The device timeline: every process's kernels on a device run one at a time,
// in submission order. Lock-free (one CAS on busy_until per kernel, one ring
// append) because launch benchmarks run through it.
#pragma once

#include <cstdint>

#include "state.h"

namespace gpuslice::fakecuda {

struct Submitter {
  int slot;                // own process slot, or -1
  std::uint32_t pid;       // in the caller's namespace
  std::uint32_t host_pid;  // as NVML reports it
};

// Schedules `duration_ns` of work on `dev` and returns its end time
// (CLOCK_MONOTONIC ns). Zero-length work occupies no time but still completes
// only after everything submitted before it.
std::uint64_t timeline_submit(State& state, std::uint32_t dev, std::uint64_t duration_ns, const Submitter& who);

// Appends one busy interval [start, end) of `pids` (host_pid << 32 | pid) to the ring.
void timeline_append(State& state, std::uint32_t dev, std::uint64_t start, std::uint64_t end, std::uint64_t pids);

// Device time inside [t0, t1) spent on kernels of `pid` (matched against the
// recorded pid or host pid; 0 = every process).
std::uint64_t timeline_busy_ns(State& state, std::uint32_t dev, std::uint32_t pid, std::uint64_t t0, std::uint64_t t1);

// Per-process busy time in [t0, t1): calls visit(host_pid, busy_ns) once per host pid seen.
template <typename Visit>
void timeline_busy_by_process(State& state, std::uint32_t dev, std::uint64_t t0, std::uint64_t t1, Visit&& visit);

// Reads every complete ring entry still held; visit(start, end, pids).
template <typename Visit>
void timeline_for_each(State& state, std::uint32_t dev, Visit&& visit) {
  DeviceShared& device = state.device(dev);
  RingEntry* ring = state.ring(dev);
  const std::uint64_t entries = state.header().ring_entries;
  std::uint64_t head = device.ring_head.load(std::memory_order_acquire);
  std::uint64_t first = head > entries ? head - entries : 0;
  for (std::uint64_t i = first; i < head; ++i) {
    RingEntry& entry = ring[i & (entries - 1)];
    std::uint64_t seq = entry.seq.load(std::memory_order_acquire);
    if (seq != 2 * i + 2) continue;  // being written, or already overwritten by a newer lap
    std::uint64_t start = entry.start_ns.load(std::memory_order_acquire);
    std::uint64_t end = entry.end_ns.load(std::memory_order_acquire);
    std::uint64_t pids = entry.pids.load(std::memory_order_acquire);
    if (entry.seq.load(std::memory_order_relaxed) != seq) continue;
    visit(start, end, pids);
  }
}

template <typename Visit>
void timeline_busy_by_process(State& state, std::uint32_t dev, std::uint64_t t0, std::uint64_t t1, Visit&& visit) {
  constexpr int kMax = 256;
  std::uint32_t pids[kMax];
  std::uint64_t busy[kMax];
  int count = 0;
  timeline_for_each(state, dev, [&](std::uint64_t start, std::uint64_t end, std::uint64_t packed) {
    std::uint64_t lo = start > t0 ? start : t0;
    std::uint64_t hi = end < t1 ? end : t1;
    if (hi <= lo) return;
    auto host = static_cast<std::uint32_t>(packed >> 32);
    for (int i = 0; i < count; ++i) {
      if (pids[i] == host) {
        busy[i] += hi - lo;
        return;
      }
    }
    if (count < kMax) {
      pids[count] = host;
      busy[count++] = hi - lo;
    }
  });
  for (int i = 0; i < count; ++i) visit(pids[i], busy[i]);
}

}  // namespace gpuslice::fakecuda
