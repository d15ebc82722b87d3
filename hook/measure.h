// Device memory the driver takes without saying how much (contexts, modules):
// measured as this process's NVML usage after minus before the call that
// takes it, exact when no counting operation of the process overlapped
// (CountingOp, wrap.h), and never short when one stayed in flight (settled
// once it finished, measured_bytes). context.cc defines it; modules.cc uses it too.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace gpuslice::hook {

struct Measure {
  bool nvml;                // before was read
  std::uint64_t before;     // NVML usage of this process
  std::uint64_t ops;        // the counts of counting operations (wrap.h) when read
  std::uint64_t committed;  // this process's counted bytes on the device
  bool quiet;               // no counting operation was in flight at the start
};

// Serialises measured calls in the process (one measurement at a time).
// measure_before() closes the gate of counting operations
// (g_measure_gate, wrap.h); unlocking opens it again, so every path out of a
// measured call ends the measurement.
class MeasureMutex {
 public:
  void lock() noexcept { mu_.lock(); }
  void unlock() noexcept;

 private:
  std::mutex mu_;
};
MeasureMutex& measure_mutex() noexcept;
// Before the call (holding measure_mutex()). Closes the gate: counting
// operations (allocations, frees and every call that can release device
// memory: destroys, unloads, trims, synchronisations) that start from now on
// wait until the measurement ends; those in flight are waited for (bounded,
// kDrainNs) before NVML is read.
Measure measure_before(CUdevice ordinal) noexcept;
// The gate part of measure_before() alone (holding measure_mutex()): true
// when no counting operation is in flight now; *ops gets their counts.
bool close_gate_and_drain(std::uint64_t* ops) noexcept;
// Runs fn(ctx) with measure_mutex() held and the gate closed (counting
// operations drained, new ones held back; a warning naming `what` if one
// stayed in flight for kDrainNs). cuDeviceSetMemPool uses it so that no
// cuMemAllocAsync is between its look at the device's current pool and its
// driver call while the pool changes (pools.cc, which takes no lock itself).
CUresult gated_call(const char* what, CUresult (*fn)(void* ctx) noexcept, void* ctx) noexcept;
inline constexpr std::uint64_t kDrainNs = 2'000'000'000;
// How long a disturbed measurement waits after the call for the operations
// in flight to finish before it settles (measured_bytes).
inline constexpr std::uint64_t kSettleNs = 8'000'000'000;
// After it: the bytes the driver began to hold. An undisturbed measurement is
// exact (and stored in *remembered when given). A disturbed one (an
// operation stayed in flight past kDrainNs) is conservative: it waits, gate
// still closed, for the operations in flight to finish (bounded, kSettleNs)
// (counting the object at the fallback meanwhile, taken back before it
// returns) and returns the largest of *remembered (when set; else the difference
// minus what the process's counted bytes moved meanwhile) and what the
// process then holds beyond all its counted bytes but `prepaid` (what was
// already reserved for this object): the process's count then covers what
// it holds. 0 when NVML cannot see the process.
// *exact (when given) says whether the measurement was undisturbed.
std::uint64_t measured_bytes(CUdevice ordinal, int entry, const Measure& m, std::atomic<std::uint64_t>* remembered,
                             bool* exact = nullptr, std::uint64_t prepaid = 0) noexcept;

}  // namespace gpuslice::hook
