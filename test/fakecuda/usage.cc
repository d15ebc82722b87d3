// Per-process views of the shared state, shared by the fake NVML, fakecuda-ctl
// and the fakecuda_* test API so they cannot disagree.
#include "state.h"

namespace gpuslice::fakecuda {

int collect_usage_locked(State& state, int dev, ProcessUsage* out, int max) {
  int count = 0;
  StateHeader& header = state.header();
  const int high = state.slots_high();
  for (int i = 0; i < high; ++i) {
    const ProcSlot& slot = header.slot[i];
    if (slot.state.load(std::memory_order_acquire) == 0) continue;
    for (std::uint32_t d = 0; d < header.devices; ++d) {
      if (dev >= 0 && d != static_cast<std::uint32_t>(dev)) continue;
      std::uint32_t contexts = slot.contexts[d].load(std::memory_order_relaxed);
      std::uint64_t alloc = slot.alloc_bytes[d].load(std::memory_order_relaxed);
      std::uint64_t context = slot.context_bytes[d].load(std::memory_order_relaxed);
      // Like NVML: a process is on a device when it has a context or memory there.
      if (contexts == 0 && alloc == 0 && context == 0) continue;
      if (count < max) {
        out[count] = ProcessUsage{slot.pid.load(std::memory_order_relaxed),
                                  slot.host_pid.load(std::memory_order_relaxed),
                                  d,
                                  contexts,
                                  alloc + context,
                                  context,
                                  slot.busy_ns[d].load(std::memory_order_relaxed),
                                  slot.graphics[d].load(std::memory_order_relaxed)};
      }
      ++count;
    }
  }
  return count;
}

}  // namespace gpuslice::fakecuda
