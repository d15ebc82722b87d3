#include "timeline.h"

#include "scheduler.h"

namespace gpuslice::fakecuda {

void timeline_append(State& state, std::uint32_t dev, std::uint64_t start, std::uint64_t end, std::uint64_t pids) {
  DeviceShared& device = state.device(dev);
  const std::uint64_t entries = state.header().ring_entries;
  std::uint64_t index = device.ring_head.fetch_add(1, std::memory_order_acq_rel);
  RingEntry& entry = state.ring(dev)[index & (entries - 1)];
  // Sequence lock: odd while the fields are rewritten, 2*index+2 once complete.
  // Release stores on the fields (not a fence, which TSan cannot model): a
  // reader that sees a new field value also sees the odd sequence number.
  entry.seq.store(2 * index + 1, std::memory_order_relaxed);
  entry.start_ns.store(start, std::memory_order_release);
  entry.end_ns.store(end, std::memory_order_release);
  entry.pids.store(pids, std::memory_order_release);
  entry.seq.store(2 * index + 2, std::memory_order_release);
}

std::uint64_t timeline_submit(State& state, std::uint32_t dev, std::uint64_t duration_ns, const Submitter& who) {
  DeviceShared& device = state.device(dev);
  const std::uint64_t now = mono_ns();
  std::uint64_t busy_until = device.busy_until_ns.load(std::memory_order_acquire);
  if (duration_ns == 0) return busy_until > now ? busy_until : now;
  std::uint64_t start = 0;
  std::uint64_t end = 0;
  // One kernel at a time per device, in submission order across processes:
  // claim [max(now, busy_until), +duration) by CAS.
  do {
    start = busy_until > now ? busy_until : now;
    end = start + duration_ns;
  } while (!device.busy_until_ns.compare_exchange_weak(busy_until, end, std::memory_order_acq_rel,
                                                       std::memory_order_acquire));
  timeline_append(state, dev, start, end, (std::uint64_t{who.host_pid} << 32) | who.pid);
  device.busy_total_ns.fetch_add(duration_ns, std::memory_order_relaxed);
  device.kernels.fetch_add(1, std::memory_order_relaxed);
  if (who.slot >= 0) {
    state.header().slot[who.slot].busy_ns[dev].fetch_add(duration_ns, std::memory_order_relaxed);
  }
  return end;
}

std::uint64_t timeline_busy_ns(State& state, std::uint32_t dev, std::uint32_t pid, std::uint64_t t0, std::uint64_t t1) {
  sched_catch_up(state);  // the realistic scheduler writes the ring lazily
  std::uint64_t busy = 0;
  timeline_for_each(state, dev, [&](std::uint64_t start, std::uint64_t end, std::uint64_t pids) {
    if (pid != 0 && static_cast<std::uint32_t>(pids) != pid && static_cast<std::uint32_t>(pids >> 32) != pid) return;
    std::uint64_t lo = start > t0 ? start : t0;
    std::uint64_t hi = end < t1 ? end : t1;
    if (hi > lo) busy += hi - lo;
  });
  return busy;
}

}  // namespace gpuslice::fakecuda
