// Device memory the driver takes without saying how much (contexts, modules):
// measured as this process's NVML usage after minus before the call that
// takes it, exact when no counting operation of the process overlapped
// (CountingOp, wrap.h). context.cc defines it; modules.cc uses it too.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace gpuslice::hook {

struct Measure {
  bool nvml;                  // before was read
  std::uint64_t before;       // NVML usage of this process
  std::uint64_t ops;          // the counts of counting operations (wrap.h) when read
  std::uint64_t committed;    // this process's counted bytes on the device
  bool quiet;                 // no counting operation was in flight at the start
};

// Serialises measured calls in the process (one measurement at a time).
std::mutex& measure_mutex() noexcept;
// Before the call (holding measure_mutex()).
Measure measure_before(CUdevice ordinal) noexcept;
// After it: the bytes the driver began to hold. An undisturbed measurement is
// exact (and stored in *remembered when given); a disturbed one returns
// *remembered when set, else the difference minus what the process's counted
// bytes moved meanwhile. 0 when NVML cannot see the process.
std::uint64_t measured_bytes(CUdevice ordinal, int entry, const Measure& m,
                             std::atomic<std::uint64_t>* remembered) noexcept;

}  // namespace gpuslice::hook
