// NVML's per-process utilisation answers turned into contiguous measurement
// windows for the compute controller (compute_control.h). Pure logic: the
// feedback loop (compute_feedback.h) makes the NVML call and hands the answer
// here. See docs/limiter.md, "Measuring on a real NVML".
//
// nvmlDeviceGetProcessUtilization (NVML reference) returns samples the driver
// took on its own period (about 1/6 s on current GPUs), each one process's
// utilisation as an integer percent of that period, stamped with the CPU time
// (us) of the sample; only samples newer than lastSeenTimeStamp, and
// NVML_ERROR_NOT_FOUND when there is none. Three consequences:
//   - NOT_FOUND usually means "no new sample yet", not "idle": a window is
//     only closed on a new sample, or, once no sample has come for two periods,
//     as idle for everybody (processes with 0% get no sample);
//   - a window ends at a sample's stamp, never at "now" (the next sample covers
//     the whole period before its stamp, also what precedes "now");
//   - each sample weighs its own period, not the window (a process absent from
//     a period got 0% in it; averaging only its samples would inflate it).
// The simulated driver's ideal profile (and any NVML that computes the window
// exactly) stamps its samples "now": detected, and measured as before.
#pragma once

#include <cstdint>

#include "gpuslice/nvml_abi.h"
#include "limiter/compute_control.h"

namespace gpuslice::limiter {

// With no sample at all for this long, NOT_FOUND is taken as an idle window
// (before NVML's period is known).
inline constexpr std::uint64_t kNoSampleIdleUs = 1'000'000;

// What the reduction remembers between queries (per device, owner only).
struct SampleClock {
  std::uint64_t last_seen_us = 0;  // end of the windows measured so far (0 = no baseline)
  bool last_is_stamp = false;      // last_seen_us is a sample's stamp (periods can be learned)
  bool periodic = false;           // NVML samples on its own period (stamps lag the query)
  bool exact = false;              // NVML stamps the moment of the call (exact windows)
  std::uint64_t period_us = 0;     // learned period: the smallest gap between two stamps
};

// Starts measuring at `now_us` (CPU microseconds, NVML's clock).
void samples_begin(SampleClock& c, std::uint64_t now_us) noexcept;

// The one rounding rule for a share of a window published in permille
// (DeviceState::util_permille & co.), by the library's feedback owner and by
// the node agent alike: truncated, at most kFullPermille; 0 for no window.
// (A consumer turns it back into time as permille x window / 1000, so a
// source never reports more than it measured.)
std::uint32_t share_permille(std::uint64_t busy_ns, std::uint64_t window_ns) noexcept;

// Receives one process's device time in a closed window; called once per
// sample, so a pid may come several times (the receiver sums).
using AddBusy = void (*)(void* ctx, std::uint32_t pid, std::uint64_t busy_ns) noexcept;

// Reduces one answer of nvmlDeviceGetProcessUtilization(..., c.last_seen_us)
// per process: `rc`, `samples[0..n)`, `asked_us` = the CPU time read just
// *before* the call. True when a window closed: *window_ns is its length,
// c.last_seen_us its end (CPU us; ask NVML from there next), and `add` got
// every process's device time in it. False when there is nothing to measure
// yet (keep asking: the next window covers this one too). An error other
// than NOT_FOUND measures nothing. The node agent measures with this too, so
// the controller's two sources (agent, own NVML) reduce NVML alike.
bool samples_window(SampleClock& c, nvmlReturn_t rc, const nvmlProcessUtilizationSample_t* samples, unsigned n,
                    std::uint64_t asked_us, AddBusy add, void* ctx, std::uint64_t* window_ns) noexcept;

// Classifies a pid as the container's (true) or somebody else's.
using IsOurs = bool (*)(const void* ctx, std::uint32_t pid) noexcept;

// samples_window() split into the container's processes and everybody
// else's: true with `out` filled (window_ns, busy_ns, others_ns) when a
// window closed.
bool samples_reduce(SampleClock& c, nvmlReturn_t rc, const nvmlProcessUtilizationSample_t* samples, unsigned n,
                    std::uint64_t asked_us, IsOurs is_ours, const void* ctx, Measurement* out) noexcept;

}  // namespace gpuslice::limiter
